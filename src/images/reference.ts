/**
 * Image references as `ferry.toml`'s `[image].base` names them: `[registry/]path[:tag][@sha256:digest]`,
 * read the way Docker and the containers tools read them, so a reference that works with `docker pull`
 * means the same image here. A name with no registry part is Docker Hub's (`docker.io`), and a single
 * path component there is an official image (`library/`); no tag and no digest means `latest`.
 *
 * The registry part is user input that Ferry connects to: parsing only says what it is; whether it may be
 * reached is `registry-guard.ts`'s to decide at connect time.
 */
import { FerryError } from '../errors.js';

export interface ImageReference {
  /** The registry as written (`docker.io`, `ghcr.io`, `127.0.0.1:5000`), lower-cased. */
  registry: string;
  /** The repository path within the registry (`library/python`, `org/app`). */
  repository: string;
  /** The tag, when one was given or implied (`latest`); undefined for a digest-only reference. */
  tag: string | undefined;
  /** `sha256:<64 hex>` when the reference pins a digest: the pulled manifest must have exactly it. */
  digest: string | undefined;
}

const DOCKER_HUB = 'docker.io';
const COMPONENT = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const TAG = /^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$/;
export const SHA256_DIGEST = /^sha256:[a-f0-9]{64}$/;
// A host name (labels of letters, digits and inner hyphens) or a bracketed IPv6 address, then an optional port.
export const REGISTRY =
  /^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$/;
const MAX_NAME_CHARS = 255;

function invalid(text: string, why: string): FerryError {
  return new FerryError('FERRY_IMAGE_REFERENCE_INVALID', `"${text.slice(0, 300)}" is not an image reference: ${why}`);
}

/**
 * Parses an image reference; throws `FERRY_IMAGE_REFERENCE_INVALID` naming what is wrong.
 *
 * @example parseImageReference('python:3.12-slim')
 *   // { registry: 'docker.io', repository: 'library/python', tag: '3.12-slim', digest: undefined }
 */
export function parseImageReference(text: string): ImageReference {
  if (typeof text !== 'string' || text.length === 0) throw invalid(String(text), 'it is empty');
  if (text.length > 512) throw invalid(text, 'it is longer than 512 characters');
  if (/[\s\0]/.test(text) || text.includes('://')) throw invalid(text, 'it has spaces or a URL scheme');
  let rest = text;
  let digest: string | undefined;
  const at = rest.indexOf('@');
  if (at !== -1) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!SHA256_DIGEST.test(digest)) throw invalid(text, 'the digest must be sha256: and 64 lower-case hex digits');
  }
  let tag: string | undefined;
  const lastSlash = rest.lastIndexOf('/');
  const colon = rest.lastIndexOf(':');
  if (colon > lastSlash) {
    tag = rest.slice(colon + 1);
    rest = rest.slice(0, colon);
    if (!TAG.test(tag)) throw invalid(text, `the tag "${tag}" is not valid (letters, digits, _ . -, at most 128)`);
  }
  const parts = rest.split('/');
  let registry = DOCKER_HUB;
  const first = parts[0] ?? '';
  if (
    parts.length > 1 &&
    (first.includes('.') || first.includes(':') || first === 'localhost' || first.startsWith('['))
  ) {
    if (!REGISTRY.test(first)) throw invalid(text, `the registry "${first}" is not a host name or host:port`);
    const port = first.match(/:([0-9]+)$/)?.[1];
    if (port !== undefined && (Number(port) < 1 || Number(port) > 65535))
      throw invalid(text, 'the port is out of range');
    registry = first.toLowerCase();
    parts.shift();
  }
  if (registry === 'index.docker.io' || registry === 'registry-1.docker.io') registry = DOCKER_HUB;
  if (parts.length === 0 || parts.some((part) => !COMPONENT.test(part))) {
    throw invalid(text, 'the repository must be lower-case path components (a-z, 0-9, separated by . _ __ or -)');
  }
  if (registry === DOCKER_HUB && parts.length === 1) parts.unshift('library');
  const repository = parts.join('/');
  if (repository.length > MAX_NAME_CHARS) throw invalid(text, 'the repository name is longer than 255 characters');
  if (tag === undefined && digest === undefined) tag = 'latest';
  return { registry, repository, tag, digest };
}

/** The reference written out in full (`docker.io/library/python:3.12-slim@sha256:…`). */
export function formatImageReference(ref: ImageReference): string {
  return `${ref.registry}/${ref.repository}${ref.tag !== undefined ? `:${ref.tag}` : ''}${ref.digest !== undefined ? `@${ref.digest}` : ''}`;
}

/**
 * A registry as a project's login (`ferry registries login`) or `FERRY_SHARED_REGISTRIES` names it: `host`
 * or `host:port` as the registry part of an image reference would be written, lower-cased, with Docker
 * Hub's aliases folded into `docker.io` (the registry `parseImageReference` gives). Undefined when `text`
 * could not be the registry of any reference: a name without a dot or a port (other than `localhost` and
 * Docker Hub's) would be read as a Docker Hub path, so a login for it could never be used.
 */
export function registryName(text: string): string | undefined {
  if (typeof text !== 'string' || text.length === 0 || text.length > MAX_NAME_CHARS) return undefined;
  if (!REGISTRY.test(text)) return undefined;
  const port = text.match(/:([0-9]+)$/)?.[1];
  if (port !== undefined && (Number(port) < 1 || Number(port) > 65535)) return undefined;
  const name = text.toLowerCase();
  if (['index.docker.io', 'registry-1.docker.io', 'registry.hub.docker.com', 'docker.io'].includes(name))
    return DOCKER_HUB;
  if (!(name.includes('.') || name.includes(':') || name === 'localhost' || name.startsWith('['))) return undefined;
  return name;
}

/** The host:port the registry's API is served at (Docker Hub's API is not at docker.io itself). */
export function registryEndpoint(registry: string): string {
  return registry === DOCKER_HUB ? 'registry-1.docker.io' : registry;
}
