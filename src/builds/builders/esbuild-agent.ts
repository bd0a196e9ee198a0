/**
 * The esbuild agent: bundles an app inside the build sandbox (sandboxed-step.ts), so esbuild reads the
 * app's files with the sandbox's view of the filesystem, never the server's. Run by Node as
 * `node esbuild-agent.mjs <request JSON>`; it imports nothing of Ferry but esbuild (bound read-only at
 * /ferry/node_modules), so it can be bound into the sandbox alone.
 *
 * It prints one line `FERRY_ESBUILD_RESULT {...}` (AgentResult) and exits 0, whether or not the bundle
 * built; any other exit is a crash.
 *
 * An import that resolves outside the app's folder (a relative path climbing out of it, an absolute path,
 * a link out of it) fails the build with the code FERRY_BUILD_IMPORT_OUTSIDE_APP naming the import and
 * the file importing it. Dependencies are inside the app folder (`node_modules`); Node's built-in modules
 * stay external.
 */
import fs from 'node:fs';
import { isBuiltin } from 'node:module';
import path from 'node:path';
import * as esbuild from 'esbuild';

export const AGENT_RESULT_PREFIX = 'FERRY_ESBUILD_RESULT ';
export const IMPORT_OUTSIDE_APP = 'FERRY_BUILD_IMPORT_OUTSIDE_APP';

export interface AgentRequest {
  /** The entry, relative to `workingDir`. */
  entry: string;
  /** The app folder: esbuild's working folder, and the only folder imports may resolve into. */
  workingDir: string;
  outfile: string;
  banner: string;
  define: Record<string, string>;
  target: string;
}

export interface AgentMessage {
  text: string;
  location: { file: string; line: number; column: number } | null;
  notes: Array<{ text: string; location: { file: string; line: number; column: number } | null }>;
}

export type AgentResult =
  | { ok: true; exports: string[]; warnings: AgentMessage[] }
  | { ok: false; errors: AgentMessage[]; warnings: AgentMessage[] };

const INNER = Symbol.for('ferry.esbuild-agent.inner');

function inside(root: string, file: string): boolean {
  const relative = path.relative(root, file);
  return relative === '' || (!relative.startsWith('..') && !path.isAbsolute(relative));
}

/**
 * The path with every link resolved, also when the file it leads to does not exist (a link to a host
 * file the sandbox does not show still leads outside the app).
 */
function real(file: string, depth = 0): string {
  try {
    return fs.realpathSync(file);
  } catch {
    // resolved by hand below
  }
  if (depth > 40) return file;
  try {
    return real(path.resolve(path.dirname(file), fs.readlinkSync(file)), depth + 1);
  } catch {
    // not a link
  }
  const parent = path.dirname(file);
  return parent === file ? file : path.join(real(parent, depth + 1), path.basename(file));
}

/** Refuses every import that resolves outside `root`. */
export function insideAppPlugin(root: string): esbuild.Plugin {
  const appRoot = real(path.resolve(root));
  return {
    name: 'ferry-inside-app',
    setup(build) {
      const refuse = (args: esbuild.OnResolveArgs) => {
        const importer = args.importer ? path.relative(appRoot, real(args.importer)) || args.importer : 'the build';
        return {
          errors: [
            {
              text: `${IMPORT_OUTSIDE_APP}: import "${args.path}" in ${importer} resolves outside the app folder; a build may only import the app's own files, its installed dependencies and Node's built-in modules`,
            },
          ],
        };
      };
      build.onResolve({ filter: /.*/ }, async (args) => {
        if (args.pluginData === INNER || args.kind === 'entry-point') return undefined;
        if (isBuiltin(args.path)) return undefined;
        // Paths are checked before resolving too: a file the sandbox does not show would otherwise only
        // be "not found", which hides what the import tried.
        if (args.path.startsWith('/') || /^\.\.?(\/|$)/.test(args.path)) {
          const target = path.resolve(args.resolveDir, args.path);
          if (!inside(appRoot, real(target))) return refuse(args);
        }
        const result = await build.resolve(args.path, {
          kind: args.kind,
          importer: args.importer,
          namespace: args.namespace,
          resolveDir: args.resolveDir,
          with: args.with,
          pluginData: INNER,
        });
        if (result.errors.length > 0) return { errors: result.errors, warnings: result.warnings };
        if (!result.external && result.namespace === 'file' && result.path !== '') {
          if (!inside(appRoot, real(result.path))) return refuse(args);
        }
        return {
          path: result.path,
          external: result.external,
          namespace: result.namespace,
          sideEffects: result.sideEffects,
          suffix: result.suffix,
          pluginData: result.pluginData,
          warnings: result.warnings,
        };
      });
    },
  };
}

function toMessage(message: esbuild.Message): AgentMessage {
  const where = (loc: esbuild.Location | null) => (loc ? { file: loc.file, line: loc.line, column: loc.column } : null);
  return {
    text: message.text,
    location: where(message.location),
    notes: message.notes.map((note) => ({ text: note.text, location: where(note.location) })),
  };
}

export async function bundleApp(request: AgentRequest): Promise<AgentResult> {
  try {
    const result = await esbuild.build({
      absWorkingDir: request.workingDir,
      entryPoints: [request.entry],
      outfile: request.outfile,
      bundle: true,
      platform: 'node',
      format: 'esm',
      target: request.target,
      sourcemap: 'linked',
      metafile: true,
      logLevel: 'silent',
      banner: { js: request.banner },
      define: request.define,
      plugins: [insideAppPlugin(request.workingDir)],
    });
    const output = Object.entries(result.metafile.outputs).find(([file]) =>
      file.endsWith(path.basename(request.outfile)),
    );
    return { ok: true, exports: [...(output?.[1].exports ?? [])].sort(), warnings: result.warnings.map(toMessage) };
  } catch (err) {
    const failure = err as Partial<esbuild.BuildFailure>;
    if (!Array.isArray(failure.errors)) throw err;
    return { ok: false, errors: failure.errors.map(toMessage), warnings: (failure.warnings ?? []).map(toMessage) };
  }
}

async function main(): Promise<void> {
  const request = JSON.parse(process.argv[2] ?? '') as AgentRequest;
  const result = await bundleApp(request);
  process.stdout.write(`${AGENT_RESULT_PREFIX}${JSON.stringify(result)}\n`);
}

// Run as a program (not when a test imports it).
if (process.argv[1] && /esbuild-agent\.m?js$/.test(process.argv[1])) {
  main().catch((err: unknown) => {
    process.stderr.write(`esbuild agent: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    process.exit(1);
  });
}
