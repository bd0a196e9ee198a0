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
 * The local half (the `builds/<id>` folders with their `.complete` markers, a build fetched once per
 * process and data directory, then bound by every replica that runs it; downloads and staging folders
 * beside them, removed after use and at start) is the local build cache (local-build-cache.ts), shared with
 * the artifacts-folder output (build-output.ts); this module supplies the object store's half.
 */
import fs from 'node:fs/promises';
import type { ObjectStore } from '@nats-io/obj';
import { FerryError } from '../errors.js';
import type { ArtifactStore } from './artifact-store.js';
import { BuildFailedError } from './build-failed.js';
import { packFolder, unpackTar } from './build-tar.js';
import {
  type BuildOutput,
  createLocalBuildCache,
  type LocalBuildCacheDeps,
  type PublishedBuilds,
} from './local-build-cache.js';
import { artifactsUnavailable, fetchObject, putObject } from './nats-artifact-store.js';

export interface NatsBuildOutputDeps extends LocalBuildCacheDeps {
  /**
   * The cluster's artifacts bucket (`openArtifactsBucket`), or a function opening it when first needed
   * (`lazyArtifactsBucket`: start-up does not wait for NATS).
   */
  bucket: ObjectStore | (() => Promise<ObjectStore>);
  /** Where uploaded archives are (ensureSource reads them). */
  artifacts: ArtifactStore;
}

export async function createNatsBuildOutput(deps: NatsBuildOutputDeps): Promise<BuildOutput> {
  const { logger } = deps;
  const given = deps.bucket;
  const bucket = typeof given === 'function' ? given : () => Promise.resolve(given);
  const objectOf = (buildId: string) => `build/${buildId}`;

  const published: PublishedBuilds = {
    where: 'the object store',

    async publish(buildId, local) {
      let there: boolean;
      try {
        const info = await (await bucket()).info(objectOf(buildId));
        there = info !== null && !info.deleted;
      } catch (err) {
        throw artifactsUnavailable(err);
      }
      // Published meanwhile by another process making the same build (a lease taken over): keep that one.
      if (there) return;
      const started = Date.now();
      try {
        await putObject(await bucket(), objectOf(buildId), packFolder(local));
      } catch (err) {
        throw artifactsUnavailable(err);
      }
      logger.info({ buildId, ms: Date.now() - started }, 'published the build to the object store');
    },

    async fetch(buildId, into, download) {
      if (!(await fetchObject(await bucket(), objectOf(buildId), download))) return null;
      await fs.mkdir(into, { mode: 0o700 });
      const { entries, bytes } = await unpackTar(download, into);
      await fs.chmod(into, 0o755);
      return { entries, bytes };
    },

    async delete(buildId) {
      try {
        await (await bucket()).delete(objectOf(buildId));
      } catch (err) {
        // Not there (never published, or removed by another node) is what was wanted.
        if (!/not found/i.test(String((err as Error)?.message))) throw artifactsUnavailable(err);
      }
      return 0;
    },

    async archive(buildId) {
      try {
        return await deps.artifacts.localPath(buildId);
      } catch (err) {
        throw new BuildFailedError(`The uploaded archive cannot be fetched: ${publicReason(err)}`);
      }
    },

    fetchFailed: (err) => `This server process cannot get the build from the object store: ${publicReason(err)}`,
  };

  return createLocalBuildCache(deps, published);
}

/** What a caller may be told of a failure: the coded or named cause, never a server path. */
function publicReason(err: unknown): string {
  if (err instanceof FerryError) return err.message;
  if (err instanceof Error && (err.name === 'CorruptObjectError' || err.name === 'UnsafeTarError')) return err.message;
  return 'see the server log';
}
