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
 *   await views.swept                             // folders of dead servers removed at start (below)
 *
 * A server that is killed (SIGKILL, a crash, the machine losing power) cannot remove its views folder,
 * and after its builds are deleted the links there are the files' last names: disk that is never freed.
 * Each views folder therefore names its server in `.owner` (pid and the process's start time, so a reused
 * pid is not mistaken for it), and a server starting removes the `ferry-view-*` folders in the places it
 * would make its own whose server is gone. Only folders that are real folders (not links), owned by this
 * user and named in a readable `.owner` are touched: anything else is left alone. `.owner` cannot meet a
 * build's view or a warm slot (a build id has no ".", and slots start with "warm.").
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
  /** Resolves, once the start's sweep is over, with the number of dead servers' views folders removed. */
  readonly swept: Promise<number>;
}

const OWNER_FILE = '.owner';

interface Owner {
  pid: number;
  /** The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); null where unknown. */
  start: string | null;
}

/** A process's state (field 3 of /proc/<pid>/stat) and start time (field 22), or null (no /proc, no process). */
async function procStat(pid: number): Promise<{ state: string; start: string } | null> {
  try {
    const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8');
    // The command name (field 2) is in parentheses and may hold spaces: count fields after its last ')'.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return fields[0] && fields[19] ? { state: fields[0], start: fields[19] } : null;
  } catch {
    return null;
  }
}

async function startTimeOf(pid: number): Promise<string | null> {
  return (await procStat(pid))?.start ?? null;
}

/** Whether the server named in an `.owner` file is still running (true when it cannot be told). */
async function ownerAlive(owner: Owner): Promise<boolean> {
  try {
    process.kill(owner.pid, 0);
  } catch (err) {
    // EPERM: a process of another user has that pid now; the folder's server (this user's) is gone.
    const code = (err as NodeJS.ErrnoException).code;
    return !(code === 'ESRCH' || code === 'EPERM');
  }
  const stat = await procStat(owner.pid);
  if (stat === null) return true; // no /proc: the pid is taken, so it may be the server
  // A zombie (killed, not reaped yet) is gone; so is a process of that pid started at another time.
  if (stat.state === 'Z' || stat.state === 'X') return false;
  return owner.start === null || stat.start === owner.start;
}

function parseOwner(text: string): Owner | null {
  try {
    const value = JSON.parse(text) as Partial<Owner>;
    if (!Number.isInteger(value.pid) || (value.pid as number) <= 0) return null;
    if (value.start !== null && typeof value.start !== 'string') return null;
    return { pid: value.pid as number, start: value.start };
  } catch {
    return null;
  }
}

/** Removes the `ferry-view-*` folders in `parents` whose server is gone (see the top of this file). */
async function sweepDeadViews(parents: string[], own: string | null): Promise<number> {
  const uid = process.getuid?.();
  let removed = 0;
  for (const parent of new Set(parents.map((p) => path.resolve(p)))) {
    const names = await fs.readdir(parent).catch(() => [] as string[]);
    for (const name of names) {
      if (!name.startsWith('ferry-view-')) continue;
      const folder = path.join(parent, name);
      if (folder === own) continue;
      const stat = await fs.lstat(folder).catch(() => null);
      if (!stat?.isDirectory() || (uid !== undefined && stat.uid !== uid)) continue;
      const owner = parseOwner(await fs.readFile(path.join(folder, OWNER_FILE), 'utf8').catch(() => ''));
      if (!owner || owner.pid === process.pid || (await ownerAlive(owner))) continue;
      try {
        await fs.rm(folder, { recursive: true, force: true });
        removed += 1;
      } catch {
        // Another server's sweep, or a file it cannot remove: left for the next start.
      }
    }
  }
  return removed;
}

/**
 * Makes a `ferry-view-*` folder of this server in the first of `candidates` on the data directory's
 * filesystem and outside it, or returns null. `othersRead`: sandboxes run as other uids than the server
 * (Ferry is root, sandbox/identity.ts), so the folder is searchable (0711: entered, never listed).
 */
export async function makeViewsRoot(options: {
  dataDir: string;
  candidates: string[];
  othersRead: boolean;
}): Promise<string | null> {
  const dataDir = path.resolve(options.dataDir);
  const device = (await fs.stat(dataDir)).dev;
  for (const parent of options.candidates) {
    const stat = await fs.stat(parent).catch(() => null);
    if (!stat || stat.dev !== device) continue;
    // Not inside the data directory: that is the path the view hides.
    if (path.resolve(parent).startsWith(`${dataDir}/`) || path.resolve(parent) === dataDir) continue;
    let root: string | null = null;
    try {
      root = await fs.mkdtemp(path.join(parent, 'ferry-view-'));
      await fs.chmod(root, options.othersRead ? 0o711 : 0o700);
      const owner: Owner = { pid: process.pid, start: await startTimeOf(process.pid) };
      await fs.writeFile(path.join(root, OWNER_FILE), JSON.stringify(owner), { mode: 0o600 });
      return root;
    } catch {
      if (root) await fs.rm(root, { recursive: true, force: true }).catch(() => {});
    }
  }
  return null;
}

const stagingRoots = new Map<string, Promise<string | null>>();

/**
 * This process's `ferry-view-*` folder for `dataDir` (made once, in the system's temporary folder or
 * beside `dataDir`), for what is bound into sandboxes outside a server's views: build steps' folders
 * (sandbox/build-step.ts) and the build folder of a launch that bwrap, as a sandbox uid, cannot reach. Removed
 * by the sweep of the next server that starts after this process has gone.
 */
export function stagingRoot(dataDir: string, othersRead: boolean): Promise<string | null> {
  const key = `${path.resolve(dataDir)}\0${othersRead}`;
  let root = stagingRoots.get(key);
  if (!root) {
    root = makeViewsRoot({ dataDir, candidates: [os.tmpdir(), path.dirname(path.resolve(dataDir))], othersRead }).catch(
      () => null,
    );
    stagingRoots.set(key, root);
  }
  return root;
}

export async function createBuildViews(options: {
  buildsDir: string;
  candidates?: string[];
  /** Sandboxes run as uids other than the server's (Ferry is root): views are made readable by others. */
  othersRead?: boolean;
}): Promise<BuildViews> {
  const buildsDir = path.resolve(options.buildsDir);
  await fs.mkdir(buildsDir, { recursive: true });
  const dataDir = path.dirname(buildsDir);
  const candidates = options.candidates ?? [os.tmpdir(), path.dirname(dataDir)];
  const othersRead = options.othersRead ?? false;
  const root = await makeViewsRoot({ dataDir, candidates, othersRead });
  let reason: string | null = null;
  if (!root) {
    reason = `no folder outside the data directory on its filesystem (tried ${candidates.join(', ')}): replicas bind build folders directly, so their path shows in /proc/self/mountinfo`;
  }
  // In the background: the server does not wait for a dead one's folders to go.
  const swept = sweepDeadViews(candidates, root).catch(() => 0);
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
      await mirror(source, staging, othersRead);
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
    swept,
    async newSlot(replicaId) {
      if (!root || reason) return null;
      if (!/^[A-Za-z0-9_-]{1,100}$/.test(replicaId)) throw new Error(`Invalid replica id ${replicaId}`);
      // A "." cannot be in a build id, so a slot never shares a name with a build's view.
      const slot = path.join(root, `warm.${replicaId}`);
      await fs.mkdir(slot, { mode: othersRead ? 0o755 : 0o700 });
      slots.add(slot);
      return slot;
    },
    async fillSlot(slot, buildId) {
      if (!/^[A-Za-z0-9_-]{1,100}$/.test(buildId)) throw new Error(`Invalid build id ${buildId}`);
      // Once, for one build: the sandbox bound to the slot belongs to that build for life.
      if (!slots.delete(slot)) throw new Error(`${slot} is not an unused warm slot`);
      if ((await fs.readdir(slot)).length > 0) throw new Error(`warm slot ${slot} is not empty`);
      await mirrorInto(path.join(buildsDir, buildId), slot, othersRead);
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

/**
 * Recreates `source` at `target`: folders made, files hard-linked, symbolic links copied as links.
 * `othersRead` (sandboxes run as other uids, Ferry is root): every folder is made readable and searchable
 * by others, and every file readable (executable where its owner may execute it) with no set-id bit: the
 * files are the build's own (a link shares the file), written by Ferry or by the build's sandbox, which
 * has ended. The link is made in the view, a folder only the server may write, so the chmod cannot be
 * turned onto another file by a link swapped in.
 */
export async function mirror(source: string, target: string, othersRead = false): Promise<void> {
  const stat = await fs.stat(source);
  await fs.mkdir(target, { mode: stat.mode & 0o777 });
  await mirrorInto(source, target, othersRead, stat.mode);
}

/** `mirror` into a folder that exists already (a warm slot). */
async function mirrorInto(source: string, target: string, othersRead: boolean, mode?: number): Promise<void> {
  const sourceMode = mode ?? (await fs.stat(source)).mode;
  const entries = await fs.readdir(source, { withFileTypes: true });
  for (const entry of entries) {
    const from = path.join(source, entry.name);
    const to = path.join(target, entry.name);
    if (entry.isDirectory()) await mirror(from, to, othersRead);
    else if (entry.isSymbolicLink()) await fs.symlink(await fs.readlink(from), to);
    else if (entry.isFile()) {
      await fs.link(from, to);
      if (othersRead) await readableByOthers(to);
    }
    // Sockets, FIFOs and devices have no place in a build: left out.
  }
  await fs.chmod(target, othersRead ? (sourceMode & 0o777) | 0o555 : sourceMode & 0o777);
}

async function readableByOthers(file: string): Promise<void> {
  const { mode } = await fs.lstat(file);
  const wanted = ((mode & 0o777) | 0o444 | (mode & 0o100 ? 0o111 : 0)) & ~0o6000;
  if ((mode & 0o7777) !== wanted) await fs.chmod(file, wanted);
}
