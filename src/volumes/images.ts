/**
 * The mechanism that bounds a volume: one ext4 filesystem image per volume, mounted through a loop device.
 *
 * Why an image: a write past the size fails inside the function with ENOSPC, at once and for every replica
 * together (they all write to the one filesystem), which no after-the-fact accounting gives; deleting the
 * volume frees its space (the image is sparse and removed); a hard link can never reach a host file (links
 * do not cross filesystems); device nodes do not open (`nodev`). It needs root (mount, loop devices),
 * `mkfs.ext4` (e2fsprogs), `setfacl` (acl), `flock`, `mountpoint` and `mount` (util-linux):
 * `probeVolumeSupport` says what is missing, and without it volumes are refused (never unbounded).
 *
 * Where things are:
 *   <FERRY_VOLUMES_DIR>/<project>/<name>.img    the image (shared by every node of a cluster)
 *   <FERRY_VOLUMES_DIR>/<project>/<name>.lock   flock(1) serializes mounting and deleting, across processes
 *   <FERRY_VOLUMES_DIR>/<project>/<name>.host   the machine that mounts it (an image is mounted by one host)
 *   /run/ferry-volumes/<hash>/                  its mount point on this machine
 * The mount point is machine-local and named by a hash of the image's path, so every Ferry process of one
 * machine finds the same mount (two loop mounts of one ext4 image would corrupt it), and the folders on its
 * way can be searched by the sandboxes' uids, which bwrap binds it as (the data directory is 0700). The
 * mount point folder itself is mode 0000 while nothing is mounted on it, so a replica bound to it by a race
 * with a delete cannot write to the host's disk.
 *
 * Ownership: the filesystem's root is `root:<volume gid>`, mode 2770, with a default ACL giving the group
 * rwx: every file and folder made in it (by any replica, whatever its umask, or by the API) belongs to the
 * group and is group-writable. Every replica that mounts the volume runs with that gid as a supplementary
 * group (sandbox/identity.ts), so replicas of different apps (different host uids) share the files.
 */
import { createHash } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { findExecutable } from '../sandbox/launch.js';
import { runQuiet, WRAPPER_ENV } from '../sandbox/run-quiet.js';

/** Machine-local folder of the mount points. */
export const MOUNT_ROOT = '/run/ferry-volumes';
/** The first host gid of volumes (after the sandboxes' default uid/gid range); one gid per volume. */
export const VOLUME_GID_FIRST = 1_879_113_728;
export const VOLUME_GID_COUNT = 16_777_216;
/** The smallest volume: room for ext4's metadata and journal and some files. */
export const MIN_VOLUME_MIB = 16;

const TOOL_TIMEOUT_MS = 120_000;

export interface VolumeSupport {
  /** Whether volumes can be made and mounted here. */
  available: boolean;
  /** What is missing, in words (`ferry doctor`, the 503 answer). */
  reasons: string[];
  tools: { mkfs: string; setfacl: string; flock: string; mount: string; umount: string; mountpoint: string } | null;
}

/**
 * What this machine has for volumes. `sandboxed`: replicas run under bwrap (a volume is bound into the
 * sandbox; a plain process would see the host).
 */
export async function probeVolumeSupport(sandboxed: boolean): Promise<VolumeSupport> {
  const reasons: string[] = [];
  if (typeof process.getuid !== 'function' || process.getuid() !== 0) {
    reasons.push('Ferry is not root: volumes are filesystem images mounted through loop devices, which needs root');
  }
  if (!sandboxed) reasons.push('replicas are not sandboxed (bubblewrap missing or FERRY_SANDBOX=off)');
  const names = ['mkfs.ext4', 'setfacl', 'flock', 'mount', 'umount', 'mountpoint'] as const;
  const found = await Promise.all(names.map((n) => findExecutable(n, WRAPPER_ENV)));
  const missing = names.filter((_, i) => !found[i]);
  if (missing.length > 0) {
    const pkg = { 'mkfs.ext4': 'e2fsprogs', setfacl: 'acl' } as Record<string, string>;
    reasons.push(
      `missing ${missing.join(', ')} (apt-get install ${[...new Set(missing.map((m) => pkg[m] ?? 'util-linux'))].join(' ')})`,
    );
  }
  const loopControl = await fs.stat('/dev/loop-control').catch(() => null);
  if (!loopControl) reasons.push('no /dev/loop-control: the kernel has no loop devices (modprobe loop)');
  const tools =
    missing.length === 0
      ? {
          mkfs: found[0]!,
          setfacl: found[1]!,
          flock: found[2]!,
          mount: found[3]!,
          umount: found[4]!,
          mountpoint: found[5]!,
        }
      : null;
  return { available: reasons.length === 0, reasons, tools };
}

export interface VolumePaths {
  image: string;
  lock: string;
  host: string;
  mountPoint: string;
}

/** Where a volume's files are (see the header). */
export function volumePaths(volumesDir: string, projectId: string, name: string): VolumePaths {
  const dir = path.join(volumesDir, projectId);
  const image = path.join(dir, `${name}.img`);
  const hash = createHash('sha256').update(path.resolve(image)).digest('hex').slice(0, 32);
  return {
    image,
    lock: path.join(dir, `${name}.lock`),
    host: path.join(dir, `${name}.host`),
    mountPoint: path.join(MOUNT_ROOT, hash),
  };
}

/** This machine, as the `.host` file names it: a volume image is mounted by one machine at a time. */
export async function machineId(): Promise<string> {
  const id = (await fs.readFile('/etc/machine-id', 'utf8').catch(() => '')).trim();
  return id || (await fs.readFile('/proc/sys/kernel/hostname', 'utf8').catch(() => 'unknown')).trim();
}

async function run(file: string, args: string[], what: string): Promise<string> {
  const result = await runQuiet(file, args, TOOL_TIMEOUT_MS);
  if (result.code !== 0) {
    const why = result.timedOut ? 'timed out' : result.stderr.trim() || result.error || `exit code ${result.code}`;
    throw new VolumeMechanismError(`${what}: ${why}`, result.code);
  }
  return result.stdout;
}

/** A step of the mechanism failed (mkfs, mount, ...); `code` is the tool's exit code. */
export class VolumeMechanismError extends Error {
  constructor(
    message: string,
    readonly code: number | null = null,
  ) {
    super(message);
    this.name = 'VolumeMechanismError';
  }
}

/**
 * Mounts the image at its mount point unless it already is, under the volume's lock: refuses (exit 3) when
 * another machine's id is in `.host`. One script, so the check and the mount are one step for flock.
 */
const MOUNT_SCRIPT = `set -eu
img=$1 mnt=$2 hostfile=$3 me=$4 mountpoint=$5 mount=$6
[ -f "$img" ] || { echo "the volume's image is gone" >&2; exit 4; }
if [ -s "$hostfile" ]; then
  other=$(cat "$hostfile")
  if [ "$other" != "$me" ]; then echo "the volume is mounted by another machine ($other)" >&2; exit 3; fi
else
  printf '%s\\n' "$me" > "$hostfile"
fi
mkdir -p "$mnt"
if ! "$mountpoint" -q "$mnt"; then chmod 000 "$mnt"; "$mount" -o loop,nodev,nosuid,noatime "$img" "$mnt"; fi
`;

/** Unmounts (lazily: replicas still running keep it until they stop) and removes the image, under the lock. */
const DESTROY_SCRIPT = `set -u
img=$1 mnt=$2 hostfile=$3 mountpoint=$4 umount=$5
if "$mountpoint" -q "$mnt"; then "$umount" -l "$mnt" || exit 1; fi
rmdir "$mnt" 2>/dev/null
rm -f "$img" "$hostfile"
exit 0
`;

/** Unmounts if mounted, under the lock (server shutdown; the next use mounts it again). */
const UNMOUNT_SCRIPT = `set -u
mnt=$1 mountpoint=$2 umount=$3
if "$mountpoint" -q "$mnt"; then "$umount" -l "$mnt" || exit 1; fi
rmdir "$mnt" 2>/dev/null
exit 0
`;

async function prepareFolders(paths: VolumePaths): Promise<void> {
  await fs.mkdir(path.dirname(paths.image), { recursive: true, mode: 0o700 });
  await fs.mkdir(MOUNT_ROOT, { recursive: true, mode: 0o711 });
  // mkdir does not change an existing folder's mode: the sandboxes' uids must be able to search it.
  await fs.chmod(MOUNT_ROOT, 0o711);
}

/** Makes a volume's image (sparse: it takes disk as files are written), formats and mounts it. */
export async function createImage(
  support: VolumeSupport,
  paths: VolumePaths,
  sizeMiB: number,
  gid: number,
): Promise<void> {
  const tools = support.tools;
  if (!support.available || !tools) throw new VolumeMechanismError(support.reasons.join('; '));
  await prepareFolders(paths);
  const handle = await fs.open(paths.image, 'wx', 0o600);
  try {
    await handle.truncate(sizeMiB * 1024 * 1024);
  } finally {
    await handle.close();
  }
  try {
    // -m 0: no blocks reserved for root (the API writes as root and must meet the same limit); the root
    // folder belongs to the volume's group from the start.
    await run(
      tools.mkfs,
      ['-q', '-F', '-m', '0', '-E', `root_owner=0:${gid},lazy_itable_init=1`, '-L', 'ferry-volume', paths.image],
      'mkfs.ext4',
    );
    await ensureMounted(support, paths);
    const root = paths.mountPoint;
    await fs.rmdir(path.join(root, 'lost+found')).catch(() => {});
    await fs.chown(root, 0, gid);
    await fs.chmod(root, 0o2770);
    await run(tools.setfacl, ['-m', 'g::rwx,o::-', '-d', '-m', 'u::rwx,g::rwx,m::rwx,o::-', root], 'setfacl');
  } catch (err) {
    await destroyImage(support, paths).catch(() => {});
    throw err;
  }
}

/** Mounts the volume on this machine unless it already is (any Ferry process of the machine may have). */
export async function ensureMounted(support: VolumeSupport, paths: VolumePaths): Promise<void> {
  const tools = support.tools;
  if (!support.available || !tools) throw new VolumeMechanismError(support.reasons.join('; '));
  await prepareFolders(paths);
  await run(
    tools.flock,
    [
      '-w',
      '60',
      paths.lock,
      '/bin/sh',
      '-c',
      MOUNT_SCRIPT,
      'sh',
      paths.image,
      paths.mountPoint,
      paths.host,
      await machineId(),
      tools.mountpoint,
      tools.mount,
    ],
    'mounting the volume',
  );
}

/** Unmounts and removes the image; its space is free once no running replica holds the mount. */
export async function destroyImage(support: VolumeSupport, paths: VolumePaths): Promise<void> {
  const tools = support.tools;
  if (!tools) throw new VolumeMechanismError(support.reasons.join('; '));
  await fs.mkdir(path.dirname(paths.lock), { recursive: true, mode: 0o700 });
  await run(
    tools.flock,
    [
      '-w',
      '60',
      paths.lock,
      '/bin/sh',
      '-c',
      DESTROY_SCRIPT,
      'sh',
      paths.image,
      paths.mountPoint,
      paths.host,
      tools.mountpoint,
      tools.umount,
    ],
    'deleting the volume',
  );
  await fs.rm(paths.lock, { force: true });
}

/** Unmounts a volume on this machine (it stays; the next use mounts it again). */
export async function unmountImage(support: VolumeSupport, paths: VolumePaths): Promise<void> {
  const tools = support.tools;
  if (!tools) return;
  if (!(await fs.stat(paths.lock).catch(() => null))) return;
  await run(
    tools.flock,
    ['-w', '60', paths.lock, '/bin/sh', '-c', UNMOUNT_SCRIPT, 'sh', paths.mountPoint, tools.mountpoint, tools.umount],
    'unmounting the volume',
  );
}

/** ext4's root folder is inode 2. */
const EXT4_ROOT_INODE = 2;

/**
 * Opens the volume's root folder, checking it is the mounted filesystem's root (not the empty mount point
 * of an unmounted volume). The caller closes it.
 */
export async function openMountedRoot(paths: VolumePaths): Promise<fs.FileHandle> {
  const { O_RDONLY, O_DIRECTORY, O_NOFOLLOW } = constants;
  const handle = await fs.open(paths.mountPoint, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  try {
    const [stat, parent] = await Promise.all([handle.stat(), fs.stat(path.dirname(paths.mountPoint))]);
    if (stat.ino !== EXT4_ROOT_INODE || stat.dev === parent.dev) {
      throw new VolumeMechanismError('the volume is not mounted');
    }
    return handle;
  } catch (err) {
    await handle.close();
    throw err;
  }
}

/** The mount points under MOUNT_ROOT that are mounted now (from this process's mountinfo). */
export async function mountedPoints(): Promise<Set<string>> {
  const text = await fs.readFile('/proc/self/mountinfo', 'utf8').catch(() => '');
  const points = new Set<string>();
  for (const line of text.split('\n')) {
    const target = line.split(' ')[4];
    if (target?.startsWith(`${MOUNT_ROOT}/`)) points.add(target.replace(/\\040/g, ' '));
  }
  return points;
}
