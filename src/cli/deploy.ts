/**
 * `ferry deploy [DIR]`: validates ferry.toml, packs the selected files, uploads them with a progress bar,
 * follows the build log live and ends with the URL of each public function (warning when there is none).
 * Exits non-zero when the build fails, or before uploading when the folder or its entry is wrong.
 * With `--json`, stdout carries only the final JSON object; the steps go to stderr.
 */
import { createReadStream } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Transform } from 'node:stream';
import cliProgress from 'cli-progress';
import { AppConfigError, entryConflict, parseAppConfig } from '../apps/app-config.js';
import { followBuildLog } from './build-log-follow.js';
import { CliError, createClient, runBaseUrl } from './client.js';
import { packZip, selectFiles } from './pack.js';
import { safeText } from './terminal.js';

export interface DeployOptions {
  json?: boolean;
}

function formatBytes(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 ** 2) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / 1024 ** 2).toFixed(1)} MiB`;
}

export async function deployCommand(dirArg: string | undefined, options: DeployOptions): Promise<void> {
  const dir = path.resolve(dirArg ?? '.');
  const say = (line: string) => (options.json ? process.stderr : process.stdout).write(`${line}\n`);

  const stat = await fs.stat(dir).catch(() => undefined);
  if (!stat) throw new CliError(`The folder ${dir} does not exist`, 2);
  if (!stat.isDirectory())
    throw new CliError(`${dir} is not a folder: pass the app's folder (the one holding ferry.toml)`, 2);
  let toml: string;
  try {
    toml = await fs.readFile(path.join(dir, 'ferry.toml'), 'utf8');
  } catch {
    throw new CliError(`No ferry.toml in ${dir}. Every app folder needs one; see docs/config.md.`);
  }
  let config: ReturnType<typeof parseAppConfig>;
  try {
    config = parseAppConfig(toml);
  } catch (err) {
    if (err instanceof AppConfigError)
      throw new CliError(`${path.join(dir, 'ferry.toml')}: ${err.message.replace(/^ferry\.toml: /, '')}`);
    throw err;
  }
  const client = createClient();
  const appId = config.app.name;

  const skipped: string[] = [];
  const files = await selectFiles(dir, config, {
    onSkip: (p: string, reason: string) => skipped.push(`${p} (${reason})`),
  });
  const packed = new Set(files.map((f) => f.path));
  const conflict = entryConflict(config, (name) => packed.has(name));
  if (conflict) throw new CliError(`${path.join(dir, 'ferry.toml')}: ${conflict}`, 2);
  const total = files.reduce((n, f) => n + f.size, 0);
  say(`Deploying ${appId} from ${dir}`);
  say(`  ${files.length} files, ${formatBytes(total)}`);
  for (const s of skipped) say(`  skipped ${s}`);

  const tmpDir = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-deploy-'));
  const archive = path.join(tmpDir, 'app.zip');
  try {
    const { bytes } = await packZip(dir, files, archive);
    say(`  archive ${formatBytes(bytes)}`);

    const interactive = process.stderr.isTTY === true;
    const bar = interactive
      ? new cliProgress.SingleBar(
          { format: '  uploading [{bar}] {percentage}% {value_h}/{total_h}', hideCursor: true, stream: process.stderr },
          cliProgress.Presets.shades_classic,
        )
      : undefined;
    let sent = 0;
    bar?.start(bytes, 0, { value_h: formatBytes(0), total_h: formatBytes(bytes) });
    const counter = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        sent += chunk.length;
        bar?.update(sent, { value_h: formatBytes(sent), total_h: formatBytes(bytes) });
        cb(null, chunk);
      },
    });
    let build: { id: string; state: string };
    try {
      build = await client.call('POST', `/v2/projects/${client.project}/apps/${appId}/builds`, {
        raw: createReadStream(archive).pipe(counter),
        headers: { 'content-type': 'application/zip', 'content-length': String(bytes) },
      });
    } finally {
      bar?.stop();
    }
    if (!interactive) say(`  uploaded ${formatBytes(bytes)}`);
    say(`Build ${build.id} queued; build log:`);

    const state = await followBuildLog(client, appId, build.id, (line) => say(`  | ${safeText(line)}`));
    const base = `${await runBaseUrl(client)}/v4/${client.project}/${appId}`;
    // A custom app's server takes every path under the app; a cortex app's functions are paths below it,
    // known from the build once it is ready (null: only loading the module can tell, as for some Python).
    let functions: string[] | null = null;
    if (state === 'ready' && config.app.runtime !== 'custom') {
      ({ functions } = await client.call<{ functions: string[] | null }>(
        'GET',
        `/v2/projects/${client.project}/apps/${appId}/builds/${build.id}`,
      ));
    }
    const functionUrls =
      functions === null ? null : Object.fromEntries(functions.map((f) => [f, `${base}/${encodeURIComponent(f)}`]));
    const runUrl =
      config.app.runtime === 'custom'
        ? `${base}/`
        : functions === null || functions.includes('run')
          ? `${base}/run`
          : null;
    if (options.json) {
      process.stdout.write(
        `${JSON.stringify({ project_id: client.project, app_id: appId, app_name: appId, build_id: build.id, status: state, run_url: runUrl, function_urls: functionUrls })}\n`,
      );
    }
    if (state !== 'ready') throw new CliError(`Build ${build.id} ${state}. The previous build, if any, stays active.`);
    say('');
    if (config.app.runtime === 'custom') {
      say(`Deployed ${appId}. Its server answers under:`);
      say(`  ${runUrl}`);
    } else if (functions === null) {
      say(`Deployed ${appId}. Run URL (the public functions are known once a replica loads the module):`);
      say(`  ${runUrl}`);
    } else if (functions.length === 0) {
      process.stderr.write(
        `Warning: ${appId} has no public function, so nothing of it can be called. Export a function (one not starting with "_") from the entry.\n`,
      );
      say(`Deployed ${appId}, without public functions.`);
    } else {
      say(`Deployed ${appId}. Function URL${functions.length === 1 ? '' : 's'}:`);
      for (const url of Object.values(functionUrls ?? {})) say(`  ${url}`);
    }
  } finally {
    await fs.rm(tmpDir, { recursive: true, force: true });
  }
}
