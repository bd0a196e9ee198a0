/**
 * `COPY` and `ADD` sources, read from the build context (the app folder) by Ferry itself, which may read
 * any host file: so nothing in the context may lead it out.
 *
 * - A source is a path relative to the context. An absolute path, or one whose `..` parts climb out,
 *   is refused (`FERRY_IMAGE_CONTEXT_ESCAPE`) before anything opens: `COPY /etc/shadow /x` never reads
 *   the host's file.
 * - Each component is opened from the folder before it (`/proc/self/fd/<folder fd>/<name>`, so the
 *   kernel looks the name up in that very folder) with O_NOFOLLOW: a source that is, or passes through,
 *   a symbolic link is refused, never followed, and no race can swap a link in after a check.
 * - A copied folder is walked the same way; a link inside it is copied as a link (its text), which at run
 *   time resolves inside the image, never on the host. FIFOs, sockets and devices are skipped (a FIFO is
 *   opened O_NONBLOCK, so it cannot stall the build). A file's bytes are read from the descriptor that
 *   was checked (fstat: a regular file).
 *
 * `CONTEXT_DEFENCES` switch the checks off for the attack tests only (each test fails when its defence is
 * off); Ferry never changes them.
 */
import { createHash } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import type { LayerWriter } from './layer-writer.js';

const { O_RDONLY, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK } = constants;

/** Test switches (never set in Ferry): each reproduces the hole it closes. */
export const CONTEXT_DEFENCES = { refuseEscape: true, noFollow: true };

const MAX_SOURCE_ENTRIES = 200_000;

export interface CopySpec {
  sources: string[];
  /** Absolute destination in the image (WORKDIR already applied); a trailing `/` means "into this folder". */
  dest: string;
  uid: number;
  gid: number;
  /** For messages: `step 3/7 (COPY app.py /app/)`. */
  label: string;
}

interface Found {
  /** Path in the image, relative (`app/main.py`). */
  name: string;
  type: 'file' | 'directory' | 'symlink';
  mode: number;
  mtime: Date;
  size: number;
  linkname?: string;
  /** Files: the open handle (closed by the visitor's caller). */
  handle?: fs.FileHandle;
}

function outside(label: string, source: string, why: string): FerryError {
  return new FerryError(
    'FERRY_IMAGE_CONTEXT_ESCAPE',
    `${label}: the source ${JSON.stringify(source.slice(0, 200))} ${why}; COPY and ADD take files of the app folder only`,
  );
}

function at(fd: number, name?: string): string {
  return name === undefined ? `/proc/self/fd/${fd}` : `/proc/self/fd/${fd}/${name}`;
}

/** The source's components inside the context; refuses absolute paths and climbing out. */
function sourceParts(source: string, label: string): string[] {
  if (source.includes('\0')) throw outside(label, source, 'has a NUL character');
  if (CONTEXT_DEFENCES.refuseEscape && source.startsWith('/')) throw outside(label, source, 'is an absolute path');
  const parts: string[] = [];
  for (const part of source.split('/')) {
    if (part === '' || part === '.') continue;
    if (part === '..') {
      if (parts.length === 0 && CONTEXT_DEFENCES.refuseEscape) throw outside(label, source, 'leaves the app folder');
      parts.pop();
      continue;
    }
    parts.push(part);
  }
  return parts;
}

function hasGlob(part: string): boolean {
  return /[*?[]/.test(part);
}

function globToRegExp(glob: string): RegExp {
  let out = '^';
  for (const ch of glob) {
    if (ch === '*') out += '[^/]*';
    else if (ch === '?') out += '[^/]';
    else out += ch.replace(/[.+^${}()|[\]\\]/g, '\\$&');
  }
  return new RegExp(`${out}$`);
}

/**
 * Visits every entry the COPY brings into the image, in order (a folder before its contents). Throws
 * FERRY_IMAGE_CONTEXT_ESCAPE, or FERRY_IMAGE_STEP_FAILED when a source is missing.
 */
async function visitSources(context: string, spec: CopySpec, visit: (entry: Found) => Promise<void>): Promise<void> {
  const rootPath = CONTEXT_DEFENCES.refuseEscape ? context : '/';
  const root = await fs.open(rootPath, O_RDONLY | O_DIRECTORY);
  let count = 0;
  const counted = () => {
    count += 1;
    if (count > MAX_SOURCE_ENTRIES) {
      throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${spec.label}: copies more than ${MAX_SOURCE_ENTRIES} entries`);
    }
  };
  const destParts = spec.dest.split('/').filter((p) => p !== '' && p !== '.');
  if (destParts.includes('..')) {
    throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', `${spec.label}: the destination has a ".." part`);
  }
  const destIsDir = spec.dest.endsWith('/') || spec.sources.length > 1;
  const noFollow = CONTEXT_DEFENCES.noFollow ? O_NOFOLLOW : 0;
  try {
    for (const source of spec.sources) {
      let parts = sourceParts(source, spec.label);
      if (!CONTEXT_DEFENCES.refuseEscape) parts = [...path.resolve(context, source).split('/').filter(Boolean)];
      // Folders on the way: real folders, opened one from the other.
      const globbed = parts.length > 0 && hasGlob(parts[parts.length - 1]!);
      const folders = globbed ? parts.slice(0, -1) : parts.slice(0, -1);
      let dir = root;
      const opened: fs.FileHandle[] = [];
      try {
        for (const part of folders) {
          if (hasGlob(part)) {
            throw new FerryError(
              'FERRY_IMAGE_DOCKERFILE_INVALID',
              `${spec.label}: wildcards are supported in the last part of a source only`,
            );
          }
          dir = await openChild(dir, part, O_DIRECTORY | noFollow, spec.label, source);
          opened.push(dir);
        }
        let names: string[];
        if (parts.length === 0) names = [];
        else if (globbed) {
          const re = globToRegExp(parts[parts.length - 1]!);
          names = (await fs.readdir(at(dir.fd))).filter((n) => re.test(n)).sort();
          if (names.length === 0) {
            throw new FerryError(
              'FERRY_IMAGE_STEP_FAILED',
              `${spec.label}: no file of the app folder matches ${source}`,
            );
          }
        } else names = [parts[parts.length - 1]!];

        if (parts.length === 0) {
          // The context itself: its contents go into dest.
          await walkFolder(root, destParts, visit, counted, noFollow);
          continue;
        }
        for (const name of names) {
          const handle = await openChild(dir, name, O_NONBLOCK | noFollow, spec.label, source);
          const st = await handle.stat();
          if (st.isDirectory()) {
            try {
              if (destParts.length > 0) {
                counted();
                await visit({ name: destParts.join('/'), type: 'directory', mode: 0o755, mtime: st.mtime, size: 0 });
              }
              await walkFolder(handle, destParts, visit, counted, noFollow);
            } finally {
              await handle.close();
            }
          } else if (st.isFile()) {
            const target = destIsDir || globbed ? [...destParts, name] : destParts;
            if (target.length === 0) {
              await handle.close();
              throw new FerryError('FERRY_IMAGE_DOCKERFILE_INVALID', `${spec.label}: cannot copy a file onto /`);
            }
            counted();
            try {
              await visit({
                name: target.join('/'),
                type: 'file',
                mode: st.mode & 0o777,
                mtime: st.mtime,
                size: st.size,
                handle,
              });
            } finally {
              await handle.close();
            }
          } else {
            await handle.close();
            throw new FerryError(
              'FERRY_IMAGE_STEP_FAILED',
              `${spec.label}: the source ${JSON.stringify(source)} is not a file or folder`,
            );
          }
        }
      } finally {
        for (const handle of opened.reverse()) await handle.close();
      }
    }
  } finally {
    await root.close();
  }
}

async function openChild(
  dir: fs.FileHandle,
  name: string,
  flags: number,
  label: string,
  source: string,
): Promise<fs.FileHandle> {
  try {
    return await fs.open(at(dir.fd, name), O_RDONLY | flags);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    // A link opened with O_NOFOLLOW: ELOOP, or ENOTDIR where a folder was asked for.
    const link =
      code === 'ELOOP' ||
      (code === 'ENOTDIR' && (await fs.lstat(at(dir.fd, name)).catch(() => null))?.isSymbolicLink());
    if (link) throw outside(label, source, 'is or passes through a symbolic link');
    if (code === 'ENOENT') {
      throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${label}: the app folder has no ${JSON.stringify(source)}`);
    }
    if (code === 'ENOTDIR') {
      throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${label}: ${JSON.stringify(source)} is not below a folder`);
    }
    throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${label}: cannot read ${JSON.stringify(source)} (${code})`);
  }
}

async function walkFolder(
  dir: fs.FileHandle,
  prefix: string[],
  visit: (entry: Found) => Promise<void>,
  counted: () => void,
  noFollow: number,
): Promise<void> {
  const names = (await fs.readdir(at(dir.fd))).sort();
  for (const name of names) {
    const st = await fs.lstat(at(dir.fd, name));
    const target = [...prefix, name].join('/');
    if (st.isSymbolicLink()) {
      counted();
      await visit({
        name: target,
        type: 'symlink',
        mode: 0o777,
        mtime: st.mtime,
        size: 0,
        linkname: await fs.readlink(at(dir.fd, name)),
      });
    } else if (st.isDirectory()) {
      const child = await fs.open(at(dir.fd, name), O_RDONLY | O_DIRECTORY | noFollow);
      try {
        counted();
        await visit({ name: target, type: 'directory', mode: st.mode & 0o777, mtime: st.mtime, size: 0 });
        await walkFolder(child, [...prefix, name], visit, counted, noFollow);
      } finally {
        await child.close();
      }
    } else if (st.isFile()) {
      const handle = await fs.open(at(dir.fd, name), O_RDONLY | O_NONBLOCK | noFollow).catch(() => null);
      if (!handle) continue; // replaced by a link since the lstat: never followed
      try {
        const fst = await handle.stat();
        if (!fst.isFile()) continue;
        counted();
        await visit({ name: target, type: 'file', mode: fst.mode & 0o777, mtime: fst.mtime, size: fst.size, handle });
      } finally {
        await handle.close();
      }
    }
    // FIFOs, sockets and devices: not copied.
  }
}

/** A digest of everything the COPY would bring (names, kinds, modes, bytes): the step's cache key part. */
export async function hashCopySources(context: string, spec: CopySpec): Promise<string> {
  const hash = createHash('sha256');
  hash.update(JSON.stringify([spec.sources, spec.dest, spec.uid, spec.gid]));
  await visitSources(context, spec, async (entry) => {
    hash.update(`\0${entry.type}\0${entry.name}\0${entry.mode}\0${entry.linkname ?? ''}\0${entry.size}\0`);
    if (entry.handle) {
      for await (const chunk of entry.handle.createReadStream({ autoClose: false, start: 0 })) hash.update(chunk);
    }
  });
  return hash.digest('hex');
}

/** Writes the COPY's entries into `layer`. */
export async function writeCopyLayer(context: string, spec: CopySpec, layer: LayerWriter): Promise<number> {
  let entries = 0;
  await visitSources(context, spec, async (entry) => {
    entries += 1;
    const common = { name: entry.name, mode: entry.mode, uid: spec.uid, gid: spec.gid, mtime: entry.mtime };
    if (entry.type === 'file') {
      await layer.add(
        { ...common, type: 'file', size: entry.size },
        entry.handle!.createReadStream({ autoClose: false, start: 0 }),
      );
    } else if (entry.type === 'symlink') await layer.add({ ...common, type: 'symlink', linkname: entry.linkname! });
    else await layer.add({ ...common, type: 'directory' });
  });
  return entries;
}
