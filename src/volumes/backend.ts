/**
 * What bounds a volume and where its files are, behind one interface (FERRY_VOLUMES_BACKEND): `image`, an
 * ext4 image mounted through a loop device (images.ts), or `quota-dir`, a folder bounded by its filesystem's
 * own quota (quota-dirs.ts). volumes.ts keeps the rows and asks the backend for everything on disk.
 *
 * Either way the volume's root folder is `root:<volume gid>`, mode 2770, with a default ACL giving the group
 * rwx, and replicas bind it (`bindSource`) with that gid as a supplementary group; the API's file routes
 * work from its root folder open (`openRoot`), through volume-files.ts.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { VolumesBackendKind } from '../config.js';
import {
  createImage,
  destroyImage,
  ensureMounted,
  mountedPoints,
  openMountedRoot,
  unmountImage,
  type VolumeSupport,
  volumePaths,
} from './images.js';
import { volumeUsage } from './volume-files.js';

export interface VolumeRef {
  projectId: string;
  name: string;
  /** The quota id a `quota-dir` volume is bounded by (its row's `quota_id`). */
  quotaId: number | null;
}

export interface VolumeBackend {
  readonly kind: VolumesBackendKind;
  readonly support: VolumeSupport;
  /** Makes the volume's storage, bounded to `sizeMiB`, its root owned by `gid`. Cleans up after a failure. */
  create(ref: VolumeRef, sizeMiB: number, gid: number): Promise<void>;
  /** Its root folder on this machine, ready (an image is mounted first). Throws VolumeMechanismError. */
  openRoot(ref: VolumeRef): Promise<fs.FileHandle>;
  /** Its root folder if it is ready here without doing anything (`ferry doctor`'s use figures), else null. */
  peekRoot(ref: VolumeRef): Promise<fs.FileHandle | null>;
  /** The host folder bwrap binds into a replica. */
  bindSource(ref: VolumeRef): string;
  /** Bytes used and free, as the bound counts them. */
  usage(ref: VolumeRef, root: fs.FileHandle): Promise<{ used_bytes: number; free_bytes: number }>;
  /** Removes its files, storage and bound. */
  destroy(ref: VolumeRef): Promise<void>;
  /** Lets go of what this process holds on this machine (an image's mounts). */
  close(onError: (err: Error) => void): Promise<void>;
}

/**
 * A volume's use as its bound counts it, read without doing anything on this machine (nothing is mounted):
 * null when its root is not ready here, or its mechanism cannot say. The one reading of a volume's use that
 * `GET …/volumes/{name}` (whose root is open already, so through `usage` itself), the server's totals and
 * `ferry doctor` share: before, the doctor read an image's allocated blocks (68.4 MiB) where `ferry volumes
 * list` said 60.0 MiB (issue 43).
 */
export async function peekVolumeUse(
  backend: VolumeBackend,
  ref: VolumeRef,
): Promise<{ used_bytes: number; free_bytes: number } | null> {
  const root = await backend.peekRoot(ref);
  if (!root) return null;
  try {
    return await backend.usage(ref, root).catch(() => null);
  } finally {
    await root.close();
  }
}

/** The `image` backend: images.ts's functions behind the interface. */
export function imageBackend(dir: string, support: VolumeSupport): VolumeBackend {
  const paths = (ref: VolumeRef) => volumePaths(dir, ref.projectId, ref.name);
  return {
    kind: 'image',
    support,
    create: (ref, sizeMiB, gid) => createImage(support, paths(ref), sizeMiB, gid),
    async openRoot(ref) {
      const p = paths(ref);
      // Mounted already (by any process of this machine): its root, checked, without spawning a tool.
      const mounted = await openMountedRoot(p).catch(() => null);
      if (mounted) return mounted;
      await ensureMounted(support, p);
      return openMountedRoot(p);
    },
    peekRoot: (ref) => openMountedRoot(paths(ref)).catch(() => null),
    bindSource: (ref) => paths(ref).mountPoint,
    usage: (_ref, root) => volumeUsage(root.fd),
    async destroy(ref) {
      if (support.tools) await destroyImage(support, paths(ref));
    },
    async close(onError) {
      if (!support.tools) return;
      // What this server's volumes dir has mounted on this machine: unmounted (lazily: a replica of another
      // process of this machine keeps its mount until it stops; that process mounts it again on next use).
      const mounted = await mountedPoints();
      const projects = await fs.readdir(dir).catch(() => [] as string[]);
      for (const project of projects) {
        const files = await fs.readdir(path.join(dir, project)).catch(() => [] as string[]);
        for (const file of files.filter((f) => f.endsWith('.img'))) {
          const p = volumePaths(dir, project, file.slice(0, -'.img'.length));
          if (!mounted.has(p.mountPoint)) continue;
          await unmountImage(support, p).catch(onError);
        }
      }
    },
  };
}
