/**
 * Ferry's check of an app's `requirements.txt`, before pip reads it (python.ts). The file is read the way
 * pip reads it (pip/_internal/req/req_file.py, pip 23), not by matching option spellings: lines split as
 * Python's `str.splitlines()` does, `\` continuations joined, comments dropped, then each line broken into
 * a requirement and options, the options split like `shlex.split` and matched like optparse does (any
 * unambiguous prefix of a long option, `-rFILE`, `--opt=value`). What pip would install from a
 * requirement is then decided as pip decides it (a URL, a local path, an archive name, a PEP 508 direct
 * reference `name @ url`, or a project name).
 *
 * Allowed: project names (from the index, or from `--find-links`), wheels inside the app folder (by path,
 * with or without `./`, or a `file:` URL) or at an http(s) URL, and the options that only choose where and
 * how pip looks: `--index-url`/`--extra-index-url` (http or https), `--no-index`, `--find-links` (http,
 * https, or a folder of the app), `--only-binary`, `--no-binary`, `--prefer-binary`, `--pre`,
 * `--require-hashes`, `--trusted-host`, `--use-feature`, and a requirement's own `--hash`,
 * `--config-settings`, `--global-option`, `--install-option`. Everything else is refused, naming the
 * line: a local folder or a source archive (pip would run its build code), an editable install, a VCS
 * URL, a nested requirements or constraints file (pip would read a file Ferry has not checked, and quote
 * it in its errors), a path or `file:` URL outside the app, an environment variable (`${NAME}`, which pip
 * expands), an option pip would not take, and a file in another encoding than UTF-8 (which pip would decode
 * differently from this check). (`--no-binary` stays pip's to read: a source build it asks for runs in
 * the build sandbox.)
 */
import fs from 'node:fs';
import path from 'node:path';

export interface RequirementProblem {
  /** 1-based, the first physical line of a continued one (as pip numbers them). */
  line: number;
  /** The logical line, comments and continuations resolved. */
  text: string;
  reason: string;
}

/** Python's `str.splitlines()` separators. */
// biome-ignore lint/suspicious/noControlCharactersInRegex: Python splits lines at these control characters too
const LINE_BREAK = /\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]/;
/** Python's `\s` (str.isspace()). */
const WS = '[\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]';
/** pip's COMMENT_RE, `(^|\s+)#.*$`. */
const COMMENT = new RegExp(`(^|${WS}+)#.*$`, 's');
const COMMENT_START = new RegExp(`^(${WS}+)?#`);
const STRIP = new RegExp(`^${WS}+|${WS}+$`, 'g');
/** pip's ENV_VAR_RE: `${NAME}` is replaced by the variable's value where pip runs. */
const ENV_VAR = /\$\{[A-Z0-9_]+\}/;
/** PEP 263 as pip applies it to the first two lines. */
const CODING = /coding[:=]\s*([-\w.]+)/;

interface OptionSpec {
  /** Takes a value. */
  value: boolean;
  /** Why it is refused, or undefined when it is allowed (values may still be checked). */
  refused?: string;
}

/**
 * The long options of pip's requirement-file parser, over the pip versions Ferry meets (23.0 has
 * --install-option and no --config-settings, 23.2 the other way round): a prefix is matched against all
 * of them, so one that is ambiguous in any pip is refused rather than guessed.
 */
const LONG_OPTIONS: Record<string, OptionSpec> = {
  '--index-url': { value: true },
  '--pypi-url': { value: true },
  '--extra-index-url': { value: true },
  '--no-index': { value: false },
  '--constraint': { value: true, refused: 'a constraints file (-c/--constraint) is not supported' },
  '--requirement': { value: true, refused: 'a nested requirements file (-r/--requirement) is not supported' },
  '--editable': { value: true, refused: 'an editable install (-e/--editable) builds from source' },
  '--find-links': { value: true },
  '--no-binary': { value: true },
  '--only-binary': { value: true },
  '--prefer-binary': { value: false },
  '--require-hashes': { value: false },
  '--pre': { value: false },
  '--trusted-host': { value: true },
  '--use-feature': { value: true },
  '--install-option': { value: true },
  '--global-option': { value: true },
  '--hash': { value: true },
  '--config-settings': { value: true },
};
const SHORT_OPTIONS: Record<string, string> = {
  '-i': '--index-url',
  '-c': '--constraint',
  '-r': '--requirement',
  '-e': '--editable',
  '-f': '--find-links',
  '-C': '--config-settings',
};
/** Options of a requirement line itself (pip ignores the others there; Ferry refuses them). */
const REQUIREMENT_OPTIONS = new Set(['--hash', '--config-settings', '--global-option', '--install-option']);

/** pip's ARCHIVE_EXTENSIONS: a requirement ending so is a file (wheels included). */
const ARCHIVE = /\.(zip|whl|tar\.bz2|tbz|tar\.xz|txz|tlz|tar\.lz|tar\.lzma|tar\.gz|tgz|tar)$/i;
const WHEEL = /\.whl$/i;
/** pip's is_url(): these schemes, and those of its version control systems. */
const URL_SCHEMES = new Set([
  'http',
  'https',
  'file',
  'ftp',
  'ssh',
  'git',
  'hg',
  'bzr',
  'sftp',
  'svn',
  ...['http', 'https', 'ssh', 'git', 'file'].map((s) => `git+${s}`),
  ...['http', 'https', 'ssh', 'static-http', 'file'].map((s) => `hg+${s}`),
  ...['http', 'https', 'ssh', 'sftp', 'ftp', 'lp', 'file'].map((s) => `bzr+${s}`),
  ...['ssh', 'http', 'https', 'svn', 'file'].map((s) => `svn+${s}`),
]);
const VCS = /^(git|hg|bzr|svn)(\+|$)/i;

/** The first problem of the file, or undefined when pip may read it. */
export function requirementsProblem(data: Buffer, sourceDir: string): RequirementProblem | undefined {
  const decoded = decode(data);
  if (typeof decoded !== 'string') return decoded;
  for (const [line, text] of logicalLines(decoded)) {
    const reason = lineProblem(text, sourceDir);
    if (reason) return { line, text, reason };
  }
  return undefined;
}

/** How deep nested `-r`/`-c` files are followed when listing the local paths of a requirements file. */
const MAX_NESTING = 10;

/**
 * The paths of the app folder a requirements file names, relative to the app folder (`.` for the whole
 * folder), for an install into an image (runtimes/python/builder.ts): local requirements (`./pkgs/x.tar.gz`,
 * `x.whl`, `file:` URLs, `name @ file:...`, `-e ./lib`), `--find-links` folders, and nested `-r`/`-c` files
 * with what they name in turn. pip resolves them the way it does when run in the app folder: requirement
 * paths against the working folder, option values against the file that names them. Only what exists inside
 * the app is listed; a path nested in a listed folder is left out. Lines this reading cannot split are
 * skipped (pip then says what is wrong with them, in the build log).
 */
export function requirementsLocalPaths(data: Buffer, sourceDir: string, file = 'requirements.txt'): string[] {
  const root = path.resolve(sourceDir);
  const found = new Set<string>();
  const seen = new Set<string>();
  const add = (candidate: string | null) => {
    if (candidate === null || !insideApp(candidate, root) || !fs.existsSync(candidate)) return;
    found.add(path.relative(root, candidate) || '.');
  };
  const read = (text: string, fileDir: string, depth: number) => {
    for (const [, line] of logicalLines(text)) {
      const words = line.split(' ');
      const firstOption = words.findIndex((word) => word.startsWith('-'));
      const args = (firstOption === -1 ? words : words.slice(0, firstOption)).join(' ');
      const tokens = shlexSplit(firstOption === -1 ? '' : words.slice(firstOption).join(' '));
      const options = tokens === null ? [] : parseOptions(tokens);
      for (const { name, value } of typeof options === 'string' ? [] : options) {
        if (value === undefined) continue;
        if (name === '--requirement' || name === '--constraint') {
          const nested = localPath(value, fileDir);
          add(nested);
          if (nested !== null && depth < MAX_NESTING && insideApp(nested, root) && !seen.has(nested)) {
            seen.add(nested);
            let body: Buffer | null = null;
            try {
              body = fs.readFileSync(nested);
            } catch {
              // pip says so
            }
            const decoded = body === null ? null : decode(body);
            if (typeof decoded === 'string') read(decoded, path.dirname(nested), depth + 1);
          }
        } else if (name === '--find-links') {
          add(localPath(value, fileDir));
          add(localPath(value, root));
        } else if (name === '--editable') {
          add(localPath(stripExtras(value), root));
        }
      }
      const markerAt = args.indexOf(';');
      const requirement = (markerAt === -1 ? args : args.slice(0, markerAt)).replace(STRIP, '');
      if (requirement === '') continue;
      const at = requirement.indexOf('@');
      if (at !== -1 && urlScheme(requirement) !== 'file') {
        add(localPath(requirement.slice(at + 1).replace(STRIP, ''), root));
      }
      add(localPath(stripExtras(requirement), root));
    }
  };
  const decoded = decode(data);
  if (typeof decoded === 'string') {
    seen.add(path.resolve(root, file));
    read(decoded, root, 0);
  }
  const sorted = [...found].sort();
  if (sorted.includes('.')) return ['.'];
  return sorted.filter((p) => !sorted.some((other) => other !== p && p.startsWith(`${other}/`)));
}

/** The text as pip decodes it, when that is UTF-8 (what this check reads). */
function decode(data: Buffer): string | RequirementProblem {
  const whole = (reason: string): RequirementProblem => ({ line: 1, text: '', reason });
  let body = data;
  if (data[0] === 0xef && data[1] === 0xbb && data[2] === 0xbf) body = data.subarray(3);
  else if ((data[0] === 0xff && data[1] === 0xfe) || (data[0] === 0xfe && data[1] === 0xff) || data[0] === 0) {
    return whole('the file must be UTF-8 (it starts with a UTF-16 or UTF-32 byte order mark)');
  } else {
    for (const line of data.toString('latin1').split('\n').slice(0, 2)) {
      const coding = line.startsWith('#') ? CODING.exec(line) : null;
      if (coding && !/^utf[-_]?8$/i.test(coding[1] ?? '')) {
        return whole(`the file must be UTF-8 (its first lines declare "coding: ${coding[1]}")`);
      }
    }
  }
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(body);
  } catch {
    return whole('the file must be UTF-8 (it holds bytes that are not)');
  }
}

/** pip's preprocess(): split, join `\` continuations, drop comments and empty lines. */
function* logicalLines(text: string): Generator<[number, string]> {
  const physical = text.split(LINE_BREAK);
  // splitlines() gives no empty last line for a trailing break.
  if (physical.length > 0 && physical.at(-1) === '') physical.pop();
  let primary = 0;
  let pending: string[] = [];
  const joined: Array<[number, string]> = [];
  physical.forEach((raw, index) => {
    let line = raw;
    const comment = COMMENT_START.test(line);
    if (!line.endsWith('\\') || comment) {
      if (comment) line = ` ${line}`;
      if (pending.length > 0) {
        pending.push(line);
        joined.push([primary, pending.join('')]);
        pending = [];
      } else joined.push([index + 1, line]);
    } else {
      if (pending.length === 0) primary = index + 1;
      pending.push(line.replace(/^\\+|\\+$/g, ''));
    }
  });
  if (pending.length > 0) joined.push([primary, pending.join('')]);
  for (const [number, line] of joined) {
    const stripped = line.replace(COMMENT, '').replace(STRIP, '');
    if (stripped !== '') yield [number, stripped];
  }
}

/** What is wrong with one logical line, or undefined. */
function lineProblem(line: string, sourceDir: string): string | undefined {
  if (ENV_VAR.test(line)) {
    return `environment variables (\${NAME}) are expanded by pip where it runs; write the value itself`;
  }
  // pip's break_args_options(): words (split on single spaces) up to the first one starting with "-".
  const words = line.split(' ');
  const firstOption = words.findIndex((word) => word.startsWith('-'));
  const args = (firstOption === -1 ? words : words.slice(0, firstOption)).join(' ');
  const optionText = firstOption === -1 ? '' : words.slice(firstOption).join(' ');
  const tokens = shlexSplit(optionText);
  if (tokens === null) return 'its options cannot be split (an unclosed quote)';
  const parsed = parseOptions(tokens);
  if (typeof parsed === 'string') return parsed;
  for (const { name, value } of parsed) {
    const spec = LONG_OPTIONS[name]!;
    if (spec.refused) return spec.refused;
    if (args !== '' && !REQUIREMENT_OPTIONS.has(name)) {
      return `${name} belongs on a line of its own, not after a requirement`;
    }
    if (args === '' && REQUIREMENT_OPTIONS.has(name)) return `${name} must follow a requirement on its line`;
    const problem = value === undefined ? undefined : optionValueProblem(name, value, sourceDir);
    if (problem) return problem;
  }
  return args === '' ? undefined : requirementProblem(args, sourceDir);
}

/** shlex.split() (POSIX mode): quotes, backslash escapes; null when a quote is left open. */
function shlexSplit(text: string): string[] | null {
  const tokens: string[] = [];
  let current: string | null = null;
  let quote: '"' | "'" | null = null;
  for (let i = 0; i < text.length; i++) {
    const ch = text[i]!;
    if (quote === "'") {
      if (ch === "'") quote = null;
      else current = `${current ?? ''}${ch}`;
    } else if (quote === '"') {
      if (ch === '"') quote = null;
      else if (ch === '\\' && (text[i + 1] === '"' || text[i + 1] === '\\')) current = `${current ?? ''}${text[++i]}`;
      else current = `${current ?? ''}${ch}`;
    } else if (' \t\r\n'.includes(ch)) {
      if (current !== null) tokens.push(current);
      current = null;
    } else if (ch === '"' || ch === "'") {
      quote = ch;
      current ??= '';
    } else if (ch === '\\') {
      if (i + 1 >= text.length) return null;
      current = (current ?? '') + text[++i];
    } else current = (current ?? '') + ch;
  }
  if (quote !== null) return null;
  if (current !== null) tokens.push(current);
  return tokens;
}

/** optparse over pip's requirement-file options: the options named (by their full name) with their values. */
function parseOptions(tokens: string[]): Array<{ name: string; value?: string }> | string {
  const found: Array<{ name: string; value?: string }> = [];
  for (let i = 0; i < tokens.length; i++) {
    const token = tokens[i]!;
    if (token === '--') break; // the rest are arguments, which pip ignores on an option line
    if (token.startsWith('--')) {
      const eq = token.indexOf('=');
      const written = eq === -1 ? token : token.slice(0, eq);
      const matches =
        written in LONG_OPTIONS ? [written] : Object.keys(LONG_OPTIONS).filter((n) => n.startsWith(written));
      if (matches.length !== 1) {
        return matches.length === 0
          ? `${written} is not an option pip reads in a requirements file`
          : `${written} is ambiguous (${matches.join(', ')}); write the option in full`;
      }
      const name = matches[0]!;
      if (!LONG_OPTIONS[name]!.value) {
        if (eq !== -1) return `${name} takes no value`;
        found.push({ name });
      } else if (eq !== -1) found.push({ name, value: token.slice(eq + 1) });
      else if (i + 1 < tokens.length) found.push({ name, value: tokens[++i]! });
      else return `${name} needs a value`;
    } else if (token.startsWith('-') && token.length > 1) {
      // Every short option takes a value: the rest of the word, or the next word.
      const name = SHORT_OPTIONS[token.slice(0, 2)];
      if (!name) return `${token.slice(0, 2)} is not an option pip reads in a requirements file`;
      if (token.length > 2) found.push({ name, value: token.slice(2) });
      else if (i + 1 < tokens.length) found.push({ name, value: tokens[++i]! });
      else return `${token} needs a value`;
    }
    // Other words are arguments, which pip ignores on an option line.
  }
  return found;
}

function optionValueProblem(name: string, value: string, sourceDir: string): string | undefined {
  if (name === '--index-url' || name === '--pypi-url' || name === '--extra-index-url') {
    return /^https?:\/\//i.test(value) ? undefined : `${name} must be an http or https URL`;
  }
  if (name === '--find-links') {
    if (/^https?:\/\//i.test(value)) return undefined;
    const local = localPath(value, sourceDir);
    if (local === null || !insideApp(local, sourceDir)) {
      return `${name} must be an http or https URL or a folder of the app`;
    }
  }
  return undefined;
}

/** The path a `file:` URL or a path names, relative to the app folder; null for another URL or a bad escape. */
function localPath(value: string, sourceDir: string): string | null {
  let rest = value;
  if (/^file:/i.test(rest)) {
    rest = rest.slice(5).replace(/^\/\/(localhost)?(?=\/|$)/i, '');
    if (rest.startsWith('//')) return null; // a host
    rest = rest.replace(/[?#].*$/, '');
    try {
      rest = decodeURIComponent(rest);
    } catch {
      return null;
    }
  } else if (/^[A-Za-z][A-Za-z0-9+.-]*:/.test(rest) && URL_SCHEMES.has(rest.split(':')[0]!.toLowerCase())) {
    return null;
  }
  return path.resolve(sourceDir, rest);
}

function insideApp(file: string, sourceDir: string): boolean {
  const root = realish(path.resolve(sourceDir));
  const relative = path.relative(root, realish(file));
  return relative === '' || (!relative.startsWith('..') && !path.isAbsolute(relative));
}

/**
 * The path with links resolved as far as it exists inside the app folder (archives hold no links, but a
 * link out would be followed by pip). Nothing outside the app is looked at: a stat there would tell the
 * app what exists on the server.
 */
function realish(file: string): string {
  try {
    return fs.realpathSync(file);
  } catch {
    const parent = path.dirname(file);
    return parent === file ? file : path.join(realish(parent), path.basename(file));
  }
}

function isDirectory(file: string): boolean {
  try {
    return fs.statSync(file).isDirectory();
  } catch {
    return false;
  }
}

/** pip's `_strip_extras`: `name[extra]` → name. */
function stripExtras(text: string): string {
  return /^(.+)(\[[^\]]+\])$/s.exec(text)?.[1] ?? text;
}

function urlScheme(text: string): string | null {
  const colon = text.indexOf(':');
  return colon === -1 ? null : text.slice(0, colon).toLowerCase();
}

/**
 * What pip would install from a requirement (pip's parse_req_from_line), and whether that is allowed:
 * a URL; else a folder (a path-like name that is one); else a file (an archive name); else a PEP 508
 * requirement, a project name or `name @ url`.
 */
function requirementProblem(args: string, sourceDir: string): string | undefined {
  const isUrl = (text: string) => URL_SCHEMES.has(urlScheme(text) ?? '');
  const markerAt = args.indexOf(isUrl(args) ? '; ' : ';');
  const name = (markerAt === -1 ? args : args.slice(0, markerAt)).replace(STRIP, '');
  if (isUrl(name)) return urlProblem(name, sourceDir);

  const looksLikePath = name.includes('/') || name.startsWith('.');
  const target = stripExtras(path.resolve(sourceDir, name));
  if (looksLikePath) {
    // pip looks at this path whatever the rest of the line is (even `x @ https://...`).
    if (!insideApp(target, sourceDir)) return 'a path outside the app folder';
    if (isDirectory(target)) return 'a local folder is built from source';
  }
  if (ARCHIVE.test(target) && !name.includes('@')) {
    // A file of that name (pip installs a folder of that name from source too).
    if (!insideApp(target, sourceDir)) return 'a path outside the app folder';
    if (isDirectory(target)) return 'a local folder is built from source';
    return WHEEL.test(target) ? undefined : 'a source archive is built from source';
  }
  const at = name.indexOf('@');
  if (at !== -1) {
    // A PEP 508 direct reference, `name @ url`.
    return urlProblem(name.slice(at + 1).replace(STRIP, ''), sourceDir);
  }
  if (looksLikePath) return 'a local path that is not a wheel (.whl)';
  if (ARCHIVE.test(name)) return 'a source archive is built from source';
  return undefined;
}

function urlProblem(url: string, sourceDir: string): string | undefined {
  const scheme = urlScheme(url) ?? '';
  if (VCS.test(scheme)) return 'a VCS requirement is built from source';
  const urlPath = url.replace(/[?#].*$/, '');
  if (scheme === 'http' || scheme === 'https') {
    return WHEEL.test(urlPath) ? undefined : 'a URL that is not a wheel (.whl) is built from source';
  }
  if (scheme === 'file') {
    const local = localPath(url, sourceDir);
    if (local === null || !insideApp(local, sourceDir)) return 'a file: URL outside the app folder';
    if (isDirectory(local)) return 'a local folder is built from source';
    return WHEEL.test(local) ? undefined : 'a local file that is not a wheel (.whl) is built from source';
  }
  return `${scheme ? `a URL of scheme ${scheme}` : 'a relative URL'} is not supported (a wheel by http(s) URL or by path only)`;
}
