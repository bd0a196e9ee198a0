/**
 * Dockerfiles, the common subset, turned into the same plan of steps as `[image]`'s `apt`/`run`/`env`
 * (build-plan.ts), which image-builder.ts runs.
 *
 * Supported: one `FROM` stage (`ARG`s before it substitute into it; `--platform` is ignored, the build is
 * for this machine), `RUN` (shell and exec form), `COPY`/`ADD` of files of the build context (`--chown`
 * with numeric ids; `ADD` copies a local archive as it is, it does not extract it), `ENV`, `ARG` (with
 * its default: there are no build arguments from outside), `WORKDIR`, `USER`, `ENTRYPOINT`, `CMD`,
 * `EXPOSE`, `LABEL`, `SHELL`, and `MAINTAINER` (a label); `VOLUME`, `STOPSIGNAL` and `HEALTHCHECK` are
 * read and ignored (the build log says so). Variables (`$A`, `${A}`, `${A:-x}`, `${A:+x}`) are
 * substituted where Docker does (not in `RUN`, `CMD`, `ENTRYPOINT`: the shell does that).
 *
 * Refused with `FERRY_IMAGE_DOCKERFILE_INVALID` naming the line: a second `FROM` (multi-stage), `COPY
 * --from`, `ONBUILD`, an unknown instruction, malformed JSON. `ADD` of a URL is
 * `FERRY_IMAGE_ADD_URL_REFUSED`: Ferry never downloads for a build; a `RUN` step does, under the egress
 * policy of the build sandbox.
 */
import { FerryError } from '../errors.js';
import type { ImageRunConfig } from './image-config.js';

export const MAX_DOCKERFILE_BYTES = 1024 * 1024;
const MAX_INSTRUCTIONS = 1000;

export interface RawInstruction {
  op: string;
  /** 1-based line where it starts. */
  line: number;
  /** Everything after the keyword, continuation lines joined. */
  rest: string;
  /** As written (for the build log), continuations joined. */
  text: string;
}

/** The state a step runs with, and that becomes the image config at the end. */
export interface BuildState {
  env: Array<[string, string]>;
  workdir: string;
  user: string | undefined;
  shell: string[];
  entrypoint: string[] | undefined;
  cmd: string[] | undefined;
  exposed: string[];
  labels: Record<string, string>;
}

export type PlanStep =
  | { kind: 'run'; label: string; argv: string[]; state: BuildState; buildArgs: Array<[string, string]> }
  | {
      kind: 'copy';
      label: string;
      sources: string[];
      dest: string;
      uid: number;
      gid: number;
      state: BuildState;
    }
  | { kind: 'mkdir'; label: string; path: string; state: BuildState }
  | { kind: 'config'; label: string; state: BuildState; note?: string };

export interface DockerfilePlan {
  /** The base image reference (after ARG substitution). */
  from: string;
  fromLine: number;
  steps: PlanStep[];
}

function invalid(line: number, why: string): FerryError {
  return new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', `Dockerfile line ${line}: ${why}`);
}

/** Splits the file into instructions: comments dropped, `\` continuations joined. */
export function readInstructions(text: string): RawInstruction[] {
  if (Buffer.byteLength(text) > MAX_DOCKERFILE_BYTES) {
    throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', 'the Dockerfile is larger than 1 MiB');
  }
  if (text.includes('\0')) throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', 'the Dockerfile has a NUL byte');
  const lines = text.replace(/^\uFEFF/, '').split(/\r?\n/);
  let escapeChar = '\\';
  // Parser directives: `# escape=` at the very top.
  for (const line of lines) {
    const m = /^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$/.exec(line);
    if (!m) break;
    if (m[1]!.toLowerCase() === 'escape') {
      if (m[2] !== '\\' && m[2] !== '`') throw invalid(1, 'the escape directive must be \\ or `');
      escapeChar = m[2]!;
    }
  }
  const out: RawInstruction[] = [];
  let current: { line: number; parts: string[] } | null = null;
  for (const [i, raw] of lines.entries()) {
    const trimmed = raw.trim();
    if (trimmed.startsWith('#')) continue;
    if (current === null && trimmed === '') continue;
    const continued = trimmed.endsWith(escapeChar) && !trimmed.endsWith(`${escapeChar}${escapeChar}`);
    const body = continued ? raw.replace(/\s*$/, '').slice(0, -1) : raw;
    if (current === null) current = { line: i + 1, parts: [] };
    if (trimmed !== '' || !continued) current.parts.push(body);
    if (!continued) {
      const joined = current.parts.join(' ').trim();
      if (joined !== '') {
        const m = /^(\S+)\s*(.*)$/s.exec(joined)!;
        out.push({ op: m[1]!.toUpperCase(), line: current.line, rest: m[2]!.trim(), text: joined });
        if (out.length > MAX_INSTRUCTIONS) throw invalid(current.line, `more than ${MAX_INSTRUCTIONS} instructions`);
      }
      current = null;
    }
  }
  if (current !== null && current.parts.join('').trim() !== '') {
    const joined = current.parts.join(' ').trim();
    const m = /^(\S+)\s*(.*)$/s.exec(joined)!;
    out.push({ op: m[1]!.toUpperCase(), line: current.line, rest: m[2]!.trim(), text: joined });
  }
  return out;
}

/** `["a", "b"]` when `rest` is a JSON array of strings, else undefined (shell form). */
function jsonForm(rest: string, line: number): string[] | undefined {
  if (!rest.startsWith('[')) return undefined;
  let value: unknown;
  try {
    value = JSON.parse(rest);
  } catch {
    return undefined; // Docker treats a malformed array as shell form
  }
  if (!Array.isArray(value) || !value.every((v) => typeof v === 'string')) {
    throw invalid(line, 'the exec form must be a JSON array of strings');
  }
  return value as string[];
}

/** Shell-like words: quotes group, a backslash escapes (as Docker's ENV/LABEL/COPY word splitting). */
export function splitWords(text: string, line: number): string[] {
  const words: string[] = [];
  let word = '';
  let inWord = false;
  let quote: '"' | "'" | null = null;
  for (let i = 0; i < text.length; i++) {
    const ch = text[i]!;
    if (quote) {
      if (ch === quote) quote = null;
      else if (ch === '\\' && quote === '"' && i + 1 < text.length) word += text[++i];
      else word += ch;
    } else if (ch === '"' || ch === "'") {
      quote = ch;
      inWord = true;
    } else if (ch === '\\' && i + 1 < text.length) {
      word += text[++i];
      inWord = true;
    } else if (/\s/.test(ch)) {
      if (inWord) words.push(word);
      word = '';
      inWord = false;
    } else {
      word += ch;
      inWord = true;
    }
  }
  if (quote) throw invalid(line, 'a quote is not closed');
  if (inWord) words.push(word);
  return words;
}

/** Substitutes `$A`, `${A}`, `${A:-x}`, `${A:+x}` from `vars`; `\$` is a literal `$`. */
export function substitute(text: string, vars: Map<string, string>, line: number): string {
  let out = '';
  for (let i = 0; i < text.length; i++) {
    const ch = text[i]!;
    if (ch === '\\' && text[i + 1] === '$') {
      out += '\\$';
      i += 1;
      continue;
    }
    if (ch !== '$') {
      out += ch;
      continue;
    }
    if (text[i + 1] === '{') {
      const end = text.indexOf('}', i + 2);
      if (end < 0) throw invalid(line, 'a ${ is not closed');
      const inner = text.slice(i + 2, end);
      const m = /^([A-Za-z_][A-Za-z0-9_]*)(?::([-+])(.*))?$/s.exec(inner);
      if (!m) throw invalid(line, `\${${inner.slice(0, 40)}} is not a supported substitution`);
      const value = vars.get(m[1]!);
      if (m[2] === '-') out += value !== undefined && value !== '' ? value : m[3]!;
      else if (m[2] === '+') out += value !== undefined && value !== '' ? m[3]! : '';
      else out += value ?? '';
      i = end;
      continue;
    }
    const m = /^[A-Za-z_][A-Za-z0-9_]*/.exec(text.slice(i + 1));
    if (!m) {
      out += '$';
      continue;
    }
    out += vars.get(m[0]) ?? '';
    i += m[0].length;
  }
  return out;
}

/** Words after substitution, with the escapes of `\$` resolved. */
function substitutedWords(rest: string, vars: Map<string, string>, line: number): string[] {
  return splitWords(substitute(rest, vars, line), line);
}

/** `key=value` pairs (or Docker's legacy `ENV key value`). */
function pairs(rest: string, vars: Map<string, string>, line: number, legacy: boolean): Array<[string, string]> {
  const words = substitutedWords(rest, vars, line);
  if (words.length === 0) throw invalid(line, 'needs key=value');
  if (legacy && !words[0]!.includes('=')) {
    const m = /^(\S+)\s+(.*)$/s.exec(rest.trim());
    if (!m) throw invalid(line, 'needs a value');
    return [[m[1]!, substitute(m[2]!, vars, line)]];
  }
  return words.map((w) => {
    const eq = w.indexOf('=');
    if (eq <= 0) throw invalid(line, `"${w.slice(0, 60)}" is not key=value`);
    return [w.slice(0, eq), w.slice(eq + 1)];
  });
}

function resolveDir(base: string, target: string): string {
  const joined = target.startsWith('/') ? target : `${base.replace(/\/$/, '')}/${target}`;
  const parts: string[] = [];
  for (const part of joined.split('/')) {
    if (part === '' || part === '.') continue;
    if (part === '..') parts.pop();
    else parts.push(part);
  }
  return `/${parts.join('/')}`;
}

const URL_SOURCE = /^(?:[a-z][a-z0-9+.-]*:\/\/|git@)/i;

/** The state a build starts from: the base image's config. */
export function initialState(base: ImageRunConfig): BuildState {
  return {
    env: base.env.map(([k, v]) => [k, v]),
    workdir: base.workingDir,
    user: base.user,
    shell: ['/bin/sh', '-c'],
    entrypoint: base.entrypoint,
    cmd: base.cmd,
    exposed: base.exposedPorts.map((p) => `${p}/tcp`),
    labels: {},
  };
}

function copyState(state: BuildState): BuildState {
  return {
    ...state,
    env: state.env.map(([k, v]) => [k, v]),
    shell: [...state.shell],
    exposed: [...state.exposed],
    labels: { ...state.labels },
  };
}

function setEnv(state: BuildState, name: string, value: string): void {
  const i = state.env.findIndex(([k]) => k === name);
  if (i >= 0) state.env[i] = [name, value];
  else state.env.push([name, value]);
}

/** The FROM reference of a Dockerfile (what the caller pulls before building). */
export function dockerfileBase(text: string): { from: string; line: number } {
  const plan = planDockerfile(text, null);
  return { from: plan.from, line: plan.fromLine };
}

/**
 * The plan of a Dockerfile on top of its base's config (`base`; null only to learn the FROM line).
 * Throws FERRY_IMAGE_DOCKERFILE_INVALID or FERRY_IMAGE_ADD_URL_REFUSED.
 */
export function planDockerfile(text: string, base: ImageRunConfig | null): DockerfilePlan {
  const instructions = readInstructions(text);
  const args = new Map<string, string>();
  let from: { ref: string; line: number } | null = null;
  const state = initialState(
    base ?? {
      env: [],
      workingDir: '/',
      user: undefined,
      entrypoint: undefined,
      cmd: undefined,
      exposedPorts: [],
      architecture: undefined,
      os: undefined,
    },
  );
  const steps: PlanStep[] = [];
  const vars = () => {
    const all = new Map(args);
    for (const [k, v] of state.env) all.set(k, v);
    return all;
  };
  for (const ins of instructions) {
    const { op, line, rest } = ins;
    const label = ins.text.length > 200 ? `${ins.text.slice(0, 200)}…` : ins.text;
    if (op === 'ARG') {
      const words = substitutedWords(rest, vars(), line);
      for (const word of words) {
        const eq = word.indexOf('=');
        const name = eq < 0 ? word : word.slice(0, eq);
        if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(name)) throw invalid(line, `"${name.slice(0, 60)}" is not an ARG name`);
        if (eq >= 0) args.set(name, word.slice(eq + 1));
        else if (!args.has(name)) args.set(name, '');
      }
      if (from) steps.push({ kind: 'config', label, state: copyState(state) });
      continue;
    }
    if (op === 'FROM') {
      if (from) throw invalid(line, 'a second FROM (multi-stage builds) is not supported: use one stage');
      const words = substitutedWords(rest, args, line).filter((w) => !w.startsWith('--platform='));
      if (words.length !== 1 && !(words.length === 3 && words[1]!.toUpperCase() === 'AS')) {
        throw invalid(line, 'FROM takes one image reference (optionally AS name)');
      }
      if (words[0]!.startsWith('--')) throw invalid(line, `FROM ${words[0]} is not supported`);
      if (words[0] === 'scratch') throw invalid(line, 'FROM scratch is not supported: name a base image');
      from = { ref: words[0]!, line };
      continue;
    }
    if (!from) throw invalid(line, `${op} before FROM`);
    switch (op) {
      case 'RUN': {
        const exec = jsonForm(rest, line);
        if (/^--/.test(rest)) throw invalid(line, 'RUN options (--mount, --network) are not supported');
        if (rest === '') throw invalid(line, 'RUN needs a command');
        const argv = exec ?? [...state.shell, rest];
        if (argv.length === 0) throw invalid(line, 'RUN needs a command');
        steps.push({ kind: 'run', label, argv, state: copyState(state), buildArgs: [...args.entries()] });
        break;
      }
      case 'COPY':
      case 'ADD': {
        let words = jsonForm(rest, line) ?? substitutedWords(rest, vars(), line);
        let uid = 0;
        let gid = 0;
        while (words[0]?.startsWith('--')) {
          const flag = words[0];
          if (flag.startsWith('--chown=')) {
            const m = /^--chown=(\d+)(?::(\d+))?$/.exec(flag);
            if (!m) throw invalid(line, '--chown takes numeric ids (uid[:gid]) here');
            uid = Number(m[1]);
            gid = Number(m[2] ?? m[1]);
          } else if (flag.startsWith('--from=')) {
            throw invalid(line, `${op} --from needs multi-stage builds, which are not supported`);
          } else if (!flag.startsWith('--chmod=') && flag !== '--link') {
            throw invalid(line, `${op} ${flag.slice(0, 40)} is not supported`);
          }
          words = words.slice(1);
        }
        if (words.length < 2) throw invalid(line, `${op} needs a source and a destination`);
        const sources = words.slice(0, -1);
        const destWord = words[words.length - 1]!;
        for (const source of sources) {
          if (URL_SOURCE.test(source)) {
            throw new FerryError(
              'FERRY_IMAGE_ADD_URL_REFUSED',
              `Dockerfile line ${line}: ${op} ${source.slice(0, 200)}: Ferry does not download for a build; fetch it in a RUN step (under the build sandbox's egress policy)`,
            );
          }
        }
        const dest = resolveDir(state.workdir, destWord) + (destWord.endsWith('/') ? '/' : '');
        steps.push({ kind: 'copy', label, sources, dest, uid, gid, state: copyState(state) });
        break;
      }
      case 'ENV':
        for (const [k, v] of pairs(rest, vars(), line, true)) {
          if (!/^[A-Za-z_][A-Za-z0-9_.-]*$/.test(k)) throw invalid(line, `"${k.slice(0, 60)}" is not a variable name`);
          setEnv(state, k, v);
        }
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      case 'WORKDIR': {
        const words = substitutedWords(rest, vars(), line);
        if (words.length !== 1) throw invalid(line, 'WORKDIR takes one path');
        state.workdir = resolveDir(state.workdir, words[0]!);
        steps.push({ kind: 'mkdir', label, path: state.workdir, state: copyState(state) });
        break;
      }
      case 'USER': {
        const words = substitutedWords(rest, vars(), line);
        if (words.length !== 1 || !/^[A-Za-z0-9_.-]+(?::[A-Za-z0-9_.-]+)?$/.test(words[0]!)) {
          throw invalid(line, 'USER takes one user[:group]');
        }
        state.user = words[0];
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      }
      case 'ENTRYPOINT':
      case 'CMD': {
        const argv = jsonForm(rest, line) ?? (rest === '' ? [] : [...state.shell, rest]);
        if (op === 'ENTRYPOINT') {
          state.entrypoint = argv;
          state.cmd = undefined; // Docker: a new ENTRYPOINT resets a CMD inherited from the base
        } else state.cmd = argv;
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      }
      case 'EXPOSE': {
        for (const word of substitutedWords(rest, vars(), line)) {
          const m = /^(\d{1,5})(?:-(\d{1,5}))?(?:\/(tcp|udp|sctp))?$/i.exec(word);
          if (!m || Number(m[1]) < 1 || Number(m[1]) > 65535)
            throw invalid(line, `"${word.slice(0, 40)}" is not a port`);
          const proto = (m[3] ?? 'tcp').toLowerCase();
          const key = `${Number(m[1])}/${proto}`;
          if (!state.exposed.includes(key)) state.exposed.push(key);
        }
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      }
      case 'LABEL':
        for (const [k, v] of pairs(rest, vars(), line, false)) state.labels[k] = v;
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      case 'MAINTAINER':
        state.labels.maintainer = rest;
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      case 'SHELL': {
        const argv = jsonForm(rest, line);
        if (!argv || argv.length === 0) throw invalid(line, 'SHELL takes a JSON array');
        state.shell = argv;
        steps.push({ kind: 'config', label, state: copyState(state) });
        break;
      }
      case 'VOLUME':
      case 'STOPSIGNAL':
      case 'HEALTHCHECK':
        steps.push({ kind: 'config', label, state: copyState(state), note: `${op} is ignored by Ferry` });
        break;
      case 'ONBUILD':
        throw invalid(line, 'ONBUILD is not supported');
      default:
        throw invalid(line, `unknown instruction ${op.slice(0, 40)}`);
    }
  }
  if (!from) throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', 'the Dockerfile has no FROM line');
  return { from: from.ref, fromLine: from.line, steps };
}
