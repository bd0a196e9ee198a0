/**
 * Pulls an image from a registry into an OCI layout (`oci-layout.ts`), speaking the distribution API
 * (`/v2/<name>/manifests/<ref>`, `/v2/<name>/blobs/<digest>`) itself rather than through skopeo, so that
 * every connection of the pull, the registry's, its token realm's and each blob redirect's, goes through
 * the address guard (`registry-guard.ts`) at connect time. skopeo resolves and connects on its own and
 * follows realms and redirects where the operator's rules cannot reach it.
 *
 * What is verified: the manifest's SHA-256 against the reference's digest when it pins one (else against
 * the registry's `Docker-Content-Digest`, when sent), the platform manifest's against the index entry
 * that named it, and every blob's against its descriptor while it streams to disk (`writeBlob`). A
 * mismatch anywhere is `FERRY_IMAGE_DIGEST_MISMATCH` and nothing of the blob is kept.
 *
 * Authentication follows the registries' two schemes: `Basic` with the credentials the caller gives (the
 * project's own login, else `FERRY_REGISTRY_AUTH_FILE`'s entry when the operator shares that registry:
 * image-store.ts decides), and `Bearer`, where a token is fetched from the realm the registry names
 * (anonymously without credentials, as public Docker Hub images need). Credentials are sent only to the
 * registry's own origin and its realm, never to a redirect's host; the result says whether any were sent
 * (`authenticated`), which decides who else the image may be handed to (image-store.ts).
 */
import { type Agent, type Dispatcher, request } from 'undici';
import { FerryError } from '../errors.js';
import {
  type Descriptor,
  hasBlob,
  type ImageManifest,
  initLayout,
  MAX_JSON_BLOB_BYTES,
  MEDIA,
  parseManifest,
  readDescriptor,
  readFileStreamToBuffer,
  readJsonBlob,
  sha256,
  writeBlob,
  writeIndex,
} from './oci-layout.js';
import { formatImageReference, type ImageReference, registryEndpoint } from './reference.js';
import { RegistryAuthFileError, type RegistryCredentials, readRegistryCredentials } from './registry-auth.js';
import { BlockedAddressError, createRegistryAgent, isInsecure, type RegistryAccess } from './registry-guard.js';

export interface PullOptions {
  access: RegistryAccess;
  /** The project's own login for the registry: sent when given, and the file is not read. */
  login?: RegistryCredentials | undefined;
  /** `FERRY_REGISTRY_AUTH_FILE`, read afresh for this pull (the caller passes it only for a shared registry). */
  authFile?: string | undefined;
  /** Bound of the image's compressed bytes (config and layers together). */
  maxBytes: number;
  /** The whole pull's deadline. */
  signal?: AbortSignal;
  /** `os/architecture` wanted from a multi-platform index; default this process's (linux/amd64 on x64). */
  platform?: { os: string; architecture: string };
  connectTimeoutMs?: number;
  /** Progress lines for the build log (`pulling layer 2/5 sha256:… 31.2 MiB`). */
  onProgress?: (line: string) => void;
  /**
   * Whether the caller has the image of this manifest digest already (the node's image cache): then the
   * manifest is fetched and checked as always, and nothing else is (`layersSkipped`).
   */
  known?: (digest: string) => boolean;
  /**
   * The caller's registry agent (createRegistryAgent over the same `access`), kept across its pulls so a
   * registry's connection is reused; not closed here. Without it, the pull makes and closes its own.
   */
  agent?: Agent;
}

export interface PulledImage {
  /** The digest of the image manifest (the platform's, for a multi-platform index). */
  digest: string;
  manifest: ImageManifest;
  /** The config blob's bytes (parse with image-config.ts); none when `layersSkipped`. */
  config?: Buffer;
  /** Compressed bytes of config and layers. */
  bytes: number;
  /**
   * `known` said the caller has the image: only its manifest was fetched, and nothing was written to the
   * layout.
   */
  layersSkipped: boolean;
  /** Whether credentials were sent (to the registry or its token realm); false: the pull was anonymous. */
  authenticated: boolean;
}

const MANIFEST_ACCEPT = [MEDIA.ociManifest, MEDIA.ociIndex, MEDIA.dockerManifest, MEDIA.dockerList].join(', ');
const MAX_REDIRECTS = 5;
const MAX_TOKEN_BYTES = 1024 * 1024;

/** Node's architecture names as OCI names them. */
export function ociArchitecture(arch: string = process.arch): string {
  return (
    ({ x64: 'amd64', arm64: 'arm64', arm: 'arm', ia32: '386', ppc64: 'ppc64le', s390x: 's390x' } as const)[
      arch as 'x64'
    ] ?? arch
  );
}

/**
 * Pulls `ref` into the OCI layout at `layout` (created when missing; blobs already there are not fetched
 * again) and tags it `tag` in `index.json`. Throws FerryError with a FERRY_IMAGE_* code.
 */
export async function pullImage(
  ref: ImageReference,
  layout: string,
  tag: string,
  options: PullOptions,
): Promise<PulledImage> {
  const agent =
    options.agent ?? createRegistryAgent(options.access, { connectTimeoutMs: options.connectTimeoutMs ?? 10_000 });
  try {
    return await pullWith(agent, ref, layout, tag, options);
  } catch (err) {
    throw asImageError(err, ref);
  } finally {
    if (!options.agent) await agent.close().catch(() => {});
  }
}

async function pullWith(
  agent: Agent,
  ref: ImageReference,
  layout: string,
  tag: string,
  options: PullOptions,
): Promise<PulledImage> {
  let credentials: Credentials | undefined;
  if (options.login) {
    credentials = { ...options.login, named: "the project's login" };
  } else {
    try {
      const fromFile = await readRegistryCredentials(options.authFile, ref.registry);
      if (fromFile) credentials = { ...fromFile, named: 'the credentials of FERRY_REGISTRY_AUTH_FILE' };
    } catch (err) {
      if (err instanceof RegistryAuthFileError) throw new FerryError('FERRY_IMAGE_REGISTRY_AUTH', err.message);
      throw err;
    }
  }
  const scheme = isInsecure(ref.registry, options.access) ? 'http' : 'https';
  const session = new RegistrySession(
    agent,
    `${scheme}://${registryEndpoint(ref.registry)}`,
    ref,
    credentials,
    options,
  );
  const first = await session.manifest(ref.digest ?? ref.tag ?? 'latest');
  let manifestBytes = first.body;
  let digest = sha256(first.body);
  if (ref.digest !== undefined && digest !== ref.digest) {
    throw new FerryError(
      'FERRY_IMAGE_DIGEST_MISMATCH',
      `the registry sent a manifest with digest ${digest}, not ${ref.digest}`,
    );
  }
  if (ref.digest === undefined && first.headerDigest !== undefined && first.headerDigest !== digest) {
    throw new FerryError(
      'FERRY_IMAGE_DIGEST_MISMATCH',
      `the manifest's digest is ${digest}, the registry says ${first.headerDigest}`,
    );
  }
  let mediaType = first.mediaType;
  let topLevel: { digest: string; bytes: Buffer; mediaType: string } | undefined;
  if (isIndex(first.mediaType, first.body)) {
    topLevel = { digest, bytes: first.body, mediaType: first.mediaType };
    const wanted = options.platform ?? { os: 'linux', architecture: ociArchitecture() };
    const entry = choosePlatform(first.body, wanted);
    const child = await session.manifest(entry.digest);
    digest = sha256(child.body);
    if (digest !== entry.digest || child.body.length !== entry.size) {
      throw new FerryError(
        'FERRY_IMAGE_DIGEST_MISMATCH',
        `the ${wanted.os}/${wanted.architecture} manifest does not match its index entry`,
      );
    }
    manifestBytes = child.body;
    mediaType = entry.mediaType;
  }
  const manifest = parseManifest(manifestBytes);
  if (manifest.layers.some((l) => !isLayerType(l.mediaType))) {
    const odd = manifest.layers.find((l) => !isLayerType(l.mediaType))!;
    throw new FerryError(
      'FERRY_IMAGE_UNSUPPORTED',
      `layer media type ${odd.mediaType} is not supported (tar or tar+gzip only)`,
    );
  }
  const total = manifest.config.size + manifest.layers.reduce((sum, l) => sum + l.size, 0);
  if (total > options.maxBytes) {
    throw new FerryError(
      'FERRY_IMAGE_TOO_LARGE',
      `the image is ${mib(total)} compressed, over the bound of ${mib(options.maxBytes)}`,
    );
  }
  if (options.known?.(digest) === true) {
    // The caller has this manifest's image (the node's cache, keyed by the digest just checked), so it has
    // the config and layers the manifest names: nothing more is fetched or written.
    for (const [i, layer] of manifest.layers.entries()) {
      options.onProgress?.(`layer ${i + 1}/${manifest.layers.length} ${short(layer.digest)} already on this node`);
    }
    return { digest, manifest, bytes: total, layersSkipped: true, authenticated: session.authenticated };
  }
  await initLayout(layout);
  const blobs = [manifest.config, ...manifest.layers];
  for (const [i, blob] of blobs.entries()) {
    if (await hasBlob(layout, blob.digest)) {
      if (i > 0) options.onProgress?.(`layer ${i}/${manifest.layers.length} ${short(blob.digest)} already here`);
      continue;
    }
    if (i > 0)
      options.onProgress?.(`pulling layer ${i}/${manifest.layers.length} ${short(blob.digest)} ${mib(blob.size)}`);
    const body = await session.blob(blob.digest);
    await writeBlob(layout, blob, body, options.maxBytes);
  }
  // The manifest (and index) go in as blobs too, so the layout is complete for umoci and skopeo.
  const manifestDescriptor: Descriptor = {
    mediaType: mediaType || MEDIA.ociManifest,
    digest,
    size: manifestBytes.length,
  };
  if (!(await hasBlob(layout, digest)))
    await writeBlob(layout, manifestDescriptor, [manifestBytes], MAX_JSON_BLOB_BYTES);
  if (topLevel && !(await hasBlob(layout, topLevel.digest))) {
    await writeBlob(
      layout,
      { digest: topLevel.digest, size: topLevel.bytes.length },
      [topLevel.bytes],
      MAX_JSON_BLOB_BYTES,
    );
  }
  await writeIndex(layout, manifestDescriptor, tag);
  const config = await readJsonBlob(layout, manifest.config.digest);
  return { digest, manifest, config, bytes: total, layersSkipped: false, authenticated: session.authenticated };
}

function isIndex(mediaType: string, body: Buffer): boolean {
  if (mediaType === MEDIA.ociIndex || mediaType === MEDIA.dockerList) return true;
  if (mediaType !== '' && mediaType !== 'application/json') return false;
  try {
    return Array.isArray((JSON.parse(body.toString('utf8')) as { manifests?: unknown }).manifests);
  } catch {
    return false;
  }
}

function isLayerType(mediaType: string): boolean {
  return [
    'application/vnd.oci.image.layer.v1.tar',
    'application/vnd.oci.image.layer.v1.tar+gzip',
    'application/vnd.docker.image.rootfs.diff.tar.gzip',
    'application/vnd.oci.image.layer.nondistributable.v1.tar+gzip',
    'application/vnd.docker.image.rootfs.foreign.diff.tar.gzip',
  ].includes(mediaType);
}

function choosePlatform(body: Buffer, wanted: { os: string; architecture: string }): Descriptor {
  const index = JSON.parse(body.toString('utf8')) as { manifests?: unknown[] };
  const entries = (index.manifests ?? []).map((m, i) => readDescriptor(m, `index entry ${i + 1}`));
  const match = entries.find((e) => e.platform?.os === wanted.os && e.platform?.architecture === wanted.architecture);
  if (!match) {
    const offered = entries.map((e) => `${e.platform?.os ?? '?'}/${e.platform?.architecture ?? '?'}`).join(', ');
    throw new FerryError(
      'FERRY_IMAGE_UNSUPPORTED',
      `the image has no ${wanted.os}/${wanted.architecture} variant (it has ${offered || 'none'})`,
    );
  }
  return match;
}

/** Credentials with how an error names them (never their content). */
type Credentials = RegistryCredentials & { named: string };

/** One pull's conversation with one registry: the auth it negotiated, reused for every request. */
class RegistrySession {
  private authorization: string | undefined;
  /** Whether the credentials were sent to the registry or its token realm. */
  authenticated = false;

  constructor(
    private readonly agent: Dispatcher,
    private readonly origin: string,
    private readonly ref: ImageReference,
    private readonly credentials: Credentials | undefined,
    private readonly options: PullOptions,
  ) {}

  async manifest(reference: string): Promise<{ body: Buffer; mediaType: string; headerDigest: string | undefined }> {
    const res = await this.get(`/v2/${this.ref.repository}/manifests/${reference}`, MANIFEST_ACCEPT);
    const body = await readFileStreamToBuffer(res.body, MAX_JSON_BLOB_BYTES);
    const contentType = String(res.headers['content-type'] ?? '')
      .split(';')[0]!
      .trim();
    const headerDigest = res.headers['docker-content-digest'];
    return { body, mediaType: contentType, headerDigest: typeof headerDigest === 'string' ? headerDigest : undefined };
  }

  async blob(digest: string): Promise<Dispatcher.ResponseData['body']> {
    return (await this.get(`/v2/${this.ref.repository}/blobs/${digest}`, '*/*')).body;
  }

  /** A GET that authenticates on a 401 once and follows redirects (guarded, without credentials off-origin). */
  private async get(pathname: string, accept: string): Promise<Dispatcher.ResponseData> {
    let url = new URL(pathname, this.origin);
    let triedAuth = false;
    for (let hop = 0; hop <= MAX_REDIRECTS; ) {
      const sameOrigin = url.origin === this.origin;
      const headers: Record<string, string> = { accept, 'user-agent': 'ferry' };
      if (sameOrigin && this.authorization) headers.authorization = this.authorization;
      const res = await request(url, {
        dispatcher: this.agent,
        method: 'GET',
        headers,
        ...(this.options.signal ? { signal: this.options.signal } : {}),
      });
      if (res.statusCode === 401 && sameOrigin && !triedAuth) {
        const challenge = res.headers['www-authenticate'];
        await res.body.dump();
        triedAuth = true;
        await this.authenticate(typeof challenge === 'string' ? challenge : undefined);
        continue;
      }
      if ([301, 302, 303, 307, 308].includes(res.statusCode)) {
        const location = res.headers.location;
        await res.body.dump();
        if (typeof location !== 'string')
          throw new FerryError(
            'FERRY_IMAGE_REGISTRY_UNREACHABLE',
            `${this.ref.registry} sent a redirect without a location`,
          );
        const next = new URL(location, url);
        if (next.protocol !== 'https:' && !(next.protocol === 'http:' && next.origin === this.origin)) {
          throw new FerryError(
            'FERRY_IMAGE_REGISTRY_UNREACHABLE',
            `${this.ref.registry} redirected to a plain-HTTP or non-HTTP address: refused`,
          );
        }
        url = next;
        hop += 1;
        continue;
      }
      if (res.statusCode === 200) return res;
      await res.body.dump();
      const name = formatImageReference(this.ref);
      if (res.statusCode === 401 || res.statusCode === 403) {
        throw new FerryError(
          'FERRY_IMAGE_REGISTRY_AUTH',
          this.credentials
            ? `${this.ref.registry} refused ${this.credentials.named} for ${name} (HTTP ${res.statusCode})`
            : `${this.ref.registry} requires credentials for ${name} (HTTP ${res.statusCode}); the project has no login for it (ferry registries login ${this.ref.registry})`,
        );
      }
      if (res.statusCode === 404)
        throw new FerryError('FERRY_IMAGE_NOT_FOUND', `${name} is not in ${this.ref.registry} (HTTP 404)`);
      throw new FerryError(
        'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        `${this.ref.registry} answered HTTP ${res.statusCode} for ${name}`,
      );
    }
    throw new FerryError(
      'FERRY_IMAGE_REGISTRY_UNREACHABLE',
      `${this.ref.registry}: more than ${MAX_REDIRECTS} redirects`,
    );
  }

  private async authenticate(challenge: string | undefined): Promise<void> {
    const scheme = challenge?.trim().split(/\s+/, 1)[0]?.toLowerCase();
    if (scheme === 'basic') {
      if (!this.credentials) return; // the retry answers 401 again, reported as "requires credentials"
      this.authorization = basic(this.credentials);
      this.authenticated = true;
      return;
    }
    if (scheme !== 'bearer' || challenge === undefined) return;
    const params = parseChallenge(challenge);
    const realm = params.realm;
    if (!realm) return;
    let tokenUrl: URL;
    try {
      tokenUrl = new URL(realm);
    } catch {
      throw new FerryError(
        'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        `${this.ref.registry} named a token realm that is not a URL`,
      );
    }
    const realmIsOrigin = tokenUrl.origin === this.origin;
    if (tokenUrl.protocol !== 'https:' && !realmIsOrigin) {
      throw new FerryError(
        'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        `${this.ref.registry} named a plain-HTTP token realm: refused`,
      );
    }
    if (params.service) tokenUrl.searchParams.set('service', params.service);
    tokenUrl.searchParams.set('scope', `repository:${this.ref.repository}:pull`);
    const headers: Record<string, string> = { accept: 'application/json', 'user-agent': 'ferry' };
    if (this.credentials) {
      headers.authorization = basic(this.credentials);
      this.authenticated = true;
    }
    const res = await request(tokenUrl, {
      dispatcher: this.agent,
      method: 'GET',
      headers,
      maxRedirections: 0,
      ...(this.options.signal ? { signal: this.options.signal } : {}),
    } as Parameters<typeof request>[1]);
    const body = await readFileStreamToBuffer(res.body, MAX_TOKEN_BYTES);
    if (res.statusCode === 401 || res.statusCode === 403) {
      throw new FerryError(
        'FERRY_IMAGE_REGISTRY_AUTH',
        `${this.ref.registry}'s token service refused ${this.credentials ? this.credentials.named : 'an anonymous pull'} (HTTP ${res.statusCode})`,
      );
    }
    if (res.statusCode !== 200) {
      throw new FerryError(
        'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        `${this.ref.registry}'s token service answered HTTP ${res.statusCode}`,
      );
    }
    let token: unknown;
    try {
      const json = JSON.parse(body.toString('utf8')) as { token?: unknown; access_token?: unknown };
      token = json.token ?? json.access_token;
    } catch {
      token = undefined;
    }
    if (typeof token !== 'string' || token === '' || /[\r\n]/.test(token)) {
      throw new FerryError('FERRY_IMAGE_REGISTRY_UNREACHABLE', `${this.ref.registry}'s token service sent no token`);
    }
    this.authorization = `Bearer ${token}`;
  }
}

function basic(c: RegistryCredentials): string {
  return `Basic ${Buffer.from(`${c.username}:${c.password}`).toString('base64')}`;
}

/** `Bearer realm="…",service="…",scope="…"` → its parameters. */
export function parseChallenge(header: string): Record<string, string> {
  const params: Record<string, string> = {};
  const rest = header.trim().replace(/^\S+\s*/, '');
  for (const match of rest.matchAll(/([A-Za-z_]+)=(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))/g)) {
    params[match[1]!.toLowerCase()] = (match[2] ?? match[3] ?? '').replace(/\\(.)/g, '$1');
  }
  return params;
}

/** Turns what a pull threw into a coded FerryError whose message names the registry, never a host path. */
function asImageError(err: unknown, ref: ImageReference): FerryError {
  if (err instanceof FerryError) return err;
  const seen = new Set<unknown>();
  for (let e: unknown = err; e && !seen.has(e); e = (e as { cause?: unknown }).cause) {
    seen.add(e);
    if (e instanceof BlockedAddressError) {
      return new FerryError(
        'FERRY_IMAGE_REGISTRY_BLOCKED',
        `${ref.registry} resolves to ${e.address}, in a blocked range (${e.reason}); list it in FERRY_INSECURE_REGISTRIES (host:port, plain HTTP) or FERRY_REGISTRY_ALLOW`,
        { cause: err },
      );
    }
  }
  const code = (err as { code?: string } | null)?.code;
  if (code === 'UND_ERR_ABORTED' || (err as Error | null)?.name === 'AbortError') {
    return new FerryError(
      'FERRY_IMAGE_REGISTRY_UNREACHABLE',
      `pulling ${formatImageReference(ref)} took longer than allowed`,
      { cause: err },
    );
  }
  const reason = code ?? (err as Error | null)?.message?.slice(0, 100) ?? 'error';
  return new FerryError('FERRY_IMAGE_REGISTRY_UNREACHABLE', `${ref.registry} cannot be reached (${reason})`, {
    cause: err,
  });
}

function short(digest: string): string {
  return digest.slice(0, 19);
}

function mib(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}
