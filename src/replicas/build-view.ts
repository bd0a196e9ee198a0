/**
 * Build views: a copy of each build folder made of hard links, in a per-server folder outside the data
 * directory, which is what the sandbox binds at /app.
 *
 * Why: a bind mount shows its source in the sandbox's /proc/self/mountinfo (the 4th field: the path of
 * the folder within its filesystem). Binding `<data dir>/builds/<id>` would tell every function where
 * Ferry's data directory, keys and database are. The view's path (`/tmp/ferry-view-<random>/<build id>`)
 * tells nothing. Hard links cost no copy of the data (a few ms for a few thousand files, once per build
 * and server) but need the view on the same filesystem as the data directory: the view folder is made in
 * the system's temporary folder, or else beside the data directory, whichever is on its filesystem. Where
 * neither is, or links are refused, replicas bind the build folder itself and `reason` says so.
 *
 * API:
 *   const views = await createBuildViews({ buildsDir });
 *   const dir = await views.viewOf(buildId);     // bind this at /app
 *   views.reason                                  // null, or why builds are bound directly
 *   await views.close();                          // removes the views (server shutdown)
 *
 * Warm slots (warm-pool.ts): an empty folder a warm sandbox binds at /app before it knows its app. When
 * the sandbox is claimed, the build's files are linked into it from the host side; the bind shows them at
 * once. A slot is filled once, for one build, and removed when its sandbox has exited: never reused.
 *   const slot = await views.newSlot(replicaId);  // null without a views folder (no warm pool then)
 *   await views.fillSlot(slot, buildId);
 *   await views.dropSlot(slot);
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';

export interface BuildViews {
  /** The folder to bind at /app for a build: its view, or the build folder itself when there is none. */
  viewOf(buildId: string): Promise<string>;
  /** Forgets a build's view (its build was deleted or replaced), removing its links. */
  drop(buildId: string): Promise<void>;
  /** null when views work; else why replicas bind build folders directly (their path shows in mountinfo). */
  readonly reason: string | null;
  /** A new, empty, never-used folder for one warm sandbox's /app; null when there is no views folder. */
  newSlot(replicaId: string): Promise<string | null>;
  /** Links the build's files into an empty slot; refuses a slot that is not empty or was filled before. */
  fillSlot(slot: string, buildId: string): Promise<void>;
  dropSlot(slot: string): Promise<void>;
  close(): Promise<void>;
}

export async function createBuildViews(options: { buildsDir: string; candidates?: string[] }): Promise<BuildViews> {
  const buildsDir = path.resolve(options.buildsDir);
  await fs.mkdir(buildsDir, { recursive: true });
  const device = (await fs.stat(buildsDir)).dev;
  const dataDir = path.dirname(buildsDir);
  const candidates = options.candidates ?? [os.tmpdir(), path.dirname(dataDir)];
  let root: string | null = null;
  let reason: string | null = null;
  for (const parent of candidates) {
    const stat = await fs.stat(parent).catch(() => null);
    if (!stat || stat.dev !== device) continue;
    // Not inside the data directory: that is the path the view hides.
    if (path.resolve(parent).startsWith(`${dataDir}/`) || path.resolve(parent) === dataDir) continue;
    try {
      root = await fs.mkdtemp(path.join(parent, 'ferry-view-'));
      await fs.chmod(root, 0o700);
      break;
    } catch {
      root = null;
    }
  }
  if (!root) {
    reason = `no folder outside the data directory on its filesystem (tried ${candidates.join(', ')}): replicas bind build folders directly, so their path shows in /proc/self/mountinfo`;
  }
  const views = new Map<string, Promise<string>>();
  /** Warm slots made and not filled yet. */
  const slots = new Set<string>();

  async function makeView(buildId: string): Promise<string> {
    const source = path.join(buildsDir, buildId);
    if (!root) return source;
    await fs.stat(source); // a missing build is an error, not a reason to bind directly
    const target = path.join(root, buildId);
    const staging = `${target}.${randomBytes(4).toString('hex')}`;
    try {
      await mirror(source, staging);
      await fs.rename(staging, target);
      return target;
    } catch (err) {
      await fs.rm(staging, { recursive: true, force: true }).catch(() => {});
      if ((err as NodeJS.ErrnoException).code === 'EEXIST' || (err as NodeJS.ErrnoException).code === 'ENOTEMPTY') {
        return target; // made by an earlier server run in this folder: impossible with mkdtemp, but harmless
      }
      reason = `cannot link build files into ${root} (${(err as Error).message}): binding build folders directly`;
      return source;
    }
  }

  return {
    viewOf(buildId) {
      if (!/^[A-Za-z0-9_-]{1,100}$/.test(buildId)) return Promise.reject(new Error(`Invalid build id ${buildId}`));
      let view = views.get(buildId);
      if (!view) {
        view = makeView(buildId);
        views.set(buildId, view);
        // A failure is not cached: the next replica tries again.
        view.catch(() => views.delete(buildId));
      }
      return view;
    },
    async drop(buildId) {
      views.delete(buildId);
      if (root) await fs.rm(path.join(root, buildId), { recursive: true, force: true });
    },
    get reason() {
      return reason;
    },
    async newSlot(replicaId) {
      if (!root || reason) return null;
      if (!/^[A-Za-z0-9_-]{1,100}$/.test(replicaId)) throw new Error(`Invalid replica id ${replicaId}`);
      // A "." cannot be in a build id, so a slot never shares a name with a build's view.
      const slot = path.join(root, `warm.${replicaId}`);
      await fs.mkdir(slot, { mode: 0o700 });
      slots.add(slot);
      return slot;
    },
    async fillSlot(slot, buildId) {
      if (!/^[A-Za-z0-9_-]{1,100}$/.test(buildId)) throw new Error(`Invalid build id ${buildId}`);
      // Once, for one build: the sandbox bound to the slot belongs to that build for life.
      if (!slots.delete(slot)) throw new Error(`${slot} is not an unused warm slot`);
      if ((await fs.readdir(slot)).length > 0) throw new Error(`warm slot ${slot} is not empty`);
      await mirrorInto(path.join(buildsDir, buildId), slot);
    },
    async dropSlot(slot) {
      slots.delete(slot);
      if (root && path.dirname(slot) === root) await fs.rm(slot, { recursive: true, force: true });
    },
    async close() {
      views.clear();
      if (root) await fs.rm(root, { recursive: true, force: true });
    },
  };
}

/** Recreates `source` at `target`: folders made, files hard-linked, symbolic links copied as links. */
async function mirror(source: string, target: string): Promise<void> {
  const stat = await fs.stat(source);
  await fs.mkdir(target, { mode: stat.mode & 0o777 });
  await mirrorInto(source, target, stat.mode);
}

/** `mirror` into a folder that exists already (a warm slot). */
async function mirrorInto(source: string, target: string, mode?: number): Promise<void> {
  const sourceMode = mode ?? (await fs.stat(source)).mode;
  const entries = await fs.readdir(source, { withFileTypes: true });
  for (const entry of entries) {
    const from = path.join(source, entry.name);
    const to = path.join(target, entry.name);
    if (entry.isDirectory()) await mirror(from, to);
    else if (entry.isSymbolicLink()) await fs.symlink(await fs.readlink(from), to);
    else if (entry.isFile()) await fs.link(from, to);
    // Sockets, FIFOs and devices have no place in a build: left out.
  }
  await fs.chmod(target, sourceMode & 0o777);
}
