/**
 * What an image build reads and makes in a build's scratch root and its context from the server's side,
 * as root: never through a link. A file is opened component by component from the folder before it with
 * O_NOFOLLOW; folders are made only where lstat finds nothing, and the walk stops at a link (bwrap, inside
 * the sandbox, resolves the rest). Used by image-builder.ts while no step runs in the root.
 */
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import type { IdRange } from './step-sandbox.js';

/**
 * A regular file below `root` (`parts`), each component opened from the one before with O_NOFOLLOW;
 * null when it is not there. Throws FERRY_IMAGE_DOCKERFILE_INVALID past `max` bytes.
 */
export async function readFileNoFollow(root: string, parts: string[], max: number): Promise<string | null> {
  const { O_RDONLY, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK } = constants;
  const handles: fs.FileHandle[] = [];
  try {
    let dir = await fs.open(root, O_RDONLY | O_DIRECTORY);
    handles.push(dir);
    for (const part of parts.slice(0, -1)) {
      dir = await fs.open(`/proc/self/fd/${dir.fd}/${part}`, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      handles.push(dir);
    }
    const file = await fs.open(
      `/proc/self/fd/${dir.fd}/${parts[parts.length - 1]}`,
      O_RDONLY | O_NOFOLLOW | O_NONBLOCK,
    );
    handles.push(file);
    const st = await file.stat();
    if (!st.isFile()) return null;
    if (st.size > max) throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', 'the file is larger than 1 MiB');
    return (await file.readFile()).toString('utf8');
  } finally {
    for (const handle of handles.reverse()) await handle.close();
  }
}

/** USER as ids inside the namespace: numbers as they are, names from the image's /etc/passwd and /etc/group. */
export async function resolveUser(
  rootfs: string,
  user: string | undefined,
  what: string,
): Promise<{ uid: number; gid: number }> {
  if (user === undefined || user === '') return { uid: 0, gid: 0 };
  const [name, group] = user.split(':') as [string, string | undefined];
  const lookup = async (file: string, key: string): Promise<{ id: number; gid: number } | null> => {
    const text = await readFileNoFollow(rootfs, ['etc', file], 4 * 1024 * 1024).catch(() => null);
    for (const line of (text ?? '').split('\n')) {
      const fields = line.split(':');
      if (fields[0] === key && fields.length >= 4) return { id: Number(fields[2]), gid: Number(fields[3]) };
    }
    return null;
  };
  let uid: number;
  let gid: number;
  if (/^\d+$/.test(name)) {
    uid = Number(name);
    gid = uid;
  } else {
    // `root` is uid 0 even in an image without /etc/passwd (busybox, scratch), as Docker and runc have it.
    const found = (await lookup('passwd', name)) ?? (name === 'root' ? { id: 0, gid: 0 } : null);
    if (!found) throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${what}: USER ${name}: the image has no such user`);
    uid = found.id;
    gid = found.gid;
  }
  if (group !== undefined) {
    if (/^\d+$/.test(group)) gid = Number(group);
    else {
      const found = await lookup('group', group);
      if (!found) throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${what}: USER ${user}: the image has no such group`);
      gid = found.id;
    }
  }
  if (!Number.isSafeInteger(uid) || uid > 65_535 || !Number.isSafeInteger(gid) || gid > 65_535) {
    throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${what}: USER ${user}: ids above 65535 are not supported`);
  }
  return { uid, gid };
}

/**
 * Makes the missing folders of `workdir` in the scratch root, never following a link: at a link (or
 * anything not a folder) it stops, and bwrap's --chdir, inside the sandbox, resolves the rest.
 */
export async function makeWorkdir(rootfs: string, workdir: string, ids: IdRange): Promise<void> {
  let dir = rootfs;
  for (const part of workdir.split('/').filter((p) => p !== '' && p !== '.')) {
    if (part === '..') return;
    const next = path.join(dir, part);
    const st = await fs.lstat(next).catch(() => null);
    if (st === null) {
      await fs.mkdir(next, { mode: 0o755 });
      await fs.lchown(next, ids.first, ids.first);
    } else if (!st.isDirectory()) return;
    dir = next;
  }
}
