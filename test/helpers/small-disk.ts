/**
 * A small filesystem for the disk-space tests (issue 43, point 3): a tmpfs of `sizeMiB` mounted at a fresh
 * folder (the tests run as root), a filler file to take its room, and the unmount. The folder above the
 * mount is 0711, so sandbox uids reach what a server there binds.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { tempDir } from './ferry.js';

const MiB = 1024 * 1024;

export interface SmallDisk {
  /** The mount point. */
  root: string;
  /** `<root>/data`, for a server's data folder (not made). */
  data: string;
  /** What an unprivileged user may still write there (statfs). */
  freeBytes(): Promise<number>;
  /** Fills the disk until `leaveBytes` are free (0: until the filesystem refuses a byte more). */
  fill(leaveBytes?: number): Promise<void>;
  /** Removes the filler. */
  unfill(): Promise<void>;
  close(): Promise<void>;
}

export async function smallDisk(sizeMiB: number): Promise<SmallDisk> {
  const parent = await tempDir('ferry-small-disk-');
  await fs.chmod(parent, 0o711);
  const root = path.join(parent, 'mnt');
  await fs.mkdir(root);
  const mounted = spawnSync('mount', ['-t', 'tmpfs', '-o', `size=${sizeMiB}m`, 'tmpfs', root], { encoding: 'utf8' });
  assert.equal(mounted.status, 0, `mount -t tmpfs failed: ${mounted.stderr}`);
  const filler = path.join(root, 'filler');
  const freeBytes = async () => {
    const stats = await fs.statfs(root);
    return stats.bavail * stats.bsize;
  };
  return {
    root,
    data: path.join(root, 'data'),
    freeBytes,
    async fill(leaveBytes = 0) {
      const handle = await fs.open(filler, 'a');
      try {
        if (leaveBytes > 0) {
          const want = (await freeBytes()) - leaveBytes;
          for (let written = 0; written < want; ) {
            const n = Math.min(MiB, want - written);
            await handle.write(Buffer.alloc(n, 1));
            written += n;
          }
          return;
        }
        for (const size of [MiB, 4096, 512]) {
          const piece = Buffer.alloc(size, 1);
          for (;;) {
            try {
              await handle.write(piece);
            } catch (err) {
              if ((err as NodeJS.ErrnoException).code === 'ENOSPC') break;
              throw err;
            }
          }
        }
      } finally {
        await handle.close();
      }
    },
    unfill: () => fs.rm(filler, { force: true }),
    async close() {
      for (let i = 0; i < 20 && spawnSync('umount', [root]).status !== 0; i++) {
        await new Promise((r) => setTimeout(r, 250));
      }
      if (spawnSync('mountpoint', ['-q', root]).status === 0) spawnSync('umount', ['-l', root]);
      await fs.rm(parent, { recursive: true, force: true });
    },
  };
}
