/**
 * Build outputs in the JetStream object store (`--nats-url`): the same `BuildOutput` as build-output.ts,
 * with the cluster's artifacts bucket in place of the shared artifacts folder, so workers on machines with
 * nothing but their own disk can run (or build) any build.
 *
 *   publish(id)        the build is ready here: pack `builds/<id>` (source/ and out/) into one tar and put
 *                      it as the object `build/<id>` (kept as it is when already there);
 *   ensureLocal(id)    a replica is to start here: when `builds/<id>` is missing or not known complete,
 *                      fetch the object once (whoever asks at once shares the fetch), check its SHA-256
 *                      digest, unpack it into a staging folder (build-tar.ts: as untrusted as an upload)
 *                      and rename that into place;
 *   ensureSource(b)    a build is to be made here: when `builds/<id>/source` is missing (another process
 *                      received the upload), extract it from the archive, which the artifact store
 *                      (nats-artifact-store.ts) fetches from the same bucket.
 *
 * The local folder with its `builds/<id>.complete` marker is the local cache: a build is fetched once per
 * process and data directory, then bound by every replica that runs it. Downloaded tars and staging
 * folders live beside it as `.staging-*` and are removed after use, and at start when a crash left them.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { ObjectStore } from '@nats-io/obj';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { ArtifactStore } from './artifact-store.js';
import { buildFolder } from './build-folder.js';
import { type BuildOutput, extractSource, removeLocalBuild } from './build-output.js';
import { packFolder, unpackTar } from './build-tar.js';
import { BuildFailedError } from './builders/types.js';
import { artifactsUnavailable, fetchObject, putObject } from './nats-artifact-store.js';
import type { ZipLimits } from './zip-archive.js';

export interface NatsBuildOutputDeps {
  /** `<data-dir>/builds`: this process's builds, which replicas bind. */
  buildsDir: string;
  /**
   * The cluster's artifacts bucket (`openArtifactsBucket`), or a function opening it when first needed
   * (`lazyArtifactsBucket`: start-up does not wait for NATS).
   */
  bucket: ObjectStore | (() => Promise<ObjectStore>);
  /** Where uploaded archives are (ensureSource reads them). */
  artifacts: ArtifactStore;
  zipLimits: ZipLimits;
  logger: Logger;
}

const STAGING_PREFIX = '.staging-';
const BUILD_ID = /^[A-Za-z0-9_-]{1,100}$/;

export async function createNatsBuildOutput(deps: NatsBuildOutputDeps): Promise<BuildOutput> {
  const { buildsDir, logger } = deps;
  const given = deps.bucket;
  const bucket = typeof given === 'function' ? given : () => Promise.resolve(given);
  await fs.mkdir(buildsDir, { recursive: true, mode: 0o700 });
  // The data directory has one process: every staging folder or download in it is left from an earlier run.
  for (const name of await fs.readdir(buildsDir)) {
    if (name.startsWith(STAGING_PREFIX)) await fs.rm(path.join(buildsDir, name), { recursive: true, force: true });
  }

  const complete = new Set<string>();
  const fetching = new Map<string, Promise<void>>();
  const objectOf = (buildId: string) => `build/${buildId}`;
  const markerOf = (buildId: string) => path.join(buildsDir, `${buildId}.complete`);
  const staging = (buildId: string, suffix = '') =>
    path.join(buildsDir, `${STAGING_PREFIX}${buildId}-${randomBytes(4).toString('hex')}${suffix}`);

  async function markComplete(buildId: string): Promise<void> {
    await fs.writeFile(markerOf(buildId), '', { mode: 0o600 });
    complete.add(buildId);
  }

  async function fetch(buildId: string): Promise<void> {
    const local = path.join(buildsDir, buildId);
    if ((await exists(markerOf(buildId))) && (await exists(local))) {
      complete.add(buildId);
      return;
    }
    const started = Date.now();
    const download = staging(buildId, '.tar');
    const folder = staging(buildId);
    const old = staging(buildId);
    try {
      if (!(await fetchObject(await bucket(), objectOf(buildId), download))) {
        // Made here before outputs were published: this folder is all there is.
        if (await exists(path.join(local, 'out'))) return;
        throw new Error(`build ${buildId} is neither in this data directory nor in the object store`);
      }
      await fs.mkdir(folder, { mode: 0o700 });
      const { entries, bytes } = await unpackTar(download, folder);
      await fs.chmod(folder, 0o755);
      // An incomplete local folder (the upload was received here, the build made elsewhere) is replaced.
      await fs.rename(local, old).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
      await fs.rename(folder, local);
      await markComplete(buildId);
      logger.info({ buildId, entries, bytes, ms: Date.now() - started }, 'fetched the build from the object store');
    } finally {
      await fs.rm(download, { force: true });
      await fs.rm(folder, { recursive: true, force: true });
      await fs.rm(old, { recursive: true, force: true });
    }
  }

  return {
    async remove(buildId, options = {}) {
      checkId(buildId);
      let bytes = 0;
      if (!options.keepLocal) {
        complete.delete(buildId);
        bytes += await removeLocalBuild(buildsDir, buildId);
      }
      if (options.shared) {
        try {
          await (await bucket()).delete(objectOf(buildId));
        } catch (err) {
          // Not there (never published, or removed by another node) is what was wanted.
          if (!/not found/i.test(String((err as Error)?.message))) throw artifactsUnavailable(err);
        }
      }
      return bytes;
    },

    async publish(buildId) {
      checkId(buildId);
      let there: boolean;
      try {
        const info = await (await bucket()).info(objectOf(buildId));
        there = info !== null && !info.deleted;
      } catch (err) {
        throw artifactsUnavailable(err);
      }
      // Published meanwhile by another process making the same build (a lease taken over): keep that one.
      if (!there) {
        const started = Date.now();
        try {
          await putObject(await bucket(), objectOf(buildId), packFolder(path.join(buildsDir, buildId)));
        } catch (err) {
          throw artifactsUnavailable(err);
        }
        logger.info({ buildId, ms: Date.now() - started }, 'published the build to the object store');
      }
      await markComplete(buildId);
    },

    ensureLocal(buildId) {
      try {
        checkId(buildId);
      } catch (err) {
        return Promise.reject(err);
      }
      if (complete.has(buildId)) return Promise.resolve();
      let pending = fetching.get(buildId);
      if (!pending) {
        pending = fetch(buildId)
          .catch((err: unknown) => {
            // The caller is a replica start, answered to a run: a coded 502 without server paths.
            logger.error({ err, buildId }, 'cannot get the build from the object store');
            throw new FerryError(
              'FERRY_REPLICA_START_FAILED',
              `This server process cannot get the build from the object store: ${publicReason(err)}`,
              { cause: err },
            );
          })
          .finally(() => fetching.delete(buildId));
        fetching.set(buildId, pending);
      }
      return pending;
    },

    async ensureSource(build) {
      checkId(build.id);
      const folder = buildFolder(buildsDir, build.id);
      // The folder is about to be (re)made here: until it is published again it is not the published build.
      complete.delete(build.id);
      await fs.rm(markerOf(build.id), { force: true });
      if (await exists(folder.source)) return;
      let archive: string | undefined;
      try {
        archive = await deps.artifacts.localPath(build.id);
      } catch (err) {
        throw new BuildFailedError(`The uploaded archive cannot be fetched: ${publicReason(err)}`);
      }
      if (!archive) throw new BuildFailedError('The uploaded archive of this build is missing from the object store');
      await extractSource(archive, staging(build.id), folder, deps.zipLimits);
      logger.info({ buildId: build.id }, 'extracted the build source from its archive');
    },
  };
}

/** What a caller may be told of a failure: the coded or named cause, never a server path. */
function publicReason(err: unknown): string {
  if (err instanceof FerryError) return err.message;
  if (err instanceof Error && (err.name === 'CorruptObjectError' || err.name === 'UnsafeTarError')) return err.message;
  return 'see the server log';
}

function checkId(buildId: string): void {
  if (!BUILD_ID.test(buildId)) throw new Error(`Invalid build id ${JSON.stringify(buildId)}`);
}

async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}
