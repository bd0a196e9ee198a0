/**
 * The custom builder (`runtime = "custom"`: the user brings their own HTTP server). It installs nothing
 * and writes nothing: a replica runs `[runtime.custom].entrypoint` in the app folder as uploaded. The build
 * only checks, without running anything, that the entrypoint can start, so a typo fails the build with a
 * clear message instead of a replica that never becomes ready:
 *
 * - list form (run directly): `argv[0]` is a relative path to a file inside the app folder, an absolute
 *   path in the system folders a replica sees, or a command on the replica's PATH; when it is a known
 *   interpreter (`node server.js`), the script it is given must be in the app folder.
 * - string form (run with `/bin/sh -c`): the same checks on its first simple command, after `exec`,
 *   `env` and `NAME=value` prefixes; shell syntax beyond that is not followed.
 *
 * Unlike the other builders' steps, these checks run in the server, not the build sandbox: they are
 * Ferry's own stat() and realpath() of names from ferry.toml, and read no byte of the app's files nor
 * run any (archives cannot hold links, so nothing in the app folder leads outside it).
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { BuildFailedError } from '../../builds/build-failed.js';
import type { BuildContext, Builder, BuildResult } from '../../builds/builder.js';
import { throwIfAborted } from '../../builds/run-child.js';
import { findInImage, isImageExecutable, resolveInRoot } from '../../images/rootfs-path.js';
import { HOST_ROOTFS } from '../runtime.js';

/**
 * The PATH a custom replica's server gets and the folders a sandboxed replica sees at their own path (plus
 * Node's own folder): those of the root filesystem its launch recipe runs it on (./index.ts), this machine's.
 */
const REPLICA_PATH = HOST_ROOTFS.searchPath;
const SYSTEM_ROOTS = HOST_ROOTFS.systemRoots;

/** Interpreters whose first script-like argument must be a file of the app. */
const INTERPRETERS = new Set([
  'node',
  'nodejs',
  'python3',
  'python',
  'bash',
  'sh',
  'deno',
  'bun',
  'ruby',
  'perl',
  'php',
]);
const VERSIONED_PYTHON = /^python3\.\d+$/;
/** Arguments that look like a script file. */
const SCRIPT_FILE = /\.(js|mjs|cjs|jsx|ts|mts|cts|tsx|py|pyw|sh|bash|rb|pl|pm|php)$/i;
/** Interpreter options after which the code is inline or a module, not a script file. */
const INLINE_CODE = new Set(['-c', '-e', '-E', '-p', '-m', '--eval', '--print', '-']);

/** Shell builtins and keywords: not programs, so not looked up. `exec` and `env` are followed instead. */
const SHELL_BUILTINS = new Set([
  'cd',
  'export',
  'set',
  'unset',
  'source',
  '.',
  'eval',
  'trap',
  'ulimit',
  'umask',
  'readonly',
  'shift',
  'wait',
  'true',
  'false',
  ':',
  'test',
  '[',
  'if',
  'then',
  'else',
  'elif',
  'fi',
  'for',
  'while',
  'until',
  'do',
  'done',
  'case',
  'esac',
  'function',
  '{',
  '}',
  '!',
  'time',
  'command',
  'builtin',
  'read',
  'echo',
  'printf',
  'alias',
  'type',
  'hash',
  'local',
  'exec',
]);

const ASSIGNMENT = /^[A-Za-z_][A-Za-z0-9_]*=/;

export function createCustomBuilder(): Builder {
  return {
    name: 'custom',
    async build(ctx: BuildContext): Promise<BuildResult> {
      throwIfAborted(ctx.signal);
      const custom = ctx.config.runtime.custom;
      if (!custom) throw new BuildFailedError('ferry.toml: runtime.custom: is required when app.runtime is "custom"');
      ctx.log('Runtime: custom (your own HTTP server); nothing is installed, replicas run the app folder as uploaded');
      const image = ctx.image;
      const fromImage = custom.entrypoint === undefined;
      const entrypoint = custom.entrypoint ?? imageCommand(image?.record.config);
      const checker = new EntrypointChecker(
        ctx,
        await fs.realpath(ctx.sourceDir),
        image ? { root: image.rootfs, searchPath: image.record.searchPath, fromImage } : undefined,
      );
      if (entrypoint === undefined) {
        throw new BuildFailedError(
          image
            ? 'runtime.custom.entrypoint: is not set, and the image has no ENTRYPOINT or CMD to run instead'
            : 'runtime.custom.entrypoint: is required (the app has no image to take one from)',
        );
      }
      if (fromImage) ctx.log(`Entrypoint: the image's ENTRYPOINT/CMD ${JSON.stringify(entrypoint)}`);
      const port = portOf(custom, image?.record.config.exposedPorts ?? []);
      if (typeof entrypoint === 'string') {
        ctx.log(`Entrypoint: ${JSON.stringify(entrypoint)} (run with /bin/sh -c)`);
        await checker.checkShell(entrypoint);
      } else {
        ctx.log(`Entrypoint: ${JSON.stringify(entrypoint)} (run directly)`);
        await checker.checkArgv(entrypoint);
      }
      if (!image) await warnAboutDependencies(ctx);
      ctx.log(`Port: ${port.port} (given to your server as PORT${port.exposed ? "; the image's EXPOSE" : ''})`);
      ctx.log(`Ready check: ${describeCheck(custom.readycheck_endpoint, port.port)}`);
      ctx.log(`Health check: ${describeCheck(custom.healthcheck_endpoint, port.port)}`);
      throwIfAborted(ctx.signal);
      return {
        runtime: 'custom',
        entry: path.basename(ctx.sourceDir),
        ...(image ? { image: { custom: { entrypoint, port: port.port, fromImage } } } : {}),
      };
    },
  };
}

/** The image's ENTRYPOINT followed by its CMD, as Docker runs them; undefined when it has neither. */
function imageCommand(config: { entrypoint: string[] | undefined; cmd: string[] | undefined } | undefined) {
  const argv = [...(config?.entrypoint ?? []), ...(config?.cmd ?? [])];
  return argv.length > 0 ? argv : undefined;
}

/**
 * `port` from ferry.toml; when it sets none, the image's last EXPOSEd TCP port: the latest declaration, so a
 * Dockerfile's own EXPOSE wins over its base's (set `port` to choose another). Replicas cannot bind below 1024.
 */
function portOf(
  custom: { port: number; port_given?: boolean },
  exposed: readonly number[],
): { port: number; exposed: boolean } {
  const last = exposed.at(-1);
  if (custom.port_given !== false || last === undefined) return { port: custom.port, exposed: false };
  if (last < 1024) {
    throw new BuildFailedError(
      `runtime.custom.port: the image EXPOSEs ${last}, below 1024, which replicas (unprivileged) cannot listen on: set port (1024 or more) and have the server listen there`,
    );
  }
  return { port: last, exposed: true };
}

function describeCheck(endpoint: string, port: number): string {
  return endpoint === '' ? `TCP connect to port ${port}` : `GET ${endpoint} answers 2xx or 3xx`;
}

class EntrypointChecker {
  constructor(
    private readonly ctx: BuildContext,
    /** The app folder with symlinks resolved, to tell whether a file really is inside it. */
    private readonly realSource: string,
    /**
     * The image replicas run on: commands are looked up in it, never on this machine. `fromImage`: the
     * command is the image's own, run in its WORKDIR, so its relative paths are not the app folder's.
     */
    private readonly image?: { root: string; searchPath: readonly string[]; fromImage: boolean },
  ) {}

  /** The list form, or the words of the string form's first command. */
  async checkArgv(argv: readonly string[]): Promise<void> {
    const [command, ...args] = argv;
    if (command === undefined) throw new BuildFailedError('runtime.custom.entrypoint: no command to run');
    await this.checkCommand(command);
    const name = path.posix.basename(command);
    if (name === 'env') return this.followEnv(args);
    if (INTERPRETERS.has(name) || VERSIONED_PYTHON.test(name)) await this.checkScript(name, args);
  }

  /** The string form: checks its first simple command. */
  async checkShell(script: string): Promise<void> {
    if (!/^\s*exec\s/.test(script)) {
      this.ctx.log(
        'Hint: start the entrypoint with "exec " (for example "exec node server.js") so your server gets SIGTERM directly; see docs/functions.md',
      );
    }
    const parsed = parseFirstCommand(script);
    let words = parsed.words;
    // `NAME=value` assignments and `exec` only prefix the command.
    for (;;) {
      const first = words[0];
      if (first === undefined) break;
      if (ASSIGNMENT.test(first.text)) words = words.slice(1);
      else if (!first.dynamic && first.text === 'exec') words = skipExecOptions(words.slice(1));
      else break;
    }
    const first = words[0];
    if (first === undefined) {
      if (parsed.syntax === null) throw new BuildFailedError('runtime.custom.entrypoint: no command to run');
      this.ctx.log(`Entrypoint not checked: it starts with shell syntax (${parsed.syntax})`);
      return;
    }
    if (first.dynamic) {
      this.ctx.log(`Entrypoint not checked: its command (${first.text}) is computed by the shell`);
    } else if (SHELL_BUILTINS.has(first.text)) {
      this.ctx.log(`Entrypoint not checked: it starts with the shell builtin "${first.text}"`);
    } else {
      // A dynamic argument (say $SCRIPT) cannot be checked; the ones before it can.
      const dynamicAt = words.findIndex((w) => w.dynamic);
      await this.checkArgv((dynamicAt === -1 ? words : words.slice(0, dynamicAt)).map((w) => w.text));
      if (dynamicAt !== -1) {
        this.ctx.log(`Entrypoint not checked from ${words[dynamicAt]!.text} on: the shell computes it when it runs`);
      }
    }
    if (parsed.syntax !== null) {
      this.ctx.log(`Entrypoint not checked beyond its first command: it uses shell syntax (${parsed.syntax})`);
    }
  }

  /** `env [-i] [-u NAME] [NAME=value]... command args...`: checks the command env runs. */
  private async followEnv(args: readonly string[]): Promise<void> {
    let i = 0;
    while (i < args.length) {
      const arg = args[i]!;
      if (arg === '-i' || arg === '--ignore-environment' || arg === '-' || arg === '-0' || arg === '--null') i += 1;
      else if (arg === '-u' || arg === '--unset') i += 2;
      else if (arg.startsWith('--unset=') || /^-u./.test(arg)) i += 1;
      else if (arg === '--') {
        i += 1;
        break;
      } else if (arg.startsWith('-')) {
        this.ctx.log(`Entrypoint not checked beyond env: env option ${arg} is not followed`);
        return;
      } else break;
    }
    while (i < args.length && ASSIGNMENT.test(args[i]!)) i += 1;
    if (i >= args.length) {
      this.ctx.log('Entrypoint not checked beyond env: env is given no command');
      return;
    }
    await this.checkArgv(args.slice(i));
  }

  /** A program: a file of the app (relative path), a system file (absolute path), or a command on PATH. */
  private async checkCommand(command: string): Promise<void> {
    if (this.image) return this.checkImageCommand(command, this.image);
    if (command.includes('/')) {
      const file = await this.resolveFile(command, 'command');
      if (path.isAbsolute(command)) {
        if (!(await isExecutable(file))) {
          throw new BuildFailedError(`runtime.custom.entrypoint: ${command} is not executable`);
        }
        this.ctx.log(`Command: ${command} (found)`);
      } else if (await isExecutable(file)) {
        this.ctx.log(`Command: ${command} (found in the app folder, executable)`);
      } else {
        this.ctx.log(`Command: ${command} (found in the app folder)`);
        this.ctx.log(
          `Warning: ${command} is not executable (archives can lose the exec bit); if the replica cannot start it, run it through its interpreter (for example ["sh", "${command}"]) or mark it executable before deploying (chmod +x)`,
        );
      }
      return;
    }
    for (const dir of REPLICA_PATH) {
      const candidate = path.join(dir, command);
      if (await isExecutable(candidate)) {
        this.ctx.log(`Command: ${command} (${candidate})`);
        return;
      }
    }
    const builtin = SHELL_BUILTINS.has(command)
      ? `; "${command}" is a shell builtin, not a program: write the entrypoint as a string to run it with /bin/sh -c`
      : '';
    throw new BuildFailedError(
      `runtime.custom.entrypoint: command "${command}" was not found on the replica's PATH (${REPLICA_PATH.join(':')})${builtin}`,
    );
  }

  /** A command on an image: an absolute path or a PATH lookup in the image; relative ones as the host's. */
  private async checkImageCommand(
    command: string,
    image: { root: string; searchPath: readonly string[]; fromImage: boolean },
  ): Promise<void> {
    if (command.startsWith('/')) {
      if (!(await isImageExecutable(image.root, command))) {
        throw new BuildFailedError(`runtime.custom.entrypoint: ${command} is not an executable file in the image`);
      }
      this.ctx.log(`Command: ${command} (found in the image)`);
      return;
    }
    if (command.includes('/')) {
      if (image.fromImage) {
        this.ctx.log(`Command: ${command} (relative to the image's WORKDIR, not checked)`);
        return;
      }
      const file = await this.resolveFile(command, 'command');
      this.ctx.log(`Command: ${command} (found in the app folder${(await isExecutable(file)) ? ', executable' : ''})`);
      return;
    }
    const found = await findInImage(image.root, command, image.searchPath);
    if (!found) {
      throw new BuildFailedError(
        `runtime.custom.entrypoint: command "${command}" was not found on the image's PATH (${image.searchPath.join(':')})`,
      );
    }
    this.ctx.log(`Command: ${command} (${found} in the image)`);
  }

  /** An interpreter's script: the first argument that does not start with `-` and looks like a file. */
  private async checkScript(interpreter: string, args: readonly string[]): Promise<void> {
    if (this.image?.fromImage) return; // the image's own command: its files are the image's
    for (const arg of args) {
      if (INLINE_CODE.has(arg)) {
        this.ctx.log(`Script: not checked (${interpreter} ${arg} runs code that is not a file of the app)`);
        return;
      }
      if (arg.startsWith('-') || !SCRIPT_FILE.test(arg)) continue;
      if (/^[a-z][a-z0-9+.-]*:\/\//i.test(arg)) {
        this.ctx.log(`Script: ${arg} (a URL, not checked)`);
        return;
      }
      await this.resolveFile(arg, 'script');
      this.ctx.log(`Script: ${arg} (found in the app folder)`);
      return;
    }
  }

  /**
   * The file a path names, as this machine sees it: a relative path inside the app folder, an absolute one
   * in the system folders a replica sees. Throws a BuildFailedError saying what is wrong.
   */
  private async resolveFile(name: string, what: 'command' | 'script'): Promise<string> {
    const label = `runtime.custom.entrypoint: ${what} ${name}`;
    if (path.isAbsolute(name) && this.image) {
      const file = await resolveInRoot(this.image.root, name);
      if (!file || !(await isFile(file))) throw new BuildFailedError(`${label} is not a file in the image`);
      return file;
    }
    if (path.isAbsolute(name)) {
      const roots = [...SYSTEM_ROOTS, path.dirname(process.execPath)];
      if (!roots.some((root) => name === root || name.startsWith(`${root}/`))) {
        throw new BuildFailedError(
          `${label} is outside the folders a replica sees (the app folder and ${SYSTEM_ROOTS.slice(0, 4).join(', ')}); name a file of your app by a relative path such as ./${path.basename(name)}`,
        );
      }
      if (!(await isFile(name))) throw new BuildFailedError(`${label} does not exist on this server`);
      return name;
    }
    const file = path.resolve(this.realSource, name);
    if (!inside(this.realSource, file)) {
      throw new BuildFailedError(`${label} is outside the app folder: replicas only see the app folder you deploy`);
    }
    let real: string;
    try {
      real = await fs.realpath(file);
    } catch {
      throw new BuildFailedError(
        `${label} is not in the app folder (paths are relative to the folder with ferry.toml)`,
      );
    }
    if (!inside(this.realSource, real)) {
      throw new BuildFailedError(`${label} is a link to a file outside the app folder`);
    }
    if (!(await isFile(real))) throw new BuildFailedError(`${label} is not a file`);
    return real;
  }
}

function inside(root: string, file: string): boolean {
  const relative = path.relative(root, file);
  return relative === '' || (!relative.startsWith('..') && !path.isAbsolute(relative));
}

async function isFile(file: string): Promise<boolean> {
  try {
    return (await fs.stat(file)).isFile();
  } catch {
    return false;
  }
}

/** A file with an exec bit (stat, not access(): as root access() would say yes to almost anything). */
async function isExecutable(file: string): Promise<boolean> {
  try {
    const stat = await fs.stat(file);
    return stat.isFile() && (stat.mode & 0o111) !== 0;
  } catch {
    return false;
  }
}

/** `exec -a NAME -c -l --` (bash's options; dash's exec has none). */
function skipExecOptions(words: ShellWord[]): ShellWord[] {
  let i = 0;
  while (i < words.length && !words[i]!.dynamic) {
    const text = words[i]!.text;
    if (text === '--') return words.slice(i + 1);
    if (text === '-a') i += 2;
    else if (text === '-c' || text === '-l' || text === '-cl' || text === '-lc') i += 1;
    else break;
  }
  return words.slice(i);
}

interface ShellWord {
  text: string;
  /** Holds an expansion (`$VAR`, a glob, `~`): its value is only known when the shell runs it. */
  dynamic: boolean;
}

/**
 * The words of a shell command line's first simple command, with quotes and backslashes removed, and the
 * first piece of shell syntax that ends it (`&&`, `|`, `;`, `$(`...), or null when there is none.
 */
export function parseFirstCommand(script: string): { words: ShellWord[]; syntax: string | null } {
  const words: ShellWord[] = [];
  let word: ShellWord | null = null;
  const add = (text: string, dynamic = false) => {
    word ??= { text: '', dynamic: false };
    word.text += text;
    if (dynamic) word.dynamic = true;
  };
  const end = () => {
    if (word) words.push(word);
    word = null;
  };
  let i = 0;
  while (i < script.length) {
    const c = script[i]!;
    const next = script[i + 1];
    if (c === ' ' || c === '\t') {
      end();
      i += 1;
    } else if (c === "'") {
      const close = script.indexOf("'", i + 1);
      if (close === -1) throw new BuildFailedError("runtime.custom.entrypoint: unterminated ' quote");
      add(script.slice(i + 1, close));
      i = close + 1;
    } else if (c === '"') {
      i += 1;
      add('');
      for (;;) {
        const d = script[i];
        if (d === undefined) throw new BuildFailedError('runtime.custom.entrypoint: unterminated " quote');
        if (d === '"') break;
        if (d === '\\' && i + 1 < script.length && '$`"\\\n'.includes(script[i + 1]!)) {
          add(script[i + 1]!);
          i += 2;
        } else if (d === '`' || (d === '$' && script[i + 1] === '(')) {
          end();
          return { words, syntax: d === '`' ? '`' : '$(' };
        } else {
          add(d, d === '$');
          i += 1;
        }
      }
      i += 1;
    } else if (c === '\\') {
      if (next !== '\n' && next !== undefined) add(next);
      i += 2;
    } else if (c === '$' && next === '(') {
      end();
      return { words, syntax: '$(' };
    } else if (c === '`') {
      end();
      return { words, syntax: '`' };
    } else if (c === '$' || c === '*' || c === '?' || c === '[' || (c === '~' && word === null)) {
      add(c, true);
      i += 1;
    } else if (c === '#' && word === null) {
      break;
    } else if (';&|<>()\n'.includes(c)) {
      end();
      const pair = c + (next ?? '');
      const syntax = pair === '&&' || pair === '||' || pair === ';;' ? pair : c === '\n' ? 'a newline' : c;
      return { words, syntax };
    } else {
      add(c);
      i += 1;
    }
  }
  end();
  return { words, syntax: null };
}

/** The custom runtime installs nothing: say so when the app looks like it expects an install. */
async function warnAboutDependencies(ctx: BuildContext): Promise<void> {
  const has = (name: string) => fsSync.existsSync(path.join(ctx.sourceDir, name));
  if (has('package.json') && !has('node_modules')) {
    try {
      const pkg = JSON.parse(await fs.readFile(path.join(ctx.sourceDir, 'package.json'), 'utf8')) as {
        dependencies?: Record<string, string>;
      };
      if (pkg.dependencies && Object.keys(pkg.dependencies).length > 0) {
        ctx.log(
          'Warning: package.json lists dependencies, but the custom runtime installs nothing and node_modules is not in the archive',
        );
      }
    } catch {
      // Not JSON: the app's business.
    }
  }
  if (has('requirements.txt')) {
    ctx.log(
      'Warning: requirements.txt is not installed by the custom runtime; ship what your server needs in the app folder',
    );
  }
}
