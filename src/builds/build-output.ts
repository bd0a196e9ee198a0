/**
 * Build outputs in the artifacts folder, so any process sharing it can run (or build) any build.
 *
 * A build is made in the building process's own `<data-dir>/builds/<id>` (`source/` from the archive,
 * `out/` from the builder), and replicas bind that local folder. This module moves it between processes:
 *
 *   publish(id)        the build is ready here: copy `builds/<id>` to `<artifacts-dir>/builds/<id>`;
 *   ensureLocal(id)    a replica is to start here: when `builds/<id>` is missing or not known complete,
 *                      fetch it from `<artifacts-dir>/builds/<id>`; once per build, whoever asks at once;
 *   ensureSource(b)    a build is to be made here: when `builds/<id>/source` is missing (another process
 *                      received the upload), extract it from the archive in the artifact store, with the
 *                      same checks as an upload.
 *
 * Every copy goes to a staging folder beside its destination and is renamed into place, so a reader never
 * sees half a build; a failed copy removes its staging folder, and staging folders left by a crash are
 * removed at start (the shared folder's only once old: another process may be filling one). Files are
 * hard-linked when both sides are on one file system (no data copied), copied otherwise; symbolic links
 * are recreated as links, never followed; anything else (sockets, FIFOs, devices) is left out. Nothing is
 * read from a build but its bytes: no file of it is parsed or run with Ferry's privileges.
 *
 * `builds/<id>.complete` (an empty file beside the folder) says the local folder equals the published
 * build: written after publishing or fetching, removed when a build is (re)made here. A local folder
 * without it (an upload received here but built elsewhere, a build interrupted here) is replaced by the
 * published one. A build that was never published (made before this module existed) is used as it is.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { Build } from '../store/schema.js';
import type { ArtifactStore } from './artifact-store.js';
import { buildFolder } from './build-folder.js';
import { BuildFailedError } from './builders/types.js';
import { extractZip, type ZipLimits } from './zip-archive.js';

export interface BuildOutputDeps {
  /** `<data-dir>/builds`: this process's builds, which replicas bind. */
  buildsDir: string;
  /** `--artifacts-dir`: build outputs go to its `builds/` folder, beside the archives. */
  artifactsDir: string;
  /** Where uploaded archives are (ensureSource reads them). */
  artifacts: ArtifactStore;
  zipLimits: ZipLimits;
  logger: Logger;
}

export interface BuildOutput {
  /** Copies the local build folder to the artifacts folder (kept as it is when already there). */
  publish(buildId: string): Promise<void>;
  /** Makes `<buildsDir>/<id>` the complete build, fetching it from the artifacts folder when needed. */
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

/** Staging folders in the shared folder older than this are from a crashed process: no copy takes that long. */
export const STALE_STAGING_MS = 60 * 60 * 1000;
const STAGING_PREFIX = '.staging-';
const BUILD_ID = /^[A-Za-z0-9_-]{1,100}$/;

export async function createBuildOutput(deps: BuildOutputDeps): Promise<BuildOutput> {
  const { buildsDir, logger } = deps;
  const sharedDir = path.join(deps.artifactsDir, 'builds');
  await fs.mkdir(sharedDir, { recursive: true, mode: 0o700 });
  await fs.mkdir(buildsDir, { recursive: true, mode: 0o700 });
  // The data directory has one process: every staging folder in it is left from an earlier run.
  await removeStaging(buildsDir, 0);
  await removeStaging(sharedDir, STALE_STAGING_MS);

  const complete = new Set<string>();
  const fetching = new Map<string, Promise<void>>();
  const markerOf = (buildId: string) => path.join(buildsDir, `${buildId}.complete`);
  const stagingIn = (dir: string, buildId: string) =>
    path.join(dir, `${STAGING_PREFIX}${buildId}-${randomBytes(4).toString('hex')}`);

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
    const shared = path.join(sharedDir, buildId);
    const stat = await fs.lstat(shared).catch(() => undefined);
    if (!stat) {
      // Made here before outputs were published: this folder is all there is.
      if (await exists(path.join(local, 'out'))) return;
      throw new Error(`build ${buildId} is neither in this data directory nor in the artifacts folder`);
    }
    if (!stat.isDirectory()) throw new Error(`${shared} is not a folder`);
    const staging = stagingIn(buildsDir, buildId);
    const old = stagingIn(buildsDir, buildId);
    const started = Date.now();
    try {
      await copyTree(shared, staging, { link: true });
      // An incomplete local folder (the upload was received here, the build made elsewhere) is replaced.
      await fs.rename(local, old).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
      await fs.rename(staging, local);
    } finally {
      await fs.rm(staging, { recursive: true, force: true });
      await fs.rm(old, { recursive: true, force: true });
    }
    await markComplete(buildId);
    logger.info({ buildId, ms: Date.now() - started }, 'fetched the build from the artifacts folder');
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
        const shared = path.join(sharedDir, buildId);
        bytes += await treeBytes(shared);
        await fs.rm(shared, { recursive: true, force: true });
      }
      return bytes;
    },

    async publish(buildId) {
      checkId(buildId);
      const shared = path.join(sharedDir, buildId);
      if (!(await exists(shared))) {
        const staging = stagingIn(sharedDir, buildId);
        try {
          await copyTree(path.join(buildsDir, buildId), staging, { link: true });
          await fs.rename(staging, shared);
        } catch (err) {
          // Published meanwhile by another process making the same build (a lease taken over): keep that one.
          const code = (err as NodeJS.ErrnoException).code;
          if (code !== 'EEXIST' && code !== 'ENOTEMPTY') throw err;
        } finally {
          await fs.rm(staging, { recursive: true, force: true });
        }
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
            logger.error({ err, buildId }, 'cannot get the build from the artifacts folder');
            throw new FerryError(
              'FERRY_REPLICA_START_FAILED',
              'This server process cannot get the build from the shared artifacts folder (see its log)',
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
      const archive = await deps.artifacts.localPath(build.id);
      if (!archive)
        throw new BuildFailedError('The uploaded archive of this build is missing from the artifacts folder');
      await extractSource(archive, stagingIn(buildsDir, build.id), folder, deps.zipLimits);
      logger.info({ buildId: build.id }, 'extracted the build source from its archive');
    },
  };
}

/**
 * Extracts a build's uploaded archive, with the upload's checks, into `staging` and moves it into place as
 * the build's `source/` (shared by the folder and object-store outputs).
 */
export async function extractSource(
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

function checkId(buildId: string): void {
  if (!BUILD_ID.test(buildId)) throw new Error(`Invalid build id ${JSON.stringify(buildId)}`);
}

async function exists(file: string): Promise<boolean> {
  try {
    await fs.lstat(file);
    return true;
  } catch {
    return false;
  }
}

/** Removes the staging folders in `dir` last changed over `olderThanMs` ago. */
async function removeStaging(dir: string, olderThanMs: number): Promise<void> {
  const now = Date.now();
  for (const name of await fs.readdir(dir)) {
    if (!name.startsWith(STAGING_PREFIX)) continue;
    const stat = await fs.lstat(path.join(dir, name)).catch(() => undefined);
    if (stat && now - stat.mtimeMs >= olderThanMs) await fs.rm(path.join(dir, name), { recursive: true, force: true });
  }
}

/** Errors of link() that copying gets around: another file system, a refused or exhausted link. */
const LINK_REFUSED = new Set(['EXDEV', 'EPERM', 'EMLINK', 'ENOTSUP', 'EOPNOTSUPP', 'EACCES']);

/**
 * Recreates the folder `from` (which must be a folder, not a link to one) at `to`, which must not exist:
 * folders made with their modes, files hard-linked while `state.link` holds (cleared for good at the first
 * EXDEV: the rest is on the other file system too) and copied otherwise, symbolic links recreated as links.
 */
export async function copyTree(from: string, to: string, state: { link: boolean }): Promise<void> {
  const stat = await fs.lstat(from);
  if (!stat.isDirectory()) throw new Error(`${from} is not a folder`);
  await fs.mkdir(to, { mode: 0o700 });
  // Dirent types come from lstat (or d_type): a link to a folder is a link here, not a folder.
  for (const entry of await fs.readdir(from, { withFileTypes: true })) {
    const source = path.join(from, entry.name);
    const target = path.join(to, entry.name);
    if (entry.isDirectory()) await copyTree(source, target, state);
    else if (entry.isSymbolicLink()) await fs.symlink(await fs.readlink(source), target);
    else if (entry.isFile()) await copyFile(source, target, state);
  }
  // Last, so a read-only folder could still be filled.
  await fs.chmod(to, stat.mode & 0o777);
}

async function copyFile(source: string, target: string, state: { link: boolean }): Promise<void> {
  if (state.link) {
    try {
      await fs.link(source, target);
      return;
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code ?? '';
      if (!LINK_REFUSED.has(code)) throw err;
      if (code === 'EXDEV') state.link = false;
    }
  }
  // Keeps the mode; a reflink where the file system has them.
  await fs.copyFile(source, target, fs.constants.COPYFILE_EXCL | fs.constants.COPYFILE_FICLONE);
}
