/**
 * What an image's config blob says about running it: `Env`, `WorkingDir`, `User`, `Entrypoint`, `Cmd`,
 * `ExposedPorts`. The config is untrusted input (anyone can push an image), so each member is checked and
 * bounded here, once, and the rest of Ferry reads only this typed result.
 */
import { FerryError } from '../errors.js';

export interface ImageRunConfig {
  /** `NAME=value` pairs, in the image's order. */
  env: Array<[name: string, value: string]>;
  /** Absolute path, `/` when the image sets none. */
  workingDir: string;
  /** The image's `USER` as written (`app`, `1000:1000`); the sandbox maps it to its unprivileged user. */
  user: string | undefined;
  entrypoint: string[] | undefined;
  cmd: string[] | undefined;
  /** TCP ports of `EXPOSE`, ascending. */
  exposedPorts: number[];
  architecture: string | undefined;
  os: string | undefined;
}

const MAX_ENTRIES = 1000;
const MAX_TEXT = 64 * 1024;

function bad(what: string): FerryError {
  return new FerryError('FERRY_IMAGE_UNSUPPORTED', `the image config's ${what} is malformed`);
}

function strings(value: unknown, what: string): string[] | undefined {
  if (value === undefined || value === null) return undefined;
  if (!Array.isArray(value) || value.length > MAX_ENTRIES) throw bad(what);
  return value.map((item) => {
    if (typeof item !== 'string' || item.length > MAX_TEXT || item.includes('\0')) throw bad(what);
    return item;
  });
}

/** Parses the config blob's bytes (digest already verified by the layout). */
export function parseImageConfig(bytes: Buffer): ImageRunConfig {
  let json: { config?: Record<string, unknown> | null; architecture?: unknown; os?: unknown };
  try {
    json = JSON.parse(bytes.toString('utf8'));
  } catch {
    throw bad('JSON');
  }
  if (typeof json !== 'object' || json === null) throw bad('JSON');
  const c = json.config ?? {};
  if (typeof c !== 'object') throw bad('config');
  const env = (strings(c.Env, 'Env') ?? []).map((pair): [string, string] => {
    const eq = pair.indexOf('=');
    if (eq <= 0) throw bad('Env');
    return [pair.slice(0, eq), pair.slice(eq + 1)];
  });
  const workingDir = c.WorkingDir === undefined || c.WorkingDir === '' ? '/' : c.WorkingDir;
  if (typeof workingDir !== 'string' || !workingDir.startsWith('/') || workingDir.includes('\0'))
    throw bad('WorkingDir');
  const user = c.User === undefined || c.User === '' ? undefined : c.User;
  if (user !== undefined && (typeof user !== 'string' || user.length > 256 || /[\0\n]/.test(user))) throw bad('User');
  const ports = new Set<number>();
  if (c.ExposedPorts !== undefined && c.ExposedPorts !== null) {
    if (typeof c.ExposedPorts !== 'object') throw bad('ExposedPorts');
    for (const key of Object.keys(c.ExposedPorts).slice(0, MAX_ENTRIES)) {
      const match = key.match(/^([0-9]{1,5})(?:\/(tcp|udp|sctp))?$/);
      if (!match) throw bad('ExposedPorts');
      const port = Number(match[1]);
      if ((match[2] ?? 'tcp') === 'tcp' && port >= 1 && port <= 65535) ports.add(port);
    }
  }
  return {
    env,
    workingDir,
    user,
    entrypoint: strings(c.Entrypoint, 'Entrypoint'),
    cmd: strings(c.Cmd, 'Cmd'),
    exposedPorts: [...ports].sort((a, b) => a - b),
    architecture: typeof json.architecture === 'string' ? json.architecture : undefined,
    os: typeof json.os === 'string' ? json.os : undefined,
  };
}
