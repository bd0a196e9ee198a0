/**
 * A filesystem with folder quotas for tests of the `quota-dir` volumes backend: a sparse file formatted
 * btrfs (simple quotas on) or XFS (mounted with prjquota), loop-mounted nodev,nosuid under a temporary
 * folder that the sandboxes' uids can search. `close()` unmounts it (which detaches the loop device) and
 * removes the folder. Needs root, btrfs-progs and xfsprogs (scripts/setup-system.sh).
 */
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { tempDir } from './ferry.js';

export interface QuotaFs {
  kind: 'btrfs' | 'xfs';
  /** The mount point. */
  mount: string;
  /** A folder on it to use as FERRY_VOLUMES_DIR. */
  volumesDir: string;
  close(): Promise<void>;
}

export interface QuotaFsOptions {
  /** btrfs: `simple` (default), `full` qgroups or `off`; XFS: prjquota unless `off`. */
  quotas?: 'simple' | 'full' | 'off';
  sizeMiB?: number;
}

/** Enables btrfs simple quotas: `btrfs quota enable --simple` where btrfs-progs has it (6.7+), else the ioctl. */
function enableSimpleQuotas(mount: string): void {
  if (spawnSync('btrfs', ['quota', 'enable', '--simple', mount]).status === 0) return;
  // BTRFS_IOC_QUOTA_CTL = _IOWR(0x94, 40, 16 bytes) with cmd BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA (4).
  execFileSync('python3', [
    '-c',
    'import fcntl,os,struct,sys\nfd=os.open(sys.argv[1],os.O_RDONLY)\nfcntl.ioctl(fd,0xC0109428,struct.pack("QQ",4,0))',
    mount,
  ]);
}

/**
 * Makes and mounts the filesystem; a string says why it cannot be had here (XFS quotas on a kernel built
 * without CONFIG_XFS_QUOTA).
 */
export async function makeQuotaFs(kind: 'btrfs' | 'xfs', options: QuotaFsOptions = {}): Promise<QuotaFs | string> {
  const quotas = options.quotas ?? 'simple';
  const root = await tempDir(`ferry-${kind}-`);
  await fs.chmod(root, 0o711);
  const image = path.join(root, 'disk.img');
  const mount = path.join(root, 'mnt');
  await fs.mkdir(mount);
  const handle = await fs.open(image, 'w');
  await handle.truncate((options.sizeMiB ?? 512) * 1024 * 1024);
  await handle.close();
  execFileSync(kind === 'btrfs' ? 'mkfs.btrfs' : 'mkfs.xfs', ['-q', '-f', image], { stdio: 'pipe' });
  const opts = ['loop', 'nodev', 'nosuid', ...(kind === 'xfs' && quotas !== 'off' ? ['prjquota'] : [])];
  const mounted = spawnSync('mount', ['-o', opts.join(','), image, mount], { encoding: 'utf8' });
  if (mounted.status !== 0) {
    await fs.rm(root, { recursive: true, force: true });
    const kernel = spawnSync('sh', ['-c', 'dmesg 2>/dev/null | tail -n 3'], { encoding: 'utf8' }).stdout.trim();
    return `mount -o ${opts.join(',')} failed: ${mounted.stderr.trim()} ${kernel}`;
  }
  const close = async () => {
    for (let i = 0; i < 20; i++) {
      if (spawnSync('umount', [mount]).status === 0) break;
      await new Promise((r) => setTimeout(r, 250));
    }
    if (spawnSync('mountpoint', ['-q', mount]).status === 0) spawnSync('umount', ['-l', mount]);
    await fs.rm(root, { recursive: true, force: true });
  };
  try {
    if (kind === 'btrfs' && quotas === 'simple') enableSimpleQuotas(mount);
    if (kind === 'btrfs' && quotas === 'full') execFileSync('btrfs', ['quota', 'enable', mount]);
  } catch (err) {
    await close();
    throw err;
  }
  return { kind, mount, volumesDir: path.join(mount, 'volumes'), close };
}
