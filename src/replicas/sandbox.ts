/**
 * The replica sandbox: bubblewrap for isolation, a memory cgroup (or RLIMIT_DATA) for memory.
 *
 * API:
 *   detectSandbox(): Promise<SandboxCapabilities>          probed once per process (cached)
 *   probeSandbox(env?): Promise<SandboxCapabilities>       probes again, uncached (tests, `ferry doctor`)
 *   sandboxPaths(layout, sandboxed): SandboxPaths          paths as the replica sees them, for building
 *                                                          `command` and `env` in either mode
 *   prepareLaunch(launch, caps): Promise<PreparedLaunch>   creates the cgroup and the argv; then
 *     prepared.spawn(stdio?) → ReplicaProcess { child, kill(signal) }
 *     prepared.wasOomKilled(), prepared.cleanup()          after the process exited
 *
 * Typical use:
 *   const caps = await detectSandbox();
 *   const layout = { buildDir, socketDir, runtimeFiles: [{ host: bootstrapJs, sandbox: '/ferry/bootstrap.js' }] };
 *   const p = sandboxPaths(layout, caps.bwrap !== null);
 *   const prepared = await prepareLaunch({ ...layout, replicaId, memoryMiB,
 *     command: [process.execPath, '--max-old-space-size=768', p.runtimeFile(bootstrapJs)],
 *     env: { FERRY_PROTOCOL: '1', FERRY_SOCKET: p.socketPath, FERRY_ENTRY: `${p.appDir}/out/main.mjs`, ... } }, caps);
 *   const replica = prepared.spawn();        // connect to prepared.paths.hostSocketPath
 *   replica.kill('SIGTERM');                 // reaches the replica itself, not bwrap
 *   ... on exit: await prepared.wasOomKilled(); await prepared.cleanup();
 *
 * The replica's memory cgroup is `<caps.cgroup.dir>/ferry-<replicaId>`; the process joins it through a
 * `/bin/sh` wrapper before exec'ing bwrap, so nothing it allocates escapes the limit. Without a writable
 * cgroup, `prlimit --data` (RLIMIT_DATA) bounds it instead: allocations fail rather than being OOM-killed.
 *
 * Identity: inside, the replica is uid/gid 65534 in its own user namespace, which maps it to the server's
 * own uid on the host. So the socket folder needs no chmod or chown (it stays as the server made it, 0700,
 * and no other host user can reach the socket), and the build folder is readable whatever its modes. The
 * flip side is that on the few host paths bound in, the replica reads what the server's user may read:
 * that is why entries of /etc that an unprivileged user could not read (shadow, TLS private keys, service
 * configs with passwords) are masked, and why nothing else of the host is bound.
 *
 * The replica's environment is exactly `env` (plus PWD, its working folder). It reaches bwrap through a
 * pipe (`--args`), never the command line (world-readable in /proc) nor the environment of the host-side
 * wrappers (an app's LD_PRELOAD must not reach programs that run outside the sandbox).
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Readable, Writable } from 'node:stream';
import type { SandboxNetworkLease } from '../sandbox/network.js';

export interface SandboxCapabilities {
  /** A bubblewrap that was seen to start a sandbox; null when it is missing, broken, or FERRY_SANDBOX=off. */
  bwrap: string | null;
  /** `bwrap --version`, when bwrap was found. */
  bwrapVersion: string | null;
  /** Options of that bwrap that newer versions add (from `bwrap --help`). */
  bwrapFeatures: { disableUserns: boolean; tmpfsSize: boolean };
  /** Whether a user namespace could be created (bwrap needs it to map the replica to uid 65534). */
  userNamespaces: boolean;
  /** A memory cgroup folder under which a child was created and joined; replicas get `<dir>/ferry-<id>`. */
  cgroup: { version: 1 | 2; dir: string } | null;
  /** util-linux prlimit, used for RLIMIT_DATA when there is no writable memory cgroup. */
  prlimit: string | null;
  /** Human-readable notes on what is missing and why. */
  reasons: string[];
}

/** Where a replica's files are: host folders and the path each has inside the sandbox. */
export interface SandboxLayout {
  /** Host folder of the build, read-only at /app. */
  buildDir: string;
  /** Host folder for the replica's socket, read-write at /run/ferry. Created (0700) when missing. */
  socketDir: string;
  /** Extra read-only files or folders, e.g. the bootstrap at /ferry/bootstrap.js (absolute sandbox paths). */
  runtimeFiles: Array<{ host: string; sandbox: string }>;
}

export interface ReplicaLaunch extends SandboxLayout {
  /** Names the memory cgroup (`ferry-<replicaId>`): letters, digits, `_`, `-`, `.`. */
  replicaId: string;
  /** argv as the replica sees it; build it with sandboxPaths(). command[0] should be absolute. */
  command: string[];
  /** The complete environment of the replica: nothing of the server's own is added. */
  env: Record<string, string>;
  memoryMiB: number;
  /** Working folder relative to the app folder (default: the app folder itself). */
  cwd?: string;
  /**
   * `host` (default): the replica shares the server's network. `isolated`: under bwrap it gets its own
   * network namespace with only a loopback interface. A lease (sandbox/network.ts): bwrap starts inside
   * the lease's namespace (`nsenter --net`), or in a fresh loopback-only one when its netnsPath is null,
   * with the lease's resolv.conf at /etc/resolv.conf. Either way replicas can all listen on one port
   * without clashing (custom runtime). Without bwrap this has no effect.
   */
  network?: 'host' | 'isolated' | Pick<SandboxNetworkLease, 'netnsPath' | 'resolvConf'>;
}

/** Paths as the replica sees them: sandbox paths under bwrap, the host paths themselves without it. */
export interface SandboxPaths {
  appDir: string;
  socketDir: string;
  /** The replica's socket (FERRY_SOCKET), `<socketDir>/replica.sock`. */
  socketPath: string;
  /** The same socket as the server sees it, to connect to. */
  hostSocketPath: string;
  /** The path of one of `runtimeFiles`, by its host path. Throws for a path not listed there. */
  runtimeFile(host: string): string;
}

export type MemoryLimitKind = 'cgroup' | 'rlimit' | 'none';

export interface PreparedLaunch {
  /** What spawn() runs: for logs and debugging. */
  readonly file: string;
  readonly args: readonly string[];
  readonly cwd: string;
  readonly sandboxed: boolean;
  readonly memoryLimit: MemoryLimitKind;
  /** The replica's own memory cgroup (`<caps.cgroup.dir>/ferry-<replicaId>`), when memoryLimit is 'cgroup'. */
  readonly cgroupDir: string | null;
  readonly paths: SandboxPaths;
  /** Paths as the replica sees it (= paths.socketPath). */
  readonly socketPathInside: string;
  /**
   * Starts the replica. stdio is for fds 0-2 (default: stdin ignored, stdout and stderr piped); under bwrap
   * two more pipes (fds 3 and 4) carry its status and the environment and are not for the caller.
   */
  spawn(stdio?: ReplicaStdio): ReplicaProcess;
  /** After the process exited: whether the memory cgroup recorded an OOM kill (always false without one). */
  wasOomKilled(): Promise<boolean>;
  /** Removes the cgroup (killing anything left in it). Call after the process exited; safe to call twice. */
  cleanup(): Promise<void>;
}

export type ReplicaStdio = [
  'ignore' | 'pipe' | 'inherit',
  'ignore' | 'pipe' | 'inherit',
  'ignore' | 'pipe' | 'inherit',
];

export interface ReplicaProcess {
  /**
   * The host-side process (bwrap, or the replica itself without bwrap); 'exit' fires when the replica has
   * ended. Under bwrap a replica killed by signal N shows as exit code 128 + N (137 for an OOM kill).
   */
  readonly child: ChildProcess;
  /**
   * Sends a signal to the replica's own process. Under bwrap a signal to `child` would only kill the
   * monitor (and with it, the sandbox, hard), so SIGTERM must go this way to allow a graceful stop.
   * SIGKILL takes the whole sandbox down. Returns false when there was nothing left to signal.
   */
  kill(signal?: NodeJS.Signals): boolean;
}

export const SANDBOX_APP_DIR = '/app';
export const SANDBOX_SOCKET_DIR = '/run/ferry';
export const REPLICA_SOCKET_NAME = 'replica.sock';
/** The uid and gid a sandboxed replica has inside its user namespace (conventionally "nobody"). */
export const SANDBOX_UID = 65534;

const PROBE_TIMEOUT_MS = 5_000;
const SYSTEM_DIRS = ['/usr', '/etc'];
/** Top-level folders that are symlinks into /usr on merged-/usr systems and real folders elsewhere. */
const SYSTEM_LINKS = ['/bin', '/sbin', '/lib', '/lib64', '/lib32', '/libx32'];
const SEARCH_PATH = ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin'];
const WRAPPER_ENV = { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' };
/** Joins the memory cgroup before anything else runs, so no allocation escapes the limit. */
const JOIN_CGROUP_SCRIPT = 'echo $$ > "$1" || exit 125; shift; exec "$@"';

let cached: Promise<SandboxCapabilities> | undefined;

/** The sandbox capabilities of this machine, probed on first use and then cached for the process. */
export function detectSandbox(): Promise<SandboxCapabilities> {
  cached ??= probeSandbox();
  return cached;
}

/**
 * Probes without the cache: finds bwrap and starts a trivial sandbox with it (5 s timeout), finds a
 * memory cgroup parent by creating, limiting, joining and removing a probe child, and finds prlimit.
 * `FERRY_SANDBOX=off` in `env` forces bwrap off (for debugging); memory limits still apply.
 */
export async function probeSandbox(env: NodeJS.ProcessEnv = process.env): Promise<SandboxCapabilities> {
  const reasons: string[] = [];
  const caps: SandboxCapabilities = {
    bwrap: null,
    bwrapVersion: null,
    bwrapFeatures: { disableUserns: false, tmpfsSize: false },
    userNamespaces: false,
    cgroup: null,
    prlimit: null,
    reasons,
  };
  // The cgroup first and alone: on v2 it may move this process, which needs no other process (a bwrap
  // probe) in its cgroup at that moment.
  const cgroup = await probeCgroup().catch((err: Error) => ({ reason: `memory cgroup probe failed: ${err.message}` }));
  const [bwrap, prlimit] = await Promise.all([
    probeBwrap(env, caps).catch((err: Error) => {
      reasons.push(`bubblewrap probe failed: ${err.message}`);
      return null;
    }),
    findExecutable('prlimit', env),
  ]);
  caps.bwrap = bwrap;
  caps.prlimit = prlimit;
  if ('reason' in cgroup) reasons.push(cgroup.reason);
  else caps.cgroup = cgroup;
  if (!caps.cgroup) {
    reasons.push(
      prlimit
        ? 'memory limits fall back to RLIMIT_DATA (prlimit): the kernel does not report OOM kills, and /tmp in the sandbox is bounded by its tmpfs size only'
        : 'prlimit (util-linux) not found: replicas run WITHOUT a memory limit',
    );
  }
  return caps;
}

async function probeBwrap(env: NodeJS.ProcessEnv, caps: SandboxCapabilities): Promise<string | null> {
  const userns: string[] = [];
  caps.userNamespaces = await userNamespacesAllowed(userns);
  caps.reasons.push(...userns.filter((note) => !note.startsWith('AppArmor')));
  const bwrap = await findExecutable('bwrap', env);
  if (!bwrap) {
    caps.reasons.push('bubblewrap (bwrap) not found on PATH: install it (apt-get install bubblewrap)');
    return null;
  }
  const [version, help] = await Promise.all([
    run(bwrap, ['--version'], { timeoutMs: PROBE_TIMEOUT_MS }),
    run(bwrap, ['--help'], { timeoutMs: PROBE_TIMEOUT_MS }),
  ]);
  caps.bwrapVersion = version.stdout.trim().replace(/^bubblewrap\s+/, '') || null;
  caps.bwrapFeatures = {
    disableUserns: help.stdout.includes('--disable-userns'),
    tmpfsSize: help.stdout.includes('--size'),
  };
  if (env.FERRY_SANDBOX === 'off') {
    caps.reasons.push('FERRY_SANDBOX=off: the sandbox is switched off');
    return null;
  }
  const truePath = (await findExecutable('true', WRAPPER_ENV)) ?? '/bin/true';
  const args = [...(await baseBwrapArgs(caps.bwrapFeatures, 'host')), '--tmpfs', '/tmp', '--', truePath];
  const result = await run(bwrap, args, { timeoutMs: PROBE_TIMEOUT_MS });
  if (result.code === 0) {
    caps.userNamespaces = true;
    return bwrap;
  }
  const why = result.timedOut ? 'timed out' : result.stderr.trim() || result.error || `exit code ${result.code}`;
  caps.reasons.push(`${bwrap} cannot start a sandbox with a user namespace: ${why}`);
  // Only worth saying when it may be the cause.
  caps.reasons.push(...userns.filter((note) => note.startsWith('AppArmor')));
  return null;
}

/** Without bwrap to ask, the sysctls tell whether an unprivileged user namespace would be allowed. */
async function userNamespacesAllowed(reasons: string[]): Promise<boolean> {
  const read = async (file: string) => (await fs.readFile(file, 'utf8').catch(() => '')).trim();
  const [max, clone, apparmor] = await Promise.all([
    read('/proc/sys/user/max_user_namespaces'),
    read('/proc/sys/kernel/unprivileged_userns_clone'),
    read('/proc/sys/kernel/apparmor_restrict_unprivileged_userns'),
  ]);
  if (max === '0') {
    reasons.push('user namespaces are disabled (user.max_user_namespaces = 0)');
    return false;
  }
  if (clone === '0') {
    reasons.push('unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0)');
    return false;
  }
  if (apparmor === '1') {
    reasons.push('AppArmor restricts unprivileged user namespaces; bwrap needs a profile that allows them');
  }
  return true;
}

// ---- cgroups ----

interface CgroupMount {
  version: 1 | 2;
  root: string;
  mountPoint: string;
}

async function probeCgroup(): Promise<{ version: 1 | 2; dir: string } | { reason: string }> {
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

  const v2 = mounts.find((m) => m.version === 2);
  const v2Path = own.get('');
  if (v2 && v2Path !== undefined) {
    const controllers = await fs.readFile(path.join(v2.mountPoint, 'cgroup.controllers'), 'utf8').catch(() => '');
    // In hybrid mode the v2 hierarchy exists but holds no controllers; memory is then on v1.
    if (controllers.split(/\s+/).includes('memory')) {
      const dir = hostDir(v2, v2Path);
      if (!dir) notes.push(`cgroup v2: own cgroup ${v2Path} is outside the mounted hierarchy`);
      else {
        const result = await prepareV2Parent(dir);
        if (typeof result === 'string') notes.push(`cgroup v2 at ${dir}: ${result}`);
        else {
          const probe = await probeChild(2, result);
          if (probe === null) return { version: 2, dir: result };
          notes.push(`cgroup v2 at ${result}: ${probe}`);
        }
      }
    }
  }

  const v1 = mounts.find((m) => m.version === 1);
  const v1Path = [...own].find(([controllers]) => controllers.split(',').includes('memory'))?.[1];
  if (v1 && v1Path !== undefined) {
    const dir = hostDir(v1, v1Path);
    if (!dir) notes.push(`cgroup v1: own memory cgroup ${v1Path} is outside the mounted hierarchy`);
    else {
      const probe = await probeChild(1, dir);
      if (probe === null) return { version: 1, dir };
      notes.push(`cgroup v1 at ${dir}: ${probe}`);
    }
  }
  if (notes.length === 0) notes.push('no memory cgroup controller is mounted');
  return { reason: `no writable memory cgroup: ${notes.join('; ')}` };
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
    if (fstype === 'cgroup2') mounts.push({ version: 2, root, mountPoint });
    else if (fstype === 'cgroup' && superOptions.split(',').includes('memory'))
      mounts.push({ version: 1, root, mountPoint });
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
  return path.join(mount.mountPoint, cgroupPath.slice(root.length));
}

/**
 * Makes a v2 cgroup able to have memory-limited children: 'memory' must be in its subtree_control, which
 * the kernel refuses (EBUSY) while the cgroup itself holds processes. When the only process in it is this
 * one, it moves into a leaf `ferry-server` first, as delegated services do.
 */
async function prepareV2Parent(dir: string): Promise<string> {
  // A previous probe of this process may already have moved it into the leaf.
  if (path.basename(dir) === 'ferry-server') dir = path.dirname(dir);
  const subtree = () => fs.readFile(path.join(dir, 'cgroup.subtree_control'), 'utf8').catch(() => '');
  if ((await subtree()).split(/\s+/).includes('memory')) return dir;
  try {
    await fs.writeFile(path.join(dir, 'cgroup.subtree_control'), '+memory');
    return dir;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EBUSY') {
      return `cannot enable the memory controller for children (${(err as Error).message})`;
    }
  }
  const procs = (await fs.readFile(path.join(dir, 'cgroup.procs'), 'utf8')).split('\n').filter(Boolean);
  if (procs.some((pid) => pid !== String(process.pid))) {
    return 'the memory controller is not enabled for children and other processes share this cgroup';
  }
  try {
    const leaf = path.join(dir, 'ferry-server');
    await fs.mkdir(leaf, { recursive: true });
    await fs.writeFile(path.join(leaf, 'cgroup.procs'), String(process.pid));
    await fs.writeFile(path.join(dir, 'cgroup.subtree_control'), '+memory');
    return dir;
  } catch (err) {
    return `cannot enable the memory controller for children (${(err as Error).message})`;
  }
}

/** Creates, limits, joins and removes a probe child; null when all of it worked, else why not. */
async function probeChild(version: 1 | 2, parent: string): Promise<string | null> {
  const dir = path.join(parent, `ferry-probe-${process.pid}-${randomBytes(4).toString('hex')}`);
  try {
    await fs.mkdir(dir);
  } catch (err) {
    return `cannot create a child cgroup (${(err as Error).message})`;
  }
  try {
    await fs.writeFile(path.join(dir, version === 1 ? 'memory.limit_in_bytes' : 'memory.max'), String(64 << 20));
    const joined = await run(
      '/bin/sh',
      ['-c', JOIN_CGROUP_SCRIPT, 'ferry-probe', path.join(dir, 'cgroup.procs'), 'true'],
      {
        timeoutMs: PROBE_TIMEOUT_MS,
        env: WRAPPER_ENV,
      },
    );
    if (joined.code !== 0) return `cannot move a process into a child cgroup (${joined.stderr.trim() || joined.code})`;
    return null;
  } catch (err) {
    return `cannot set a memory limit (${(err as Error).message})`;
  } finally {
    await removeCgroup(dir).catch(() => {});
  }
}

async function removeCgroup(dir: string): Promise<void> {
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
  const procs = await fs.readFile(path.join(dir, 'cgroup.procs'), 'utf8').catch(() => '');
  for (const pid of procs.split('\n').filter(Boolean)) {
    try {
      process.kill(Number(pid), 'SIGKILL');
    } catch {
      // already gone
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

// ---- paths ----

/** Paths as the replica will see them, so the caller builds `command` and `env` right for either mode. */
export function sandboxPaths(layout: SandboxLayout, sandboxed: boolean): SandboxPaths {
  const socketDir = sandboxed ? SANDBOX_SOCKET_DIR : path.resolve(layout.socketDir);
  return {
    appDir: sandboxed ? SANDBOX_APP_DIR : path.resolve(layout.buildDir),
    socketDir,
    socketPath: path.posix.join(socketDir, REPLICA_SOCKET_NAME),
    hostSocketPath: path.join(path.resolve(layout.socketDir), REPLICA_SOCKET_NAME),
    runtimeFile(host: string): string {
      const entry = layout.runtimeFiles.find((f) => path.resolve(f.host) === path.resolve(host));
      if (!entry) throw new Error(`${host} is not one of the launch's runtimeFiles`);
      return sandboxed ? entry.sandbox : path.resolve(entry.host);
    },
  };
}

// ---- launching ----

/**
 * Creates the replica's memory cgroup (when there is one) and the command that starts it: under bwrap
 * when caps.bwrap is set, else as a plain process in the build folder. Call cleanup() after it exited.
 */
export async function prepareLaunch(launch: ReplicaLaunch, caps: SandboxCapabilities): Promise<PreparedLaunch> {
  validateLaunch(launch);
  const sandboxed = caps.bwrap !== null;
  const paths = sandboxPaths(launch, sandboxed);
  const buildDir = path.resolve(launch.buildDir);
  const socketDir = path.resolve(launch.socketDir);
  if (!(await fs.stat(buildDir)).isDirectory()) throw new Error(`Build folder ${buildDir} is not a folder`);
  // bwrap would fail too, but only in the replica's stderr.
  for (const entry of launch.runtimeFiles) await fs.access(entry.host);
  await fs.mkdir(socketDir, { recursive: true, mode: 0o700 });
  // A socket file left by an earlier replica in this folder would make the new one's listen fail.
  await fs.rm(paths.hostSocketPath, { force: true });
  const memoryBytes = Math.floor(launch.memoryMiB * 1024 * 1024);

  const cwdInside = path.posix.join(paths.appDir, launch.cwd ?? '.');
  const cwdHost = path.join(buildDir, launch.cwd ?? '.');

  let file: string;
  let args: string[];
  let env: Record<string, string>;
  let envArgs: Buffer | null = null;
  const network = launch.network ?? 'host';
  const netnsPath = typeof network === 'object' ? network.netnsPath : null;
  if (sandboxed) {
    const bwrapArgs = [
      ...(await baseBwrapArgs(
        caps.bwrapFeatures,
        typeof network === 'object' ? (netnsPath ? 'host' : 'isolated') : network,
      )),
      ...(typeof network === 'object' && network.resolvConf ? await resolvConfArgs(network.resolvConf) : []),
      ...(caps.bwrapFeatures.tmpfsSize ? ['--size', String(memoryBytes)] : []),
      '--tmpfs',
      '/tmp',
      '--ro-bind',
      buildDir,
      SANDBOX_APP_DIR,
      '--bind',
      socketDir,
      SANDBOX_SOCKET_DIR,
    ];
    for (const entry of launch.runtimeFiles) bwrapArgs.push('--ro-bind', path.resolve(entry.host), entry.sandbox);
    bwrapArgs.push('--chdir', cwdInside, '--info-fd', '3', '--clearenv', '--args', '4', '--', ...launch.command);
    file = caps.bwrap!;
    args = bwrapArgs;
    if (netnsPath) {
      // The namespace is joined outside bwrap, so the sandbox holds no capability over it.
      args = [`--net=${netnsPath}`, '--', file, ...args];
      file = await nsenterPath();
    }
    env = { ...WRAPPER_ENV };
    envArgs = Buffer.from(
      Object.entries(launch.env)
        .flatMap(([name, value]) => ['--setenv', name, value, ''].join('\0'))
        .join(''),
    );
  } else {
    file = launch.command[0]!;
    args = launch.command.slice(1);
    // Shells set PWD; set it here too so both modes give the replica the same environment.
    env = { ...launch.env, PWD: cwdHost };
  }

  let memoryLimit: MemoryLimitKind = 'none';
  let cgroupDir: string | null = null;
  if (caps.cgroup) {
    cgroupDir = await createReplicaCgroup(caps.cgroup.version, caps.cgroup.dir, launch.replicaId, memoryBytes);
    args = ['-c', JOIN_CGROUP_SCRIPT, 'ferry-replica', path.join(cgroupDir, 'cgroup.procs'), file, ...args];
    file = '/bin/sh';
    memoryLimit = 'cgroup';
  } else if (caps.prlimit) {
    // RLIMIT_DATA, not RLIMIT_AS: V8 reserves far more address space than it ever uses.
    args = [`--data=${memoryBytes}`, '--', file, ...args];
    file = caps.prlimit;
    memoryLimit = 'rlimit';
  }

  const cgroupVersion = caps.cgroup?.version ?? 1;
  let oomKilled: boolean | undefined;
  const wasOomKilled = async () => {
    if (oomKilled !== undefined) return oomKilled;
    return cgroupDir ? readOomKilled(cgroupVersion, cgroupDir) : false;
  };
  const finalArgs = args;
  const finalFile = file;
  const finalEnv = env;
  const spawnCwd = sandboxed ? '/' : cwdHost;

  return {
    file,
    args,
    cwd: sandboxed ? cwdInside : cwdHost,
    sandboxed,
    memoryLimit,
    cgroupDir,
    paths,
    socketPathInside: paths.socketPath,
    spawn: (stdio = ['ignore', 'pipe', 'pipe']) =>
      spawnReplica(finalFile, finalArgs, finalEnv, spawnCwd, stdio, envArgs),
    wasOomKilled,
    async cleanup() {
      if (!cgroupDir) return;
      oomKilled = await wasOomKilled();
      await removeCgroup(cgroupDir);
      cgroupDir = null;
    },
  };
}

function validateLaunch(launch: ReplicaLaunch): void {
  if (!/^[A-Za-z0-9_.-]{1,100}$/.test(launch.replicaId) || /^\.+$/.test(launch.replicaId)) {
    throw new Error(`Invalid replica id ${JSON.stringify(launch.replicaId)}`);
  }
  if (launch.command.length === 0) throw new Error('The replica command is empty');
  if (!Number.isFinite(launch.memoryMiB) || launch.memoryMiB < 16) {
    throw new Error(`Memory limit must be at least 16 MiB (got ${launch.memoryMiB})`);
  }
  if (launch.cwd !== undefined && (path.isAbsolute(launch.cwd) || launch.cwd.split(/[\\/]/).includes('..'))) {
    throw new Error(`cwd must be a folder inside the app (got ${launch.cwd})`);
  }
  for (const entry of launch.runtimeFiles) {
    const target = entry.sandbox;
    if (!path.posix.isAbsolute(target) || target.split('/').includes('..')) {
      throw new Error(`Sandbox path ${target} must be absolute without ".."`);
    }
    const reserved = [SANDBOX_APP_DIR, SANDBOX_SOCKET_DIR, '/tmp', '/proc', '/dev', ...SYSTEM_DIRS, ...SYSTEM_LINKS];
    if (reserved.some((dir) => target === dir || target.startsWith(`${dir}/`))) {
      throw new Error(`Sandbox path ${target} is inside a folder the sandbox already uses`);
    }
  }
  for (const [name, value] of Object.entries(launch.env)) {
    if (name === '' || name.includes('=') || name.includes('\0') || value.includes('\0')) {
      throw new Error(`Invalid environment variable ${JSON.stringify(name)}`);
    }
  }
}

async function createReplicaCgroup(version: 1 | 2, parent: string, replicaId: string, bytes: number): Promise<string> {
  const dir = path.join(parent, `ferry-${replicaId}`);
  try {
    await fs.mkdir(dir);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
    // Left by a crash: empty ones go, a busy one is a replica still running under this id.
    await removeCgroup(dir);
    await fs.mkdir(dir);
  }
  try {
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
  } catch (err) {
    await removeCgroup(dir).catch(() => {});
    throw err;
  }
  return dir;
}

async function writeIfPresent(file: string, value: string): Promise<void> {
  try {
    await fs.writeFile(file, value, { flag: 'r+' });
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
}

function spawnReplica(
  file: string,
  args: string[],
  env: Record<string, string>,
  cwd: string,
  stdio: ReplicaStdio,
  envArgs: Buffer | null,
): ReplicaProcess {
  const child = spawn(file, args, { cwd, env, stdio: envArgs ? [...stdio, 'pipe', 'pipe'] : stdio });
  if (!envArgs) {
    return { child, kill: (signal = 'SIGTERM') => child.kill(signal) };
  }
  // bwrap writes {"child-pid": N} on fd 3: the host pid of the sandbox's init (bwrap's reaper).
  let initPid: number | undefined;
  const info = child.stdio[3] as Readable;
  let text = '';
  info.setEncoding('utf8');
  info.on('data', (chunk: string) => {
    text += chunk;
    const match = /"child-pid"\s*:\s*(\d+)/.exec(text);
    if (match) initPid = Number(match[1]);
  });
  info.on('error', () => {});
  const envPipe = child.stdio[4] as Writable;
  envPipe.on('error', () => {}); // bwrap failed before reading it: its exit says why
  envPipe.end(envArgs);

  let exited = false;
  child.once('exit', () => {
    exited = true;
  });
  return {
    child,
    kill(signal: NodeJS.Signals = 'SIGTERM') {
      if (exited) return false;
      const target = signal === 'SIGKILL' || initPid === undefined ? undefined : firstChild(initPid);
      if (target === undefined) return child.kill(signal);
      try {
        process.kill(target, signal);
        return true;
      } catch {
        return child.kill(signal);
      }
    },
  };
}

/** The replica itself is the only child of the sandbox's init. */
function firstChild(pid: number): number | undefined {
  try {
    const children = fsSync.readFileSync(`/proc/${pid}/task/${pid}/children`, 'utf8').trim().split(/\s+/);
    const first = Number(children[0]);
    return Number.isInteger(first) && first > 0 ? first : undefined;
  } catch {
    return undefined;
  }
}

// ---- bwrap arguments ----

let nsenterFound: Promise<string> | undefined;

function nsenterPath(): Promise<string> {
  nsenterFound ??= findExecutable('nsenter', WRAPPER_ENV).then((file) => {
    if (!file) throw new Error('nsenter (util-linux) not found: cannot join the sandbox network');
    return file;
  });
  return nsenterFound;
}

/**
 * Binds the lease's resolv.conf over /etc/resolv.conf; where that is a symlink (systemd-resolved's stub
 * file), over the file it points to, since bwrap cannot mount over a dangling symlink.
 */
async function resolvConfArgs(resolvConf: string): Promise<string[]> {
  let target = '/etc/resolv.conf';
  const stat = await fs.lstat(target).catch(() => null);
  if (stat?.isSymbolicLink()) target = path.resolve('/etc', await fs.readlink(target));
  return ['--ro-bind', resolvConf, target];
}

/** Everything but the replica's own folders: namespaces, the system folders, and /etc's masked entries. */
async function baseBwrapArgs(
  features: SandboxCapabilities['bwrapFeatures'],
  network: 'host' | 'isolated',
): Promise<string[]> {
  const args = [
    '--unshare-all',
    ...(network === 'host' ? ['--share-net'] : []),
    '--unshare-user',
    '--uid',
    String(SANDBOX_UID),
    '--gid',
    String(SANDBOX_UID),
    ...(features.disableUserns ? ['--disable-userns'] : []),
    '--die-with-parent',
    '--new-session',
    '--cap-drop',
    'ALL',
  ];
  const systemRoots: string[] = [];
  for (const dir of SYSTEM_DIRS) {
    args.push('--ro-bind', dir, dir);
    systemRoots.push(dir);
  }
  for (const link of SYSTEM_LINKS) {
    const stat = await fs.lstat(link).catch(() => null);
    if (!stat) continue;
    if (stat.isSymbolicLink()) args.push('--symlink', await fs.readlink(link), link);
    else if (stat.isDirectory()) {
      args.push('--ro-bind', link, link);
      systemRoots.push(link);
    }
  }
  const nodeDir = path.dirname(process.execPath);
  const realRoots = await Promise.all(systemRoots.map((dir) => fs.realpath(dir).catch(() => dir)));
  if (!realRoots.some((root) => nodeDir === root || nodeDir.startsWith(`${root}/`))) {
    args.push('--ro-bind', nodeDir, nodeDir);
  }
  const masks = await etcMasks();
  for (const dir of masks.dirs) args.push('--tmpfs', dir, '--remount-ro', dir);
  // bwrap binds with nodev, so a masked file opens with EACCES, as it would for an unprivileged user.
  for (const file of masks.files) args.push('--ro-bind', '/dev/null', file);
  args.push('--proc', '/proc', '--dev', '/dev');
  return args;
}

const ETC_MASK_TTL_MS = 60_000;
const ETC_MAX_ENTRIES = 20_000;
let etcMaskCache: { at: number; value: Promise<{ dirs: string[]; files: string[] }> } | undefined;

/**
 * Entries of /etc an unprivileged user could not read. Recomputed at most once a minute, so secrets
 * installed while the server runs (a new service's config) get masked too.
 */
function etcMasks(): Promise<{ dirs: string[]; files: string[] }> {
  if (!etcMaskCache || Date.now() - etcMaskCache.at > ETC_MASK_TTL_MS) {
    etcMaskCache = { at: Date.now(), value: scanUnreadable('/etc') };
  }
  return etcMaskCache.value;
}

async function scanUnreadable(root: string): Promise<{ dirs: string[]; files: string[] }> {
  const dirs: string[] = [];
  const files: string[] = [];
  const queue = [root];
  let seen = 0;
  while (queue.length > 0 && seen < ETC_MAX_ENTRIES) {
    const dir = queue.shift()!;
    const entries = await fs.readdir(dir).catch(() => [] as string[]);
    const stats = await Promise.all(
      entries.map(async (name) => {
        const full = path.join(dir, name);
        return { full, stat: await fs.lstat(full).catch(() => null) };
      }),
    );
    seen += entries.length;
    for (const { full, stat } of stats) {
      if (!stat || stat.isSymbolicLink()) continue;
      if (stat.isDirectory()) {
        if ((stat.mode & 0o005) !== 0o005) dirs.push(full);
        else queue.push(full);
      } else if ((stat.mode & 0o004) === 0) {
        files.push(full);
      }
    }
  }
  return { dirs, files };
}

// ---- small helpers ----

async function findExecutable(name: string, env: NodeJS.ProcessEnv): Promise<string | null> {
  const dirs = [...(env.PATH ?? '').split(':').filter((d) => d.startsWith('/')), ...SEARCH_PATH];
  for (const dir of dirs) {
    const candidate = path.join(dir, name);
    try {
      const stat = await fs.stat(candidate);
      if (!stat.isFile()) continue;
      await fs.access(candidate, fsSync.constants.X_OK);
      return candidate;
    } catch {
      // not here
    }
  }
  return null;
}

interface RunResult {
  code: number | null;
  stdout: string;
  stderr: string;
  timedOut: boolean;
  error?: string;
}

function run(
  file: string,
  args: string[],
  options: { timeoutMs: number; env?: Record<string, string> },
): Promise<RunResult> {
  return new Promise((resolve) => {
    const child = spawn(file, args, { env: options.env ?? WRAPPER_ENV, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    let timedOut = false;
    child.stdout.setEncoding('utf8').on('data', (chunk: string) => {
      stdout += chunk;
    });
    child.stderr.setEncoding('utf8').on('data', (chunk: string) => {
      stderr += chunk;
    });
    const timer = setTimeout(() => {
      timedOut = true;
      child.kill('SIGKILL');
    }, options.timeoutMs);
    child.on('error', (err) => {
      clearTimeout(timer);
      resolve({ code: null, stdout, stderr, timedOut, error: err.message });
    });
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr, timedOut });
    });
  });
}
