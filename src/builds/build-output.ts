/**
 * Build outputs in the artifacts folder, so any process sharing it can run (or build) any build: the
 * `BuildOutput` of a server without NATS. The local half (this process's `builds/<id>` folders, fetched
 * once, completion markers, source extraction) is the local build cache (local-build-cache.ts), shared
 * with the object-store output (nats-build-output.ts); this module is the published half:
 *
 *   publish     copy `builds/<id>` to `<artifacts-dir>/builds/<id>` (kept as it is when already there);
 *   fetch       recreate `<artifacts-dir>/builds/<id>` in the cache's staging folder;
 *   archive     the uploaded archive, from the artifact store's folder.
 *
 * Every copy into the shared folder goes to a staging folder beside its destination and is renamed into
 * place; staging folders left there by a crash are removed at start once old (another process may be
 * filling one). Files are hard-linked when both sides are on one file system (no data copied), copied
 * otherwise; symbolic links are recreated as links, never followed; anything else (sockets, FIFOs, devices)
 * is left out. Nothing is read from a build but its bytes: no file of it is parsed or run with Ferry's
 * privileges.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { ArtifactStore } from './artifact-store.js';
import {
  type BuildOutput,
  createLocalBuildCache,
  exists,
  type LocalBuildCacheDeps,
  type PublishedBuilds,
  removeStaging,
  STAGING_PREFIX,
  treeBytes,
} from './local-build-cache.js';

export type { BuildOutput } from './local-build-cache.js';

export interface BuildOutputDeps extends LocalBuildCacheDeps {
  /** `--artifacts-dir`: build outputs go to its `builds/` folder, beside the archives. */
  artifactsDir: string;
  /** Where uploaded archives are (ensureSource reads them). */
  artifacts: ArtifactStore;
}

/** Staging folders in the shared folder older than this are from a crashed process: no copy takes that long. */
export const STALE_STAGING_MS = 60 * 60 * 1000;

export async function createBuildOutput(deps: BuildOutputDeps): Promise<BuildOutput> {
  const sharedDir = path.join(deps.artifactsDir, 'builds');
  await fs.mkdir(sharedDir, { recursive: true, mode: 0o700 });
  await removeStaging(sharedDir, STALE_STAGING_MS);
  const stagingIn = (dir: string, buildId: string) =>
    path.join(dir, `${STAGING_PREFIX}${buildId}-${randomBytes(4).toString('hex')}`);

  const published: PublishedBuilds = {
    where: 'the artifacts folder',

    async publish(buildId, local) {
      const shared = path.join(sharedDir, buildId);
      if (await exists(shared)) return;
      const staging = stagingIn(sharedDir, buildId);
      try {
        await copyTree(local, staging, { link: true });
        await fs.rename(staging, shared);
      } catch (err) {
        // Published meanwhile by another process making the same build (a lease taken over): keep that one.
        const code = (err as NodeJS.ErrnoException).code;
        if (code !== 'EEXIST' && code !== 'ENOTEMPTY') throw err;
      } finally {
        await fs.rm(staging, { recursive: true, force: true });
      }
    },

    async fetch(buildId, into) {
      const shared = path.join(sharedDir, buildId);
      const stat = await fs.lstat(shared).catch(() => undefined);
      if (!stat) return null;
      if (!stat.isDirectory()) throw new Error(`${shared} is not a folder`);
      await copyTree(shared, into, { link: true });
      return {};
    },

    async delete(buildId) {
      const shared = path.join(sharedDir, buildId);
      const bytes = await treeBytes(shared);
      await fs.rm(shared, { recursive: true, force: true });
      return bytes;
    },

    archive: (buildId) => deps.artifacts.localPath(buildId),

    fetchFailed: () => 'This server process cannot get the build from the shared artifacts folder (see its log)',
  };

  return createLocalBuildCache(deps, published);
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
