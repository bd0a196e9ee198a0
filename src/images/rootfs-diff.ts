/**
 * What a build step changed in the scratch root, as an OCI layer: a snapshot of every entry's inode,
 * times, mode, owner and size before the step, compared with the root after it.
 *
 * - New or changed entries are written (a folder as its header only). The change time (ctime) moves with
 *   every write, chmod, chown, link or rename and cannot be set back from user space, so a step cannot
 *   hide a change by restoring mtime.
 * - A removed entry becomes a whiteout (`.wh.<name>`) in its folder; a folder that was replaced (another
 *   inode) gets an opaque whiteout and all its contents.
 * - Owners are written as the namespace sees them (host id less the range's first); modes keep set-id
 *   and sticky bits as the step set them (unpack.ts drops set-id bits again wherever the image is run).
 * - FIFOs, sockets and device nodes are left out (unpack.ts would refuse them).
 *
 * The root is read only after the step has ended and its cgroup was removed: nothing runs in it any more,
 * so the walk (lstat, readdir, never following a link) and the reads (O_NOFOLLOW on a path whose
 * folders were all seen as real folders by this walk) see a still tree. Links are written as their text.
 */
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { LayerWriter } from './layer-writer.js';
import type { IdRange } from './step-sandbox.js';

export interface EntryState {
  kind: 'file' | 'directory' | 'symlink' | 'other';
  ino: bigint;
  mode: number;
  uid: number;
  gid: number;
  size: bigint;
  mtimeNs: bigint;
  ctimeNs: bigint;
  nlink: bigint;
}

/** Relative path (`usr/bin/x`) → state, folders before what they hold (sorted). */
export type Snapshot = Map<string, EntryState>;

function kindOf(st: { isFile(): boolean; isDirectory(): boolean; isSymbolicLink(): boolean }): EntryState['kind'] {
  if (st.isFile()) return 'file';
  if (st.isDirectory()) return 'directory';
  if (st.isSymbolicLink()) return 'symlink';
  return 'other';
}

/** Every entry below `root` (not the root itself). */
export async function snapshotTree(root: string): Promise<Snapshot> {
  const out: Snapshot = new Map();
  const walk = async (rel: string): Promise<void> => {
    const names = (await fs.readdir(path.join(root, rel))).sort();
    for (const name of names) {
      const childRel = rel === '' ? name : `${rel}/${name}`;
      const st = await fs.lstat(path.join(root, childRel), { bigint: true });
      const state: EntryState = {
        kind: kindOf(st),
        ino: st.ino,
        mode: Number(st.mode & 0o7777n),
        uid: Number(st.uid),
        gid: Number(st.gid),
        size: st.size,
        mtimeNs: st.mtimeNs,
        ctimeNs: st.ctimeNs,
        nlink: st.nlink,
      };
      out.set(childRel, state);
      if (state.kind === 'directory') await walk(childRel);
    }
  };
  await walk('');
  return out;
}

function same(a: EntryState, b: EntryState): boolean {
  return (
    a.kind === b.kind &&
    a.ino === b.ino &&
    a.mode === b.mode &&
    a.uid === b.uid &&
    a.gid === b.gid &&
    a.size === b.size &&
    a.mtimeNs === b.mtimeNs &&
    a.ctimeNs === b.ctimeNs
  );
}

export interface DiffResult {
  /** Entries written (whiteouts included). */
  written: number;
  removed: number;
}

/**
 * Writes to `layer` what changed under `root` since `before` (the snapshot taken before the step);
 * `ignore`: paths Ferry itself made for the sandbox (mount points), left out.
 */
export async function writeRootDiff(
  root: string,
  before: Snapshot,
  layer: Pick<LayerWriter, 'add'>,
  ids: IdRange,
  ignore: readonly string[] = [],
): Promise<DiffResult> {
  const after = await snapshotTree(root);
  for (const p of ignore) {
    before.delete(p);
    after.delete(p);
  }
  const id = (host: number) => (host >= ids.first && host < ids.first + ids.count ? host - ids.first : 0);
  let written = 0;
  let removed = 0;

  // Removed entries first: a whiteout for the highest removed path only.
  const gone = new Set<string>();
  for (const p of before.keys()) {
    if (after.has(p)) continue;
    const parent = path.posix.dirname(p);
    if (parent !== '.' && gone.has(parent)) {
      gone.add(p);
      continue;
    }
    gone.add(p);
    // A parent that is now of another kind (folder → file) is rewritten whole: no whiteout below it.
    if (parent !== '.' && after.get(parent)?.kind !== 'directory') continue;
    await layer.add({
      name: parent === '.' ? `.wh.${path.posix.basename(p)}` : `${parent}/.wh.${path.posix.basename(p)}`,
      type: 'file',
      mode: 0o644,
      uid: 0,
      gid: 0,
      mtime: new Date(0),
      size: 0,
    });
    written += 1;
    removed += 1;
  }

  const replaced: string[] = [];
  const firstName = new Map<bigint, string>();
  for (const [p, state] of after) {
    const old = before.get(p);
    const underReplaced = replaced.some((dir) => p.startsWith(`${dir}/`));
    if (old && same(old, state) && !underReplaced) continue;
    if (state.kind === 'other') continue;
    const mtime = new Date(Number(state.mtimeNs / 1_000_000n));
    const common = { name: p, mode: state.mode, uid: id(state.uid), gid: id(state.gid), mtime };
    const full = path.join(root, p);
    if (state.kind === 'directory') {
      await layer.add({ ...common, type: 'directory' });
      written += 1;
      if (old && (old.kind !== 'directory' || old.ino !== state.ino) && !underReplaced) {
        replaced.push(p);
        await layer.add({ name: `${p}/.wh..wh..opq`, type: 'file', mode: 0o644, uid: 0, gid: 0, mtime, size: 0 });
        written += 1;
      }
    } else if (state.kind === 'symlink') {
      await layer.add({ ...common, type: 'symlink', linkname: await fs.readlink(full) });
      written += 1;
    } else {
      const earlier = state.nlink > 1n ? firstName.get(state.ino) : undefined;
      if (earlier !== undefined) {
        await layer.add({ ...common, type: 'link', linkname: earlier });
      } else {
        if (state.nlink > 1n) firstName.set(state.ino, p);
        const handle = await fs.open(full, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
        try {
          const st = await handle.stat({ bigint: true });
          if (!st.isFile() || st.ino !== state.ino) throw new Error(`the build root changed under ${p}`);
          await layer.add(
            { ...common, type: 'file', size: Number(st.size) },
            handle.createReadStream({ autoClose: false }),
          );
        } finally {
          await handle.close();
        }
      }
      written += 1;
    }
  }
  return { written, removed };
}

/**
 * A snapshot as JSON, for the diff's sandboxed process (layer-sandbox.ts), with owners as that process's
 * namespace sees them: host ids of `ids` become `n`, any other the kernel's overflow id.
 */
export function snapshotJson(snapshot: Snapshot, ids: IdRange): string {
  const inside = (id: number) => (id >= ids.first && id < ids.first + ids.count ? id - ids.first : OVERFLOW_ID);
  const entries = [...snapshot].map(([p, s]) => [
    p,
    {
      ...s,
      uid: inside(s.uid),
      gid: inside(s.gid),
      ino: String(s.ino),
      size: String(s.size),
      mtimeNs: String(s.mtimeNs),
      ctimeNs: String(s.ctimeNs),
      nlink: String(s.nlink),
    },
  ]);
  return JSON.stringify(entries);
}

/** The snapshot snapshotJson wrote. */
export function snapshotFromJson(text: string): Snapshot {
  const entries = JSON.parse(text) as Array<[string, Record<string, string | number>]>;
  return new Map(
    entries.map(([p, s]) => [
      p,
      {
        kind: s.kind as EntryState['kind'],
        mode: Number(s.mode),
        uid: Number(s.uid),
        gid: Number(s.gid),
        ino: BigInt(s.ino!),
        size: BigInt(s.size!),
        mtimeNs: BigInt(s.mtimeNs!),
        ctimeNs: BigInt(s.ctimeNs!),
        nlink: BigInt(s.nlink!),
      },
    ]),
  );
}

/** The id an unmapped owner has inside a user namespace (/proc/sys/kernel/overflowuid). */
const OVERFLOW_ID = 65_534;
