/**
 * Build views: a copy of each build folder made of hard links, in a per-server folder outside the data
 * directory, which is what the sandbox binds at /app.
 *
 * Why: a bind mount shows its source in the sandbox's /proc/self/mountinfo (the 4th field: the path of
 * the folder within its filesystem). Binding `<data dir>/builds/<id>` would tell every function where
 * Ferry's data directory, keys and database are. The view's path (`/tmp/ferry-view-<random>/<build id>`)
 * tells nothing. Hard links cost no copy of the data (a few ms for a few thousand files, once per build
 * and server) but need the view on the same filesystem as the data directory: the view folder is made in
 * the system's temporary folder, or else beside the data directory, whichever is on its filesystem.
 *
 * Where neither is (the data directory is the root of a filesystem of its own: a disk mounted there, the
 * usual production layout), the view folder is made in `<data dir>/staging` (INSIDE_STAGING). Its path in
 * mountinfo is then relative to that filesystem's root, `/staging/ferry-view-<random>/<build id>`, which
 * says nothing of where the data directory is on the host, only that it is a filesystem of its own. When
 * sandboxes run as other uids (Ferry is root), the data directory becomes 0711 and `staging/` 0711, so that
 * bwrap, as the sandbox's uid, can pass through them (never list them) to what it binds; everything else in
 * the data directory keeps its own mode (keys/, builds/, the database: 0700 or 0600). Where that cannot be
 * made either, or links are refused, replicas bind the build folder itself and `reason` says so.
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

/** The folder inside the data directory where views and stages go when no folder outside it can hold them. */
export const INSIDE_STAGING = 'staging';

/** Where a views folder for `dataDir` is looked for outside it: the system's temporary folder, then its parent. */
export function stagingCandidates(dataDir: string): string[] {
  return [os.tmpdir(), path.dirname(path.resolve(dataDir))];
}

/** Where this data directory's views and stages go (`ferry doctor`), made or not: see `stagingPlace`. */
export interface StagingPlace {
  /** The folder the `ferry-view-*` folders are made in. */
  dir: string;
  /** `<data dir>/staging`: no folder outside the data directory is on its filesystem. */
  inside: boolean;
}

/**
 * The first of `candidates` that is on the data directory's filesystem, outside it and writable, else
 * `<data dir>/staging`: where makeViewsRoot puts views. Makes nothing (for `ferry doctor`).
 */
export async function stagingPlace(dataDir: string, candidates = stagingCandidates(dataDir)): Promise<StagingPlace> {
  const data = path.resolve(dataDir);
  const device = (await fs.stat(data)).dev;
  for (const parent of candidates) {
    if (!(await usableOutside(data, device, parent))) continue;
    try {
      await fs.access(parent, fs.constants.W_OK | fs.constants.X_OK);
      return { dir: path.resolve(parent), inside: false };
    } catch {
      // Not writable by this user: the next one.
    }
  }
  return { dir: path.join(data, INSIDE_STAGING), inside: true };
}

/** Whether `parent` is a folder on the data directory's filesystem (`device`) and outside it. */
async function usableOutside(dataDir: string, device: number, parent: string): Promise<boolean> {
  const stat = await fs.stat(parent).catch(() => null);
  if (!stat?.isDirectory() || stat.dev !== device) return false;
  // Not inside the data directory: that is the path the view hides.
  const resolved = path.resolve(parent);
  return !(resolved.startsWith(`${dataDir}/`) || resolved === dataDir);
}

/**
 * Makes a `ferry-view-*` folder of this server in the first of `candidates` on the data directory's
 * filesystem and outside it; when there is none and `inside` is not false, in `<data dir>/staging` (see the
 * top of this file); else returns null. `othersRead`: sandboxes run as other uids than the server (Ferry
 * is root, sandbox/identity.ts), so the folder is searchable (0711: entered, never listed).
 */
export async function makeViewsRoot(options: {
  dataDir: string;
  candidates: string[];
  othersRead: boolean;
  /** Whether `<data dir>/staging` may hold it when no candidate can (default true). */
  inside?: boolean;
}): Promise<string | null> {
  const dataDir = path.resolve(options.dataDir);
  const device = (await fs.stat(dataDir)).dev;
  for (const parent of options.candidates) {
    if (!(await usableOutside(dataDir, device, parent))) continue;
    const root = await makeRootIn(parent, options.othersRead);
    if (root) return root;
  }
  if (options.inside === false) return null;
  const inside = await prepareInsideStaging(dataDir, options.othersRead).catch(() => null);
  return inside ? makeRootIn(inside, options.othersRead) : null;
}

/** A new `ferry-view-*` folder in `parent`, naming this process in `.owner`; null when it cannot be made. */
async function makeRootIn(parent: string, othersRead: boolean): Promise<string | null> {
  let root: string | null = null;
  try {
    root = await fs.mkdtemp(path.join(parent, 'ferry-view-'));
    await fs.chmod(root, othersRead ? 0o711 : 0o700);
    const owner: Owner = { pid: process.pid, start: await startTimeOf(process.pid) };
    await fs.writeFile(path.join(root, OWNER_FILE), JSON.stringify(owner), { mode: 0o600 });
    return root;
  } catch {
    if (root) await fs.rm(root, { recursive: true, force: true }).catch(() => {});
    return null;
  }
}

/**
 * `<data dir>/staging`, made when missing: a real folder of this user (never followed if a link), 0711
 * when sandboxes run as other uids, with the data directory then 0711 too (searchable by them on the way,
 * never listed; its other folders and files keep their own modes). Throws when it cannot be had.
 */
async function prepareInsideStaging(dataDir: string, othersRead: boolean): Promise<string> {
  const dir = path.join(dataDir, INSIDE_STAGING);
  await fs.mkdir(dir, { mode: 0o700 }).catch((err: NodeJS.ErrnoException) => {
    if (err.code !== 'EEXIST') throw err;
  });
  const stat = await fs.lstat(dir);
  const uid = process.getuid?.();
  if (!stat.isDirectory() || (uid !== undefined && stat.uid !== uid)) {
    throw new Error(`${dir} is not a folder of this user`);
  }
  const mode = othersRead ? 0o711 : 0o700;
  if ((stat.mode & 0o7777) !== mode) await fs.chmod(dir, mode);
  if (othersRead) {
    // Search only: a sandbox uid passes through to staging/ (and only there: everything else is 0700).
    const data = await fs.stat(dataDir);
    if ((data.mode & 0o7777) !== 0o711) await fs.chmod(dataDir, 0o711);
  }
  return dir;
}

const stagingRoots = new Map<string, Promise<string | null>>();

/**
 * This process's `ferry-view-*` folder for the data directory `dataDir` (made once, in the system's
 * temporary folder or beside `dataDir`, else in `<dataDir>/staging`), for what is bound into sandboxes
 * outside a server's views: build steps' folders (sandbox/build-step.ts), image unpacking and image builds
 * (images/), and the build folder of a launch that bwrap, as a sandbox uid, cannot reach (`inside` false:
 * that folder is not a data directory, nothing is to be made in it). Removed by the sweep of the next
 * server that starts after this process has gone.
 */
export function stagingRoot(dataDir: string, othersRead: boolean, inside = true): Promise<string | null> {
  const key = `${path.resolve(dataDir)}\0${othersRead}\0${inside}`;
  let root = stagingRoots.get(key);
  if (!root) {
    root = makeViewsRoot({ dataDir, candidates: stagingCandidates(dataDir), othersRead, inside }).catch(() => null);
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
  const candidates = options.candidates ?? stagingCandidates(dataDir);
  const othersRead = options.othersRead ?? false;
  const root = await makeViewsRoot({ dataDir, candidates, othersRead });
  let reason: string | null = null;
  if (!root) {
    reason = `no folder outside the data directory on its filesystem (tried ${candidates.join(', ')}), and none could be made in ${path.join(dataDir, INSIDE_STAGING)}: replicas bind build folders directly, so their path shows in /proc/self/mountinfo`;
  }
  // In the background: the server does not wait for a dead one's folders to go.
  const swept = sweepDeadViews([...candidates, path.join(dataDir, INSIDE_STAGING)], root).catch(() => 0);
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
