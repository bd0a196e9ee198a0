/**
 * Uploaded archives in the JetStream object store (`--nats-url`), so no shared filesystem is needed: the
 * `ArtifactStore` of a scaled-out cluster. Archives are the objects `archive/<build id>` of the cluster's
 * artifacts bucket (`clusterNames(cluster).artifactsBucket`, shared with the build outputs of
 * nats-build-output.ts); each process keeps the archives it received or fetched in a local cache
 * (`<data-dir>/archive-cache/<id>.zip`), so a listing or a rebuild reads a local file.
 *
 * Also the object-store helpers both modules use: open the bucket, put a stream, and fetch an object into
 * a local file, verified against the SHA-256 digest the object store recorded when it was put.
 */
import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { ReadableStream as WebReadableStream } from 'node:stream/web';
import { type ObjectStore, Objm, StorageType } from '@nats-io/obj';
import type { NatsConnection } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { ArtifactStore } from './artifact-store.js';

/** How the object store names its digests (`SHA-256=` and the padded base64url of the hash). */
const DIGEST_PREFIX = 'SHA-256=';
const BUILD_ID = /^[A-Za-z0-9_-]{1,100}$/;

/** Opens (creating when missing) the cluster's artifacts bucket: file storage, one replica per NATS server set-up. */
export async function openArtifactsBucket(nc: NatsConnection, bucket: string): Promise<ObjectStore> {
  return new Objm(nc).create(bucket, { storage: StorageType.File });
}

/**
 * The artifacts bucket opened when first needed, on the connection as it is then: start-up does not wait
 * for NATS. Until NATS has been reached (and while opening fails) each use fails, which the callers answer
 * as `503 FERRY_ARTIFACTS_UNAVAILABLE`; the first success is kept.
 */
export function lazyArtifactsBucket(nc: () => NatsConnection, bucket: string): () => Promise<ObjectStore> {
  let opened: Promise<ObjectStore> | undefined;
  return () => {
    if (!opened) {
      const opening = (async () => openArtifactsBucket(nc(), bucket))();
      opened = opening;
      opening.catch(() => {
        if (opened === opening) opened = undefined;
      });
    }
    return opened;
  };
}

/** An object's content does not match the digest recorded with it: refused, never used. */
export class CorruptObjectError extends Error {
  constructor(name: string, detail: string, options?: { cause?: unknown }) {
    super(`the object ${name} in the artifacts bucket is corrupt: ${detail}`, options);
    this.name = 'CorruptObjectError';
  }
}

/** Puts `data` as the object `name` (replacing any object of that name); resolves to its digest. */
export async function putObject(os: ObjectStore, name: string, data: Readable): Promise<string> {
  const web = Readable.toWeb(data) as unknown as ReadableStream<Uint8Array>;
  const info = await os.put({ name }, web);
  return info.digest;
}

/**
 * Fetches the object `name` into `file` (written beside it, then renamed: a reader never sees part of it).
 * Resolves false when there is no such object. The bytes are hashed as they arrive and compared with the
 * digest the object store recorded at put time; a mismatch (or the client's own digest check failing)
 * rejects with CorruptObjectError and leaves no file.
 */
export async function fetchObject(os: ObjectStore, name: string, file: string): Promise<boolean> {
  const result = await os.get(name);
  if (!result) return false;
  const expected = parseDigest(name, result.info.digest);
  const partial = `${file}.partial-${randomBytes(4).toString('hex')}`;
  const hash = createHash('sha256');
  try {
    try {
      await pipeline(
        Readable.fromWeb(result.data as unknown as WebReadableStream<Uint8Array>),
        new Transform({
          transform(chunk: Buffer, _encoding, done) {
            hash.update(chunk);
            done(null, chunk);
          },
        }),
        createWriteStream(partial, { flags: 'wx', mode: 0o600 }),
      );
    } catch (err) {
      // The client checks the digest too, and fails the stream when it does not match.
      if (err instanceof Error && /digest/i.test(err.message))
        throw new CorruptObjectError(name, 'its SHA-256 digest does not match', { cause: err });
      throw err;
    }
    const failed = await result.error;
    if (failed) {
      if (/digest/i.test(failed.message))
        throw new CorruptObjectError(name, 'its SHA-256 digest does not match', { cause: failed });
      throw failed;
    }
    const actual = hash.digest();
    if (!actual.equals(expected)) {
      throw new CorruptObjectError(
        name,
        `its SHA-256 digest is ${actual.toString('hex')}, not the ${expected.toString('hex')} recorded when it was stored`,
      );
    }
    await fs.rename(partial, file);
    return true;
  } finally {
    await fs.rm(partial, { force: true });
  }
}

function parseDigest(name: string, digest: string): Buffer {
  const hash = Buffer.from(digest.startsWith(DIGEST_PREFIX) ? digest.slice(DIGEST_PREFIX.length) : '', 'base64url');
  if (hash.length !== 32) throw new CorruptObjectError(name, `its recorded digest "${digest}" is not SHA-256`);
  return hash;
}

/**
 * A failure to get or put an object, as a coded 503 for the caller: NATS cannot be reached (retry later),
 * or the object is corrupt (said so; the log has the details).
 */
export function artifactsUnavailable(err: unknown): unknown {
  // This process's own failures (disk full, permissions) are not NATS's: passed on as they are.
  if (err instanceof FerryError || (err instanceof Error && 'syscall' in err)) return err;
  const message =
    err instanceof CorruptObjectError
      ? `The artifact store holds a corrupt copy of this object (${err.message}); it is not used`
      : undefined;
  return new FerryError('FERRY_ARTIFACTS_UNAVAILABLE', message, { cause: err, headers: { 'retry-after': '5' } });
}

export interface NatsArtifactStoreDeps {
  /** The connection, or a function returning it (throwing while NATS has not been reached: `requireNats`). */
  nc: NatsConnection | (() => NatsConnection);
  /** `clusterNames(cluster).artifactsBucket`. */
  bucket: string;
  /** `<data-dir>/archive-cache`: this process's copies of archives (created here, mode 0700). */
  cacheDir: string;
  logger: Logger;
}

export async function createNatsArtifactStore(deps: NatsArtifactStoreDeps): Promise<ArtifactStore> {
  const { logger, cacheDir } = deps;
  const { nc } = deps;
  const os = lazyArtifactsBucket(typeof nc === 'function' ? nc : () => nc, deps.bucket);
  await fs.mkdir(cacheDir, { recursive: true, mode: 0o700 });
  // Partial downloads left by a crash: this folder belongs to this process alone.
  for (const name of await fs.readdir(cacheDir)) {
    if (name.includes('.partial-')) await fs.rm(path.join(cacheDir, name), { force: true });
  }
  const objectOf = (buildId: string) => `archive/${buildId}`;
  const fileOf = (buildId: string) => {
    if (!BUILD_ID.test(buildId)) throw new Error(`Invalid build id ${JSON.stringify(buildId)}`);
    return path.join(cacheDir, `${buildId}.zip`);
  };
  const fetching = new Map<string, Promise<string | undefined>>();

  async function fetchArchive(buildId: string): Promise<string | undefined> {
    const file = fileOf(buildId);
    if (await exists(file)) return file;
    let found: boolean;
    try {
      found = await fetchObject(await os(), objectOf(buildId), file);
    } catch (err) {
      logger.error({ err, buildId }, 'cannot fetch the uploaded archive from the object store');
      throw artifactsUnavailable(err);
    }
    if (!found) return undefined;
    logger.info({ buildId }, 'fetched the uploaded archive from the object store');
    return file;
  }

  return {
    async put(buildId, file) {
      const cached = fileOf(buildId);
      const handle = await fs.open(file, 'r');
      try {
        await putObject(await os(), objectOf(buildId), handle.createReadStream({ autoClose: false }));
      } catch (err) {
        throw artifactsUnavailable(err);
      } finally {
        await handle.close();
      }
      // Kept here too: the process that received an upload usually builds it and lists it.
      await fs.rename(file, cached);
      await fs.chmod(cached, 0o600);
    },

    localPath(buildId) {
      let pending = fetching.get(buildId);
      if (!pending) {
        pending = fetchArchive(buildId).finally(() => fetching.delete(buildId));
        fetching.set(buildId, pending);
      }
      return pending;
    },

    async delete(buildId) {
      await fs.rm(fileOf(buildId), { force: true });
      try {
        await (await os()).delete(objectOf(buildId));
      } catch (err) {
        throw artifactsUnavailable(err);
      }
    },
  };
}

async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}
