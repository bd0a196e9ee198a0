/**
 * Credentials for private registries, from `FERRY_REGISTRY_AUTH_FILE`: a `config.json` in the format
 * Docker (`~/.docker/config.json`) and the containers tools (`auth.json` of podman, skopeo, buildah)
 * share: `{"auths": {"<registry>": {"auth": base64("user:password")}}}` (or `username`/`password`, or an
 * `identitytoken`). Keys may be written with a scheme and a path (`https://index.docker.io/v1/`), as
 * `docker login` writes Docker Hub's.
 *
 * The file is read afresh for each pull (an operator can rotate a password without a restart), and its
 * content never reaches a log, a build log or an error message: a failure names the registry only.
 */
import fs from 'node:fs/promises';

export interface RegistryCredentials {
  username: string;
  password: string;
}

/** A credentials file that cannot be used: the message names the file and what is wrong, never a secret. */
export class RegistryAuthFileError extends Error {
  override readonly name = 'RegistryAuthFileError';
}

/** The registry a key of `auths` names: scheme and path dropped, Docker Hub's aliases folded into docker.io. */
export function normalizeAuthKey(key: string): string {
  let host = key.trim().toLowerCase();
  host = host.replace(/^[a-z][a-z0-9+.-]*:\/\//, '');
  host = host.split('/')[0] ?? '';
  if (host === 'index.docker.io' || host === 'registry-1.docker.io' || host === 'registry.hub.docker.com') {
    return 'docker.io';
  }
  return host;
}

/**
 * The credentials for `registry` (as in an image reference: `docker.io`, `host:port`) from the file, or
 * undefined when the file has none for it. Throws RegistryAuthFileError when the file cannot be read or
 * parsed, or its entry for the registry is malformed.
 */
export async function readRegistryCredentials(
  file: string | undefined,
  registry: string,
): Promise<RegistryCredentials | undefined> {
  if (!file) return undefined;
  let text: string;
  try {
    text = await fs.readFile(file, 'utf8');
  } catch (err) {
    throw new RegistryAuthFileError(
      `FERRY_REGISTRY_AUTH_FILE cannot be read (${(err as NodeJS.ErrnoException).code ?? 'error'})`,
    );
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    throw new RegistryAuthFileError('FERRY_REGISTRY_AUTH_FILE is not valid JSON');
  }
  const auths = (parsed as { auths?: unknown } | null)?.auths;
  if (auths === undefined) return undefined;
  if (typeof auths !== 'object' || auths === null || Array.isArray(auths)) {
    throw new RegistryAuthFileError('FERRY_REGISTRY_AUTH_FILE: "auths" must be an object');
  }
  const wanted = registry.toLowerCase();
  for (const [key, entry] of Object.entries(auths as Record<string, unknown>)) {
    if (normalizeAuthKey(key) !== wanted) continue;
    const bad = () => new RegistryAuthFileError(`FERRY_REGISTRY_AUTH_FILE: the entry for ${registry} is malformed`);
    if (typeof entry !== 'object' || entry === null) throw bad();
    const { auth, username, password, identitytoken } = entry as Record<string, unknown>;
    if (typeof auth === 'string' && auth !== '') {
      const decoded = Buffer.from(auth, 'base64').toString('utf8');
      const colon = decoded.indexOf(':');
      if (colon <= 0) throw bad();
      return { username: decoded.slice(0, colon), password: decoded.slice(colon + 1) };
    }
    if (typeof username === 'string' && typeof password === 'string') return { username, password };
    // An identity token is an OAuth2 refresh token; registries take it as the password of user "<token>".
    if (typeof identitytoken === 'string' && identitytoken !== '')
      return { username: '<token>', password: identitytoken };
    throw bad();
  }
  return undefined;
}
