/**
 * An OCI image layout on disk (`oci-layout`, `index.json`, `blobs/sha256/<hex>`), the form a pulled image
 * is kept in before it is unpacked, and the form umoci and skopeo read and write (`oci:<dir>:<tag>`).
 *
 * Every blob enters through `writeBlob`, which hashes while it writes to a temporary file and moves the
 * file into place only when the SHA-256 and the size match the descriptor: a blob in `blobs/` has been
 * verified, whoever sent it. Reading a manifest or config checks its digest again (the layout may have
 * been written by another tool) and bounds its size before parsing.
 */
import { createHash, randomBytes } from 'node:crypto';
import { createReadStream, createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { FerryError } from '../errors.js';
import { SHA256_DIGEST } from './reference.js';

export const MEDIA = {
  ociIndex: 'application/vnd.oci.image.index.v1+json',
  ociManifest: 'application/vnd.oci.image.manifest.v1+json',
  ociConfig: 'application/vnd.oci.image.config.v1+json',
  dockerList: 'application/vnd.docker.distribution.manifest.list.v2+json',
  dockerManifest: 'application/vnd.docker.distribution.manifest.v2+json',
  dockerConfig: 'application/vnd.docker.container.image.v1+json',
} as const;

/** Manifests and configs larger than this are refused before parsing (real ones are a few KiB). */
export const MAX_JSON_BLOB_BYTES = 4 * 1024 * 1024;

export interface Descriptor {
  mediaType: string;
  digest: string;
  size: number;
  platform?: { os?: string; architecture?: string; variant?: string };
  annotations?: Record<string, string>;
}

export interface ImageManifest {
  schemaVersion: number;
  mediaType?: string;
  config: Descriptor;
  layers: Descriptor[];
}

/** A descriptor from untrusted JSON, checked member by member; throws FERRY_IMAGE_UNSUPPORTED. */
export function readDescriptor(value: unknown, what: string): Descriptor {
  const d = value as Partial<Descriptor> | null;
  if (
    typeof d !== 'object' ||
    d === null ||
    typeof d.mediaType !== 'string' ||
    typeof d.digest !== 'string' ||
    !SHA256_DIGEST.test(d.digest) ||
    typeof d.size !== 'number' ||
    !Number.isSafeInteger(d.size) ||
    d.size < 0
  ) {
    throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `the image's ${what} descriptor is malformed or not sha256`);
  }
  return d as Descriptor;
}

/** An image manifest from its bytes: OCI or Docker schema 2, with sha256 descriptors. */
export function parseManifest(bytes: Buffer): ImageManifest {
  let json: Partial<ImageManifest> & { mediaType?: string };
  try {
    json = JSON.parse(bytes.toString('utf8'));
  } catch {
    throw new FerryError('FERRY_IMAGE_UNSUPPORTED', 'the image manifest is not JSON');
  }
  if (json?.schemaVersion !== 2 || !Array.isArray(json.layers)) {
    throw new FerryError('FERRY_IMAGE_UNSUPPORTED', 'the image manifest is not an OCI or Docker schema 2 manifest');
  }
  return {
    schemaVersion: 2,
    ...(typeof json.mediaType === 'string' ? { mediaType: json.mediaType } : {}),
    config: readDescriptor(json.config, 'config'),
    layers: json.layers.map((layer, i) => readDescriptor(layer, `layer ${i + 1}`)),
  };
}

export function sha256(bytes: Buffer): string {
  return `sha256:${createHash('sha256').update(bytes).digest('hex')}`;
}

export function blobPath(layout: string, digest: string): string {
  return path.join(layout, 'blobs', 'sha256', digest.slice('sha256:'.length));
}

/** Creates the layout's skeleton (idempotent). */
export async function initLayout(layout: string): Promise<void> {
  await fs.mkdir(path.join(layout, 'blobs', 'sha256'), { recursive: true });
  await fs.writeFile(path.join(layout, 'oci-layout'), '{"imageLayoutVersion":"1.0.0"}');
}

/** Whether the layout already has the blob (it was verified when written). */
export async function hasBlob(layout: string, digest: string): Promise<boolean> {
  return fs
    .stat(blobPath(layout, digest))
    .then((s) => s.isFile())
    .catch(() => false);
}

/**
 * What `writeBlob` adds up when given: bytes written, and the time spent hashing them (the verification,
 * done as the bytes stream through, so it is part of the write's own time).
 */
export interface BlobWriteStats {
  bytes: number;
  hashMs: number;
}

/**
 * Streams `body` into the layout as the blob `expected`: refused with FERRY_IMAGE_DIGEST_MISMATCH when the
 * bytes' SHA-256 or count differ, FERRY_IMAGE_TOO_LARGE past `maxBytes`. Nothing is left behind on failure.
 * `stats`, when given, gets the bytes and the hashing time added to it.
 */
export async function writeBlob(
  layout: string,
  expected: { digest: string; size: number },
  body: Readable | AsyncIterable<Uint8Array> | Iterable<Uint8Array>,
  maxBytes: number,
  stats?: BlobWriteStats,
): Promise<void> {
  const final = blobPath(layout, expected.digest);
  const temp = `${final}.${randomBytes(6).toString('hex')}.part`;
  const hash = createHash('sha256');
  let bytes = 0;
  try {
    await pipeline(
      Readable.from(body),
      async function* count(source: AsyncIterable<Uint8Array>) {
        for await (const chunk of source) {
          bytes += chunk.length;
          if (bytes > maxBytes) {
            throw new FerryError(
              'FERRY_IMAGE_TOO_LARGE',
              `blob ${expected.digest} is larger than the image size bound`,
            );
          }
          if (bytes > expected.size) {
            throw new FerryError(
              'FERRY_IMAGE_DIGEST_MISMATCH',
              `blob ${expected.digest} is longer than its descriptor's ${expected.size} bytes`,
            );
          }
          if (stats) {
            const t0 = performance.now();
            hash.update(chunk);
            stats.hashMs += performance.now() - t0;
            stats.bytes += chunk.length;
          } else hash.update(chunk);
          yield chunk;
        }
      },
      createWriteStream(temp, { flags: 'wx', mode: 0o600 }),
    );
    const actual = `sha256:${hash.digest('hex')}`;
    if (actual !== expected.digest || bytes !== expected.size) {
      throw new FerryError(
        'FERRY_IMAGE_DIGEST_MISMATCH',
        `blob ${expected.digest} arrived with digest ${actual} (${bytes} of ${expected.size} bytes): refused`,
      );
    }
    await fs.rename(temp, final);
  } catch (err) {
    await fs.rm(temp, { force: true });
    throw err;
  }
}

/** Reads a JSON blob of the layout (bounded, digest checked again). */
export async function readJsonBlob(layout: string, digest: string): Promise<Buffer> {
  const file = blobPath(layout, digest);
  const size = (await fs.stat(file)).size;
  if (size > MAX_JSON_BLOB_BYTES)
    throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `blob ${digest} is too large for JSON`);
  const bytes = await fs.readFile(file);
  if (sha256(bytes) !== digest) {
    throw new FerryError('FERRY_IMAGE_DIGEST_MISMATCH', `blob ${digest} in the layout does not match its digest`);
  }
  return bytes;
}

/** Opens a blob for reading (layers, which are streamed rather than read whole). */
export function openBlob(layout: string, digest: string): Readable {
  return createReadStream(blobPath(layout, digest));
}

/** Writes `index.json` naming one manifest, tagged `name` (as `org.opencontainers.image.ref.name`). */
export async function writeIndex(layout: string, manifest: Descriptor, name: string): Promise<void> {
  const index = {
    schemaVersion: 2,
    mediaType: MEDIA.ociIndex,
    manifests: [{ ...manifest, annotations: { 'org.opencontainers.image.ref.name': name } }],
  };
  await fs.writeFile(path.join(layout, 'index.json'), JSON.stringify(index));
}

/** The manifest descriptor of the layout's `index.json` tagged `name`, or its only one when `name` is undefined. */
export async function readIndexEntry(layout: string, name?: string): Promise<Descriptor> {
  const bytes = await fs.readFile(path.join(layout, 'index.json'));
  if (bytes.length > MAX_JSON_BLOB_BYTES) throw new FerryError('FERRY_IMAGE_UNSUPPORTED', 'index.json is too large');
  const index = JSON.parse(bytes.toString('utf8')) as { manifests?: unknown[] };
  const entries = (index.manifests ?? []).map((m, i) => readDescriptor(m, `index entry ${i + 1}`));
  const found =
    name === undefined
      ? entries.length === 1
        ? entries[0]
        : undefined
      : entries.find((e) => e.annotations?.['org.opencontainers.image.ref.name'] === name);
  if (!found) throw new FerryError('FERRY_IMAGE_NOT_FOUND', `the layout has no image ${name ?? '(single)'}`);
  return found;
}

export async function readFileStreamToBuffer(stream: AsyncIterable<Uint8Array>, max: number): Promise<Buffer> {
  const chunks: Buffer[] = [];
  let total = 0;
  for await (const chunk of stream) {
    total += chunk.length;
    if (total > max) throw new FerryError('FERRY_IMAGE_UNSUPPORTED', `a response is larger than ${max} bytes`);
    chunks.push(Buffer.from(chunk));
  }
  return Buffer.concat(chunks);
}
