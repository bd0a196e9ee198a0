/**
 * The replica sandbox: bubblewrap for isolation, the replica cgroup (cgroups.ts: memory, processes, CPU)
 * for limits, RLIMIT_DATA for memory where no cgroup is writable.
 *
 * API:
 *   detectSandbox(): Promise<SandboxCapabilities>          probed once per process (cached)
 *   probeSandbox(env?): Promise<SandboxCapabilities>       probes again, uncached (tests, `ferry doctor`)
 *   sandboxPaths(layout, sandboxed): SandboxPaths          paths as the replica sees them, for building
 *                                                          `command` and `env` in either mode
 *   prepareLaunch(launch, caps): Promise<PreparedLaunch>   creates the cgroup and the argv; then
 *     prepared.spawn(stdio?) → ReplicaProcess { child, kill(signal), socketPath }
 *     prepared.wasOomKilled(), prepared.cleanup()          after the process exited
 *
 * Typical use:
 *   const caps = await detectSandbox();
 *   const layout = { buildDir, socketDir, runtimeFiles: [{ host: bootstrapJs, sandbox: '/ferry/bootstrap.js' }] };
 *   const p = sandboxPaths(layout, caps.bwrap !== null);
 *   const prepared = await prepareLaunch({ ...layout, replicaId, memoryMiB, maxProcesses, cpu,
 *     command: [process.execPath, '--max-old-space-size=768', p.runtimeFile(bootstrapJs)],
 *     env: { FERRY_PROTOCOL: '1', FERRY_SOCKET: p.socketPath, FERRY_ENTRY: `${p.appDir}/out/main.mjs`, ... } }, caps);
 *   const replica = prepared.spawn();        // connect to `await replica.socketPath`
 *   replica.kill('SIGTERM');                 // reaches the replica itself, not bwrap
 *   ... on exit: await prepared.wasOomKilled(); await prepared.cleanup();
 *
 * Limits: the process joins its replica cgroup through a `/bin/sh` wrapper before exec'ing bwrap, so
 * nothing it starts or allocates escapes them. Every writable place in the sandbox is a size-limited tmpfs
 * whose pages the kernel charges to that cgroup: /tmp and /dev/shm (each at most the memory limit) and
 * /run/ferry (64 KiB, the replica's socket). The sandbox's root and /dev are remounted read-only, so
 * nothing else can be written. No host folder is writable inside.
 *
 * The socket: the replica listens on /run/ferry/replica.sock in its private tmpfs; the server connects
 * through `/proc/<sandbox init pid>/root/run/ferry/replica.sock`, known once bwrap reports the pid (on
 * --info-fd), hence `ReplicaProcess.socketPath` is a promise. Without bwrap the socket is in `socketDir`.
 *
 * Identity: inside, the replica is uid/gid 65534 in its own user namespace. When Ferry is not root, that
 * maps to the server's own (unprivileged) uid on the host. When Ferry is root it never maps to host root:
 * the wrapper drops to a host uid of the sandbox's own (sandbox/identity.ts: `setpriv`, then bwrap makes
 * an unprivileged user namespace), so every kernel check sees an ordinary user; build views make the
 * build's files readable by others for it (views.ts). /proc/sys is read-only and the host-wide
 * entries of /proc (keys, timer_list, slabinfo, kpage*, sysrq-trigger, ...) are masked either way. On the
 * few host paths bound in, the replica reads what an unprivileged user may read: that is why entries of
 * /etc that such a user could not read (shadow, TLS private keys, service configs with passwords) are
 * masked too, and why nothing else of the host is bound.
 *
 * Nothing of the host shows inside: all of bwrap's options (the environment too) reach it through a pipe
 * (`--args`), so /proc/1/cmdline in the sandbox reads `bwrap --args 4 -- <command>`, the command made of
 * sandbox paths only; the runtime files (bootstrap,
 * supervisor) are copied in (`--file`), not bound, so no mount shows Ferry's install path. The one host
 * path left in /proc/self/mountinfo is the build folder's (the source of the /app bind): see
 * docs/operations.md. The replica's environment is exactly `env` (plus PWD, its working folder), and the
 * host-side wrappers get none of it (an app's LD_PRELOAD must not reach programs outside the sandbox).
 */
import { type ChildProcess, spawn } from 'node:child_process';
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Readable, Writable } from 'node:stream';
import { type CgroupSupport, createReplicaCgroup, probeCgroups, type ReplicaCgroup } from './cgroups.js';
import {
  acquireSandboxUid,
  dropPrivilegesArgs,
  probeIdentity,
  releaseSandboxUid,
  type SandboxIdentity,
  unreachableByOthers,
} from './identity.js';
import { joinNetworkArgs, type SandboxNetworkLease } from './network.js';
import { runQuiet, WRAPPER_ENV } from './run-quiet.js';
import { mirror, stagingRoot } from './views.js';

export { WRAPPER_ENV };

export interface SandboxCapabilities {
  /** A bubblewrap that was seen to start a sandbox; null when it is missing, broken, or FERRY_SANDBOX=off. */
  bwrap: string | null;
  /** `bwrap --version`, when bwrap was found. */
  bwrapVersion: string | null;
  /** Options of that bwrap that newer versions add (from `bwrap --help`). */
  bwrapFeatures: { disableUserns: boolean; tmpfsSize: boolean };
  /** Whether a user namespace could be created (bwrap needs it to map the replica to uid 65534). */
  userNamespaces: boolean;
  /**
   * The controllers (memory, pids, cpu) under which a child was created, limited and joined; replicas get
   * `<parent>/ferry-<id>` under each. null when none is writable.
   */
  cgroup: CgroupSupport | null;
  /** util-linux prlimit, used for RLIMIT_DATA when there is no writable memory cgroup. */
  prlimit: string | null;
  /**
   * When Ferry runs as root: the range of unprivileged host uids sandboxes run as (sandbox/identity.ts),
   * so that none maps to host root. null when Ferry is not root (sandboxes map to Ferry's own uid).
   */
  identity: SandboxIdentity | null;
  /** Human-readable notes on what is missing and why. */
  reasons: string[];
}

/** Where a replica's files are: host folders and the path each has inside the sandbox. */
export interface SandboxLayout {
  /** Host folder of the build, read-only at /app. */
  buildDir: string;
  /**
   * Host folder for the replica's socket, used only without bwrap (under bwrap the socket is in a private
   * tmpfs at /run/ferry). Created (0700) when missing.
   */
  socketDir: string;
  /**
   * Small read-only files, e.g. the bootstrap at /ferry/bootstrap.mjs (absolute sandbox paths). Under bwrap
   * they are copied into the sandbox when it starts, so no mount names their host path.
   */
  runtimeFiles: Array<{ host: string; sandbox: string }>;
}

export interface ReplicaLaunch extends SandboxLayout {
  /** Names the cgroup (`ferry-<replicaId>`): letters, digits, `_`, `-`, `.`. */
  replicaId: string;
  /** argv as the replica sees it; build it with sandboxPaths(). command[0] should be absolute. */
  command: string[];
  /** The complete environment of the replica: nothing of the server's own is added. */
  env: Record<string, string>;
  memoryMiB: number;
  /** Processes (threads included: the kernel counts tasks) the replica may have at once; default 256. */
  maxProcesses?: number;
  /** CPU cores as a quota (0.25 = a quarter of one core's time); default 1. */
  cpu?: number;
  /** Working folder relative to the app folder (default: the app folder itself). */
  cwd?: string;
  /**
   * `host` (default): the replica shares the server's network. `isolated`: under bwrap it gets its own
   * network namespace with only a loopback interface. A lease (sandbox/network.ts): bwrap starts inside
   * the lease's namespace (`nsenter --net`), or in a fresh loopback-only one when its netnsPath is null,
   * with the lease's resolv.conf at /etc/resolv.conf. Either way replicas can all listen on one port
   * without clashing (custom runtime). Without bwrap this has no effect.
   */
  network?: 'host' | 'isolated' | Pick<SandboxNetworkLease, 'netnsPath' | 'usernsPath' | 'resolvConf'>;
  /** Host folders bound read-write (or read-only) at absolute sandbox paths: the app's volumes. Needs bwrap. */
  volumes?: ReadonlyArray<{ host: string; sandbox: string; readOnly: boolean }>;
  /** Supplementary host groups the sandbox keeps (as root: the volumes' groups, identity.ts). */
  groups?: readonly number[];
  /** An image's unpacked root as `/` instead of the host's system folders (see ImageRoot). Needs bwrap. */
  image?: ImageRoot;
}

/**
 * An image's root file system as the sandbox's `/`, read-only: each top-level entry of the unpacked root
 * is bound (folders and files) or recreated (links) in bwrap's root, except the folders the sandbox makes
 * itself (/proc, /dev, /tmp, /run, /app, /ferry). Nothing of the host's system folders is visible.
 */
export interface ImageRoot {
  /** The unpacked root on the host (the node's image cache; never written). */
  rootfs: string;
  /** Host files bound read-only at sandbox paths under /ferry (Ferry's own Node, sandbox/node-binding.ts). */
  files: ReadonlyArray<{ host: string; sandbox: string }>;
  /** The working folder, absolute in the image (its WORKDIR); default: the app folder. */
  workingDir?: string;
}

/** Top-level names of an image the sandbox provides itself. */
const IMAGE_ROOT_SKIPPED = new Set(['proc', 'dev', 'tmp', 'run', 'app', 'ferry']);

/** Paths as the replica sees them: sandbox paths under bwrap, the host paths themselves without it. */
export interface SandboxPaths {
  appDir: string;
  socketDir: string;
  /** The replica's socket (FERRY_SOCKET), `<socketDir>/replica.sock`. */
  socketPath: string;
  /**
   * The same socket as the server sees it, to connect to; null under bwrap, where it is only known after
   * spawn (ReplicaProcess.socketPath).
   */
  hostSocketPath: string | null;
  /** The path of one of `runtimeFiles`, by its host path. Throws for a path not listed there. */
  runtimeFile(host: string): string;
}

export type LimitKind = 'cgroup' | 'rlimit' | 'none';
export type MemoryLimitKind = LimitKind;

export interface PreparedLaunch {
  /** What spawn() runs: for logs and debugging (under bwrap the arguments go through a pipe, see bwrapArgs). */
  readonly file: string;
  readonly args: readonly string[];
  /** bwrap's own options, sent on fd 4 (`--args 4`; only the command follows on its command line); empty without bwrap. */
  readonly bwrapArgs: readonly string[];
  readonly cwd: string;
  readonly sandboxed: boolean;
  readonly memoryLimit: MemoryLimitKind;
  /** 'cgroup' when the pids controller limits the replica's processes, else 'none'. */
  readonly processLimit: LimitKind;
  /** 'cgroup' when a CFS quota limits the replica's CPU, else 'none'. */
  readonly cpuLimit: LimitKind;
  /** The replica's memory cgroup (`<parent>/ferry-<replicaId>`), when memoryLimit is 'cgroup'. */
  readonly cgroupDir: string | null;
  /** The replica's cgroup folder per controller (empty without one). */
  readonly cgroupDirs: Readonly<Partial<Record<'memory' | 'pids' | 'cpu', string>>>;
  readonly paths: SandboxPaths;
  /** Paths as the replica sees it (= paths.socketPath). */
  readonly socketPathInside: string;
  /** The host uid the sandbox's user maps to when Ferry is root (caps.identity); null: Ferry's own uid. */
  readonly hostUid: number | null;
  /**
   * Starts the replica. stdio is for fds 0-2 (default: stdin ignored, stdout and stderr piped); under bwrap
   * more fds (3: status, 4: arguments, 5…: runtime files) follow and are not for the caller.
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
   * SIGKILL takes the whole sandbox down (and everything in its cgroup). Returns false when there was
   * nothing left to signal.
   */
  kill(signal?: NodeJS.Signals): boolean;
  /**
   * The replica's socket as the server reaches it: under bwrap through the sandbox init's
   * `/proc/<pid>/root`, once bwrap has reported that pid; null if the process ended before it did.
   */
  readonly socketPath: Promise<string | null>;
}

export const SANDBOX_APP_DIR = '/app';
export const SANDBOX_SOCKET_DIR = '/run/ferry';
export const REPLICA_SOCKET_NAME = 'replica.sock';
/** The uid and gid a sandboxed replica has inside its user namespace (conventionally "nobody"). */
export const SANDBOX_UID = 65534;
/** The size of the socket folder's tmpfs: room for the socket, not for files. */
export const SOCKET_TMPFS_BYTES = 65_536;
/** Default of `[resources].max_processes`. */
export const DEFAULT_MAX_PROCESSES = 256;

const PROBE_TIMEOUT_MS = 5_000;
const SYSTEM_DIRS = ['/usr', '/etc'];
/** Top-level folders that are symlinks into /usr on merged-/usr systems and real folders elsewhere. */
const SYSTEM_LINKS = ['/bin', '/sbin', '/lib', '/lib64', '/lib32', '/libx32'];
/** The host's folders a sandbox sees at their own path, read-only (the `host` root filesystem, runtimes/runtime.ts). */
export const HOST_SYSTEM_ROOTS: readonly string[] = [...SYSTEM_DIRS, ...SYSTEM_LINKS];
const SEARCH_PATH = ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin'];
/** The first fd of the runtime files passed to bwrap's --file (0-2 stdio, 3 status, 4 arguments). */
const FIRST_FILE_FD = 5;

let cached: Promise<SandboxCapabilities> | undefined;

/** The sandbox capabilities of this machine, probed on first use and then cached for the process. */
export function detectSandbox(): Promise<SandboxCapabilities> {
  cached ??= probeSandbox();
  return cached;
}

/**
 * Probes without the cache: finds bwrap and starts a trivial sandbox with it (5 s timeout), finds the
 * writable cgroup controllers by creating, limiting, joining and removing a probe child, and finds
 * prlimit. `FERRY_SANDBOX=off` in `env` forces bwrap off (for debugging); limits still apply.
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
    identity: null,
    reasons,
  };
  // The cgroup first and alone: on v2 it may move this process, which needs no other process (a bwrap
  // probe) in its cgroup at that moment.
  const cgroups = await probeCgroups().catch((err: Error) => ({
    support: null,
    reasons: [`cgroup probe failed: ${err.message}`],
  }));
  const identity = await probeIdentity(env, () => findExecutable('setpriv', WRAPPER_ENV));
  caps.identity = identity.identity;
  reasons.push(...identity.reasons);
  const [bwrap, prlimit] = await Promise.all([
    (identity.unusable ? Promise.resolve(null) : probeBwrap(env, caps)).catch((err: Error) => {
      reasons.push(`bubblewrap probe failed: ${err.message}`);
      return null;
    }),
    findExecutable('prlimit', env),
  ]);
  caps.bwrap = bwrap;
  caps.prlimit = prlimit;
  caps.cgroup = cgroups.support;
  reasons.push(...cgroups.reasons);
  if (!caps.cgroup?.controllers.memory) {
    reasons.push(
      prlimit
        ? 'memory limits fall back to RLIMIT_DATA (prlimit): the kernel does not report OOM kills, and tmpfs pages (/tmp, /dev/shm) are bounded by their sizes only'
        : 'prlimit (util-linux) not found: replicas run WITHOUT a memory limit',
    );
  }
  if (caps.bwrap && !caps.bwrapFeatures.tmpfsSize) {
    reasons.push(
      `bwrap ${caps.bwrapVersion ?? ''} has no --size: /tmp and /dev/shm in the sandbox are bounded by the memory cgroup only`,
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
    runQuiet(bwrap, ['--version'], PROBE_TIMEOUT_MS),
    runQuiet(bwrap, ['--help'], PROBE_TIMEOUT_MS),
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
  const args = [...(await baseBwrapArgs(caps.bwrapFeatures, 'host', caps.identity !== null)), '--', truePath];
  // As root, the probe starts bwrap the way every sandbox is started: as an unprivileged sandbox uid.
  const probeUid = caps.identity ? acquireSandboxUid(caps.identity) : null;
  const [probeFile, ...probeArgs] =
    caps.identity && probeUid !== null
      ? [...dropPrivilegesArgs(caps.identity, probeUid), bwrap, ...args]
      : [bwrap, ...args];
  const result = await runQuiet(probeFile!, probeArgs, PROBE_TIMEOUT_MS).finally(() => releaseSandboxUid(probeUid));
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

// ---- paths ----

/** Paths as the replica will see them, so the caller builds `command` and `env` right for either mode. */
export function sandboxPaths(layout: SandboxLayout, sandboxed: boolean): SandboxPaths {
  const socketDir = sandboxed ? SANDBOX_SOCKET_DIR : path.resolve(layout.socketDir);
  return {
    appDir: sandboxed ? SANDBOX_APP_DIR : path.resolve(layout.buildDir),
    socketDir,
    socketPath: path.posix.join(socketDir, REPLICA_SOCKET_NAME),
    hostSocketPath: sandboxed ? null : path.join(path.resolve(layout.socketDir), REPLICA_SOCKET_NAME),
    runtimeFile(host: string): string {
      const entry = layout.runtimeFiles.find((f) => path.resolve(f.host) === path.resolve(host));
      if (!entry) throw new Error(`${host} is not one of the launch's runtimeFiles`);
      return sandboxed ? entry.sandbox : path.resolve(entry.host);
    },
  };
}

/** The replica's socket as the server reaches it, through the sandbox init's view of the filesystem. */
export function socketPathThroughInit(initPid: number): string {
  return `/proc/${initPid}/root${SANDBOX_SOCKET_DIR}/${REPLICA_SOCKET_NAME}`;
}

// ---- launching ----

/**
 * Creates the replica's cgroup (when there is one) and the command that starts it: under bwrap when
 * caps.bwrap is set, else as a plain process in the build folder. Call cleanup() after it exited.
 */
export async function prepareLaunch(launch: ReplicaLaunch, caps: SandboxCapabilities): Promise<PreparedLaunch> {
  validateLaunch(launch);
  const sandboxed = caps.bwrap !== null;
  if (!sandboxed && (launch.volumes?.length ?? 0) > 0) {
    throw new Error('Volumes are mounted into sandboxes only, and replicas are not sandboxed here');
  }
  if (!sandboxed && launch.image)
    throw new Error('Images run in the sandbox only, and replicas are not sandboxed here');
  const paths = sandboxPaths(launch, sandboxed);
  const buildDir = path.resolve(launch.buildDir);
  if (!(await fs.stat(buildDir)).isDirectory()) throw new Error(`Build folder ${buildDir} is not a folder`);
  // bwrap would fail too, but only in the replica's stderr.
  for (const entry of launch.runtimeFiles) {
    if (sandboxed && !(await fs.stat(entry.host)).isFile()) {
      throw new Error(`Runtime file ${entry.host} must be a file: it is copied into the sandbox`);
    }
    await fs.access(entry.host);
  }
  if (!sandboxed) {
    const socketDir = path.resolve(launch.socketDir);
    await fs.mkdir(socketDir, { recursive: true, mode: 0o700 });
    // A socket file left by an earlier replica in this folder would make the new one's listen fail.
    await fs.rm(paths.hostSocketPath!, { force: true });
  }
  const memoryBytes = Math.floor(launch.memoryMiB * 1024 * 1024);
  const maxProcesses = launch.maxProcesses ?? DEFAULT_MAX_PROCESSES;
  const cpu = launch.cpu ?? 1;

  const cwdInside = launch.image?.workingDir ?? path.posix.join(paths.appDir, launch.cwd ?? '.');
  const cwdHost = path.join(buildDir, launch.cwd ?? '.');

  let file: string;
  let args: string[];
  let env: Record<string, string>;
  let bwrapArgs: string[] = [];
  let hostUid: number | null = null;
  /** A mirror of the build made for this launch only (see below), removed by cleanup(). */
  let launchView: string | null = null;
  let appBind = buildDir;
  const network = launch.network ?? 'host';
  const netnsPath = typeof network === 'object' ? network.netnsPath : null;
  if (sandboxed) {
    const size = (bytes: number) => (caps.bwrapFeatures.tmpfsSize ? ['--size', String(bytes)] : []);
    bwrapArgs = [
      ...(await baseBwrapArgs(
        caps.bwrapFeatures,
        typeof network === 'object' ? (netnsPath ? 'host' : 'isolated') : network,
        caps.identity !== null,
        launch.image,
        memoryBytes,
      )),
      ...(typeof network === 'object' && network.resolvConf
        ? await resolvConfArgs(FIRST_FILE_FD + launch.runtimeFiles.length, launch.image?.rootfs)
        : []),
      // bwrap's --dev has no shm mount of its own: /dev/shm would be a folder of the unbounded /dev tmpfs.
      ...size(memoryBytes),
      '--tmpfs',
      '/dev/shm',
      '--remount-ro',
      '/dev',
      ...size(SOCKET_TMPFS_BYTES),
      '--tmpfs',
      SANDBOX_SOCKET_DIR,
      '--ro-bind',
      buildDir,
      SANDBOX_APP_DIR,
    ];
    const appBindAt = bwrapArgs.length - 2;
    bwrapArgs.push(...volumeBindArgs(launch.volumes ?? []));
    launch.runtimeFiles.forEach((entry, i) => {
      bwrapArgs.push('--perms', '0444', '--file', String(FIRST_FILE_FD + i), entry.sandbox);
    });
    // Last: the root tmpfs (bwrap's newroot) would otherwise take writes of any size at `/`.
    bwrapArgs.push('--remount-ro', '/');
    bwrapArgs.push('--chdir', cwdInside, '--info-fd', '3', '--clearenv');
    for (const [name, value] of Object.entries(launch.env)) bwrapArgs.push('--setenv', name, value);
    file = caps.bwrap!;
    // bwrap takes the command only on its command line; it is built from sandbox paths (sandboxPaths()).
    args = ['--args', '4', '--', ...launch.command];
    if (caps.identity) {
      // As root: bwrap itself runs as the sandbox's own unprivileged uid (sandbox/identity.ts), so it must
      // be able to reach what it binds. Said here, not as bwrap's terse error in the replica's stderr.
      if (await unreachableByOthers(buildDir)) {
        // Not a server's view (tests, tools): the build is mirrored for this launch where the uid can reach it.
        const root = await stagingRoot(buildDir, true, false);
        if (root) {
          launchView = await fs.mkdtemp(path.join(root, 'launch-'));
          await fs.chmod(launchView, 0o711);
          await mirror(buildDir, path.join(launchView, 'app'), true);
          appBind = path.join(launchView, 'app');
        }
      }
      const bound = [
        appBind,
        ...(launch.image
          ? [launch.image.rootfs, ...launch.image.files.map((f) => f.host)]
          : [path.dirname(process.execPath)]),
      ];
      for (const host of bound) {
        const blocked = await unreachableByOthers(host);
        if (blocked) {
          throw new Error(
            `Sandboxes run as an unprivileged uid, which cannot enter ${blocked} (on the way to ${host}): give it o+x, or move the folder`,
          );
        }
      }
      bwrapArgs[appBindAt] = appBind;
      hostUid = acquireSandboxUid(caps.identity);
      const [setpriv, ...drop] = dropPrivilegesArgs(caps.identity, hostUid, launch.groups);
      args = [...drop, file, ...args];
      file = setpriv!;
    }
    if (netnsPath) {
      // The namespace is joined outside bwrap, so the sandbox holds no capability over it.
      if (typeof network === 'object') args = [...joinNetworkArgs(network), file, ...args];
      file = await nsenterPath();
    }
    env = { ...WRAPPER_ENV };
  } else {
    file = launch.command[0]!;
    args = launch.command.slice(1);
    // Shells set PWD; set it here too so both modes give the replica the same environment.
    env = { ...launch.env, PWD: cwdHost };
  }

  let memoryLimit: LimitKind = 'none';
  let cgroup: ReplicaCgroup | null = null;
  if (caps.cgroup) {
    try {
      cgroup = await createReplicaCgroup(caps.cgroup, launch.replicaId, { memoryBytes, maxProcesses, cpu });
    } catch (err) {
      releaseSandboxUid(hostUid);
      if (launchView) await fs.rm(launchView, { recursive: true, force: true }).catch(() => {});
      throw err;
    }
    ({ file, args } = cgroup.wrap(file, args));
    if (cgroup.dirs.memory) memoryLimit = 'cgroup';
  }
  if (memoryLimit === 'none' && caps.prlimit) {
    // RLIMIT_DATA, not RLIMIT_AS: V8 reserves far more address space than it ever uses.
    args = [`--data=${memoryBytes}`, '--', file, ...args];
    file = caps.prlimit;
    memoryLimit = 'rlimit';
  }

  const finalArgs = args;
  const finalFile = file;
  const finalEnv = env;
  const spawnCwd = sandboxed ? '/' : cwdHost;
  const argsBlob = sandboxed ? Buffer.from(bwrapArgs.map((arg) => `${arg}\0`).join('')) : null;
  const cgroupDirs = { ...(cgroup?.dirs ?? {}) };

  return {
    file,
    args,
    bwrapArgs,
    cwd: sandboxed ? cwdInside : cwdHost,
    sandboxed,
    memoryLimit,
    processLimit: cgroupDirs.pids ? 'cgroup' : 'none',
    cpuLimit: cgroupDirs.cpu ? 'cgroup' : 'none',
    cgroupDir: cgroupDirs.memory ?? null,
    cgroupDirs,
    paths,
    socketPathInside: paths.socketPath,
    spawn: (stdio = ['ignore', 'pipe', 'pipe']) =>
      spawnReplica({
        file: finalFile,
        args: finalArgs,
        env: finalEnv,
        cwd: spawnCwd,
        stdio,
        argsBlob,
        // The lease's resolv.conf last: its fd follows the runtime files' (resolvConfArgs above).
        runtimeFiles: sandboxed
          ? [
              ...launch.runtimeFiles.map((entry) => entry.host),
              ...(typeof network === 'object' && network.resolvConf ? [network.resolvConf] : []),
            ]
          : [],
        hostSocketPath: paths.hostSocketPath,
        killAll: cgroup ? () => cgroup.kill() : undefined,
      }),
    hostUid,
    wasOomKilled: async () => (cgroup ? cgroup.oomKilled() : false),
    async cleanup() {
      try {
        await cgroup?.remove();
      } finally {
        // Only once nothing of the sandbox is left (the cgroup's removal kills stragglers) may another take it.
        releaseSandboxUid(hostUid);
        hostUid = null;
        if (launchView) await fs.rm(launchView, { recursive: true, force: true }).catch(() => {});
        launchView = null;
      }
    },
  };
}

/**
 * bwrap's binds of an app's volumes (volumes/volumes.ts): each host mount point at its sandbox path, before
 * the root is made read-only (which does not reach the binds: bwrap's --remount-ro is not recursive).
 */
export function volumeBindArgs(volumes: NonNullable<ReplicaLaunch['volumes']>): string[] {
  return volumes.flatMap((v) => [v.readOnly ? '--ro-bind' : '--bind', v.host, v.sandbox]);
}

function validateLaunch(launch: ReplicaLaunch): void {
  if (!/^[A-Za-z0-9_.-]{1,100}$/.test(launch.replicaId) || /^\.+$/.test(launch.replicaId)) {
    throw new Error(`Invalid replica id ${JSON.stringify(launch.replicaId)}`);
  }
  if (launch.command.length === 0) throw new Error('The replica command is empty');
  if (!Number.isFinite(launch.memoryMiB) || launch.memoryMiB < 16) {
    throw new Error(`Memory limit must be at least 16 MiB (got ${launch.memoryMiB})`);
  }
  if (launch.maxProcesses !== undefined && (!Number.isInteger(launch.maxProcesses) || launch.maxProcesses < 1)) {
    throw new Error(`maxProcesses must be a positive integer (got ${launch.maxProcesses})`);
  }
  if (launch.cpu !== undefined && (!Number.isFinite(launch.cpu) || launch.cpu <= 0)) {
    throw new Error(`cpu must be a positive number (got ${launch.cpu})`);
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
  for (const volume of launch.volumes ?? []) {
    const target = volume.sandbox;
    if (!path.posix.isAbsolute(target) || target.split('/').includes('..') || target === '/') {
      throw new Error(`Volume mount ${target} must be absolute without ".."`);
    }
    const reserved = [SANDBOX_APP_DIR, SANDBOX_SOCKET_DIR, '/run', '/tmp', '/proc', '/dev'];
    if (reserved.some((dir) => target === dir || target.startsWith(`${dir}/`))) {
      throw new Error(`Volume mount ${target} is inside a folder the sandbox already uses`);
    }
  }
  for (const [name, value] of Object.entries(launch.env)) {
    if (name === '' || name.includes('=') || name.includes('\0') || value.includes('\0')) {
      throw new Error(`Invalid environment variable ${JSON.stringify(name)}`);
    }
  }
}

/** What spawnReplica starts: the (wrapped) command, and under bwrap its options and runtime files. */
export interface SpawnSpec {
  file: string;
  args: string[];
  env: Record<string, string>;
  cwd: string;
  stdio: ReplicaStdio;
  /** bwrap's arguments for `--args 4`; null without bwrap. */
  argsBlob: Buffer | null;
  /** Host files for bwrap's `--file 5…`, in order. */
  runtimeFiles: string[];
  /** Without bwrap: where the socket is. */
  hostSocketPath: string | null;
  /** Kills everything in the replica's cgroup. */
  killAll: (() => Promise<void>) | undefined;
}

/**
 * Starts a prepared sandbox: fds 3 (bwrap's status, from which the init pid and so the socket path come),
 * 4 (bwrap's options, `--args 4`) and 5… (runtime files, `--file`) follow stdio. Build steps reuse it.
 */
export function spawnReplica(spec: SpawnSpec): ReplicaProcess {
  const { argsBlob } = spec;
  if (!argsBlob) {
    const child = spawn(spec.file, spec.args, { cwd: spec.cwd, env: spec.env, stdio: spec.stdio });
    return {
      child,
      kill: (signal = 'SIGTERM') => child.kill(signal),
      socketPath: Promise.resolve(spec.hostSocketPath),
    };
  }
  const fileFds = spec.runtimeFiles.map((file) => fsSync.openSync(file, 'r'));
  let child: ChildProcess;
  try {
    child = spawn(spec.file, spec.args, {
      cwd: spec.cwd,
      env: spec.env,
      stdio: [...spec.stdio, 'pipe', 'pipe', ...fileFds],
    });
  } finally {
    // The child has its own copies now.
    for (const fd of fileFds) fsSync.closeSync(fd);
  }
  // bwrap writes {"child-pid": N} on fd 3: the host pid of the sandbox's init (bwrap's reaper).
  let initPid: number | undefined;
  let exited = false;
  const socketPath = new Promise<string | null>((resolve) => {
    const info = child.stdio[3] as Readable;
    let text = '';
    info.setEncoding('utf8');
    info.on('data', (chunk: string) => {
      text += chunk;
      const match = /"child-pid"\s*:\s*(\d+)/.exec(text);
      if (match && initPid === undefined) {
        initPid = Number(match[1]);
        resolve(socketPathThroughInit(initPid));
      }
    });
    info.on('error', () => {});
    child.once('exit', () => {
      exited = true;
      resolve(null);
    });
    child.once('error', () => resolve(null));
  });
  const argsPipe = child.stdio[4] as Writable;
  argsPipe.on('error', () => {}); // bwrap failed before reading it: its exit says why
  argsPipe.end(argsBlob);

  return {
    child,
    socketPath,
    kill(signal: NodeJS.Signals = 'SIGTERM') {
      if (exited) return false;
      if (signal === 'SIGKILL') {
        const sent = child.kill('SIGKILL');
        // bwrap's death takes the sandbox (its PID namespace) with it; the cgroup catches anything else.
        void spec.killAll?.().catch(() => {});
        return sent;
      }
      const target = initPid === undefined ? undefined : firstChild(initPid);
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
 * Puts the lease's resolv.conf (open on `fd`) over /etc/resolv.conf; where that is a symlink
 * (systemd-resolved's stub file), over the file it points to, since bwrap cannot mount over a dangling
 * symlink. bwrap copies it into a file of its own (`--ro-bind-data`), so the sandbox's mountinfo names no
 * host folder for it.
 */
export async function resolvConfArgs(fd: number, imageRoot?: string): Promise<string[]> {
  // An image's /etc/resolv.conf is a file the image store made sure of (image-store.ts), never a link.
  if (imageRoot !== undefined) return ['--ro-bind-data', String(fd), '/etc/resolv.conf'];
  let target = '/etc/resolv.conf';
  const stat = await fs.lstat(target).catch(() => null);
  if (stat?.isSymbolicLink()) target = path.resolve('/etc', await fs.readlink(target));
  return ['--ro-bind-data', String(fd), target];
}

/**
 * Everything but the replica's own folders: namespaces, the private `/tmp`, the system folders, and /etc's
 * masked entries. bwrap mounts in the order it is told, so `/tmp` comes first: a bind under /tmp (a Node
 * installed there, whose folder is bound at its own path) made before it would be hidden by it, and
 * `execvp /tmp/.../node: No such file or directory` was all a build step said (issue 43).
 */
export async function baseBwrapArgs(
  features: SandboxCapabilities['bwrapFeatures'],
  network: 'host' | 'isolated',
  /** The sandbox runs as a uid of its own (caps.identity): /etc needs no masks (see etcMasks). */
  ownUid = false,
  /** An image's root instead of the host's system folders. */
  image?: Pick<ImageRoot, 'rootfs' | 'files'>,
  /** The size of the `/tmp` tmpfs (where bwrap takes `--size`), or undefined for bwrap's default. */
  tmpBytes?: number,
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
    ...(features.tmpfsSize && tmpBytes !== undefined ? ['--size', String(tmpBytes)] : []),
    '--tmpfs',
    '/tmp',
  ];
  if (image) {
    args.push(...(await imageRootArgs(image)));
    args.push('--proc', '/proc', '--dev', '/dev', '--ro-bind', '/proc/sys', '/proc/sys');
    for (const file of await procMasks()) args.push('--ro-bind', '/dev/null', file);
    return args;
  }
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
  const masks = ownUid ? { dirs: [], files: [] } : await etcMasks();
  for (const dir of masks.dirs) args.push('--tmpfs', dir, '--remount-ro', dir);
  // bwrap binds with nodev, so a masked file opens with EACCES, as it would for an unprivileged user.
  for (const file of masks.files) args.push('--ro-bind', '/dev/null', file);
  args.push('--proc', '/proc', '--dev', '/dev');
  // /proc/sys read-only: the settings there that are not per namespace are the host's own (a writable
  // kernel.core_pattern is root on the host). A sandbox uid could not write them anyway (identity.ts); this
  // holds even for a sandbox that maps to a privileged uid. bwrap cannot remount a folder of its own
  // procfs, so the host's is bound read-only over it.
  args.push('--ro-bind', '/proc/sys', '/proc/sys');
  // Files of /proc that tell about the host's kernel and every user's keys: /dev/null over each (binds are
  // nodev, so opening one fails with EACCES), only where the host has it (bwrap cannot bind over nothing).
  for (const file of await procMasks()) args.push('--ro-bind', '/dev/null', file);
  return args;
}

/**
 * The binds that make an image's unpacked root the sandbox's `/` (see ImageRoot). Entries are read with
 * lstat and never followed: a top-level link is recreated as the same link, resolved inside the sandbox.
 */
async function imageRootArgs(image: Pick<ImageRoot, 'rootfs' | 'files'>): Promise<string[]> {
  const args: string[] = [];
  const names = (await fs.readdir(image.rootfs)).sort();
  for (const name of names) {
    if (IMAGE_ROOT_SKIPPED.has(name)) continue;
    const host = path.join(image.rootfs, name);
    const st = await fs.lstat(host);
    if (st.isSymbolicLink()) args.push('--symlink', await fs.readlink(host), `/${name}`);
    else if (st.isDirectory() || st.isFile()) args.push('--ro-bind', host, `/${name}`);
  }
  for (const file of image.files) args.push('--ro-bind', file.host, file.sandbox);
  return args;
}

/** Host-wide or root-only entries of /proc a sandbox must not read or write. */
export const PROC_MASKED = [
  '/proc/keys',
  '/proc/key-users',
  '/proc/timer_list',
  '/proc/sched_debug',
  '/proc/kpageflags',
  '/proc/kpagecount',
  '/proc/kpagecgroup',
  '/proc/slabinfo',
  '/proc/kcore',
  '/proc/kmsg',
  '/proc/latency_stats',
  '/proc/sysrq-trigger',
] as const;

let procMaskCache: Promise<string[]> | undefined;

function procMasks(): Promise<string[]> {
  procMaskCache ??= (async () => {
    const present: string[] = [];
    for (const file of PROC_MASKED) if ((await fs.lstat(file).catch(() => null))?.isFile()) present.push(file);
    return present;
  })();
  return procMaskCache;
}

const ETC_MASK_TTL_MS = 60_000;
const ETC_MAX_ENTRIES = 20_000;
let etcMaskCache: { at: number; value: Promise<{ dirs: string[]; files: string[] }> } | undefined;

/**
 * Entries of /etc that other users could not read but the server's own user can: a sandbox that maps to
 * the server's uid would read them. Recomputed at most once a minute, so secrets installed while the
 * server runs (a new service's config) get masked too. A sandbox that runs as a uid of its own (Ferry is
 * root, identity.ts) needs none: the kernel refuses it what it refuses any other user, and a list of
 * masks would show it the names of the host's private files in its mountinfo.
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
        if ((stat.mode & 0o005) !== 0o005) {
          if (serverMay(stat, 0o5)) dirs.push(full);
        } else queue.push(full);
      } else if ((stat.mode & 0o004) === 0 && serverMay(stat, 0o4)) {
        files.push(full);
      }
    }
  }
  return { dirs, files };
}

/** Whether this process's user may do any of `bits` (0o4 read, 0o1 search) on a file other users may not. */
function serverMay(stat: { uid: number; gid: number; mode: number }, bits: number): boolean {
  const uid = process.getuid?.();
  if (uid === undefined || uid === 0) return true;
  if (stat.uid === uid) return ((stat.mode >> 6) & bits) !== 0;
  const groups = process.getgroups?.() ?? [];
  if (stat.gid === process.getgid?.() || groups.includes(stat.gid)) return ((stat.mode >> 3) & bits) !== 0;
  return false;
}

// ---- small helpers ----

export async function findExecutable(name: string, env: NodeJS.ProcessEnv): Promise<string | null> {
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
