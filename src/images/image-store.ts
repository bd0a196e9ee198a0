/**
 * One call from an image reference to a pinned, unpacked root file system on this node: pull (guarded,
 * verified) into a scratch OCI layout, unpack the layers as untrusted input into the node's cache, and
 * pin the result: what builds (builds/pipeline.ts, images/build-image.ts) and replicas (replicas/launcher.ts)
 * call.
 *
 * The cache is keyed by the manifest digest; a tag is always resolved at the registry first (a tag moves),
 * and when the cache has the digest it resolves to, no layer is fetched again, if the project may have it.
 *
 * Who may have an image (issue 43): the cache and the shelf are shared by every project, and a private
 * image in them was pulled with some project's credentials. So an image is handed to a project only when
 * that project could pull it itself:
 *
 * - a build naming an image (`acquire`) sends the registry the project's own login (else the file of
 *   FERRY_REGISTRY_AUTH_FILE, for a registry of FERRY_SHARED_REGISTRIES only; else nothing), and the
 *   manifest the registry gives it is the proof: its digest says which image the project may have. The
 *   cache's copy is taken without fetching the layers only when that manifest came from a repository the
 *   cache's copy was fetched whole from (a registry serves a repository's blobs to whoever may read its
 *   manifests), or when the image was once pulled without any credentials (`public`); from any other
 *   repository every layer is fetched and verified again, then dropped for the cache's copy. A reference
 *   pinned by digest skips the registry only for a `public` image; any other is asked of the registry.
 * - a replica's launch (`recorded`) runs what its project's build recorded: that build made the proof, so
 *   the cache and then the shelf hand it out by digest, and only a node with neither pulls it again, with
 *   that project's credentials.
 *
 * What each cache entry was proven by is kept beside it (its `access`: `public`, and the repositories it
 * was fetched whole from); an entry from the shelf or an image build has none, so a build naming it
 * fetches it from its registry. The shelf holds images by digest for every node and says nothing of who
 * may have them: a node takes an image from it only for a launch (or `acquireBuilt`), never for a build
 * naming one.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import type { ImageSettings } from '../config.js';
import { FerryError } from '../errors.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import { stagingRoot } from '../sandbox/views.js';
import { acquireIds, releaseIds } from './build-ids.js';
import { type CachedImage, createImageCache, type ImageCache } from './image-cache.js';
import { type ImageRunConfig, parseImageConfig } from './image-config.js';
import type { ImageShelf, ShelfFetchStats } from './image-shelf.js';
import { unpackInSandbox } from './layer-sandbox.js';
import { openBlob, parseManifest, readJsonBlob } from './oci-layout.js';
import { pullImage } from './pull.js';
import { formatImageReference, parseImageReference, registryName } from './reference.js';
import { createRegistryAgent, registryAccess } from './registry-guard.js';
import type { RegistryLoginService } from './registry-logins.js';
import { prepareResolvConf, type UnpackLimits, type UnpackResult, unpackLayers } from './unpack.js';

export interface PinnedImage {
  digest: string;
  /** The reference as resolved (`docker.io/library/python:3.12-slim`). */
  reference: string;
  config: ImageRunConfig;
  image: CachedImage;
  /**
   * The image as an OCI layout (its manifest, config and layers; tagged `image`), kept beside its unpacked
   * root while the cache has it: what an image build starts from, and what goes on the shelf.
   */
  layout: string;
  /** Unpins the image (the cache may evict it after); call once when done. */
  release: () => void;
}

/** Who an image is acquired for, and why. */
export interface AcquireOptions {
  /** The project the image is for: its own login goes to the registry, and only what it may pull comes back. */
  projectId: string;
  /**
   * A build of this project recorded the image (a replica's launch; the reference pins its digest): that
   * build proved the project may have it, so the cache, then the shelf, hand it out without the registry.
   */
  recorded?: boolean;
  signal?: AbortSignal;
  onProgress?: (line: string) => void;
}

export interface ImageStore {
  cache: ImageCache;
  /**
   * Returns `reference` unpacked and pinned, for `options.projectId` (the rule in the header): pulled when
   * needed, with that project's credentials. Throws FerryError FERRY_IMAGE_*.
   */
  acquire(reference: string, options: AcquireOptions): Promise<PinnedImage>;
  /**
   * An image this cluster built (no registry has it): from the cache, else from the shelf. Throws
   * FERRY_IMAGE_NOT_FOUND when neither has it.
   */
  acquireBuilt(digest: string, reference: string): Promise<PinnedImage>;
  /** The image `digest` pinned when this node's cache has it (with its layout), else undefined. */
  pinCached(digest: string, reference: string): Promise<PinnedImage | undefined>;
  /** Takes a built image's OCI layout (moved, not copied) into the cache, unpacked and pinned. */
  adopt(layoutDir: string, digest: string, reference: string): Promise<PinnedImage>;
  /** Puts a pinned image on the shelf, so other nodes run it without the registry (no shelf: nothing). */
  publish(image: PinnedImage): Promise<void>;
  /** Removes the unpinned images whose digest `used` does not list (images of deleted builds); how many. */
  sweep(used: (digests: string[]) => Promise<Set<string>>): Promise<number>;
  /** The shelf the store fetches from and publishes to, if any. */
  shelf: ImageShelf | undefined;
  /** A scratch path for a build's output layout, not made yet (removed at start; `adopt` moves it away). */
  scratch(): Promise<string>;
  /**
   * Registers what must let go of an image's files before the cache removes them (the replicas' views);
   * also told of every image at `close`.
   */
  onDiscard(listener: (digest: string) => Promise<void>): void;
  /** At shutdown (after the replicas): what holds images lets go, and the cache's use stamps are written. */
  close(): Promise<void>;
}

const NOT_CACHED = new Error('not cached');

/** Most entries an image may have over all its layers (a full Debian with a toolchain has ~100,000). */
const MAX_IMAGE_ENTRIES = 2_000_000;

/** The tag of an image in its kept layout. */
const LAYOUT_TAG = 'image';

/** What proved who may have a cache entry (its `meta.access`; none for an entry from the shelf or a build). */
interface ImageAccess {
  /** Once pulled without any credentials: any project may have it. */
  public: boolean;
  /** `registry/repository`s it was fetched whole from (manifest and every blob), with credentials. */
  repositories: string[];
}

function accessOf(image: CachedImage | undefined): ImageAccess {
  const access = image?.meta.access as Partial<ImageAccess> | undefined;
  return {
    public: access?.public === true,
    repositories: Array.isArray(access?.repositories) ? access.repositories.filter((r) => typeof r === 'string') : [],
  };
}

/**
 * Whether a project that was just given `repository`'s manifest of `image` by the registry may have the
 * cache's copy without fetching its layers: the same repository serves it the same blobs.
 */
function servedFrom(image: CachedImage | undefined, repository: string): boolean {
  const access = accessOf(image);
  return access.public || access.repositories.includes(repository);
}

/** Where an entry's layout is kept: beside its `rootfs`, in the cache entry's folder (evicted with it). */
function layoutOf(image: CachedImage): string {
  return path.join(path.dirname(image.rootfs), 'layout');
}

async function folderBytes(dir: string): Promise<number> {
  let bytes = 0;
  for (const entry of await fs.readdir(dir, { recursive: true, withFileTypes: true })) {
    if (entry.isFile()) bytes += (await fs.stat(path.join(entry.parentPath, entry.name))).size;
  }
  return bytes;
}

export async function createImageStore(options: {
  dir: string;
  settings: ImageSettings;
  shelf?: ImageShelf;
  /** Says, at info level, how long each image fetched from the shelf took, and where the time went. */
  logger?: Pick<Logger, 'info' | 'warn'>;
  /**
   * The sandbox layers are unpacked in (layer-sandbox.ts), as the server always has it; null unpacks in
   * this process, for tests of pulling and caching only.
   */
  sandbox: SandboxCapabilities | null;
  /** The projects' registry logins (registry-logins.ts); none: no project has one (tests of pulls). */
  logins?: Pick<RegistryLoginService, 'credentials'>;
}): Promise<ImageStore> {
  const { dir, settings, shelf, logger, sandbox, logins } = options;
  const shared = new Set(settings.sharedRegistries);
  if (settings.authFile && shared.size === 0) {
    logger?.warn(
      'FERRY_REGISTRY_AUTH_FILE is set but FERRY_SHARED_REGISTRIES is empty: the file serves no registry (each project logs in with ferry registries login; list the registries every project may pull from with the file in FERRY_SHARED_REGISTRIES)',
    );
  }

  /** What a pull from `registry` for `projectId` sends: its own login, else the file for a shared registry. */
  async function credentialsFor(projectId: string, registry: string) {
    const login = await logins?.credentials(projectId, registry);
    if (login) return { login };
    if (shared.has('*') || shared.has(registryName(registry) ?? '')) return { authFile: settings.authFile };
    return {};
  }
  const discardListeners: Array<(digest: string) => Promise<void>> = [];
  const cache = await createImageCache({
    dir: path.join(dir, 'unpacked'),
    maxBytes: settings.cacheBytes,
    async onDiscard(digest) {
      withLayout.delete(digest);
      for (const listener of discardListeners) await listener(digest);
    },
  });
  const pulls = path.join(dir, 'pulls');
  await fs.rm(pulls, { recursive: true, force: true }); // scratch layouts of pulls a crash interrupted
  await fs.mkdir(pulls, { recursive: true, mode: 0o700 });
  const access = registryAccess(settings.insecureRegistries, settings.registryAllow);
  // One agent for every pull of this node: a registry's connection is reused from one deploy to the next
  // (each new connection still passes the address guard when it is made).
  const agent = createRegistryAgent(access, { connectTimeoutMs: 10_000 });
  /** Cache entries whose kept layout was seen (entries unpacked before layouts were kept have none). */
  const withLayout = new Set<string>();

  /** The cached image `digest`, pinned, when the cache has it (with its layout). */
  async function fromCache(digest: string, reference: string): Promise<PinnedImage | undefined> {
    if (!cache.peek(digest)) return undefined;
    // Evicted between the look and the pin: then it is fetched as if it had never been here.
    const pinned = await cache
      .acquire(digest, () => Promise.reject(NOT_CACHED))
      .catch((err: unknown) => (err === NOT_CACHED ? undefined : Promise.reject(err)));
    if (!pinned) return undefined;
    const layout = layoutOf(pinned.image);
    if (!withLayout.has(digest)) {
      if (!(await fs.stat(path.join(layout, 'index.json')).catch(() => undefined))) {
        // An entry unpacked before layouts were kept: dropped, and fetched again whole.
        pinned.release();
        await cache.remove(digest);
        return undefined;
      }
      withLayout.add(digest);
    }
    const { image, release } = pinned;
    return { digest, reference, config: runConfigOf(image), image, layout, release };
  }

  /**
   * Unpacks the verified layout `layout` (moved into the entry) as the image `digest`, pinned; `access` is
   * what its pull proved (none: from the shelf or a build).
   */
  async function unpackLayout(
    layout: string,
    digest: string,
    reference: string,
    access?: ImageAccess,
  ): Promise<PinnedImage> {
    const manifest = parseManifest(await readJsonBlob(layout, digest));
    const config = parseImageConfig(await readJsonBlob(layout, manifest.config.digest));
    const { image, release } = await cache.acquire(digest, async (rootfs) => {
      const result = await unpackForReplicas(
        sandbox,
        path.dirname(dir), // the data folder (host-tools.ts imagesDir)
        rootfs,
        manifest.layers.map((layer) => ({ layout, digest: layer.digest })),
        { maxBytes: settings.cacheBytes, maxEntries: MAX_IMAGE_ENTRIES },
      );
      const kept = path.join(path.dirname(rootfs), 'layout');
      await fs.rename(layout, kept);
      return { bytes: result.bytes + (await folderBytes(kept)), meta: { config, ...(access ? { access } : {}) } };
    });
    return { digest, reference, config, image, layout: layoutOf(image), release };
  }

  /** Adds what a pull just proved of a cached image to what its entry records. */
  async function remember(digest: string, proven: ImageAccess): Promise<void> {
    const was = accessOf(cache.peek(digest));
    const now: ImageAccess = {
      public: was.public || proven.public,
      repositories: [...new Set([...was.repositories, ...proven.repositories])],
    };
    if (now.public === was.public && now.repositories.length === was.repositories.length) return;
    await cache.annotate(digest, { access: now });
  }

  /** A fresh path in the pulls folder (0700), not made: what writes there makes it (initLayout does). */
  async function scratch(): Promise<string> {
    return path.join(pulls, randomBytes(8).toString('hex'));
  }

  /**
   * The image from the shelf, unpacked and pinned; undefined when the shelf lacks it. Logs one line with
   * the three parts of its time: the fetch (each blob streamed into a scratch layout, hashed on the way:
   * `fetchMs` includes `verifyMs`, the hashing), and the unpacking into the cache (`unpackMs`).
   */
  async function fromShelf(digest: string, reference: string): Promise<PinnedImage | undefined> {
    if (!shelf) return undefined;
    const layout = await scratch();
    try {
      const started = performance.now();
      const stats: ShelfFetchStats = { blobs: 0, bytes: 0, hashMs: 0 };
      if (!(await shelf.fetch(digest, layout, { tag: LAYOUT_TAG, maxBytes: settings.cacheBytes, stats })))
        return undefined;
      const fetched = performance.now();
      const pinned = await unpackLayout(layout, digest, reference);
      const unpacked = performance.now();
      logger?.info(
        {
          digest,
          blobs: stats.blobs,
          bytes: stats.bytes,
          fetchMs: Math.round(fetched - started),
          verifyMs: Math.round(stats.hashMs),
          unpackMs: Math.round(unpacked - fetched),
          cacheBytes: pinned.image.bytes,
          ms: Math.round(unpacked - started),
        },
        'fetched the image from the image shelf',
      );
      return pinned;
    } finally {
      await fs.rm(layout, { recursive: true, force: true });
    }
  }

  return {
    cache,
    shelf,
    scratch,
    onDiscard(listener) {
      discardListeners.push(listener);
    },
    async close() {
      for (const { digest } of cache.usage().images) {
        for (const listener of discardListeners) await listener(digest).catch(() => undefined);
      }
      await cache.close();
      await agent.close().catch(() => undefined);
    },
    async acquire(reference, opts) {
      const ref = parseImageReference(reference);
      const formatted = formatImageReference(ref);
      const repository = `${ref.registry}/${ref.repository}`;
      if (ref.digest !== undefined) {
        // What a build of the project recorded, from anywhere this cluster keeps it; anything else by digest
        // without the registry only when anyone could pull it.
        const found = opts.recorded
          ? ((await fromCache(ref.digest, formatted)) ?? (await fromShelf(ref.digest, formatted)))
          : accessOf(cache.peek(ref.digest)).public
            ? await fromCache(ref.digest, formatted)
            : undefined;
        if (found) return found;
      }
      const credentials = await credentialsFor(opts.projectId, ref.registry);
      // The registry's manifest, given to this project, names the image. A digest the cache has, fetched
      // from this repository before (or public), is not fetched again; else every layer is, and verified,
      // before the cache's copy is handed out. Evicted between the look and the pin, it is pulled again whole.
      for (const skipKnown of [true, false]) {
        const layout = await scratch();
        let wrote = true;
        try {
          const pulled = await pullImage(ref, layout, LAYOUT_TAG, {
            access,
            agent,
            ...credentials,
            maxBytes: settings.cacheBytes,
            ...(opts.signal ? { signal: opts.signal } : {}),
            ...(opts.onProgress ? { onProgress: opts.onProgress } : {}),
            ...(skipKnown ? { known: (digest: string) => servedFrom(cache.peek(digest), repository) } : {}),
          });
          wrote = !pulled.layersSkipped; // a pull that skipped the layers writes nothing
          // Fetched whole from the repository, or named by it to a project that sent no credentials.
          const proven = { public: !pulled.authenticated, repositories: pulled.layersSkipped ? [] : [repository] };
          const cached = await fromCache(pulled.digest, formatted);
          if (cached) {
            await remember(pulled.digest, proven);
            return cached;
          }
          if (pulled.layersSkipped) continue;
          return await unpackLayout(layout, pulled.digest, formatted, proven);
        } finally {
          if (wrote) await fs.rm(layout, { recursive: true, force: true });
        }
      }
      throw new Error('unreachable: the second pull fetches every layer');
    },

    async acquireBuilt(digest, reference) {
      const found = (await fromCache(digest, reference)) ?? (await fromShelf(digest, reference));
      if (found) return found;
      throw new FerryError(
        'FERRY_IMAGE_NOT_FOUND',
        `the image ${digest} was built by this cluster but neither this node nor the image shelf has it (removed with its build, or the shelf was emptied): redeploy the app`,
      );
    },

    pinCached: fromCache,

    async adopt(layoutDir, digest, reference) {
      try {
        return (await fromCache(digest, reference)) ?? (await unpackLayout(layoutDir, digest, reference));
      } finally {
        await fs.rm(layoutDir, { recursive: true, force: true });
      }
    },

    async publish(image) {
      // The manifest goes on last, so a shelf that has it has the whole image: one look, not one per blob.
      if (!shelf || (await shelf.has(image.digest))) return;
      await shelf.put(image.layout, image.digest);
    },

    async sweep(used) {
      const unpinned = cache
        .usage()
        .images.filter((i) => i.pins === 0)
        .map((i) => i.digest);
      if (unpinned.length === 0) return 0;
      const keep = await used(unpinned);
      let removed = 0;
      for (const digest of unpinned) if (!keep.has(digest) && (await cache.remove(digest))) removed++;
      return removed;
    },
  };
}

/**
 * Unpacks an image for the cache, with /etc/resolv.conf made ready for replicas' DNS: in the sandbox, as
 * a range of ids held for the unpacking (entries get the image's owners, shifted into it); in this process
 * without one (tests).
 */
async function unpackForReplicas(
  sandbox: SandboxCapabilities | null,
  dataDir: string,
  rootfs: string,
  layers: Array<{ layout: string; digest: string }>,
  limits: UnpackLimits,
): Promise<UnpackResult> {
  if (!sandbox) {
    const result = await unpackLayers(
      rootfs,
      layers.map((layer) => () => openBlob(layer.layout, layer.digest)),
      limits,
    );
    await prepareResolvConf(rootfs);
    return result;
  }
  const { ids, mapRange, slot } = acquireIds(sandbox);
  let staging: string | null = null;
  try {
    let root = rootfs;
    if (mapRange) {
      // The unpacker's uid must reach the folder it binds, and the cache is inside the data folder (0700):
      // it fills a folder of the staging root (outside the data folder on its filesystem, else
      // `<data>/staging`: sandbox/views.ts), moved in after.
      const stagingParent = await stagingRoot(dataDir, true);
      if (!stagingParent) {
        throw new Error(
          `no staging folder on the filesystem of the data directory ${dataDir} to unpack images in as an unprivileged uid`,
        );
      }
      staging = await fs.mkdtemp(path.join(stagingParent, 'unpack-'));
      await fs.chmod(staging, 0o711);
      root = path.join(staging, 'rootfs');
      await fs.mkdir(root, { mode: 0o755 });
    }
    const result = await unpackInSandbox({ caps: sandbox, root, layers, limits, ids, mapRange, resolvConf: true });
    if (root !== rootfs) {
      await fs.rmdir(rootfs);
      await fs.rename(root, rootfs);
    }
    return result;
  } finally {
    releaseIds(slot);
    if (staging) await fs.rm(staging, { recursive: true, force: true });
  }
}

function runConfigOf(image: CachedImage): ImageRunConfig {
  return image.meta.config as ImageRunConfig;
}
