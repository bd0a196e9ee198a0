/**
 * The local build cache: this process's `<data-dir>/builds/<id>` folders, kept equal to the published
 * builds, and (sandboxed) their views, which replicas bind (sandbox/views.ts makes them; they go with
 * their folder here). One implementation, used by both places builds are published (the `BuildOutput`
 * seam): the shared artifacts folder (build-output.ts) and the JetStream object store
 * (nats-build-output.ts), which supply only the `PublishedBuilds` half.
 *
 *   publish(id)        the build is ready here: publish `builds/<id>` (kept as it is when already there);
 *   ensureLocal(id)    a replica is to start here: when `builds/<id>` is missing or not known complete,
 *                      fetch the published build; once per build, whoever asks at once shares the fetch;
 *   ensureSource(b)    a build is to be made here: when `builds/<id>/source` is missing (another process
 *                      received the upload), extract it from the archive in the artifact store, with the
 *                      same checks as an upload.
 *
 * Every fetch goes to a staging folder beside its destination and is renamed into place, so a reader
 * never sees half a build; a failed fetch removes its staging folder, and staging folders (and downloads)
 * left by a crash are removed at start: the data directory has one process.
 *
 * `builds/<id>.complete` (an empty file beside the folder) says the local folder equals the published
 * build: written after publishing or fetching, removed when a build is (re)made here. A local folder
 * without it (an upload received here but built elsewhere, a build interrupted here) is replaced by the
 * published one. A build that was never published (made before outputs were published) is used as it is.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { BuildViews } from '../sandbox/views.js';
import type { Build } from '../store/schema.js';
import { BuildFailedError } from './build-failed.js';
import { buildFolder } from './build-folder.js';
import { extractZip, type ZipLimits } from './zip-archive.js';

export interface BuildOutput {
  /** Publishes the local build folder (kept as it is when already published). */
  publish(buildId: string): Promise<void>;
  /** Makes `<buildsDir>/<id>` the complete build, fetching the published one when needed. */
  ensureLocal(buildId: string): Promise<void>;
  /** Makes `<buildsDir>/<id>/source` from the build's archive when this process does not have it. */
  ensureSource(build: Pick<Build, 'id'>): Promise<void>;
  /**
   * Deletes the build's files: this process's folder and, with `shared`, the published copy too (a build
   * deleted by retention or with its app); with `keepLocal`, only the published copy (a replica here still
   * runs the build: its folder goes once it stops). Resolves with the bytes freed here, as far as counted.
   */
  remove(buildId: string, options?: { shared?: boolean; keepLocal?: boolean }): Promise<number>;
}

/** Where builds are published for every process: what differs between the two `BuildOutput`s. */
export interface PublishedBuilds {
  /** For logs and messages: "the artifacts folder", "the object store". */
  readonly where: string;
  /** Publishes the folder `local` as the build `buildId`, unless it is published already. */
  publish(buildId: string, local: string): Promise<void>;
  /**
   * Recreates the published build at `into` (which does not exist); `scratch` is a path beside it for a
   * download, removed afterwards. Resolves with what to log of the fetch, or null when it is not published.
   */
  fetch(buildId: string, into: string, scratch: string): Promise<Record<string, unknown> | null>;
  /** Deletes the published build; resolves with the bytes freed, as far as counted. */
  delete(buildId: string): Promise<number>;
  /** The build's uploaded archive as a local file, or undefined when it is missing. */
  archive(buildId: string): Promise<string | undefined>;
  /** The message of a FERRY_REPLICA_START_FAILED for a fetch that failed (no server paths). */
  fetchFailed(err: unknown): string;
}

export interface LocalBuildCacheDeps {
  /** `<data-dir>/builds`: this process's builds, which replicas bind. */
  buildsDir: string;
  /** The upload's limits, checked again when a source is extracted here (ensureSource). */
  zipLimits: ZipLimits;
  /**
   * The views of this process's builds that sandboxed replicas bind (sandbox/views.ts: hard links, so a
   * view keeps the files' space taken after the folder is gone): a build's view goes with its folder.
   */
  views?: Pick<BuildViews, 'drop'> | undefined;
  logger: Logger;
}

export const STAGING_PREFIX = '.staging-';
const BUILD_ID = /^[A-Za-z0-9_-]{1,100}$/;

export async function createLocalBuildCache(
  deps: LocalBuildCacheDeps,
  published: PublishedBuilds,
): Promise<BuildOutput> {
  const { buildsDir, logger } = deps;
  await fs.mkdir(buildsDir, { recursive: true, mode: 0o700 });
  // The data directory has one process: every staging folder or download in it is left from an earlier run.
  await removeStaging(buildsDir, 0);

  const complete = new Set<string>();
  const fetching = new Map<string, Promise<void>>();
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
      const fetched = await published.fetch(buildId, folder, download);
      if (!fetched) {
        // Made here before outputs were published: this folder is all there is.
        if (await exists(path.join(local, 'out'))) return;
        throw new Error(`build ${buildId} is neither in this data directory nor in ${published.where}`);
      }
      // An incomplete local folder (the upload was received here, the build made elsewhere) is replaced.
      await fs.rename(local, old).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
      await fs.rename(folder, local);
      await markComplete(buildId);
      logger.info({ buildId, ...fetched, ms: Date.now() - started }, `fetched the build from ${published.where}`);
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
        try {
          bytes += await removeLocalBuild(buildsDir, buildId);
        } finally {
          await deps.views?.drop(buildId);
        }
      }
      if (options.shared) bytes += await published.delete(buildId);
      return bytes;
    },

    async publish(buildId) {
      checkId(buildId);
      await published.publish(buildId, path.join(buildsDir, buildId));
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
            logger.error({ err, buildId }, `cannot get the build from ${published.where}`);
            throw new FerryError('FERRY_REPLICA_START_FAILED', published.fetchFailed(err), { cause: err });
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
      const archive = await published.archive(build.id);
      if (!archive) {
        throw new BuildFailedError(`The uploaded archive of this build is missing from ${published.where}`);
      }
      await extractSource(archive, staging(build.id), folder, deps.zipLimits);
      logger.info({ buildId: build.id }, 'extracted the build source from its archive');
    },
  };
}

/** Bytes of the files under `dir` (not following links); 0 when it is not there. Bounded: 100,000 entries. */
export async function treeBytes(dir: string): Promise<number> {
  let total = 0;
  let seen = 0;
  const stack = [dir];
  while (stack.length > 0 && seen < 100_000) {
    const current = stack.pop()!;
    let entries: import('node:fs').Dirent[];
    try {
      entries = await fs.readdir(current, { withFileTypes: true });
    } catch {
      continue;
    }
    for (const e of entries) {
      seen += 1;
      const full = path.join(current, e.name);
      if (e.isDirectory()) stack.push(full);
      else if (e.isFile()) total += (await fs.lstat(full).catch(() => ({ size: 0 }))).size;
    }
  }
  return total;
}

/** Removes `<buildsDir>/<id>` and its completion marker; resolves with the bytes it held. */
export async function removeLocalBuild(buildsDir: string, buildId: string): Promise<number> {
  const local = path.join(buildsDir, buildId);
  const bytes = await treeBytes(local);
  await fs.rm(local, { recursive: true, force: true });
  await fs.rm(path.join(buildsDir, `${buildId}.complete`), { force: true });
  return bytes;
}

/**
 * Extracts a build's uploaded archive, with the upload's checks, into `staging` and moves it into place as
 * the build's `source/`.
 */
async function extractSource(
  archive: string,
  staging: string,
  folder: { root: string; source: string },
  zipLimits: ZipLimits,
): Promise<void> {
  try {
    await fs.mkdir(staging, { mode: 0o755 });
    try {
      await extractZip(archive, staging, { limits: zipLimits });
    } catch (err) {
      if (err instanceof FerryError)
        throw new BuildFailedError(`The uploaded archive cannot be extracted: ${err.message}`);
      throw err;
    }
    await fs.mkdir(folder.root, { recursive: true, mode: 0o755 });
    await fs.rename(staging, folder.source);
  } finally {
    await fs.rm(staging, { recursive: true, force: true });
  }
}

export function checkId(buildId: string): void {
  if (!BUILD_ID.test(buildId)) throw new Error(`Invalid build id ${JSON.stringify(buildId)}`);
}

export async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}

/** Removes the staging folders in `dir` last changed over `olderThanMs` ago. */
export async function removeStaging(dir: string, olderThanMs: number): Promise<void> {
  const now = Date.now();
  for (const name of await fs.readdir(dir)) {
    if (!name.startsWith(STAGING_PREFIX)) continue;
    const stat = await fs.lstat(path.join(dir, name)).catch(() => undefined);
    if (stat && now - stat.mtimeMs >= olderThanMs) await fs.rm(path.join(dir, name), { recursive: true, force: true });
  }
}
