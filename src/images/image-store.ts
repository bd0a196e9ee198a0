/**
 * One call from an image reference to a pinned, unpacked root file system on this node: pull (guarded,
 * verified) into a scratch OCI layout, unpack the layers as untrusted input into the node's cache, and
 * pin the result: what builds (builds/pipeline.ts, images/build-image.ts) and replicas (replicas/launcher.ts)
 * call.
 *
 * The cache is keyed by the manifest digest, so a reference pinned by digest that the cache already has
 * needs no registry at all; a tag is always resolved at the registry first (a tag moves), and only the
 * blobs are skipped when the digest is known.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { ImageSettings } from '../config.js';
import { type CachedImage, createImageCache, type ImageCache } from './image-cache.js';
import { type ImageRunConfig, parseImageConfig } from './image-config.js';
import { openBlob } from './oci-layout.js';
import { pullImage } from './pull.js';
import { formatImageReference, parseImageReference } from './reference.js';
import { registryAccess } from './registry-guard.js';
import { unpackLayers } from './unpack.js';

export interface PinnedImage {
  digest: string;
  /** The reference as resolved (`docker.io/library/python:3.12-slim`). */
  reference: string;
  config: ImageRunConfig;
  image: CachedImage;
  /** Unpins the image (the cache may evict it after); call once when done. */
  release: () => void;
}

export interface ImageStore {
  cache: ImageCache;
  /** Pulls `reference` when needed and returns it unpacked and pinned. Throws FerryError FERRY_IMAGE_*. */
  acquire(
    reference: string,
    options?: { signal?: AbortSignal; onProgress?: (line: string) => void },
  ): Promise<PinnedImage>;
}

const NOT_CACHED = new Error('not cached');

/** Most entries an image may have over all its layers (a full Debian with a toolchain has ~100,000). */
const MAX_IMAGE_ENTRIES = 2_000_000;

export async function createImageStore(options: { dir: string; settings: ImageSettings }): Promise<ImageStore> {
  const { dir, settings } = options;
  const cache = await createImageCache({ dir: path.join(dir, 'unpacked'), maxBytes: settings.cacheBytes });
  const pulls = path.join(dir, 'pulls');
  await fs.rm(pulls, { recursive: true, force: true }); // scratch layouts of pulls a crash interrupted
  await fs.mkdir(pulls, { recursive: true, mode: 0o700 });
  const access = registryAccess(settings.insecureRegistries, settings.registryAllow);

  return {
    cache,
    async acquire(reference, opts = {}) {
      const ref = parseImageReference(reference);
      if (ref.digest !== undefined && cache.peek(ref.digest)) {
        // Evicted between the look and the pin: then it is pulled as if it had never been here.
        const pinned = await cache
          .acquire(ref.digest, () => Promise.reject(NOT_CACHED))
          .catch((err: unknown) => (err === NOT_CACHED ? undefined : Promise.reject(err)));
        if (pinned) {
          const { image, release } = pinned;
          return {
            digest: ref.digest,
            reference: formatImageReference(ref),
            config: runConfigOf(image),
            image,
            release,
          };
        }
      }
      const layout = path.join(pulls, randomBytes(8).toString('hex'));
      try {
        const pulled = await pullImage(ref, layout, 'image', {
          access,
          authFile: settings.authFile,
          maxBytes: settings.cacheBytes,
          ...(opts.signal ? { signal: opts.signal } : {}),
          ...(opts.onProgress ? { onProgress: opts.onProgress } : {}),
        });
        const config = parseImageConfig(pulled.config);
        const { image, release } = await cache.acquire(pulled.digest, async (rootfs) => {
          const result = await unpackLayers(
            rootfs,
            pulled.manifest.layers.map((layer) => () => openBlob(layout, layer.digest)),
            { maxBytes: settings.cacheBytes, maxEntries: MAX_IMAGE_ENTRIES },
          );
          await prepareMountPoints(rootfs);
          return { bytes: result.bytes, meta: { config } };
        });
        return { digest: pulled.digest, reference: formatImageReference(ref), config, image, release };
      } finally {
        await fs.rm(layout, { recursive: true, force: true });
      }
    },
  };
}

/**
 * What the sandbox mounts over inside an image's root must exist there before it is shared read-only:
 * `/etc/resolv.conf` as a regular file (a replica's DNS settings go over it; a link there, as many images
 * have, would point bwrap elsewhere). The root is Ferry's own copy, so this changes no image.
 */
async function prepareMountPoints(rootfs: string): Promise<void> {
  const etc = path.join(rootfs, 'etc');
  let st = await fs.lstat(etc).catch(() => undefined);
  if (!st) {
    await fs.mkdir(etc, { mode: 0o755 });
    st = await fs.lstat(etc);
  }
  if (!st.isDirectory()) return; // an image whose /etc is not a folder: replicas get no resolv.conf of Ferry's
  const file = path.join(etc, 'resolv.conf');
  if ((await fs.lstat(file).catch(() => undefined))?.isFile()) return;
  const mode = st.mode & 0o7777;
  await fs.chmod(etc, mode | 0o700);
  try {
    await fs.rm(file, { recursive: true, force: true });
    await fs.writeFile(file, '', { mode: 0o644 });
  } finally {
    await fs.chmod(etc, mode);
  }
}

function runConfigOf(image: CachedImage): ImageRunConfig {
  return image.meta.config as ImageRunConfig;
}
