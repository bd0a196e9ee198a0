/**
 * Paths inside an unpacked image, looked up from the host the way the image itself would see them: a
 * symbolic link is followed with the image's root as `/` (an absolute target `/bin/busybox` means the
 * image's own, never the host's), and no lookup ever leaves the root. The build uses this to check a
 * custom entrypoint and to find an image's `python3` without running anything of the image.
 */
import fs from 'node:fs/promises';
import path from 'node:path';

/** Links followed in one lookup at most (Linux's own bound, MAXSYMLINKS). */
const MAX_LINKS = 40;

/**
 * The host path of `name` (absolute, as the image sees it) inside the image rooted at `root`, with every
 * link resolved inside the root; undefined when it does not exist or loops. `..` stops at the root.
 */
export async function resolveInRoot(root: string, name: string): Promise<string | undefined> {
  const pending = name.split('/').filter((p) => p !== '' && p !== '.');
  const done: string[] = [];
  let links = 0;
  while (pending.length > 0) {
    const part = pending.shift()!;
    if (part === '..') {
      done.pop();
      continue;
    }
    const host = path.join(root, ...done, part);
    const st = await fs.lstat(host).catch(() => undefined);
    if (!st) return undefined;
    if (st.isSymbolicLink()) {
      if (++links > MAX_LINKS) return undefined;
      const target = await fs.readlink(host);
      const parts = target.split('/').filter((p) => p !== '' && p !== '.');
      if (target.startsWith('/')) done.length = 0;
      pending.unshift(...parts);
      continue;
    }
    if (pending.length > 0 && !st.isDirectory()) return undefined;
    done.push(part);
  }
  return path.join(root, ...done);
}

/** The image path (`/usr/bin/python3`) as the resolved host path shows it, for messages and argv. */
export function imagePathOf(root: string, host: string): string {
  return `/${path.relative(root, host).split(path.sep).join('/')}`;
}

/** Whether `name` in the image is a regular file with an exec bit (links followed inside the root). */
export async function isImageExecutable(root: string, name: string): Promise<boolean> {
  const host = await resolveInRoot(root, name);
  if (!host) return false;
  const st = await fs.stat(host).catch(() => undefined);
  return st?.isFile() === true && (st.mode & 0o111) !== 0;
}

/** The first `<dir>/<command>` of `searchPath` that is executable in the image, as the image names it. */
export async function findInImage(
  root: string,
  command: string,
  searchPath: readonly string[],
): Promise<string | undefined> {
  for (const dir of searchPath) {
    const candidate = path.posix.join(dir, command);
    if (await isImageExecutable(root, candidate)) return candidate;
  }
  return undefined;
}
