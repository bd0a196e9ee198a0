/**
 * What a replica's sandbox binds of an image: not the node's cache folder itself (under the data
 * directory), but a view of it made of hard links in this server's `ferry-view-*` folder
 * (sandbox/views.ts), for the reasons build views exist:
 *
 * - a bind shows its source in the sandbox's /proc/self/mountinfo, and the view's path
 *   (`/tmp/ferry-view-<random>/image-<hex>-<random>`) names no data directory;
 * - when Ferry is root, sandboxes run as uids of their own (sandbox/identity.ts), which cannot enter the
 *   data directory (0700); the view's folders are searchable by them, and its files readable.
 *
 * One view per digest, shared by every replica on it, made when the first starts (a hard link per file:
 * milliseconds for a small image, about a second for a large distribution) and kept while the image stays
 * in the node's cache, so a cold start on an image that ran here before makes no view (bench:images: 1,408
 * files cost 80 to 230 ms a start when each start made its own). It is removed when the cache discards the
 * image (`drop`, called from the cache's discard), so no view keeps an image's disk after eviction. Where
 * no view folder can be made, the cache folder is bound directly (its path then shows in mountinfo, as for
 * builds; views.reason).
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { mirror, stagingRoot } from '../sandbox/views.js';

export interface ImageViews {
  /** The folder to bind for the image unpacked at `rootfs`; `release` once the replica has ended. */
  acquire(digest: string, rootfs: string): Promise<{ dir: string; release: () => Promise<void> }>;
  /** The cache is discarding the image: its view goes (at once when unused, else when its last user ends). */
  drop(digest: string): Promise<void>;
}

export function createImageViews(options: { dataDir: string; othersRead: boolean }): ImageViews {
  const views = new Map<string, { dir: Promise<string>; users: number; dropped: boolean; rootfs: string }>();

  async function remove(dir: string, rootfs: string): Promise<void> {
    if (dir !== rootfs) await fs.rm(dir, { recursive: true, force: true }).catch(() => {});
  }

  async function make(digest: string, rootfs: string): Promise<string> {
    const root = await stagingRoot(options.dataDir, options.othersRead);
    if (!root) return rootfs;
    // A name of its own each time: the view of an earlier replica may still be being removed.
    const target = path.join(root, `image-${digest.slice('sha256:'.length, 19)}-${randomBytes(4).toString('hex')}`);
    try {
      await mirror(rootfs, target, options.othersRead);
    } catch (err) {
      await fs.rm(target, { recursive: true, force: true }).catch(() => {});
      throw err;
    }
    return target;
  }

  return {
    async acquire(digest, rootfs) {
      let view = views.get(digest);
      if (!view) {
        view = { dir: make(digest, rootfs), users: 0, dropped: false, rootfs };
        views.set(digest, view);
      }
      view.users += 1;
      const held = view;
      let dir: string;
      try {
        dir = await held.dir;
      } catch (err) {
        held.users -= 1;
        if (views.get(digest) === held) views.delete(digest);
        throw err;
      }
      let released = false;
      return {
        dir,
        async release() {
          if (released) return;
          released = true;
          held.users -= 1;
          // Kept for the next replica on the image, unless the cache discarded the image meanwhile.
          if (held.users > 0 || !held.dropped) return;
          if (views.get(digest) === held) views.delete(digest);
          await remove(dir, rootfs);
        },
      };
    },

    async drop(digest) {
      const view = views.get(digest);
      if (!view) return;
      view.dropped = true;
      views.delete(digest);
      if (view.users > 0) return; // its last user's release removes it
      const dir = await view.dir.catch(() => undefined);
      if (dir) await remove(dir, view.rootfs);
    },
  };
}
