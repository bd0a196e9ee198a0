/**
 * The `quota-dir` backend (FERRY_VOLUMES_BACKEND=quota-dir): a volume is a folder on the filesystem of
 * FERRY_VOLUMES_DIR, bounded by that filesystem's own quota (quotas.ts), in place of an image. Nothing is
 * mounted: every node that has the filesystem at FERRY_VOLUMES_DIR binds the folder itself, so replicas on
 * every worker of a cluster write one volume at the same time (an ext4 image is one machine's at a time).
 *
 * Where things are:
 *   <FERRY_VOLUMES_DIR>/<project>/<name>/    the volume's root: `root:<volume gid>`, mode 2770, default ACL
 *                                            giving the group rwx (as an image's root), bounded by its quota
 * bwrap binds the root as the sandbox's own uid, so every folder on its way must be searchable by others
 * (FERRY_VOLUMES_DIR and the project folders are 0711; the probe says which folder above is not); the root
 * itself lets in only its group.
 *
 * The host-side file routes open the root with O_NOFOLLOW and work from it (volume-files.ts), as with an
 * image; a delete empties the folder the same way (never following what a function planted), then removes
 * it and its quota. Hard links cannot leave a volume: link(2) fails across bind mounts and across quotas
 * (XFS projects, btrfs subvolumes) with EXDEV. Device nodes: a sandbox cannot make one, and the routes
 * refuse any file that is not a regular one (mount the filesystem nodev,nosuid as well).
 */
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { findExecutable } from '../sandbox/launch.js';
import { WRAPPER_ENV } from '../sandbox/run-quiet.js';
import type { VolumeBackend, VolumeRef } from './backend.js';
import { VolumeMechanismError, type VolumeSupport } from './images.js';
import { detectQuotaMechanism, type QuotaMechanism, runTool } from './quotas.js';
import { removePath } from './volume-files.js';

export interface QuotaDirSupport extends VolumeSupport {
  quota: QuotaMechanism | null;
  setfacl: string | null;
}

/**
 * What this machine has for `quota-dir` volumes in `dir`. `prepare`: make FERRY_VOLUMES_DIR (0711) if it is
 * missing and let others search it (the server; `ferry doctor` only looks).
 */
export async function probeQuotaDirSupport(
  dir: string,
  sandboxed: boolean,
  prepare: boolean,
): Promise<QuotaDirSupport> {
  const reasons: string[] = [];
  if (typeof process.getuid !== 'function' || process.getuid() !== 0) {
    reasons.push("Ferry is not root: a volume's folder is given to its group and bounded by a quota, which needs root");
  }
  if (!sandboxed) reasons.push('replicas are not sandboxed (bubblewrap missing or FERRY_SANDBOX=off)');
  const setfacl = await findExecutable('setfacl', WRAPPER_ENV);
  if (!setfacl) reasons.push('missing setfacl (apt-get install acl)');
  if (prepare) {
    await fs.mkdir(dir, { recursive: true, mode: 0o711 }).catch(() => {});
    const stat = await fs.stat(dir).catch(() => null);
    if (stat && (stat.mode & 0o001) === 0) await fs.chmod(dir, (stat.mode & 0o7777) | 0o001).catch(() => {});
  }
  let quota: QuotaMechanism | null = null;
  if (!(await fs.stat(dir).catch(() => null))?.isDirectory()) {
    reasons.push(`FERRY_VOLUMES_DIR (${dir}) is not a folder here`);
  } else {
    const hidden = await firstUnsearchable(dir);
    if (hidden) {
      reasons.push(
        `${hidden} is not searchable by others, and the sandboxes bind volume folders under FERRY_VOLUMES_DIR (${dir}) as their own uids: chmod o+x ${hidden}`,
      );
    }
    const found = await detectQuotaMechanism(dir, setfacl);
    quota = found.mechanism;
    reasons.push(...found.reasons);
  }
  return { available: reasons.length === 0, reasons, tools: null, quota, setfacl };
}

/** The first folder from / down to `dir` (inclusive) that others cannot search, or null. */
async function firstUnsearchable(dir: string): Promise<string | null> {
  const chain: string[] = [];
  for (let d = path.resolve(dir); ; d = path.dirname(d)) {
    chain.unshift(d);
    if (path.dirname(d) === d) break;
  }
  for (const folder of chain) {
    const stat = await fs.stat(folder).catch(() => null);
    if (!stat || (stat.mode & 0o001) === 0) return folder;
  }
  return null;
}

const MIB = 1024 * 1024;

export function quotaDirBackend(dir: string, support: QuotaDirSupport): VolumeBackend {
  const rootOf = (ref: VolumeRef) => path.join(dir, ref.projectId, ref.name);

  function mechanism(): QuotaMechanism {
    if (!support.available || !support.quota) throw new VolumeMechanismError(support.reasons.join('; '));
    return support.quota;
  }
  function quotaId(ref: VolumeRef): number {
    if (ref.quotaId === null) throw new VolumeMechanismError(`volume ${ref.name} has no quota id`);
    return ref.quotaId;
  }
  /** A quota tool's failure, as the mechanism error volumes.ts answers 503 for. */
  const asMechanismError = (err: unknown): never => {
    if (err instanceof Error && err.name === 'QuotaError') throw new VolumeMechanismError(err.message);
    throw err;
  };

  async function openRoot(ref: VolumeRef): Promise<fs.FileHandle> {
    const root = rootOf(ref);
    try {
      return await fs.open(root, constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') {
        throw new VolumeMechanismError(
          `its folder ${root} is not here: is FERRY_VOLUMES_DIR the shared folder the volume was made in?`,
        );
      }
      throw new VolumeMechanismError(`its folder ${root} cannot be opened: ${(err as Error).message}`);
    }
  }

  async function destroy(ref: VolumeRef): Promise<void> {
    const quota = mechanism();
    const root = rootOf(ref);
    const handle = await fs
      .open(root, constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW)
      .catch((err: NodeJS.ErrnoException) => {
        if (err.code === 'ENOENT') return null;
        throw err;
      });
    if (handle) {
      try {
        // Through descriptors, never following a link a function planted (volume-files.ts).
        await removePath(handle.fd, [], true);
      } finally {
        await handle.close();
      }
    }
    await quota.remove(root, quotaId(ref)).catch(asMechanismError);
  }

  return {
    kind: 'quota-dir',
    support,
    async create(ref, sizeMiB, gid) {
      const quota = mechanism();
      const id = quotaId(ref);
      const root = rootOf(ref);
      const projectDir = path.dirname(root);
      await fs.mkdir(projectDir, { recursive: true, mode: 0o711 });
      await fs.chmod(projectDir, 0o711);
      if (await fs.lstat(root).catch(() => null)) {
        throw new VolumeMechanismError(`${root} exists already (left by a volume deleted elsewhere?)`);
      }
      try {
        await quota.make(root, id, sizeMiB * MIB).catch(asMechanismError);
        // The group's rights last: until then only root gets in (the mechanism made it 0700).
        await runTool(
          support.setfacl!,
          ['-m', 'g::rwx,o::-', '-d', '-m', 'u::rwx,g::rwx,m::rwx,o::-', root],
          'setfacl',
        ).catch(asMechanismError);
        await fs.chown(root, 0, gid);
        await fs.chmod(root, 0o2770);
      } catch (err) {
        await destroy(ref).catch(() => {});
        throw err;
      }
    },
    openRoot,
    peekRoot: (ref) => openRoot(ref).catch(() => null),
    bindSource: rootOf,
    async usage(ref) {
      const use = await mechanism().usage(rootOf(ref)).catch(asMechanismError);
      return { used_bytes: use.used_bytes, free_bytes: Math.max(0, use.limit_bytes - use.used_bytes) };
    },
    destroy,
    async close() {},
  };
}

/** The volume folders in `dir` with their use and limit, by project and name (`ferry doctor`). */
export async function localQuotaDirs(
  dir: string,
  quota: QuotaMechanism | null,
): Promise<Array<{ project_id: string; name: string; size_bytes: number | null; used_bytes: number | null }>> {
  const out = [];
  const projects = (await fs.readdir(dir).catch(() => [] as string[])).filter((p) => !p.startsWith('.'));
  for (const project of projects.sort()) {
    const entries = await fs.readdir(path.join(dir, project), { withFileTypes: true }).catch(() => []);
    for (const entry of entries.filter((e) => e.isDirectory()).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      const use = quota ? await quota.usage(path.join(dir, project, entry.name)).catch(() => null) : null;
      out.push({
        project_id: project,
        name: entry.name,
        size_bytes: use?.limit_bytes ?? null,
        used_bytes: use?.used_bytes ?? null,
      });
    }
  }
  return out;
}
