/**
 * The API's and CLI's reads and writes of files in a volume, done as root on the host on behalf of a
 * caller, in a folder a function fills as it likes. Nothing a function plants may lead them out:
 *
 * - Paths are split into components; `..`, NUL and over-long components are refused before anything opens.
 * - Each component is opened from the folder before it (`/proc/self/fd/<folder fd>/<name>`: the kernel looks
 *   the name up in that very folder, whatever was renamed meanwhile) with O_NOFOLLOW | O_DIRECTORY: a
 *   symbolic link anywhere on the way is refused, never followed, and no race can swap one in afterwards.
 * - A file is opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat on the open descriptor: only a
 *   regular file with one link is read. A FIFO opens without blocking and is refused; a device node does
 *   not open at all (the volume is mounted nodev) and is refused anyway; a hard link (nlink > 1) is
 *   refused (links cannot leave the volume's own filesystem, but a reader never relies on one check).
 * - An upload is written to a fresh temporary name (O_CREAT | O_EXCL) and renamed over the target, which
 *   replaces a link, FIFO or device in its place rather than writing through it; a rename is atomic, so a
 *   reader sees the old file or the whole new one, and an interrupted copy leaves no partial file.
 * - A recursive delete walks folders through descriptors too, and unlinks links rather than following them.
 *
 * `test/security/volume-attacks.test.ts` plants each of these and fails when a defence is switched off
 * (`VOLUME_DEFENCES`, test only).
 */
import { randomBytes } from 'node:crypto';
import fsSync, { constants } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import type { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { FerryError } from '../errors.js';

const { EDQUOT } = os.constants.errno;
const { O_RDONLY, O_WRONLY, O_CREAT, O_EXCL, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK, O_NOCTTY } = constants;

/** Switches for the attack tests only: each one off reproduces the hole it closes. Never set in Ferry. */
export const VOLUME_DEFENCES = { noFollow: true, regularOnly: true, singleLink: true, renameUploads: true };

export const MAX_PATH_BYTES = 4096;
const MAX_NAME_BYTES = 255;
/** Entries a listing answers with at most (`truncated` says there were more). */
export const MAX_LIST_ENTRIES = 10_000;
const TEMP_PREFIX = '.ferry-upload-';

/** The components of a path inside a volume; `""` and `/` are the root. Throws FERRY_VOLUME_PATH_INVALID. */
export function splitVolumePath(text: string): string[] {
  if (text.includes('\0') || Buffer.byteLength(text) > MAX_PATH_BYTES) {
    throw new FerryError('FERRY_VOLUME_PATH_INVALID');
  }
  const parts = text.split('/').filter((p) => p !== '' && p !== '.');
  for (const part of parts) {
    if (part === '..') throw new FerryError('FERRY_VOLUME_PATH_INVALID', `The path ${text} has a ".." component`);
    if (Buffer.byteLength(part) > MAX_NAME_BYTES) {
      throw new FerryError('FERRY_VOLUME_PATH_INVALID', `A component of ${text} is longer than 255 bytes`);
    }
  }
  return parts;
}

/** A path that reaches `name` in the folder open on `fd`, without resolving anything before it again. */
function at(fd: number, name?: string): string {
  return name === undefined ? `/proc/self/fd/${fd}` : `/proc/self/fd/${fd}/${name}`;
}

function code(err: unknown): string | undefined {
  return (err as NodeJS.ErrnoException).code;
}

function notFound(parts: string[]): FerryError {
  return new FerryError('FERRY_VOLUME_FILE_NOT_FOUND', `Nothing at /${parts.join('/')} in the volume`);
}

function refused(parts: string[], what: string): FerryError {
  return new FerryError(
    'FERRY_VOLUME_FILE_REFUSED',
    `/${parts.join('/')} is ${what}: Ferry does not read or follow it`,
  );
}

/** Opens the folder `name` in the folder `dirFd`, never through a link. */
async function openChildDir(dirFd: number, name: string, parts: string[]): Promise<fs.FileHandle> {
  const flags = O_RDONLY | O_DIRECTORY | (VOLUME_DEFENCES.noFollow ? O_NOFOLLOW : 0);
  try {
    return await fs.open(at(dirFd, name), flags);
  } catch (err) {
    const c = code(err);
    if (c === 'ENOENT') throw notFound(parts);
    if (c === 'ELOOP') throw refused(parts, 'a symbolic link');
    if (c === 'ENOTDIR') {
      const stat = await fs.lstat(at(dirFd, name)).catch(() => null);
      if (stat?.isSymbolicLink()) throw refused(parts, 'a symbolic link');
      throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', `/${parts.join('/')} is not a folder`);
    }
    throw err;
  }
}

/**
 * Walks `parts` from the root folder (open on `rootFd`), folder by folder; with `create`, makes missing
 * folders. Returns the last folder, open (the caller closes it; it is never `rootFd` itself).
 */
async function walk(rootFd: number, parts: string[], create = false): Promise<fs.FileHandle> {
  let current = await fs.open(at(rootFd), O_RDONLY | O_DIRECTORY);
  try {
    for (let i = 0; i < parts.length; i++) {
      const name = parts[i]!;
      const shown = parts.slice(0, i + 1);
      let next: fs.FileHandle;
      try {
        next = await openChildDir(current.fd, name, shown);
      } catch (err) {
        if (!(create && err instanceof FerryError && err.code === 'FERRY_VOLUME_FILE_NOT_FOUND')) throw err;
        // mkdir never follows a link in its last component (it fails with EEXIST instead).
        await fs.mkdir(at(current.fd, name), 0o2770).catch((e: unknown) => {
          if (code(e) !== 'EEXIST') throw e;
        });
        next = await openChildDir(current.fd, name, shown);
      }
      await current.close();
      current = next;
    }
    return current;
  } catch (err) {
    await current.close().catch(() => {});
    throw err;
  }
}

export interface VolumeEntry {
  name: string;
  type: 'file' | 'folder' | 'link' | 'other';
  size: number;
  modified_at: string;
}

/** The entries of a folder, by name; links and special files are listed as such, never followed. */
export async function listFolder(
  rootFd: number,
  parts: string[],
): Promise<{ entries: VolumeEntry[]; truncated: boolean }> {
  const dir = await walk(rootFd, parts);
  try {
    const names = (await fs.readdir(at(dir.fd))).filter((n) => !n.startsWith(TEMP_PREFIX)).sort();
    const truncated = names.length > MAX_LIST_ENTRIES;
    const entries: VolumeEntry[] = [];
    for (const name of names.slice(0, MAX_LIST_ENTRIES)) {
      const stat = await fs.lstat(at(dir.fd, name)).catch(() => null);
      if (!stat) continue;
      const type = stat.isFile() ? 'file' : stat.isDirectory() ? 'folder' : stat.isSymbolicLink() ? 'link' : 'other';
      entries.push({ name, type, size: type === 'file' ? stat.size : 0, modified_at: stat.mtime.toISOString() });
    }
    return { entries, truncated };
  } finally {
    await dir.close();
  }
}

/**
 * Opens a regular file for reading. The caller streams it (`createReadStream(null, {fd})` closes it) and
 * knows its size. Refuses links, FIFOs, devices, sockets and hard-linked files.
 */
export async function openFileForRead(
  rootFd: number,
  parts: string[],
): Promise<{ handle: fs.FileHandle; size: number }> {
  if (parts.length === 0) throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', 'The root of the volume is a folder');
  const dir = await walk(rootFd, parts.slice(0, -1));
  let handle: fs.FileHandle;
  try {
    const flags =
      O_RDONLY |
      O_NOCTTY |
      (VOLUME_DEFENCES.noFollow ? O_NOFOLLOW : 0) |
      (VOLUME_DEFENCES.regularOnly ? O_NONBLOCK : 0);
    try {
      handle = await fs.open(at(dir.fd, parts.at(-1)!), flags);
    } catch (err) {
      const c = code(err);
      if (c === 'ENOENT') throw notFound(parts);
      if (c === 'ELOOP') throw refused(parts, 'a symbolic link');
      // nodev: a device node does not open (EACCES); nor does a socket (ENXIO).
      if (c === 'EACCES' || c === 'ENXIO' || c === 'EPERM') throw refused(parts, 'a device node or socket');
      throw err;
    }
  } finally {
    await dir.close();
  }
  try {
    const stat = await handle.stat();
    if (stat.isDirectory()) throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', `/${parts.join('/')} is a folder`);
    if (VOLUME_DEFENCES.regularOnly && !stat.isFile()) throw refused(parts, 'not a regular file');
    if (VOLUME_DEFENCES.singleLink && stat.nlink > 1) throw refused(parts, 'a file with more than one hard link');
    return { handle, size: stat.size };
  } catch (err) {
    await handle.close();
    throw err;
  }
}

/**
 * Writes `body` to `parts` (folders made as needed): to a temporary file first, renamed over the target
 * once complete. ENOSPC or EDQUOT (the volume's size) is FERRY_VOLUME_FULL, and the partial file is removed.
 */
export async function writeFile(rootFd: number, parts: string[], body: Readable): Promise<{ bytes: number }> {
  if (parts.length === 0)
    throw new FerryError('FERRY_VOLUME_PATH_INVALID', 'An upload needs a file path, not the root');
  const dir = await walk(rootFd, parts.slice(0, -1), true);
  const name = parts.at(-1)!;
  const temp = VOLUME_DEFENCES.renameUploads ? `${TEMP_PREFIX}${randomBytes(8).toString('hex')}` : name;
  const flags = VOLUME_DEFENCES.renameUploads
    ? O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW
    : O_WRONLY | O_CREAT | fsSync.constants.O_TRUNC;
  let bytes = 0;
  try {
    const existing = await fs.lstat(at(dir.fd, name)).catch(() => null);
    if (existing?.isDirectory()) {
      throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', `/${parts.join('/')} is a folder: upload to a path inside it`);
    }
    const handle = await fs.open(at(dir.fd, temp), flags, 0o660);
    try {
      // The stream closes the descriptor once written (pipeline waits for that close).
      const out = handle.createWriteStream();
      body.on('data', (chunk: Buffer) => {
        bytes += chunk.length;
      });
      await pipeline(body, out);
    } catch (err) {
      await handle.close().catch(() => {});
      if (VOLUME_DEFENCES.renameUploads) await fs.unlink(at(dir.fd, temp)).catch(() => {});
      // EDQUOT: a folder's quota (quota-dirs.ts); Node names it UNKNOWN, so by its number.
      if (code(err) === 'ENOSPC' || code(err) === 'EDQUOT' || (err as NodeJS.ErrnoException).errno === -EDQUOT) {
        throw new FerryError('FERRY_VOLUME_FULL', `The volume has no room left for /${parts.join('/')}`, {
          cause: err,
        });
      }
      throw err;
    }
    await handle.close();
    if (VOLUME_DEFENCES.renameUploads) {
      try {
        await fs.rename(at(dir.fd, temp), at(dir.fd, name));
      } catch (err) {
        await fs.unlink(at(dir.fd, temp)).catch(() => {});
        if (code(err) === 'EISDIR' || code(err) === 'ENOTEMPTY' || code(err) === 'EEXIST') {
          throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', `/${parts.join('/')} is a folder`);
        }
        throw err;
      }
    }
    return { bytes };
  } finally {
    await dir.close();
  }
}

/** Removes a file, link or empty folder; with `recursive`, a folder and all in it (links are removed, not followed). */
export async function removePath(rootFd: number, parts: string[], recursive: boolean): Promise<void> {
  if (parts.length === 0) {
    if (!recursive) throw new FerryError('FERRY_VOLUME_PATH_CONFLICT', 'The root is a folder: use recursive=true');
    const root = await walk(rootFd, []);
    try {
      await emptyFolder(root.fd);
    } finally {
      await root.close();
    }
    return;
  }
  const dir = await walk(rootFd, parts.slice(0, -1));
  try {
    const name = parts.at(-1)!;
    const stat = await fs.lstat(at(dir.fd, name)).catch(() => null);
    if (!stat) throw notFound(parts);
    if (!stat.isDirectory()) {
      await fs.unlink(at(dir.fd, name));
      return;
    }
    if (!recursive) {
      await fs.rmdir(at(dir.fd, name)).catch((err: unknown) => {
        if (code(err) === 'ENOTEMPTY' || code(err) === 'EEXIST') {
          throw new FerryError(
            'FERRY_VOLUME_PATH_CONFLICT',
            `/${parts.join('/')} is a folder that is not empty: use recursive=true`,
          );
        }
        throw err;
      });
      return;
    }
    await removeTree(dir.fd, name);
  } finally {
    await dir.close();
  }
}

/** Removes `name` in the folder `dirFd`: a folder through its descriptor, anything else by unlinking it. */
async function removeTree(dirFd: number, name: string): Promise<void> {
  let child: fs.FileHandle;
  try {
    child = await fs.open(at(dirFd, name), O_RDONLY | O_DIRECTORY | (VOLUME_DEFENCES.noFollow ? O_NOFOLLOW : 0));
  } catch (err) {
    // A link (ELOOP), or a file that replaced the folder meanwhile (ENOTDIR): its name goes, nothing else.
    if (code(err) === 'ELOOP' || code(err) === 'ENOTDIR') {
      await fs.unlink(at(dirFd, name));
      return;
    }
    if (code(err) === 'ENOENT') return;
    throw err;
  }
  try {
    await emptyFolder(child.fd);
  } finally {
    await child.close();
  }
  await fs.rmdir(at(dirFd, name)).catch((err: unknown) => {
    if (code(err) !== 'ENOENT') throw err;
  });
}

async function emptyFolder(fd: number): Promise<void> {
  for (const entry of await fs.readdir(at(fd), { withFileTypes: true })) {
    if (entry.isDirectory()) await removeTree(fd, entry.name);
    else
      await fs.unlink(at(fd, entry.name)).catch(async (err: unknown) => {
        // A folder that replaced the entry meanwhile.
        if (code(err) === 'EISDIR' || code(err) === 'EPERM') await removeTree(fd, entry.name);
        else if (code(err) !== 'ENOENT') throw err;
      });
  }
}

/** Bytes used and free in the volume's filesystem. */
export async function volumeUsage(rootFd: number): Promise<{ used_bytes: number; free_bytes: number }> {
  const s = await fs.statfs(at(rootFd));
  return { used_bytes: (s.blocks - s.bfree) * s.bsize, free_bytes: s.bavail * s.bsize };
}
