/**
 * The `[image]` table of `ferry.toml`: what an app asks its environment to be built from. Validated here,
 * in one function the app-config module calls (`parseImageTable`), so the CLI refuses a bad table before
 * uploading and the server refuses it in an uploaded archive, with the same words.
 *
 * ```toml
 * [image]
 * base = "docker.io/library/python:3.12-slim"   # tag or @sha256: digest
 * apt = ["ffmpeg", "libgl1"]                     # Debian/Ubuntu packages (name, or name=version)
 * run = ["pip install --no-cache-dir numpy"]      # shell commands, in order, after apt
 * env = { HF_HOME = "/models" }                   # baked into the image
 * # or, instead of base/apt/run:
 * dockerfile = "Dockerfile"                       # a path in the app folder
 * ```
 *
 * Errors are `FERRY_IMAGE_CONFIG_INVALID` (`FERRY_IMAGE_REFERENCE_INVALID` for `base`), with the message
 * naming the key, as `ferry.toml: image.apt[2]: …`. Without an `[image]` table nothing changes: the app
 * runs on the host runtime as before.
 */
import { FerryError } from '../errors.js';
import { type ImageReference, parseImageReference } from './reference.js';

export type ImageSpec =
  | {
      kind: 'steps';
      /** The reference as written, and parsed. */
      baseText: string;
      base: ImageReference;
      apt: string[];
      run: string[];
      env: Record<string, string>;
    }
  | {
      kind: 'dockerfile';
      /** Relative to the app folder, `/`-separated, normalized. */
      dockerfile: string;
      env: Record<string, string>;
    };

export const IMAGE_LIMITS = {
  aptPackages: 500,
  runSteps: 100,
  runStepChars: 16 * 1024,
  envEntries: 200,
  envValueChars: 32 * 1024,
  pathChars: 1024,
} as const;

const KEYS = new Set(['base', 'apt', 'run', 'env', 'dockerfile']);
// Debian package names (policy 5.6.1), optionally pinned to a version; never starting with "-" (no options).
const APT_PACKAGE = /^[a-z0-9][a-z0-9+.-]+(?::[a-z0-9-]+)?(?:=[A-Za-z0-9.+~:-]+)?$/;
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

function invalid(key: string, why: string): FerryError {
  return new FerryError('FERRY_IMAGE_CONFIG_INVALID', `ferry.toml: image${key ? `.${key}` : ''}: ${why}`);
}

function isTable(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value) && !(value instanceof Date);
}

/**
 * Validates the parsed `[image]` table (`undefined` when the file has none: then undefined is returned
 * and nothing about the app changes). Throws FerryError naming the key.
 */
export function parseImageTable(raw: unknown): ImageSpec | undefined {
  if (raw === undefined) return undefined;
  if (!isTable(raw)) throw invalid('', 'must be a table');
  for (const key of Object.keys(raw)) {
    if (!KEYS.has(key)) throw invalid(key, `unknown key (expected one of ${[...KEYS].join(', ')})`);
  }
  const env = parseEnv(raw.env);
  if (raw.dockerfile !== undefined) {
    for (const key of ['base', 'apt', 'run'] as const) {
      if (raw[key] !== undefined) throw invalid(key, 'cannot be used with image.dockerfile (the Dockerfile says it)');
    }
    return { kind: 'dockerfile', dockerfile: parseAppPath(raw.dockerfile, 'dockerfile'), env };
  }
  if (raw.base === undefined) throw invalid('base', 'is required (or image.dockerfile)');
  if (typeof raw.base !== 'string') throw invalid('base', 'must be a string');
  let base: ImageReference;
  try {
    base = parseImageReference(raw.base);
  } catch (err) {
    if (err instanceof FerryError) throw new FerryError(err.code, `ferry.toml: image.base: ${err.message}`);
    throw err;
  }
  const apt = stringList(raw.apt, 'apt', IMAGE_LIMITS.aptPackages, (item, key) => {
    if (!APT_PACKAGE.test(item))
      throw invalid(key, `"${item.slice(0, 100)}" is not a Debian package name (optionally =version)`);
  });
  const run = stringList(raw.run, 'run', IMAGE_LIMITS.runSteps, (item, key) => {
    if (item.trim() === '') throw invalid(key, 'is empty');
    if (item.length > IMAGE_LIMITS.runStepChars)
      throw invalid(key, `is longer than ${IMAGE_LIMITS.runStepChars} characters`);
    if (item.includes('\0')) throw invalid(key, 'has a NUL character');
  });
  return { kind: 'steps', baseText: raw.base, base, apt, run, env };
}

function stringList(value: unknown, key: string, max: number, check: (item: string, key: string) => void): string[] {
  if (value === undefined) return [];
  if (!Array.isArray(value)) throw invalid(key, 'must be an array of strings');
  if (value.length > max) throw invalid(key, `has more than ${max} entries`);
  return value.map((item, i) => {
    if (typeof item !== 'string') throw invalid(`${key}[${i}]`, 'must be a string');
    check(item, `${key}[${i}]`);
    return item;
  });
}

function parseEnv(value: unknown): Record<string, string> {
  if (value === undefined) return {};
  if (!isTable(value)) throw invalid('env', 'must be a table of NAME = "value"');
  const entries = Object.entries(value);
  if (entries.length > IMAGE_LIMITS.envEntries)
    throw invalid('env', `has more than ${IMAGE_LIMITS.envEntries} entries`);
  const env: Record<string, string> = {};
  for (const [name, v] of entries) {
    if (!ENV_NAME.test(name)) throw invalid(`env.${name.slice(0, 100)}`, 'is not a variable name (letters, digits, _)');
    if (name.startsWith('FERRY_')) throw invalid(`env.${name}`, 'FERRY_ names are reserved for Ferry');
    if (typeof v !== 'string') throw invalid(`env.${name}`, 'must be a string');
    if (v.length > IMAGE_LIMITS.envValueChars || v.includes('\0')) {
      throw invalid(`env.${name}`, `must be at most ${IMAGE_LIMITS.envValueChars} characters without NUL`);
    }
    env[name] = v;
  }
  return env;
}

/** A path inside the app folder: relative, no `..`, normalized to `/`-separated parts. */
function parseAppPath(value: unknown, key: string): string {
  if (typeof value !== 'string' || value === '') throw invalid(key, 'must be a path in the app folder');
  if (value.length > IMAGE_LIMITS.pathChars || value.includes('\0') || value.includes('\\')) {
    throw invalid(key, 'must be a path in the app folder (no NUL or backslash, at most 1024 characters)');
  }
  if (value.startsWith('/')) throw invalid(key, 'must be relative to the app folder, not absolute');
  const parts = value.split('/').filter((p) => p !== '' && p !== '.');
  if (parts.length === 0 || parts.includes('..')) throw invalid(key, 'must name a file inside the app folder');
  return parts.join('/');
}
