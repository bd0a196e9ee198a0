/**
 * The replica cgroup: one cgroup per replica over the controllers this machine lets Ferry write (memory,
 * pids, cpu), cgroup v2 (one folder) or v1 (one folder per controller). What is usable is probed once at
 * start by creating, limiting, joining and removing a probe child under each controller.
 *
 * API:
 *   probeCgroups(): Promise<{ support, reasons }>             support is null when no controller is writable
 *   createReplicaCgroup(support, replicaId, limits)           the replica's cgroup, limits written
 *     → ReplicaCgroup { procsFiles, joinArgs(file, args), oomKilled(), kill(), remove() }
 *
 * A replica joins through a `/bin/sh` wrapper (JOIN_CGROUP_SCRIPT) before it exec's bwrap, so nothing it
 * starts or allocates (tmpfs pages of /tmp, /dev/shm and /run/ferry included: they are charged to the
 * cgroup of the process that writes them) escapes the limits.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { runQuiet } from './run-quiet.js';

export type CgroupController = 'memory' | 'pids' | 'cpu';
export const CGROUP_CONTROLLERS: readonly CgroupController[] = ['memory', 'pids', 'cpu'];

export interface CgroupSupport {
  version: 1 | 2;
  /** The parent of the memory cgroups (v2: the one parent); the first usable controller's without memory. */
  dir: string;
  /** Parent folder per controller that was seen to work; replicas get `<parent>/ferry-<id>` under each. */
  controllers: Partial<Record<CgroupController, string>>;
}

export interface CgroupLimits {
  memoryBytes: number;
  maxProcesses: number;
  /** Cores, as a CFS quota: 0.5 = half a core's time per period. No quota when absent (build steps). */
  cpu?: number;
}

export interface ReplicaCgroup {
  /** The replica's folder per controller. */
  readonly dirs: Partial<Record<CgroupController, string>>;
  /** Wraps a command so it joins every controller's cgroup before it runs. */
  wrap(file: string, args: string[]): { file: string; args: string[] };
  /** Whether the memory controller recorded an OOM kill (false without one). */
  oomKilled(): Promise<boolean>;
  /** SIGKILLs everything in the cgroup. */
  kill(): Promise<void>;
  /** Removes the cgroup (killing anything left in it); safe to call twice. */
  remove(): Promise<void>;
}

/** The CFS period: 100 ms, the kernel's default. */
export const CPU_PERIOD_US = 100_000;
/** Joins each cgroup given before `--`, then exec's the rest, so nothing runs outside the limits. */
const JOIN_CGROUP_SCRIPT = 'while [ "$1" != "--" ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"';
const PROBE_TIMEOUT_MS = 5_000;

/** The file that limits each controller, by cgroup version: writing it is what the probe tries. */
const LIMIT_FILE: Record<CgroupController, Record<1 | 2, string>> = {
  memory: { 1: 'memory.limit_in_bytes', 2: 'memory.max' },
  pids: { 1: 'pids.max', 2: 'pids.max' },
  cpu: { 1: 'cpu.cfs_quota_us', 2: 'cpu.max' },
};
const PROBE_VALUE: Record<CgroupController, Record<1 | 2, string>> = {
  memory: { 1: String(64 << 20), 2: String(64 << 20) },
  pids: { 1: '64', 2: '64' },
  cpu: { 1: String(CPU_PERIOD_US), 2: `${CPU_PERIOD_US} ${CPU_PERIOD_US}` },
};

interface CgroupMount {
  version: 1 | 2;
  root: string;
  mountPoint: string;
  /** v1: the controllers of this hierarchy. */
  controllers: string[];
}

/**
 * Finds, per controller, a parent cgroup under which a child can be created, limited and joined. cgroup v2
 * is preferred when it has the memory controller; otherwise v1, one hierarchy per controller.
 */
export async function probeCgroups(): Promise<{ support: CgroupSupport | null; reasons: string[] }> {
  const [mountinfo, selfCgroup] = await Promise.all([
    fs.readFile('/proc/self/mountinfo', 'utf8').catch(() => ''),
    fs.readFile('/proc/self/cgroup', 'utf8').catch(() => ''),
  ]);
  const mounts = parseCgroupMounts(mountinfo);
  const own = new Map<string, string>(); // controller list ('' for v2) → path
  for (const line of selfCgroup.split('\n')) {
    const match = /^\d+:([^:]*):(.*)$/.exec(line);
    if (match) own.set(match[1]!, match[2]!);
  }
  const notes: string[] = [];
  const v2 = await probeV2(mounts, own.get(''), notes);
  if (v2?.controllers.memory) return withReasons(v2, notes);
  const v1 = await probeV1(mounts, own, notes);
  const support = v1 ?? v2;
  return withReasons(support, notes);
}

function withReasons(
  support: CgroupSupport | null,
  notes: string[],
): { support: CgroupSupport | null; reasons: string[] } {
  const reasons: string[] = [];
  const missing = CGROUP_CONTROLLERS.filter((c) => !support?.controllers[c]);
  if (missing.length > 0) {
    reasons.push(`no writable cgroup for ${missing.join(', ')}${notes.length > 0 ? ` (${notes.join('; ')})` : ''}`);
  }
  if (missing.includes('pids')) {
    reasons.push(
      "replicas have NO process limit ([resources].max_processes is not enforced): RLIMIT_NPROC cannot stand in, it counts every process of the server's own uid, which the sandbox uid maps to",
    );
  }
  if (missing.includes('cpu')) reasons.push('replicas have NO CPU quota ([resources].cpu is not enforced)');
  return { support, reasons };
}

async function probeV2(
  mounts: CgroupMount[],
  ownPath: string | undefined,
  notes: string[],
): Promise<CgroupSupport | null> {
  const v2 = mounts.find((m) => m.version === 2);
  if (!v2 || ownPath === undefined) return null;
  const available = (await fs.readFile(path.join(v2.mountPoint, 'cgroup.controllers'), 'utf8').catch(() => ''))
    .split(/\s+/)
    .filter((c): c is CgroupController => (CGROUP_CONTROLLERS as string[]).includes(c));
  // In hybrid mode the v2 hierarchy exists but holds no controllers; they are on v1 then.
  if (available.length === 0) return null;
  const dir = hostDir(v2, ownPath);
  if (!dir) {
    notes.push(`cgroup v2: own cgroup ${ownPath} is outside the mounted hierarchy`);
    return null;
  }
  const parent = await prepareV2Parent(dir, available);
  if (typeof parent !== 'string' || parent.startsWith('!')) {
    notes.push(`cgroup v2 at ${dir}: ${String(parent).slice(1)}`);
    return null;
  }
  const controllers: CgroupSupport['controllers'] = {};
  for (const controller of available) {
    const problem = await probeChild(2, parent, controller);
    if (problem === null) controllers[controller] = parent;
    else notes.push(`cgroup v2 ${controller} at ${parent}: ${problem}`);
  }
  const first = controllers.memory ?? Object.values(controllers)[0];
  return first ? { version: 2, dir: first, controllers } : null;
}

async function probeV1(
  mounts: CgroupMount[],
  own: Map<string, string>,
  notes: string[],
): Promise<CgroupSupport | null> {
  const controllers: CgroupSupport['controllers'] = {};
  for (const controller of CGROUP_CONTROLLERS) {
    const mount = mounts.find((m) => m.version === 1 && m.controllers.includes(controller));
    const ownPath = [...own].find(([list]) => list.split(',').includes(controller))?.[1];
    if (!mount || ownPath === undefined) continue;
    const dir = hostDir(mount, ownPath);
    if (!dir) {
      notes.push(`cgroup v1: own ${controller} cgroup ${ownPath} is outside the mounted hierarchy`);
      continue;
    }
    const problem = await probeChild(1, dir, controller);
    if (problem === null) controllers[controller] = dir;
    else notes.push(`cgroup v1 ${controller} at ${dir}: ${problem}`);
  }
  const first = controllers.memory ?? Object.values(controllers)[0];
  return first ? { version: 1, dir: first, controllers } : null;
}

function parseCgroupMounts(mountinfo: string): CgroupMount[] {
  const mounts: CgroupMount[] = [];
  for (const line of mountinfo.split('\n')) {
    const [left, right] = line.split(' - ');
    if (!left || !right) continue;
    const fields = left.split(' ');
    const [fstype, , superOptions = ''] = right.split(' ');
    const root = unescapeMountPath(fields[3] ?? '');
    const mountPoint = unescapeMountPath(fields[4] ?? '');
    if (fstype === 'cgroup2') mounts.push({ version: 2, root, mountPoint, controllers: [] });
    else if (fstype === 'cgroup') mounts.push({ version: 1, root, mountPoint, controllers: superOptions.split(',') });
  }
  return mounts;
}

function unescapeMountPath(text: string): string {
  return text.replace(/\\([0-7]{3})/g, (_, octal: string) => String.fromCharCode(Number.parseInt(octal, 8)));
}

/** The host folder of a cgroup path, given where (and from which root) its hierarchy is mounted. */
function hostDir(mount: CgroupMount, cgroupPath: string): string | null {
  const root = mount.root === '/' ? '' : mount.root;
  if (root !== '' && cgroupPath !== root && !cgroupPath.startsWith(`${root}/`)) return null;
  return path.resolve(mount.mountPoint, `.${cgroupPath.slice(root.length)}`);
}

/**
 * Makes a v2 cgroup able to have limited children: the controllers must be in its subtree_control, which
 * the kernel refuses (EBUSY) while the cgroup itself holds processes. When the only process in it is this
 * one, it moves into a leaf `ferry-server` first, as delegated services do. Returns the parent, or `!why`.
 */
async function prepareV2Parent(dir: string, controllers: CgroupController[]): Promise<string> {
  // A previous probe of this process may already have moved it into the leaf.
  if (path.basename(dir) === 'ferry-server') dir = path.dirname(dir);
  const enabled = async () =>
    (await fs.readFile(path.join(dir, 'cgroup.subtree_control'), 'utf8').catch(() => '')).split(/\s+/);
  const enable = async () => {
    const have = await enabled();
    for (const controller of controllers) {
      if (!have.includes(controller)) await fs.writeFile(path.join(dir, 'cgroup.subtree_control'), `+${controller}`);
    }
  };
  try {
    await enable();
    return dir;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EBUSY') {
      return `!cannot enable the controllers for children (${(err as Error).message})`;
    }
  }
  const procs = (await fs.readFile(path.join(dir, 'cgroup.procs'), 'utf8')).split('\n').filter(Boolean);
  if (procs.some((pid) => pid !== String(process.pid))) {
    return '!the controllers are not enabled for children and other processes share this cgroup';
  }
  try {
    const leaf = path.join(dir, 'ferry-server');
    await fs.mkdir(leaf, { recursive: true });
    await fs.writeFile(path.join(leaf, 'cgroup.procs'), String(process.pid));
    await enable();
    return dir;
  } catch (err) {
    return `!cannot enable the controllers for children (${(err as Error).message})`;
  }
}

/** Creates, limits, joins and removes a probe child; null when all of it worked, else why not. */
async function probeChild(version: 1 | 2, parent: string, controller: CgroupController): Promise<string | null> {
  const dir = path.join(parent, `ferry-probe-${process.pid}-${randomBytes(4).toString('hex')}`);
  try {
    await fs.mkdir(dir);
  } catch (err) {
    return `cannot create a child cgroup (${(err as Error).message})`;
  }
  try {
    await fs.writeFile(path.join(dir, LIMIT_FILE[controller][version]), PROBE_VALUE[controller][version]);
    const joined = await runQuiet(
      '/bin/sh',
      ['-c', JOIN_CGROUP_SCRIPT, 'ferry-probe', path.join(dir, 'cgroup.procs'), '--', 'true'],
      PROBE_TIMEOUT_MS,
    );
    if (joined.code !== 0) return `cannot move a process into a child cgroup (${joined.stderr.trim() || joined.code})`;
    return null;
  } catch (err) {
    return `cannot set a limit (${(err as Error).message})`;
  } finally {
    await removeCgroupDir(dir).catch(() => {});
  }
}

/**
 * Creates `ferry-<replicaId>` under each usable controller and writes the limits. A folder left by a crash
 * is removed first (an empty one goes; a busy one is a replica still running under this id: an error).
 */
export async function createReplicaCgroup(
  support: CgroupSupport,
  replicaId: string,
  limits: CgroupLimits,
): Promise<ReplicaCgroup> {
  const dirs: Partial<Record<CgroupController, string>> = {};
  const made: string[] = [];
  const { version } = support;
  try {
    for (const controller of CGROUP_CONTROLLERS) {
      const parent = support.controllers[controller];
      if (!parent) continue;
      const dir = path.join(parent, `ferry-${replicaId}`);
      dirs[controller] = dir;
      if (made.includes(dir)) continue; // v2: one folder for all
      try {
        await fs.mkdir(dir);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
        await removeCgroupDir(dir);
        await fs.mkdir(dir);
      }
      made.push(dir);
    }
    if (dirs.memory) await writeMemoryLimit(version, dirs.memory, limits.memoryBytes);
    if (dirs.pids) await fs.writeFile(path.join(dirs.pids, 'pids.max'), String(limits.maxProcesses));
    if (dirs.cpu && limits.cpu !== undefined) {
      const quota = Math.max(1000, Math.round(limits.cpu * CPU_PERIOD_US));
      if (version === 1) {
        await fs.writeFile(path.join(dirs.cpu, 'cpu.cfs_period_us'), String(CPU_PERIOD_US));
        await fs.writeFile(path.join(dirs.cpu, 'cpu.cfs_quota_us'), String(quota));
      } else {
        await fs.writeFile(path.join(dirs.cpu, 'cpu.max'), `${quota} ${CPU_PERIOD_US}`);
      }
    }
  } catch (err) {
    for (const dir of made) await removeCgroupDir(dir).catch(() => {});
    throw err;
  }

  let removed = false;
  let oom: boolean | undefined;
  const cgroup: ReplicaCgroup = {
    dirs,
    wrap(file, args) {
      const procs = made.map((dir) => path.join(dir, 'cgroup.procs'));
      return { file: '/bin/sh', args: ['-c', JOIN_CGROUP_SCRIPT, 'ferry-replica', ...procs, '--', file, ...args] };
    },
    async oomKilled() {
      if (oom !== undefined) return oom;
      return dirs.memory ? readOomKilled(version, dirs.memory) : false;
    },
    async kill() {
      for (const dir of made) await killCgroupMembers(dir);
    },
    async remove() {
      if (removed) return;
      oom = await cgroup.oomKilled();
      for (const dir of made) await removeCgroupDir(dir);
      removed = true;
    },
  };
  return cgroup;
}

async function writeMemoryLimit(version: 1 | 2, dir: string, bytes: number): Promise<void> {
  if (version === 1) {
    await fs.writeFile(path.join(dir, 'memory.limit_in_bytes'), String(bytes));
    // With swap accounting, memory+swap gets the same limit, or swap would quietly extend it.
    await writeIfPresent(path.join(dir, 'memory.memsw.limit_in_bytes'), String(bytes));
  } else {
    await fs.writeFile(path.join(dir, 'memory.max'), String(bytes));
    await writeIfPresent(path.join(dir, 'memory.swap.max'), '0');
    // An OOM kill takes the whole sandbox, not just the biggest process in it.
    await writeIfPresent(path.join(dir, 'memory.oom.group'), '1');
  }
}

async function writeIfPresent(file: string, value: string): Promise<void> {
  try {
    await fs.writeFile(file, value, { flag: 'r+' });
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
}

async function removeCgroupDir(dir: string): Promise<void> {
  for (let attempt = 0; ; attempt++) {
    try {
      await fs.rmdir(dir);
      return;
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOENT') return;
      if (code !== 'EBUSY' || attempt >= 50) throw err;
    }
    // Left-overs of a replica that did not exit (cleanup called early): they are the replica's own.
    if (attempt === 0 || attempt === 10) await killCgroupMembers(dir);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

async function killCgroupMembers(dir: string): Promise<void> {
  try {
    await fs.writeFile(path.join(dir, 'cgroup.kill'), '1', { flag: 'r+' }); // v2, Linux 5.14+
    return;
  } catch {
    // v1 or an older kernel: one by one
  }
  // A fork bomb may add processes while this loop kills: go round a few times.
  for (let round = 0; round < 5; round++) {
    const procs = (await fs.readFile(path.join(dir, 'cgroup.procs'), 'utf8').catch(() => ''))
      .split('\n')
      .filter(Boolean);
    if (procs.length === 0) return;
    for (const pid of procs) {
      try {
        process.kill(Number(pid), 'SIGKILL');
      } catch {
        // already gone
      }
    }
  }
}

async function readOomKilled(version: 1 | 2, dir: string): Promise<boolean> {
  if (version === 2) {
    const events = await fs.readFile(path.join(dir, 'memory.events'), 'utf8').catch(() => '');
    return counter(events, 'oom_kill') > 0;
  }
  const control = await fs.readFile(path.join(dir, 'memory.oom_control'), 'utf8').catch(() => '');
  // oom_kill exists since Linux 4.13; before it, hitting the limit at all is the best sign there is.
  if (/^oom_kill /m.test(control)) return counter(control, 'oom_kill') > 0;
  const failcnt = await fs.readFile(path.join(dir, 'memory.failcnt'), 'utf8').catch(() => '0');
  return Number.parseInt(failcnt, 10) > 0;
}

function counter(text: string, name: string): number {
  const match = new RegExp(`^${name} (\\d+)$`, 'm').exec(text);
  return match ? Number(match[1]) : 0;
}
