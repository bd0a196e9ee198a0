/**
 * Unpacks an image's layers into a root file system, reading them as untrusted input: anyone can push an
 * image, and the layers of an image Ferry built hold what strangers' `RUN` lines left. The rules are the
 * build outputs' (`builds/build-tar.ts`), widened for what images legitimately have (symbolic links with
 * absolute targets, hard links, whiteouts):
 *
 * - A name that is absolute, has a `..` part or a NUL is refused (`FERRY_IMAGE_LAYER_UNSAFE`).
 * - Every folder on the way to an entry must be a real folder inside the root: an entry whose path passes
 *   through a symbolic link is refused, so a link planted by one entry (`etc -> /etc`, `x -> ../../..`)
 *   can never carry a later entry, of the same layer or a later one, out of the root. Links themselves
 *   are created as text and never followed while unpacking; at run time the root is the sandbox's `/`.
 * - A hard link must name a regular file already unpacked inside the root.
 * - Device nodes and FIFOs are refused; so is any other entry type.
 * - Set-user-id, set-group-id and sticky bits are dropped; files belong to Ferry's user, whoever the tar
 *   says owns them.
 * - The unpacked bytes and the entry count are bounded (`FERRY_IMAGE_TOO_LARGE`).
 * - Whiteouts (`.wh.<name>`, `.wh..wh..opq`) remove what lower layers put there, as the OCI layer
 *   format says; an opaque folder keeps what this same layer writes into it.
 *
 * Folder modes are applied at the end, so a read-only folder can still be filled by a later layer.
 *
 * Deferred work (an opaque whiteout's emptying at its layer's end, the folder modes at the end) acts on
 * what is there then, never through a link: a later entry of the same layer, or a later layer, may have
 * replaced the folder with a link to a host folder (`a/`, `a/.wh..wh..opq`, `a -> /etc` once emptied /etc).
 * Each such path is checked again component by component with lstat, and modes are set on a descriptor
 * opened with O_NOFOLLOW | O_DIRECTORY. Files are written, owned and moded through their own descriptor.
 * Ferry runs this in a sandbox of its own (layer-sandbox.ts), as an unprivileged id that can write
 * nothing but the root, so that a bug here still cannot reach the host.
 *
 * An image build's scratch root (image-builder.ts) passes `owner`: each entry then belongs to the tar's
 * uid/gid shifted into the sandbox's id range (ids outside the range become the range's first, its root),
 * and folders keep their sticky bit (`/tmp`), so the build's steps see the ownership the image says.
 */

import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { createGunzip } from 'node:zlib';
import tar from 'tar-stream';
import { FerryError } from '../errors.js';

export interface UnpackLimits {
  /** Bound of the file bytes of the whole root file system. */
  maxBytes: number;
  /** Bound of the entries of all layers together. */
  maxEntries: number;
}

export interface UnpackOptions {
  /** Host ids of the build sandbox's user namespace: entry uid/gid N becomes `first + N` (N < count). */
  owner?: { first: number; count: number };
}

export interface UnpackResult {
  /** File bytes written (hard links counted once). */
  bytes: number;
  entries: number;
}

const MAX_LABEL_CHARS = 200;
const WHITEOUT = '.wh.';
const OPAQUE = '.wh..wh..opq';

function quote(name: string): string {
  return JSON.stringify(name.length > MAX_LABEL_CHARS ? `${name.slice(0, MAX_LABEL_CHARS)}…` : name);
}

function unsafe(layer: number, message: string): FerryError {
  return new FerryError('FERRY_IMAGE_LAYER_UNSAFE', `layer ${layer}: ${message}`);
}

/** The entry's path parts (`./usr/bin/` → ['usr', 'bin']); refuses absolute, `..` and NUL. */
function partsOf(name: string, layer: number): string[] {
  if (name.includes('\0')) throw unsafe(layer, `entry ${quote(name)} has a NUL in its name`);
  if (name.startsWith('/')) throw unsafe(layer, `entry ${quote(name)} has an absolute path`);
  const parts = name.split('/').filter((p) => p !== '' && p !== '.');
  if (parts.includes('..')) throw unsafe(layer, `entry ${quote(name)} leaves the root (a ".." part)`);
  return parts;
}

/** A layer's bytes, gunzipped when they are gzip (by their magic bytes, as the media type may lie). */
async function layerStream(blob: Readable, layer: number): Promise<Readable> {
  const iterator = blob[Symbol.asyncIterator]();
  const first = await iterator.next();
  const head: Buffer = first.done ? Buffer.alloc(0) : Buffer.from(first.value as Buffer);
  if (head.length >= 4 && head.readUInt32BE(0) === 0x28b52ffd) {
    blob.destroy();
    throw new FerryError(
      'FERRY_IMAGE_UNSUPPORTED',
      `layer ${layer} is zstd-compressed; only tar and tar+gzip layers are supported`,
    );
  }
  const rest = Readable.from(
    (async function* () {
      if (head.length > 0) yield head;
      for (;;) {
        const next = await iterator.next();
        if (next.done) return;
        yield next.value as Buffer;
      }
    })(),
  );
  if (head.length >= 2 && head[0] === 0x1f && head[1] === 0x8b) return rest.pipe(createGunzip());
  return rest;
}

/**
 * Applies `layers` (opened blobs, lowest first) onto the empty folder `root`. Throws FERRY_IMAGE_LAYER_UNSAFE,
 * FERRY_IMAGE_TOO_LARGE or FERRY_IMAGE_UNSUPPORTED; the caller removes `root` then.
 */
export async function unpackLayers(
  root: string,
  layers: Array<() => Readable>,
  limits: UnpackLimits,
  options: UnpackOptions = {},
): Promise<UnpackResult> {
  const state = { bytes: 0, entries: 0, dirModes: new Map<string, number>(), owner: options.owner };
  if (options.owner) await fs.lchown(root, options.owner.first, options.owner.first);
  for (const [i, open] of layers.entries()) {
    await applyLayer(root, await layerStream(open(), i + 1), i + 1, limits, state);
  }
  // Deepest first, so a folder made read-only does not stop its children's chmod. A folder a later entry
  // replaced (with a link, a file, or a folder of its own) was dropped from dirModes by remove(); each one
  // left is checked again all the same, and changed through a descriptor opened without following a link.
  const dirs = [...state.dirModes.entries()].sort((a, b) => b[0].length - a[0].length);
  for (const [dir, mode] of dirs) {
    if (!(await isRealFolder(root, dir))) continue;
    const handle = await fs.open(dir, FOLDER_NOFOLLOW).catch(() => undefined);
    if (!handle) continue;
    try {
      if ((await handle.stat()).isDirectory()) await handle.chmod(mode);
    } finally {
      await handle.close();
    }
  }
  return { bytes: state.bytes, entries: state.entries };
}

const FOLDER_NOFOLLOW = constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW;

/**
 * Whether `dir` (below `root`) is, now, a real folder reached through real folders only: every component
 * is looked at with lstat, so a link anywhere on the way (planted after the path was first seen) says no.
 * The unpacker is the tree's only writer, so what this sees holds until the unpacker itself changes it.
 */
export async function isRealFolder(root: string, dir: string): Promise<boolean> {
  const rel = path.relative(root, dir);
  if (rel === '') return true;
  if (rel.startsWith('..') || path.isAbsolute(rel)) return false;
  let at = root;
  for (const part of rel.split(path.sep)) {
    at = path.join(at, part);
    const st = await fs.lstat(at).catch(() => undefined);
    if (!st?.isDirectory()) return false;
  }
  return true;
}

async function applyLayer(
  root: string,
  stream: Readable,
  layer: number,
  limits: UnpackLimits,
  state: {
    bytes: number;
    entries: number;
    dirModes: Map<string, number>;
    owner: UnpackOptions['owner'];
  },
): Promise<void> {
  const { owner } = state;
  const shift = (id: number | undefined) =>
    owner === undefined ? 0 : owner.first + (id !== undefined && id >= 0 && id < owner.count ? id : 0);
  /** With `owner`: the entry belongs to its (shifted) uid/gid; a link is changed, never followed. */
  const own = async (target: string, header: tar.Header) => {
    if (owner) await fs.lchown(target, shift(header.uid), shift(header.gid));
  };
  const extract = tar.extract();
  // Folders known to be real folders inside the root, cleared whenever something is removed or replaced.
  const safeDirs = new Set<string>([root]);
  // Paths this layer wrote: an opaque whiteout removes only what lower layers left.
  const written = new Set<string>();
  const opaque: string[] = [];

  /** The real folder `parts` names (made when missing), checked component by component without following links. */
  async function folder(parts: string[], name: string): Promise<string> {
    let dir = root;
    for (const part of parts) {
      const next = path.join(dir, part);
      if (!safeDirs.has(next)) {
        const st = await fs.lstat(next).catch((err: NodeJS.ErrnoException) => {
          if (err.code === 'ENOENT') return undefined;
          throw err;
        });
        if (st === undefined) {
          await fs.mkdir(next, { mode: 0o755 });
          if (owner) await fs.lchown(next, owner.first, owner.first);
          state.dirModes.set(next, 0o755);
        } else if (st.isSymbolicLink()) {
          throw unsafe(
            layer,
            `entry ${quote(name)} passes through the symbolic link ${quote(path.relative(root, next))}`,
          );
        } else if (!st.isDirectory()) {
          throw unsafe(
            layer,
            `entry ${quote(name)} lies below ${quote(path.relative(root, next))}, which is not a folder`,
          );
        }
        safeDirs.add(next);
      }
      dir = next;
    }
    return dir;
  }

  /**
   * Removes whatever is at `target` (a link is removed, never followed), and forgets every folder at or
   * below it: what replaces it (a link to a host folder, say) must never get a mode meant for the folder.
   */
  async function remove(target: string): Promise<void> {
    await fs.rm(target, { recursive: true, force: true });
    const gone = (dir: string) => dir === target || dir.startsWith(`${target}/`);
    for (const dir of safeDirs) if (gone(dir)) safeDirs.delete(dir);
    for (const dir of state.dirModes.keys()) if (gone(dir)) state.dirModes.delete(dir);
  }

  const entryLoop = (async () => {
    for await (const entry of extract) {
      const header = entry.header;
      state.entries += 1;
      if (state.entries > limits.maxEntries) {
        throw new FerryError('FERRY_IMAGE_TOO_LARGE', `the image has more than ${limits.maxEntries} entries`);
      }
      const parts = partsOf(header.name, layer);
      if (parts.length === 0) {
        entry.resume();
        continue;
      }
      const base = parts[parts.length - 1]!;
      const parent = await folder(parts.slice(0, -1), header.name);
      const target = path.join(parent, base);

      if (base === OPAQUE) {
        opaque.push(parent);
        entry.resume();
        continue;
      }
      if (base.startsWith(WHITEOUT)) {
        const hidden = base.slice(WHITEOUT.length);
        if (hidden === '' || hidden === '.' || hidden === '..')
          throw unsafe(layer, `whiteout ${quote(header.name)} is malformed`);
        await remove(path.join(parent, hidden));
        entry.resume();
        continue;
      }
      const mode = (header.mode ?? 0o644) & 0o777;
      switch (header.type) {
        case 'directory': {
          const st = await fs.lstat(target).catch(() => undefined);
          if (st && !st.isDirectory()) await remove(target);
          if (!st?.isDirectory()) await fs.mkdir(target, { mode: 0o755 });
          safeDirs.add(target);
          await own(target, header);
          state.dirModes.set(target, owner ? mode | ((header.mode ?? 0) & 0o1000) : mode);
          entry.resume();
          break;
        }
        case 'file':
        case 'contiguous-file': {
          await remove(target);
          const size = header.size ?? 0;
          if (state.bytes + size > limits.maxBytes) {
            throw new FerryError(
              'FERRY_IMAGE_TOO_LARGE',
              `the image unpacks to more than ${Math.round(limits.maxBytes / 1024 / 1024)} MiB`,
            );
          }
          state.bytes += size;
          // O_EXCL: a link put at `target` meanwhile is never written through (there is none: removed above).
          const handle = await fs.open(target, 'wx', 0o600);
          try {
            for await (const chunk of entry) await handle.write(chunk as Buffer);
            // chmod after writing: a file without its owner's write bit is still filled; after chown, which
            // would clear set-id bits (none are kept anyway). Both on the descriptor, never by path.
            if (owner) await handle.chown(shift(header.uid), shift(header.gid));
            await handle.chmod(mode);
          } finally {
            await handle.close();
          }
          break;
        }
        case 'symlink': {
          const linkname = header.linkname ?? '';
          if (linkname === '' || linkname.includes('\0'))
            throw unsafe(layer, `link ${quote(header.name)} has no target`);
          await remove(target);
          await fs.symlink(linkname, target);
          await own(target, header);
          entry.resume();
          break;
        }
        case 'link': {
          const linkParts = partsOf(header.linkname ?? '', layer);
          if (linkParts.length === 0) throw unsafe(layer, `hard link ${quote(header.name)} has no target`);
          const source = path.join(
            await folder(linkParts.slice(0, -1), header.linkname ?? ''),
            linkParts[linkParts.length - 1]!,
          );
          const st = await fs.lstat(source).catch(() => undefined);
          if (!st?.isFile()) {
            throw unsafe(
              layer,
              `hard link ${quote(header.name)} names ${quote(header.linkname ?? '')}, which is not a file unpacked before it`,
            );
          }
          await remove(target);
          await fs.link(source, target);
          entry.resume();
          break;
        }
        case 'character-device':
        case 'block-device':
          throw unsafe(layer, `entry ${quote(header.name)} is a device node`);
        case 'fifo':
          throw unsafe(layer, `entry ${quote(header.name)} is a FIFO`);
        default:
          throw unsafe(layer, `entry ${quote(header.name)} has the unsupported type ${String(header.type)}`);
      }
      for (let p = target; p !== root && !written.has(p); p = path.dirname(p)) written.add(p);
    }
  })();

  stream.on('error', (err) => extract.destroy(err));
  stream.pipe(extract);
  try {
    await entryLoop;
  } catch (err) {
    stream.destroy();
    if (err instanceof FerryError) throw err;
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'ENOSPC' || code === 'EDQUOT')
      throw new FerryError('FERRY_IMAGE_TOO_LARGE', 'the disk filled while unpacking the image', { cause: err });
    throw unsafe(layer, `the layer is not a readable tar (${code ?? (err as Error).message?.slice(0, 80) ?? 'error'})`);
  }

  for (const dir of opaque) {
    // A later entry of this layer may have replaced the folder (with a link to a host folder, say): its
    // lower contents went with it, and what is there now is not read, let alone emptied.
    if (!(await isRealFolder(root, dir))) continue;
    for (const name of await fs.readdir(dir)) {
      const child = path.join(dir, name);
      if (!written.has(child)) await remove(child);
    }
  }
}

/**
 * What the sandbox mounts over inside an image's root must exist there before it is shared read-only:
 * `/etc/resolv.conf` as a regular file (a replica's DNS settings go over it; a link there, as many images
 * have, would point bwrap elsewhere). The root is Ferry's own copy, so this changes no image. Like the
 * rest of the unpacking, it never acts through a link: `/etc` is changed through a descriptor opened with
 * O_NOFOLLOW, and the file is made with O_EXCL.
 */
export async function prepareResolvConf(rootfs: string): Promise<void> {
  const etc = path.join(rootfs, 'etc');
  let st = await fs.lstat(etc).catch(() => undefined);
  if (!st) {
    await fs.mkdir(etc, { mode: 0o755 });
    st = await fs.lstat(etc);
  }
  if (!st.isDirectory()) return; // an image whose /etc is not a folder: replicas get no resolv.conf of Ferry's
  const file = path.join(etc, 'resolv.conf');
  if ((await fs.lstat(file).catch(() => undefined))?.isFile()) return;
  const handle = await fs.open(etc, FOLDER_NOFOLLOW);
  try {
    const mode = (await handle.stat()).mode & 0o7777;
    await handle.chmod(mode | 0o700);
    try {
      await fs.rm(file, { recursive: true, force: true });
      await fs.writeFile(file, '', { mode: 0o644, flag: 'wx' });
    } finally {
      await handle.chmod(mode);
    }
  } finally {
    await handle.close();
  }
}
