/**
 * The esbuild agent: bundles an app inside the build sandbox (sandbox/build-step.ts), so esbuild reads the
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
 * stay external. Glob imports (``import(`./x/${name}`)``) are expanded by esbuild without asking the
 * resolve hook, so every file esbuild loads is checked too (the load hook, then the metafile's inputs
 * before anything is written).
 *
 * esbuild also reads files no import names: a `//# sourceMappingURL=` comment's map, a tsconfig.json's
 * `extends`. A source map comment that leads outside the app fails the build with
 * FERRY_BUILD_FILE_OUTSIDE_APP before esbuild reads it (its map's sources would go into the bundle's
 * map); a message about a file outside the app (a tsconfig `extends` that is not JSON) names the file but
 * never quotes it.
 */
import fs from 'node:fs';
import { isBuiltin } from 'node:module';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import * as esbuild from 'esbuild';

export const AGENT_RESULT_PREFIX = 'FERRY_ESBUILD_RESULT ';
export const IMPORT_OUTSIDE_APP = 'FERRY_BUILD_IMPORT_OUTSIDE_APP';
export const FILE_OUTSIDE_APP = 'FERRY_BUILD_FILE_OUTSIDE_APP';

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

/**
 * What esbuild may take for a source map comment: `//# sourceMappingURL=<url>` (or `/*# ...`, `//@ ...`),
 * matched more loosely than esbuild does, so nothing it reads is missed (a string that looks like one is
 * checked too, which costs nothing when it leads inside the app).
 */
const SOURCE_MAP_COMMENT = /[#@][ \t]*sourceMappingURL[ \t]*=[ \t]*([^\s]*)/g;

/**
 * Where esbuild might read the map named by a source map comment in a file of `dir`: every reading of the
 * URL (as a URL, as a path, with and without its %-escapes), or null when one cannot be made, so that a
 * trick in the spelling does not slip past. URLs of other schemes (`https:`) are never read; `data:`
 * URLs hold the map itself.
 */
function sourceMapTargets(dir: string, url: string): string[] | null {
  const value = url.replace(/\*\/.*$/, '');
  if (value === '' || /^data:/i.test(value)) return [];
  if (/^[A-Za-z][A-Za-z0-9+.-]*:/.test(value) && !/^file:/i.test(value)) return [];
  const targets: string[] = [];
  try {
    targets.push(fileURLToPath(new URL(value, pathToFileURL(`${dir}/`))));
    let decoded = decodeURIComponent(value.replace(/[?#].*$/, ''));
    decoded = decoded.replace(/^file:(\/\/(localhost)?)?/i, '');
    targets.push(path.resolve(dir, decoded), path.resolve(dir, value));
  } catch {
    return null;
  }
  return targets;
}

/**
 * Refuses every import that resolves outside `root`, every file esbuild would load from outside it (a
 * glob import's matches), and source map comments that lead outside it.
 */
export function insideAppPlugin(root: string): esbuild.Plugin {
  const appRoot = real(path.resolve(root));
  return {
    name: 'ferry-inside-app',
    setup(build) {
      build.onLoad({ filter: /.*/ }, async (args) => {
        if (args.namespace !== 'file') return undefined;
        if (!inside(appRoot, real(args.path))) {
          // A glob import's match (the resolve hook never sees those); esbuild puts the error at the import.
          // The matched file is not named: the message would list what exists outside the app.
          return {
            errors: [
              {
                text: `${IMPORT_OUTSIDE_APP}: this import matches a file outside the app folder (a glob import such as import(\`../x\${name}\`) leaves the app); a build may only import the app's own files, its installed dependencies and Node's built-in modules`,
              },
            ],
          };
        }
        let bytes: Buffer;
        try {
          bytes = await fs.promises.readFile(args.path);
        } catch {
          return undefined; // esbuild reports it
        }
        if (!bytes.includes('sourceMappingURL')) return undefined;
        const text = bytes.toString('latin1');
        const file = path.relative(appRoot, real(args.path));
        for (const match of text.matchAll(SOURCE_MAP_COMMENT)) {
          const targets = sourceMapTargets(path.dirname(args.path), match[1] ?? '');
          if (targets === null || targets.some((target) => !inside(appRoot, real(target)))) {
            return {
              errors: [
                {
                  text: `${FILE_OUTSIDE_APP}: the source map comment "${match[0]}" in ${file} leads outside the app folder; a source map must be a file of the app or a data: URL`,
                },
              ],
            };
          }
        }
        return undefined;
      });
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

/**
 * esbuild's messages as the build log shows them. One about a file outside the app (a tsconfig.json
 * `extends` or a source map esbuild read) names the file but not what esbuild found in it: its text
 * quotes the file ("Unexpected \"root\" in JSON"). Repeats (a glob's matches) are shown once.
 */
function toMessages(messages: esbuild.Message[], workingDir: string): AgentMessage[] {
  const appRoot = real(path.resolve(workingDir));
  const outside = (loc: esbuild.Location | null) =>
    loc !== null &&
    (loc.namespace === '' || loc.namespace === 'file') &&
    !inside(appRoot, real(path.resolve(workingDir, loc.file)));
  const where = (loc: esbuild.Location | null) => (loc ? { file: loc.file, line: loc.line, column: loc.column } : null);
  const hidden = (loc: esbuild.Location) =>
    `${FILE_OUTSIDE_APP}: esbuild read ${loc.file}, which is outside the app folder (through a tsconfig.json "extends", for example); what it found there is not shown`;
  const seen = new Set<string>();
  const out: AgentMessage[] = [];
  for (const message of messages) {
    const converted: AgentMessage = outside(message.location)
      ? { text: hidden(message.location!), location: null, notes: [] }
      : {
          text: message.text,
          location: where(message.location),
          notes: message.notes.map((note) =>
            outside(note.location)
              ? { text: hidden(note.location!), location: null }
              : { text: note.text, location: where(note.location) },
          ),
        };
    const key = JSON.stringify(converted);
    if (seen.has(key)) continue;
    seen.add(key);
    out.push(converted);
  }
  return out;
}

/**
 * The files of the metafile's inputs that are outside the app folder (relative to it). None once the load
 * hook has done its work: a last check, before anything is written, on what the bundle really holds.
 */
export function inputsOutsideApp(metafile: Pick<esbuild.Metafile, 'inputs'>, workingDir: string): string[] {
  const appRoot = real(path.resolve(workingDir));
  const outside: string[] = [];
  for (const input of Object.keys(metafile.inputs)) {
    // Inputs of other namespaces are written `namespace:path`; files are plain paths, relative to workingDir.
    const namespaced = /^([a-z][a-z0-9-]*):/i.exec(input);
    if (namespaced && namespaced[1] !== 'file') continue;
    const file = namespaced ? input.slice('file:'.length) : input;
    if (!inside(appRoot, real(path.resolve(workingDir, file)))) outside.push(file);
  }
  return outside;
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
      // Written below, once the inputs are checked.
      write: false,
      logLevel: 'silent',
      banner: { js: request.banner },
      define: request.define,
      plugins: [insideAppPlugin(request.workingDir)],
    });
    const warnings = toMessages(result.warnings, request.workingDir);
    if (inputsOutsideApp(result.metafile, request.workingDir).length > 0) {
      const text = `${IMPORT_OUTSIDE_APP}: the bundle would hold a file from outside the app folder; a build may only import the app's own files, its installed dependencies and Node's built-in modules`;
      return { ok: false, errors: [{ text, location: null, notes: [] }], warnings };
    }
    for (const file of result.outputFiles) {
      fs.mkdirSync(path.dirname(file.path), { recursive: true });
      fs.writeFileSync(file.path, file.contents);
    }
    const output = Object.entries(result.metafile.outputs).find(([file]) =>
      file.endsWith(path.basename(request.outfile)),
    );
    return { ok: true, exports: [...(output?.[1].exports ?? [])].sort(), warnings };
  } catch (err) {
    const failure = err as Partial<esbuild.BuildFailure>;
    if (!Array.isArray(failure.errors)) throw err;
    return {
      ok: false,
      errors: toMessages(failure.errors, request.workingDir),
      warnings: toMessages(failure.warnings ?? [], request.workingDir),
    };
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
