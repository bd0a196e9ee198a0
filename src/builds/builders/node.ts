/**
 * The Node builder (cortex runtime, TypeScript or JavaScript): installs production dependencies with npm,
 * then bundles the entry and everything it imports into one ESM file, `<outputDir>/main.mjs`, that a
 * replica imports without needing `node_modules`.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import * as esbuild from 'esbuild';
import { isFile, PROXY_ENV, runInstallStep, throwIfAborted } from './run-child.js';
import { type BuildContext, type Builder, BuildFailedError, type BuildResult, noEntryError } from './types.js';

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
  /** The npm executable (default `npm`, found on PATH). */
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

async function installDependencies(ctx: BuildContext, npmCommand: string): Promise<void> {
  const pkg = await readPackageJson(ctx.sourceDir);
  const hasLock = await exists(path.join(ctx.sourceDir, 'package-lock.json'));
  const command = hasLock ? 'ci' : 'install';
  const args = hasLock
    ? ['ci', '--omit=dev', '--ignore-scripts', '--no-audit', '--no-fund']
    : ['install', '--omit=dev', '--ignore-scripts', '--no-audit', '--no-fund', '--no-package-lock'];
  const dependencies = pkg.dependencies;
  if (dependencies && typeof dependencies === 'object' && Object.keys(dependencies).length > 0) {
    ctx.log('Install scripts are not run: they would run unsandboxed on the server');
  }
  ctx.log(`Running npm ${args.join(' ')}`);

  const npmCache = path.join(ctx.cacheDir, 'npm');
  await fs.mkdir(npmCache, { recursive: true });
  await runInstallStep(ctx, {
    label: `npm ${command}`,
    command: npmCommand,
    args,
    extra: { npm_config_cache: npmCache, npm_config_update_notifier: 'false', npm_config_loglevel: 'warn' },
    passed: PROXY_ENV,
  });
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

/** Bundles the entry and returns the names it exports (from esbuild's metafile: no user code runs). */
async function bundle(ctx: BuildContext, entry: string): Promise<string[]> {
  const outfile = path.join(ctx.outputDir, 'main.mjs');
  const context = await esbuild.context({
    absWorkingDir: path.resolve(ctx.sourceDir),
    entryPoints: [entry],
    outfile,
    bundle: true,
    platform: 'node',
    format: 'esm',
    target: 'node20',
    sourcemap: 'linked',
    metafile: true,
    logLevel: 'silent',
    banner: { js: BANNER },
    define: { __filename: '__ferry_filename', __dirname: '__ferry_dirname' },
  });
  const onAbort = () => {
    void context.cancel().catch(() => {});
  };
  ctx.signal.addEventListener('abort', onAbort, { once: true });
  try {
    ctx.log(`Bundling ${entry} with esbuild ${esbuild.version}`);
    throwIfAborted(ctx.signal);
    let result: esbuild.BuildResult;
    try {
      result = await context.rebuild();
    } catch (err) {
      // A cancelled build rejects with "The build was canceled"; report the cancellation instead.
      throwIfAborted(ctx.signal);
      const failure = err as Partial<esbuild.BuildFailure>;
      if (!Array.isArray(failure.errors)) throw err;
      logMessages(ctx, failure.warnings ?? [], 'warning');
      logMessages(ctx, failure.errors, 'error');
      const first = failure.errors[0];
      throw new BuildFailedError(`Bundling failed: ${first ? formatMessage(first) : 'unknown error'}`, { cause: err });
    }
    throwIfAborted(ctx.signal);
    logMessages(ctx, result.warnings, 'warning');
    const { size } = await fs.stat(outfile);
    ctx.log(`Bundle: main.mjs, ${formatSize(size)}`);
    const output = Object.entries(result.metafile?.outputs ?? {}).find(([file]) => file.endsWith('main.mjs'));
    return [...(output?.[1].exports ?? [])].sort();
  } finally {
    ctx.signal.removeEventListener('abort', onAbort);
    await context.dispose();
  }
}

function logMessages(ctx: BuildContext, messages: esbuild.Message[], kind: 'error' | 'warning'): void {
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
function formatMessage(message: esbuild.Message): string {
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
