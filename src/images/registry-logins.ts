/**
 * A project's registry logins (`ferry registries login`, `/v2/projects/{p}/registries`): the credentials its
 * builds' pulls send to a private registry, one per registry, and no other project's pulls ever (issue 43).
 * This module owns their table (`registry_logins`, migration 0017): every statement on it is here.
 *
 * The password is encrypted at rest like a secret (AES-256-GCM under `keys/secrets.key`, secrets/secrets.ts's
 * own functions) but bound to `<project>/registry:<registry>`: a secret's name can hold no `:`, so a login's
 * ciphertext never decrypts as a secret and a secret's never as a login. The table is not the secrets': no
 * replica's environment (`secretEnvironment`) and no secrets list can come across a login. The username is
 * kept in clear, so the list can say which account a login uses; the password is never answered, and the
 * responses' schemas have no member that could carry it.
 *
 * A login is not checked against its registry when it is set (a gateway may not reach the registry): the
 * next pull says whether the registry took it (`FERRY_IMAGE_REGISTRY_AUTH`).
 */

import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import { decryptSecret, encryptSecret } from '../secrets/secrets.js';
import type { Store } from '../store/index.js';
import { registryName } from './reference.js';
import type { RegistryCredentials } from './registry-auth.js';

/** Characters of a username; Basic authentication ends the user at the first `:`, so it may hold none. */
export const MAX_REGISTRY_USERNAME_CHARS = 256;
/** Characters of a password or token (a cloud key file used as a password is a few KiB). */
export const MAX_REGISTRY_PASSWORD_CHARS = 16_384;

export interface RegistryLogin {
  registry: string;
  username: string;
  created_at: string;
  updated_at: string;
}

export interface RegistryLoginService {
  /** Creates or replaces the project's login for `registry`; replacing keeps `created_at`. */
  set(projectId: string, registry: string, login: RegistryCredentials): Promise<RegistryLogin>;
  /** The project's logins, without passwords, sorted by registry (code-unit order). */
  list(projectId: string): Promise<RegistryLogin[]>;
  /** FERRY_REGISTRY_LOGIN_NOT_FOUND when the project has none for `registry`. */
  delete(projectId: string, registry: string): Promise<void>;
  /** The project's credentials for `registry` (as an image reference names it), decrypted; undefined: none. */
  credentials(projectId: string, registry: string): Promise<RegistryCredentials | undefined>;
}

/** The binding of a login's ciphertext: never a secret's, whose names hold no `:`. */
function binding(projectId: string, registry: string) {
  return { projectId, name: `registry:${registry}` };
}

/** `registry` as logins are keyed (lower case, Docker Hub's aliases folded), or FERRY_VALIDATION. */
export function loginRegistry(registry: string): string {
  const name = registryName(registry);
  if (!name) {
    throw new FerryError(
      'FERRY_VALIDATION',
      `"${registry.slice(0, 100)}" is not a registry: write it as an image reference names it (host with a dot or a port, localhost, or docker.io; no scheme, no path)`,
    );
  }
  return name;
}

function checkCredentials(login: RegistryCredentials): void {
  const { username, password } = login;
  if (typeof username !== 'string' || username.length === 0 || username.length > MAX_REGISTRY_USERNAME_CHARS)
    throw new FerryError('FERRY_VALIDATION', `The username must be 1 to ${MAX_REGISTRY_USERNAME_CHARS} characters`);
  // biome-ignore lint/suspicious/noControlCharactersInRegex: control characters are what is refused
  if (/[:\u0000-\u001f\u007f]/.test(username))
    throw new FerryError('FERRY_VALIDATION', 'The username must not contain ":" or control characters');
  if (typeof password !== 'string' || password.length === 0)
    throw new FerryError('FERRY_VALIDATION', 'A password (or token) is required');
  if (password.length > MAX_REGISTRY_PASSWORD_CHARS)
    throw new FerryError('FERRY_VALIDATION', `The password must be at most ${MAX_REGISTRY_PASSWORD_CHARS} characters`);
  if (password.includes('\0')) throw new FerryError('FERRY_VALIDATION', 'The password must not contain NUL characters');
}

export function createRegistryLogins(deps: { store: Store; secretsKey: Uint8Array }): RegistryLoginService {
  const { store, secretsKey } = deps;
  const columns = ['registry', 'username', 'created_at', 'updated_at'] as const;
  return {
    async set(projectId, registry, login) {
      const name = loginRegistry(registry);
      checkCredentials(login);
      const password = encryptSecret(secretsKey, login.password, binding(projectId, name));
      const at = nowIso();
      await store
        .insertInto('registry_logins')
        .values({
          project_id: projectId,
          registry: name,
          username: login.username,
          password,
          created_at: at,
          updated_at: at,
        })
        .onConflict((oc) =>
          oc.columns(['project_id', 'registry']).doUpdateSet({ username: login.username, password, updated_at: at }),
        )
        .execute();
      const row = await store
        .selectFrom('registry_logins')
        .select(columns)
        .where('project_id', '=', projectId)
        .where('registry', '=', name)
        .executeTakeFirst();
      if (!row) throw new Error(`The login for ${name} vanished right after it was written`);
      return row;
    },

    async list(projectId) {
      const rows = await store
        .selectFrom('registry_logins')
        .select(columns)
        .where('project_id', '=', projectId)
        .execute();
      return rows.sort((a, b) => (a.registry < b.registry ? -1 : a.registry > b.registry ? 1 : 0));
    },

    async delete(projectId, registry) {
      const name = loginRegistry(registry);
      const result = await store
        .deleteFrom('registry_logins')
        .where('project_id', '=', projectId)
        .where('registry', '=', name)
        .executeTakeFirst();
      if (result.numDeletedRows === 0n)
        throw new FerryError('FERRY_REGISTRY_LOGIN_NOT_FOUND', `The project has no login for ${name}`);
    },

    async credentials(projectId, registry) {
      const name = registryName(registry);
      if (!name) return undefined;
      const row = await store
        .selectFrom('registry_logins')
        .select(['username', 'password'])
        .where('project_id', '=', projectId)
        .where('registry', '=', name)
        .executeTakeFirst();
      if (!row) return undefined;
      let password: string;
      try {
        password = decryptSecret(secretsKey, row.password, binding(projectId, name));
      } catch (err) {
        // Never the ciphertext or the cause's text in what a build log shows: the registry, and what to do.
        throw new FerryError(
          'FERRY_IMAGE_REGISTRY_AUTH',
          `the project's login for ${name} does not decrypt (keys/secrets.key replaced?): log in again with ferry registries login ${name}`,
          { cause: err },
        );
      }
      return { username: row.username, password };
    },
  };
}
