/**
 * The image shelf: where a node that built (or pulled) an image puts it, by manifest digest, so that any
 * other node of the cluster can run it without a shared filesystem and without asking the registry again
 * (issue 26, point 4). Two implementations, chosen with the build storage:
 *
 * - with `--nats-url`, the JetStream object store: the objects `blobs/sha256/<hex>` of the cluster's images
 *   bucket (`<cluster>_images`), one per blob, so layers shared by images are stored once;
 * - without NATS, an OCI layout in the artifacts folder (`<artifacts>/images`), shared by the processes
 *   that share that folder.
 *
 * Why the object store rather than a registry: it is already the cluster's one shared store for archives
 * and builds (no second service to run, secure and back up), a worker fetches from it with the
 * credentials it already has, and its objects are addressed by what Ferry verifies anyway (the digest).
 *
 * Whatever the shelf holds is untrusted on the way back in: `fetch` writes every blob through
 * `writeBlob`, which checks its SHA-256 and size against the manifest's descriptor (the manifest against
 * the digest asked for) before it is moved into the layout; a blob that does not match is refused with
 * FERRY_IMAGE_DIGEST_MISMATCH and nothing of it is kept. The unpacking that follows is the image cache's,
 * with the same rules as any pulled image.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import type { ReadableStream as WebReadableStream } from 'node:stream/web';
import { type ObjectStore, Objm, StorageType } from '@nats-io/obj';
import type { NatsConnection } from '@nats-io/transport-node';
import { FerryError } from '../errors.js';
import {
  type BlobWriteStats,
  blobPath,
  type Descriptor,
  hasBlob,
  initLayout,
  MAX_JSON_BLOB_BYTES,
  MEDIA,
  openBlob,
  parseManifest,
  readJsonBlob,
  writeBlob,
  writeIndex,
} from './oci-layout.js';
import { SHA256_DIGEST } from './reference.js';

export interface ImageShelf {
  /** Puts the image `digest` of `layout` on the shelf: its blobs first, its manifest last. Idempotent. */
  put(layout: string, digest: string): Promise<void>;
  /**
   * Fetches the image `digest` into `layout` (created when missing), each blob verified as it arrives, and
   * tags it `tag` in the layout's index. Resolves false when the shelf has no such image. `stats`, when
   * given, gets the blobs fetched, their bytes and the time spent hashing them added to it.
   */
  fetch(
    digest: string,
    layout: string,
    options: { tag: string; maxBytes: number; stats?: ShelfFetchStats },
  ): Promise<boolean>;
  /** Whether the shelf has the image's manifest (and so, once `put` ended, every blob of it). */
  has(digest: string): Promise<boolean>;
  /**
   * Removes the images `digests` from the shelf, and every blob of them that none of `keep` (the images
   * still in use) needs.
   */
  remove(digests: string[], keep: string[]): Promise<void>;
}

/** What one `fetch` did: blobs fetched (the manifest among them), their bytes, and their hashing time. */
export interface ShelfFetchStats extends BlobWriteStats {
  blobs: number;
}

/** Where a blob lives in either shelf (the same path as in an OCI layout). */
function blobName(digest: string): string {
  if (!SHA256_DIGEST.test(digest))
    throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `"${digest}" is not a sha256 digest`);
  return `blobs/sha256/${digest.slice('sha256:'.length)}`;
}

/** The blobs of a manifest: config and layers (the manifest's own digest aside). */
async function manifestBlobs(manifestBytes: Buffer): Promise<Descriptor[]> {
  const manifest = parseManifest(manifestBytes);
  return [manifest.config, ...manifest.layers];
}

function manifestDescriptor(digest: string, bytes: Buffer): Descriptor {
  const parsed = JSON.parse(bytes.toString('utf8')) as { mediaType?: unknown };
  const mediaType = typeof parsed.mediaType === 'string' ? parsed.mediaType : MEDIA.ociManifest;
  return { mediaType, digest, size: bytes.length };
}

/**
 * The shared skeleton of both shelves: `get(name)` returns the object's bytes as a stream with its size
 * (or undefined), `put(name, stream)` stores one, `exists(name)`, `delete(name)`.
 */
interface BlobStore {
  get(name: string): Promise<{ size: number; body: Readable } | undefined>;
  put(name: string, file: string): Promise<void>;
  exists(name: string): Promise<boolean>;
  delete(name: string): Promise<void>;
}

function shelfOver(store: BlobStore): ImageShelf {
  async function readManifest(digest: string): Promise<Buffer | undefined> {
    const found = await store.get(blobName(digest));
    if (!found) return undefined;
    if (found.size > MAX_JSON_BLOB_BYTES) {
      found.body.destroy();
      throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `the manifest ${digest} on the image shelf is too large`);
    }
    const chunks: Buffer[] = [];
    let bytes = 0;
    for await (const chunk of found.body) {
      bytes += (chunk as Buffer).length;
      if (bytes > MAX_JSON_BLOB_BYTES)
        throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `the manifest ${digest} on the image shelf is too large`);
      chunks.push(chunk as Buffer);
    }
    return Buffer.concat(chunks);
  }

  return {
    async put(layout, digest) {
      const manifest = await readJsonBlob(layout, digest);
      for (const blob of await manifestBlobs(manifest)) {
        const name = blobName(blob.digest);
        if (!(await store.exists(name))) await store.put(name, blobPath(layout, blob.digest));
      }
      // The manifest last: an image whose manifest is on the shelf has every blob there.
      if (!(await store.exists(blobName(digest)))) await store.put(blobName(digest), blobPath(layout, digest));
    },

    async fetch(digest, layout, { tag, maxBytes, stats }) {
      const manifestBytes = await readManifest(digest);
      if (!manifestBytes) return false;
      await initLayout(layout);
      // The manifest is what was asked for only if it hashes to the digest: writeBlob checks.
      await writeBlob(layout, { digest, size: manifestBytes.length }, [manifestBytes], MAX_JSON_BLOB_BYTES, stats);
      if (stats) stats.blobs += 1;
      let total = 0;
      for (const blob of await manifestBlobs(manifestBytes)) {
        total += blob.size;
        if (total > maxBytes)
          throw new FerryError('FERRY_IMAGE_TOO_LARGE', `the image ${digest} is larger than the image size bound`);
        if (await hasBlob(layout, blob.digest)) continue;
        const found = await store.get(blobName(blob.digest));
        if (!found) {
          throw new FerryError(
            'FERRY_IMAGE_NOT_FOUND',
            `the image ${digest} on the image shelf lacks its blob ${blob.digest}`,
          );
        }
        await writeBlob(layout, blob, found.body, maxBytes, stats);
        if (stats) stats.blobs += 1;
      }
      await writeIndex(layout, manifestDescriptor(digest, manifestBytes), tag);
      return true;
    },

    has: (digest) => store.exists(blobName(digest)),

    async remove(digests, keep) {
      const needed = new Set<string>(keep);
      for (const digest of keep) {
        const bytes = await readManifest(digest).catch(() => undefined);
        if (bytes) for (const blob of await manifestBlobs(bytes)) needed.add(blob.digest);
      }
      for (const digest of digests) {
        if (needed.has(digest)) continue;
        const bytes = await readManifest(digest).catch(() => undefined);
        // The manifest first: a half-removed image is one the shelf no longer has, not one with holes.
        await store.delete(blobName(digest));
        if (!bytes) continue;
        for (const blob of await manifestBlobs(bytes)) {
          if (!needed.has(blob.digest)) await store.delete(blobName(blob.digest));
        }
      }
    },
  };
}

/** The shelf in a folder shared by the processes of one machine (an OCI layout's blobs). */
export function createFolderImageShelf(dir: string): ImageShelf {
  return shelfOver({
    async get(name) {
      const file = path.join(dir, name);
      const stat = await fs.stat(file).catch(() => undefined);
      if (!stat?.isFile()) return undefined;
      return { size: stat.size, body: openBlobAt(file) };
    },
    async put(name, source) {
      const file = path.join(dir, name);
      await fs.mkdir(path.dirname(file), { recursive: true });
      const temp = `${file}.${process.pid}.${Date.now()}.part`;
      await fs.copyFile(source, temp);
      await fs.rename(temp, file);
    },
    exists: (name) =>
      fs
        .stat(path.join(dir, name))
        .then((s) => s.isFile())
        .catch(() => false),
    delete: (name) => fs.rm(path.join(dir, name), { force: true }),
  });
}

function openBlobAt(file: string): Readable {
  // openBlob takes a layout and a digest; the folder shelf's files are at the same relative path.
  const layout = path.dirname(path.dirname(path.dirname(file)));
  return openBlob(layout, `sha256:${path.basename(file)}`);
}

/** Opens (creating when missing) the cluster's images bucket. */
export async function openImagesBucket(nc: NatsConnection, bucket: string): Promise<ObjectStore> {
  return new Objm(nc).create(bucket, { storage: StorageType.File });
}

/**
 * The shelf in the JetStream object store. `bucket` opens the bucket when first needed (start-up does not
 * wait for NATS); a failure to reach it rejects the call, which the build or the replica start answers.
 */
export function createNatsImageShelf(bucket: () => Promise<ObjectStore>): ImageShelf {
  return shelfOver({
    async get(name) {
      const os = await bucket();
      const result = await os.get(name);
      if (!result) return undefined;
      return {
        size: result.info.size,
        body: Readable.fromWeb(result.data as unknown as WebReadableStream<Uint8Array>),
      };
    },
    async put(name, file) {
      const os = await bucket();
      const handle = await fs.open(file);
      try {
        const web = Readable.toWeb(handle.createReadStream()) as unknown as ReadableStream<Uint8Array>;
        await os.put({ name }, web);
      } finally {
        await handle.close();
      }
    },
    async exists(name) {
      const os = await bucket();
      const info = await os.info(name);
      return info !== null && !info.deleted;
    },
    async delete(name) {
      const os = await bucket();
      await os.delete(name).catch(() => undefined);
    },
  });
}
