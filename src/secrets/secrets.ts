/**
 * Project secrets: named values that replicas receive as environment variables.
 *
 * Values are encrypted at rest with AES-256-GCM under `keys/secrets.key` and never leave the server in
 * clear except to replicas (`secretEnvironment`); the API only ever shows names and timestamps.
 * Stored form: `v1.<iv>.<tag>.<ciphertext>`, each part base64url. The additional authenticated data is
 * `<project_id>/<name>`, so a value copied to another row (or project) fails to decrypt instead of
 * silently becoming some other secret.
 */
import { createCipheriv, createDecipheriv, randomBytes } from 'node:crypto';
import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import type { Store } from '../store/index.js';

/** The syntax of a name; `secretNameProblem` also refuses reserved names. */
export const SECRET_NAME_PATTERN = '^[A-Za-z_][A-Za-z0-9_]{0,127}$';
const NAME_RE = new RegExp(SECRET_NAME_PATTERN);
/** Ferry sets these itself in every replica; a secret must not shadow them. */
export const RESERVED_SECRET_NAMES: readonly string[] = ['APP_NAME', 'PROJECT_ID', 'BUILD_ID', 'PATH', 'HOME'];
export const RESERVED_SECRET_PREFIX = 'FERRY_';
/** UTF-8 bytes. */
export const MAX_SECRET_VALUE_BYTES = 64 * 1024;

const FORMAT = 'v1';
const IV_BYTES = 12;
const TAG_BYTES = 16;

export interface SecretMetadata {
  name: string;
  created_at: string;
  updated_at: string;
}

/** Which project and name a ciphertext belongs to; authenticated, not encrypted. */
export interface SecretBinding {
  projectId: string;
  name: string;
}

function aad(binding: SecretBinding): Buffer {
  return Buffer.from(`${binding.projectId}/${binding.name}`, 'utf8');
}

function checkKey(key: Uint8Array): void {
  if (key.length !== 32) throw new Error(`The secrets key must be 32 bytes, not ${key.length}`);
}

export function encryptSecret(key: Uint8Array, plaintext: string, binding: SecretBinding): string {
  checkKey(key);
  // A fresh random IV per encryption: GCM breaks badly if an IV is ever reused under one key.
  const iv = randomBytes(IV_BYTES);
  const cipher = createCipheriv('aes-256-gcm', key, iv, { authTagLength: TAG_BYTES });
  cipher.setAAD(aad(binding));
  const data = Buffer.concat([cipher.update(plaintext, 'utf8'), cipher.final()]);
  const tag = cipher.getAuthTag();
  return [FORMAT, iv.toString('base64url'), tag.toString('base64url'), data.toString('base64url')].join('.');
}

/** Throws when the value was tampered with, belongs to another project or name, or was made with another key. */
export function decryptSecret(key: Uint8Array, stored: string, binding: SecretBinding): string {
  checkKey(key);
  const parts = stored.split('.');
  if (parts.length !== 4 || parts[0] !== FORMAT) throw new Error(`Secret ${binding.name} has an unknown format`);
  const iv = Buffer.from(parts[1] ?? '', 'base64url');
  const tag = Buffer.from(parts[2] ?? '', 'base64url');
  const data = Buffer.from(parts[3] ?? '', 'base64url');
  if (iv.length !== IV_BYTES || tag.length !== TAG_BYTES) throw new Error(`Secret ${binding.name} is malformed`);
  const decipher = createDecipheriv('aes-256-gcm', key, iv, { authTagLength: TAG_BYTES });
  decipher.setAAD(aad(binding));
  decipher.setAuthTag(tag);
  try {
    return Buffer.concat([decipher.update(data), decipher.final()]).toString('utf8');
  } catch (err) {
    throw new Error(
      `Secret ${binding.name} of project ${binding.projectId} does not decrypt (tampered, moved, or keys/secrets.key replaced)`,
      { cause: err },
    );
  }
}

/** Why a name cannot be used, or undefined when it can. */
export function secretNameProblem(name: string): string | undefined {
  if (!NAME_RE.test(name)) {
    return 'secret names are 1 to 128 letters, digits and underscores, not starting with a digit';
  }
  if (name.startsWith(RESERVED_SECRET_PREFIX))
    return `secret names starting with ${RESERVED_SECRET_PREFIX} are reserved`;
  if (RESERVED_SECRET_NAMES.includes(name)) return `${name} is set by Ferry and cannot be a secret`;
  return undefined;
}

function checkName(name: string): void {
  const reason = secretNameProblem(name);
  if (reason) throw new FerryError('FERRY_VALIDATION', `Invalid secret name "${name}": ${reason}`);
}

function checkValue(value: unknown): asserts value is string {
  if (typeof value !== 'string') throw new FerryError('FERRY_VALIDATION', 'A secret value must be a string');
  if (Buffer.byteLength(value, 'utf8') > MAX_SECRET_VALUE_BYTES) {
    throw new FerryError('FERRY_VALIDATION', `A secret value must be at most ${MAX_SECRET_VALUE_BYTES} bytes`);
  }
  // An environment variable cannot hold NUL; refusing it here beats a replica that cannot start later.
  if (value.includes('\0')) throw new FerryError('FERRY_VALIDATION', 'A secret value must not contain NUL characters');
}

/** Creates or replaces a secret; replacing keeps `created_at`. */
export async function setSecret(
  store: Store,
  key: Uint8Array,
  projectId: string,
  name: string,
  value: string,
): Promise<SecretMetadata> {
  checkName(name);
  checkValue(value);
  const encrypted = encryptSecret(key, value, { projectId, name });
  const at = nowIso();
  await store
    .insertInto('secrets')
    .values({ project_id: projectId, name, value: encrypted, created_at: at, updated_at: at })
    .onConflict((oc) => oc.columns(['project_id', 'name']).doUpdateSet({ value: encrypted, updated_at: at }))
    .execute();
  const meta = await getSecret(store, projectId, name);
  if (!meta) throw new Error(`Secret ${name} vanished right after it was written`);
  return meta;
}

export async function getSecret(store: Store, projectId: string, name: string): Promise<SecretMetadata | undefined> {
  return store
    .selectFrom('secrets')
    .select(['name', 'created_at', 'updated_at'])
    .where('project_id', '=', projectId)
    .where('name', '=', name)
    .executeTakeFirst();
}

/** Sorted by name, by code unit, in JS: SQLite and PostgreSQL collations would order differently. */
export async function listSecrets(store: Store, projectId: string): Promise<SecretMetadata[]> {
  const rows = await store
    .selectFrom('secrets')
    .select(['name', 'created_at', 'updated_at'])
    .where('project_id', '=', projectId)
    .execute();
  return rows.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
}

export async function deleteSecret(store: Store, projectId: string, name: string): Promise<void> {
  const result = await store
    .deleteFrom('secrets')
    .where('project_id', '=', projectId)
    .where('name', '=', name)
    .executeTakeFirst();
  if (result.numDeletedRows === 0n) throw new FerryError('FERRY_SECRET_NOT_FOUND', `No secret named ${name}`);
}

/**
 * Every secret of the project, decrypted: the environment a new replica starts with. Throws when one
 * does not decrypt, because a replica missing a secret would fail later in a far more confusing way.
 */
export async function secretEnvironment(
  store: Store,
  key: Uint8Array,
  projectId: string,
): Promise<Record<string, string>> {
  const rows = await store
    .selectFrom('secrets')
    .select(['name', 'value'])
    .where('project_id', '=', projectId)
    .execute();
  const env: Record<string, string> = {};
  for (const row of rows) env[row.name] = decryptSecret(key, row.value, { projectId, name: row.name });
  return env;
}
