/**
 * The node's unpacked images: one root file system per image digest (`<dir>/<hex>/rootfs`), shared by
 * every replica of every build that uses that digest on this node, bounded by `FERRY_IMAGE_CACHE_MIB`.
 *
 * Content-addressed: an entry is named by the manifest digest it was unpacked from, and is complete only
 * once its `image.json` is written (a crash mid-unpack leaves a `.partial-*` folder, removed at start).
 * Two callers wanting the same digest at once share one unpack.
 *
 * Eviction is least recently used, and never takes an image in use: `acquire` pins the image until its
 * `release` is called (a replica holds it while it runs, a build while it builds), and eviction skips
 * pinned entries. An image is unpacked first and the room made after, since its size is known only
 * then: while one unpack runs, the disk may hold that one image over the bound. When the pinned images
 * alone leave no room, the new one is removed again and `FERRY_IMAGE_CACHE_FULL` says so.
 *
 * Pins are this process's: each Ferry process has a data directory, and so a cache, of its own.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import { SHA256_DIGEST } from './reference.js';

export interface CachedImage {
  digest: string;
  /** The unpacked root file system. */
  rootfs: string;
  /** File bytes of the root file system, as the bound counts them. */
  bytes: number;
  /** What the filler recorded next to it (the image's run config, for one). */
  meta: Record<string, unknown>;
}

export interface CacheUsage {
  bytes: number;
  maxBytes: number;
  images: Array<{ digest: string; bytes: number; pins: number; lastUsedMs: number }>;
}

export interface ImageCache {
  /**
   * The image `digest`, unpacked by `fill` into the empty folder it is given when the cache does not have
   * it, and pinned: it is not evicted before `release()` is called (once; later calls do nothing).
   */
  acquire(
    digest: string,
    fill: (rootfs: string) => Promise<{ bytes: number; meta?: Record<string, unknown> }>,
  ): Promise<{ image: CachedImage; release: () => void }>;
  /** The image when the cache has it (no pin, no fill). */
  peek(digest: string): CachedImage | undefined;
  /**
   * Merges `meta` into what was recorded next to the image (kept on disk with it, so a restart sees it);
   * false when the cache does not have the image.
   */
  annotate(digest: string, meta: Record<string, unknown>): Promise<boolean>;
  /** Removes an unpinned image (retention of deleted builds); false when it is pinned or absent. */
  remove(digest: string): Promise<boolean>;
  usage(): CacheUsage;
  /** Waits for the use stamps still being written (at shutdown, so a restart sees the same order). */
  close(): Promise<void>;
}

interface Entry extends CachedImage {
  pins: number;
  lastUsedMs: number;
  /** The last rewrite of its `image.json` (annotate), so that rewrites land in order. */
  writing?: Promise<void>;
}

const META_FILE = 'image.json';

/** Opens (and cleans) the cache folder `dir`; the entries found there are kept, oldest use first to go. */
export async function createImageCache(options: {
  dir: string;
  maxBytes: number;
  now?: () => number;
  /** Told before an image's folder is removed (eviction or `remove`): what links to its files lets go. */
  onDiscard?: (digest: string) => Promise<void>;
}): Promise<ImageCache> {
  const { dir, maxBytes } = options;
  const now = options.now ?? Date.now;
  await fs.mkdir(dir, { recursive: true, mode: 0o711 });
  const entries = new Map<string, Entry>();
  const filling = new Map<string, Promise<Entry>>();
  const stamping = new Set<Promise<void>>();

  for (const name of await fs.readdir(dir)) {
    const folder = path.join(dir, name);
    if (!/^[a-f0-9]{64}$/.test(name)) {
      if (name.startsWith('.partial-') || name.startsWith('.removing-'))
        await fs.rm(folder, { recursive: true, force: true });
      continue;
    }
    try {
      const metaPath = path.join(folder, META_FILE);
      const [text, st] = await Promise.all([fs.readFile(metaPath, 'utf8'), fs.stat(metaPath)]);
      const saved = JSON.parse(text) as { bytes: number; meta?: Record<string, unknown> };
      const digest = `sha256:${name}`;
      entries.set(digest, {
        digest,
        rootfs: path.join(folder, 'rootfs'),
        bytes: Number(saved.bytes) || 0,
        meta: saved.meta ?? {},
        pins: 0,
        lastUsedMs: st.mtimeMs,
      });
    } catch {
      await fs.rm(folder, { recursive: true, force: true }); // incomplete: unpacked again when wanted
    }
  }

  const total = () => [...entries.values()].reduce((sum, e) => sum + e.bytes, 0);

  async function discard(entry: Entry): Promise<void> {
    entries.delete(entry.digest);
    await options.onDiscard?.(entry.digest).catch(() => undefined);
    // Renamed first, so a crash halfway through leaves no entry that looks complete.
    const doomed = path.join(dir, `.removing-${randomBytes(6).toString('hex')}`);
    await fs.rename(path.dirname(entry.rootfs), doomed);
    await makeWritable(doomed);
    await fs.rm(doomed, { recursive: true, force: true });
  }

  /** Evicts least recently used, unpinned entries until `needed` more bytes fit; false when they cannot. */
  async function makeRoom(needed: number): Promise<boolean> {
    const victims = [...entries.values()].filter((e) => e.pins === 0).sort((a, b) => a.lastUsedMs - b.lastUsedMs);
    let used = total();
    for (const victim of victims) {
      if (used + needed <= maxBytes) break;
      await discard(victim);
      used -= victim.bytes;
    }
    return used + needed <= maxBytes;
  }

  async function fillEntry(
    digest: string,
    fill: (rootfs: string) => Promise<{ bytes: number; meta?: Record<string, unknown> }>,
  ): Promise<Entry> {
    const hex = digest.slice('sha256:'.length);
    const partial = path.join(dir, `.partial-${hex.slice(0, 12)}-${randomBytes(6).toString('hex')}`);
    const rootfs = path.join(partial, 'rootfs');
    await fs.mkdir(rootfs, { recursive: true });
    try {
      const result = await fill(rootfs);
      if (result.bytes > maxBytes || !(await makeRoom(result.bytes))) {
        throw new FerryError(
          'FERRY_IMAGE_CACHE_FULL',
          `the image needs ${mib(result.bytes)}; the images in use leave less than that of FERRY_IMAGE_CACHE_MIB (${mib(maxBytes)})`,
        );
      }
      await fs.writeFile(
        path.join(partial, META_FILE),
        JSON.stringify({ digest, bytes: result.bytes, meta: result.meta ?? {} }),
      );
      const final = path.join(dir, hex);
      await fs.rename(partial, final);
      const entry: Entry = {
        digest,
        rootfs: path.join(final, 'rootfs'),
        bytes: result.bytes,
        meta: result.meta ?? {},
        pins: 0,
        lastUsedMs: now(),
      };
      entries.set(digest, entry);
      return entry;
    } catch (err) {
      await makeWritable(partial);
      await fs.rm(partial, { recursive: true, force: true });
      throw err;
    }
  }

  function touch(entry: Entry): void {
    entry.lastUsedMs = Math.max(now(), entry.lastUsedMs + 1e-3);
    const stamp = new Date(entry.lastUsedMs);
    // Kept on disk too, so the order survives a restart; best effort.
    const write = fs
      .utimes(path.join(path.dirname(entry.rootfs), META_FILE), stamp, stamp)
      .catch(() => {})
      .finally(() => stamping.delete(write));
    stamping.add(write);
  }

  return {
    async acquire(digest, fill) {
      if (!SHA256_DIGEST.test(digest)) throw new Error(`not a sha256 digest: ${digest}`);
      let entry = entries.get(digest);
      while (!entry) {
        let pending = filling.get(digest);
        if (!pending) {
          pending = fillEntry(digest, fill).finally(() => filling.delete(digest));
          filling.set(digest, pending);
        }
        await pending;
        entry = entries.get(digest); // evicted between fill and here only if unpinned: fill again
      }
      const pinned = entry;
      pinned.pins += 1;
      touch(pinned);
      let released = false;
      return {
        image: { digest: pinned.digest, rootfs: pinned.rootfs, bytes: pinned.bytes, meta: pinned.meta },
        release() {
          if (released) return;
          released = true;
          pinned.pins -= 1;
          touch(pinned);
        },
      };
    },
    peek(digest) {
      const entry = entries.get(digest);
      return entry ? { digest: entry.digest, rootfs: entry.rootfs, bytes: entry.bytes, meta: entry.meta } : undefined;
    },
    async annotate(digest, meta) {
      const entry = entries.get(digest);
      if (!entry) return false;
      entry.meta = { ...entry.meta, ...meta };
      const folder = path.dirname(entry.rootfs);
      // Each write takes the entry's meta as it is when it runs, after the one before: the last one wins.
      const write = (entry.writing ?? Promise.resolve()).then(async () => {
        const temp = path.join(folder, `.${META_FILE}.${randomBytes(4).toString('hex')}`);
        await fs.writeFile(temp, JSON.stringify({ digest, bytes: entry.bytes, meta: entry.meta }));
        await fs.rename(temp, path.join(folder, META_FILE));
      });
      entry.writing = write.catch(() => undefined);
      await write.catch(() => undefined); // removed meanwhile: nothing left to annotate
      return entries.get(digest) === entry;
    },
    async remove(digest) {
      const entry = entries.get(digest);
      if (!entry || entry.pins > 0) return false;
      await discard(entry);
      return true;
    },
    async close() {
      await Promise.all([...stamping]);
    },
    usage() {
      return {
        bytes: total(),
        maxBytes,
        images: [...entries.values()]
          .sort((a, b) => b.lastUsedMs - a.lastUsedMs)
          .map((e) => ({ digest: e.digest, bytes: e.bytes, pins: e.pins, lastUsedMs: e.lastUsedMs })),
      };
    },
  };
}

/** Gives the owner write and search on every folder below `top`, so an image's read-only folders can be removed. */
async function makeWritable(top: string): Promise<void> {
  if (process.getuid?.() === 0) return; // root removes read-only folders as they are
  const walk = async (folder: string): Promise<void> => {
    await fs.chmod(folder, 0o700).catch(() => {});
    const children = await fs.readdir(folder, { withFileTypes: true }).catch(() => []);
    for (const child of children) if (child.isDirectory()) await walk(path.join(folder, child.name));
  };
  await walk(top);
}

function mib(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}
