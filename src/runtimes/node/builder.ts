/**
 * The Node builder (cortex runtime, TypeScript or JavaScript): installs production dependencies with npm,
 * then bundles the entry and everything it imports into one ESM file, `<outputDir>/main.mjs`, that a
 * replica imports without needing `node_modules`. Both steps run in the build sandbox (sandbox/build-step.ts):
 * npm, and esbuild through Ferry's agent (esbuild-agent.ts), which refuses imports from outside the app.
 */
import fs from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { BuildFailedError, noEntryError } from '../../builds/build-failed.js';
import type { BuildContext, Builder, BuildResult } from '../../builds/builder.js';
import { isFile, PROXY_ENV, throwIfAborted } from '../../builds/run-child.js';
import {
  describeStepExit,
  runBuildStep,
  STEP_SOURCE_DIR,
  type StepMount,
  stepPaths,
  toolMounts,
} from '../../sandbox/build-step.js';
import { AGENT_RESULT_PREFIX, type AgentMessage, type AgentRequest, type AgentResult } from './esbuild-agent.js';

/** Entry files the Node builder accepts, in the order they are looked for. */
export const NODE_ENTRIES = ['main.ts', 'main.js', 'main.mjs'] as const;

/**
 * The top of every bundle. CommonJS dependencies expect `require`, `__filename` and `__dirname`, which
 * do not exist in an ES module. `require` must keep its name because esbuild's own `__require` shim
 * looks it up (esbuild renames app code's own `require` out of the way). `__filename`/`__dirname` get
 * private names and are mapped in with `define` instead: that only touches free uses, so an app's
 * `const __dirname = path.dirname(fileURLToPath(import.meta.url))`, the usual ESM idiom, does not clash
 * with the banner ("Identifier '__dirname' has already been declared").
 */
const BANNER = [
  "import { createRequire as __ferryCreateRequire } from 'node:module';",
  "import { fileURLToPath as __ferryFileURLToPath } from 'node:url';",
  "import { dirname as __ferryDirname } from 'node:path';",
  'const require = __ferryCreateRequire(import.meta.url);',
  'const __ferry_filename = __ferryFileURLToPath(import.meta.url);',
  'const __ferry_dirname = __ferryDirname(__ferry_filename);',
].join('\n');

export interface NodeBuilderOptions {
  /**
   * The npm executable (default `npm`, looked up on the step's PATH). An absolute path outside the
   * system folders is bound read-only into the sandbox at the same path.
   */
  npmCommand?: string;
}

export function createNodeBuilder(options: NodeBuilderOptions = {}): Builder {
  const npmCommand = options.npmCommand ?? 'npm';
  return {
    name: 'node',
    async build(ctx: BuildContext): Promise<BuildResult> {
      throwIfAborted(ctx.signal);
      const entry = await findEntry(ctx);
      ctx.log(`Entry: ${entry}`);
      if (await exists(path.join(ctx.sourceDir, 'package.json'))) {
        await installDependencies(ctx, npmCommand);
      }
      throwIfAborted(ctx.signal);
      const exported = await bundle(ctx, entry);
      const functions = exported.filter((name) => !name.startsWith('_') && name !== 'default');
      ctx.log(`Public exports: ${functions.length > 0 ? functions.join(', ') : '(none)'}`);
      return { runtime: 'node', entry: `${path.basename(ctx.outputDir)}/main.mjs`, functions };
    },
  };
}

async function findEntry(ctx: BuildContext): Promise<string> {
  const configured = ctx.config.app.entry;
  if (configured !== undefined) {
    if (!(await isFile(path.join(ctx.sourceDir, configured)))) {
      throw new BuildFailedError(`Entry file ${configured} (app.entry in ferry.toml) is not at the archive root`);
    }
    return configured;
  }
  for (const candidate of NODE_ENTRIES) {
    if (await isFile(path.join(ctx.sourceDir, candidate))) return candidate;
  }
  throw noEntryError();
}

/**
 * npm runs in the sandbox with the app folder read-only and only `node_modules` in it writable (a folder
 * Ferry makes on the host first). So the app's `.npmrc` still applies, but whatever it makes npm do (a
 * `git` of its own, another registry) happens inside the sandbox, as uid 65534, on the build's network.
 */
async function installDependencies(ctx: BuildContext, npmCommand: string): Promise<void> {
  const pkg = await readPackageJson(ctx.sourceDir);
  const hasLock = await exists(path.join(ctx.sourceDir, 'package-lock.json'));
  const command = hasLock ? 'ci' : 'install';
  const args = hasLock
    ? ['ci', '--omit=dev', '--ignore-scripts', '--no-audit', '--no-fund']
    : ['install', '--omit=dev', '--ignore-scripts', '--no-audit', '--no-fund', '--no-package-lock'];
  const dependencies = pkg.dependencies;
  if (dependencies && typeof dependencies === 'object' && Object.keys(dependencies).length > 0) {
    ctx.log('Install scripts are not run (--ignore-scripts)');
  }
  ctx.log(`Running npm ${args.join(' ')}`);

  const nodeModules = await prepareNodeModules(ctx.sourceDir);
  const paths = stepPaths(ctx);
  const env: Record<string, string> = {
    PATH: paths.searchPath,
    HOME: path.posix.join(paths.cache, 'home'),
    npm_config_cache: path.posix.join(paths.cache, 'npm'),
    npm_config_update_notifier: 'false',
    npm_config_loglevel: 'warn',
  };
  for (const name of PROXY_ENV) {
    const value = process.env[name];
    if (value !== undefined) env[name] = value;
  }
  const started = Date.now();
  const exit = await runBuildStep(ctx, {
    label: `npm ${command}`,
    command: [npmCommand, ...args],
    env,
    cwd: paths.source,
    readOnly: toolMounts(paths, npmCommand),
    writable: [{ host: nodeModules, sandbox: path.posix.join(STEP_SOURCE_DIR, 'node_modules') }],
    onLine: (_stream, line) => ctx.log(line),
  });
  if (exit.code !== 0) throw new BuildFailedError(`npm ${command} ${describeStepExit(exit, ctx.sandbox.limits)}`);
  ctx.log(`npm ${command} finished in ${((Date.now() - started) / 1000).toFixed(1)} s`);
}

/**
 * `<source>/node_modules` as a real, empty folder of the host, to bind writable over the read-only app
 * folder. An uploaded one is emptied: npm installs from package.json, as `npm ci` would. (Archives
 * cannot hold links, so it is never one; checked anyway, since the bind would follow it.)
 */
async function prepareNodeModules(sourceDir: string): Promise<string> {
  const dir = path.join(sourceDir, 'node_modules');
  const stat = await fs.lstat(dir).catch(() => null);
  if (stat && !stat.isDirectory()) {
    throw new BuildFailedError('node_modules in the archive is not a folder; leave it out (npm installs it)');
  }
  if (stat) await fs.rm(dir, { recursive: true, force: true });
  await fs.mkdir(dir);
  return dir;
}

async function readPackageJson(sourceDir: string): Promise<Record<string, unknown>> {
  const text = await fs.readFile(path.join(sourceDir, 'package.json'), 'utf8');
  let data: unknown;
  try {
    data = JSON.parse(text);
  } catch (err) {
    throw new BuildFailedError(`package.json is not valid JSON: ${err instanceof Error ? err.message : String(err)}`);
  }
  if (!data || typeof data !== 'object' || Array.isArray(data)) {
    throw new BuildFailedError('package.json must contain a JSON object');
  }
  return data as Record<string, unknown>;
}

/** Ferry's own esbuild, found once: its package and the platform binary's, bound read-only into the sandbox. */
interface EsbuildFiles {
  version: string;
  packageDir: string;
  platformDir: string | null;
  platformName: string | null;
}

let esbuildFiles: Promise<EsbuildFiles> | undefined;

function findEsbuild(): Promise<EsbuildFiles> {
  esbuildFiles ??= (async () => {
    const require = createRequire(import.meta.url);
    const packageDir = await fs.realpath(path.dirname(require.resolve('esbuild/package.json')));
    const { version } = JSON.parse(await fs.readFile(path.join(packageDir, 'package.json'), 'utf8')) as {
      version: string;
    };
    const platformName = `@esbuild/${process.platform}-${process.arch}`;
    try {
      const fromEsbuild = createRequire(path.join(packageDir, 'package.json'));
      const platformDir = await fs.realpath(path.dirname(fromEsbuild.resolve(`${platformName}/package.json`)));
      return { version, packageDir, platformDir, platformName };
    } catch {
      // esbuild falls back to its own bin/esbuild (an install without optional dependencies).
      return { version, packageDir, platformDir: null, platformName: null };
    }
  })();
  return esbuildFiles;
}

const AGENT_HOST = fileURLToPath(new URL('./esbuild-agent.js', import.meta.url));
const AGENT_SANDBOX = '/ferry/esbuild-agent.mjs';
const SANDBOX_MODULES = '/ferry/node_modules';

/**
 * Bundles the entry in the sandbox with Ferry's esbuild agent (esbuild-agent.ts) and returns the names it
 * exports (from esbuild's metafile: no user code runs).
 */
async function bundle(ctx: BuildContext, entry: string): Promise<string[]> {
  const esbuild = await findEsbuild();
  const paths = stepPaths(ctx);
  const request: AgentRequest = {
    entry,
    workingDir: paths.source,
    outfile: path.posix.join(paths.out, 'main.mjs'),
    banner: BANNER,
    define: { __filename: '__ferry_filename', __dirname: '__ferry_dirname' },
    target: 'node20',
  };
  const readOnly: StepMount[] = [];
  let agent = AGENT_HOST;
  if (paths.sandboxed) {
    agent = AGENT_SANDBOX;
    readOnly.push(
      { host: AGENT_HOST, sandbox: AGENT_SANDBOX },
      { host: esbuild.packageDir, sandbox: `${SANDBOX_MODULES}/esbuild` },
    );
    if (esbuild.platformDir && esbuild.platformName) {
      readOnly.push({ host: esbuild.platformDir, sandbox: `${SANDBOX_MODULES}/${esbuild.platformName}` });
    }
  }
  ctx.log(`Bundling ${entry} with esbuild ${esbuild.version}`);
  let result: AgentResult | undefined;
  const stderr: string[] = [];
  const exit = await runBuildStep(ctx, {
    label: 'esbuild',
    command: [process.execPath, agent, JSON.stringify(request)],
    env: { PATH: paths.searchPath, HOME: path.posix.join(paths.cache, 'home') },
    cwd: paths.out,
    readOnly,
    onLine: (stream, line) => {
      if (stream === 'stdout' && line.startsWith(AGENT_RESULT_PREFIX)) {
        result = JSON.parse(line.slice(AGENT_RESULT_PREFIX.length)) as AgentResult;
      } else if (stream === 'stderr') stderr.push(line);
      else ctx.log(line);
    },
  });
  throwIfAborted(ctx.signal);
  if (exit.code !== 0 || result === undefined) {
    for (const line of stderr.slice(-20)) ctx.log(line);
    if (exit.oomKilled) throw new BuildFailedError(`Bundling ${describeStepExit(exit, ctx.sandbox.limits)}`);
    throw new Error(`The esbuild agent ${describeStepExit(exit, ctx.sandbox.limits)}`);
  }
  logMessages(ctx, result.warnings, 'warning');
  if (!result.ok) {
    logMessages(ctx, result.errors, 'error');
    const first = result.errors[0];
    throw new BuildFailedError(`Bundling failed: ${first ? formatMessage(first) : 'unknown error'}`);
  }
  const { size } = await fs.stat(path.join(ctx.outputDir, 'main.mjs'));
  ctx.log(`Bundle: main.mjs, ${formatSize(size)}`);
  return result.exports;
}

function logMessages(ctx: BuildContext, messages: AgentMessage[], kind: 'error' | 'warning'): void {
  for (const message of messages) {
    ctx.log(`${kind === 'warning' ? 'warning: ' : ''}${formatMessage(message)}`);
    for (const note of message.notes) {
      ctx.log(
        `  note: ${note.location ? `${note.location.file}:${note.location.line}:${note.location.column}: ` : ''}${note.text}`,
      );
    }
  }
}

/** `file:line:col: message`, with esbuild's own numbering (1-based lines, 0-based columns). */
function formatMessage(message: AgentMessage): string {
  const loc = message.location;
  return loc ? `${loc.file}:${loc.line}:${loc.column}: ${message.text}` : message.text;
}

function formatSize(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / (1024 * 1024)).toFixed(1)} MiB`;
}

async function exists(file: string): Promise<boolean> {
  try {
    await fs.access(file);
    return true;
  } catch {
    return false;
  }
}
