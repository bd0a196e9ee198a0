/**
 * `ferry deploy [DIR]`: validates ferry.toml, packs the selected files, uploads them with a progress bar,
 * follows the build log live and ends with the app's run URL. Exits non-zero when the build fails.
 * With `--json`, stdout carries only the final JSON object; the steps go to stderr.
 */
import { createReadStream } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Transform } from 'node:stream';
import cliProgress from 'cli-progress';
import { AppConfigError, parseAppConfig } from '../apps/app-config.js';
import { followBuildLog } from './build-log-follow.js';
import { CliError, createClient } from './client.js';
import { packZip, selectFiles } from './pack.js';

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

    const state = await followBuildLog(client, appId, build.id, (line) => say(`  | ${line}`));
    // A custom app's server takes every path under the app; a cortex app's functions are paths below it.
    const runUrl =
      config.app.runtime === 'custom'
        ? `${client.url}/v4/${client.project}/${appId}/`
        : `${client.url}/v4/${client.project}/${appId}/run`;
    if (options.json) {
      process.stdout.write(
        `${JSON.stringify({ project_id: client.project, app_id: appId, app_name: appId, build_id: build.id, status: state, run_url: runUrl })}\n`,
      );
    }
    if (state !== 'ready') throw new CliError(`Build ${build.id} ${state}. The previous build, if any, stays active.`);
    say('');
    say(`Deployed ${appId}. ${config.app.runtime === 'custom' ? 'Its server answers under' : 'Run URL'}:`);
    say(`  ${runUrl}`);
  } finally {
    await fs.rm(tmpDir, { recursive: true, force: true });
  }
}
