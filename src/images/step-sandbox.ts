/**
 * One image build step (`apt`, a `run` entry, a Dockerfile `RUN`) in Ferry's bubblewrap sandbox, with an
 * image's root file system as `/`, writable. The step is a stranger's code; what it gets:
 *
 * - `/` is the build's scratch root (image-builder.ts unpacked it, outside the data directory), plus a
 *   fresh `/proc` and a minimal `/dev`, the host's `/proc/sys` read-only and the host-wide files of /proc
 *   masked, as for replicas (sandbox/launch.ts). No other host path is visible: no /usr, no data folder.
 * - Its own user, PID, IPC, UTS, cgroup and mount namespaces. As root, Ferry maps a range of 65,536 host
 *   ids of the build's own (build-ids.ts) into the user namespace, so the step is uid 0 there and dpkg's
 *   chowns to `_apt` or `messagebus` work; bwrap waits (`--userns-block-fd`) while Ferry writes the maps
 *   (what newuidmap would do; util-linux 2.38's `unshare --map-users` needs newuidmap, which this host
 *   does not install). Capabilities are the container default set (chown, setuid, ...: what package
 *   scripts use), valid only inside that namespace: over the host's files, network and kernel the step
 *   is an unprivileged stranger uid. bwrap is started as that uid (setpriv), after the wrappers joined
 *   the cgroup and the network namespace as root. Not yet closed: with the 65,536-id map a step can make
 *   nested user namespaces (bwrap cannot combine --disable-userns with maps written from outside; a
 *   seccomp filter is the fix); those hold no more power over the host than the step's own.
 *   Without root the namespace maps uid 0 to Ferry's own uid only (package scripts that chown fail).
 * - The network of a sandbox lease (sandbox/network.ts): the same egress policy as replicas (the host's
 *   services and private ranges unreachable), DNS through the lease's resolver.
 * - A cgroup bounding memory, processes and CPU; RLIMIT_FSIZE and a watch of the root's size bound its
 *   disk (the watch looks every few seconds, so a step may overshoot by what it writes in one interval
 *   before it is killed); the caller's signal carries the build's time limit.
 */
import { spawn } from 'node:child_process';
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { createInterface } from 'node:readline';
import type { Readable, Writable } from 'node:stream';
import { createReplicaCgroup, type ReplicaCgroup } from '../sandbox/cgroups.js';
import { dropPrivilegesArgs, unreachableByOthers } from '../sandbox/identity.js';
import { PROC_MASKED, type SandboxCapabilities, WRAPPER_ENV } from '../sandbox/launch.js';
import { joinNetworkArgs, type SandboxNetwork } from '../sandbox/network.js';
import { mapWhenReady } from '../sandbox/userns-map.js';
import { isRealFolder } from './unpack.js';

export interface StepLimits {
  memoryMiB: number;
  maxProcesses: number;
  /** Cores as a CFS quota. */
  cpu: number;
  /** Bytes the whole root file system may hold (base and earlier steps included). */
  diskBytes: number;
}

/** The id range of the build's user namespace: host `first + n` is uid/gid `n` inside. */
export interface IdRange {
  first: number;
  count: number;
}

export interface StepRun {
  /** Host folder of the scratch root, reachable (o+x) by `ids.first`. */
  rootfs: string;
  /** What prepareMountPoints made in it (before the caller's snapshot). */
  made: MadePoints;
  /** argv inside the image. */
  command: string[];
  env: Record<string, string>;
  cwd: string;
  /** uid and gid inside the namespace (the Dockerfile's USER); 0 by default. */
  uid: number;
  gid: number;
  ids: IdRange;
  /** Whether Ferry writes the 65,536-id maps itself (it is root); else bwrap maps uid 0 to Ferry's uid. */
  mapRange: boolean;
  caps: SandboxCapabilities;
  network: SandboxNetwork;
  limits: StepLimits;
  /** Names the cgroup and network lease. */
  id: string;
  signal: AbortSignal;
  onLine: (line: string) => void;
}

export interface StepResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  oomKilled: boolean;
  /** The watch found the root over `diskBytes` and killed the step. */
  diskExceeded: boolean;
}

/** Capabilities inside the build's user namespace: Docker's default set less NET_RAW and MKNOD. */
const STEP_CAPS = [
  'CAP_CHOWN',
  'CAP_DAC_OVERRIDE',
  'CAP_FOWNER',
  'CAP_FSETID',
  'CAP_KILL',
  'CAP_SETGID',
  'CAP_SETUID',
  'CAP_SETPCAP',
  'CAP_SETFCAP',
  'CAP_NET_BIND_SERVICE',
  'CAP_SYS_CHROOT',
  'CAP_AUDIT_WRITE',
];

const DISK_WATCH_MS = 3000;

/** Paths bwrap mounts on: made in the root when missing, and removed again after the step. */
const MOUNT_DIRS = ['proc', 'dev'];

/**
 * Runs one step; resolves with how it ended. Rejects when the sandbox cannot start (an Error whose
 * message names no host path) or with the signal's reason when aborted (after everything is gone).
 */
export async function runImageStep(run: StepRun): Promise<StepResult> {
  const { caps, limits } = run;
  if (!caps.bwrap) throw new Error('image builds need the bubblewrap sandbox, which this server does not have');
  if (run.signal.aborted) throw run.signal.reason;
  const blocked = run.mapRange ? await unreachableByOthers(run.rootfs) : null;
  if (blocked) throw new Error('the build sandbox cannot reach its scratch folder (a folder on the way lacks o+x)');

  const { made } = run;
  const lease = await run.network.acquire(run.id);
  let cgroup: ReplicaCgroup | null = null;
  try {
    const memoryBytes = Math.floor(limits.memoryMiB * 1024 * 1024);
    const options = [
      '--unshare-all',
      ...(lease.netnsPath !== null ? ['--share-net'] : []),
      '--unshare-user',
      '--uid',
      String(run.uid),
      '--gid',
      String(run.gid),
      // No --disable-userns when Ferry writes the maps: bwrap refuses it with --userns-block-fd.
      ...(caps.bwrapFeatures.disableUserns && !run.mapRange ? ['--disable-userns'] : []),
      '--die-with-parent',
      '--new-session',
      '--info-fd',
      '3',
      ...(run.mapRange ? ['--userns-block-fd', '5'] : []),
      '--cap-drop',
      'ALL',
      ...(run.uid === 0 ? STEP_CAPS.flatMap((cap) => ['--cap-add', cap]) : []),
      '--bind',
      run.rootfs,
      '/',
      '--proc',
      '/proc',
      '--dev',
      '/dev',
      '--ro-bind',
      '/proc/sys',
      '/proc/sys',
    ];
    for (const file of PROC_MASKED) {
      if ((await fs.lstat(file).catch(() => null))?.isFile()) options.push('--ro-bind', '/dev/null', file);
    }
    const dns = lease.resolvConf !== null && made.resolvConf;
    // The root is the image's, so the lease's resolv.conf goes over the image's file (made when missing).
    if (dns) options.push('--ro-bind-data', '6', '/etc/resolv.conf');
    options.push('--chdir', run.cwd, '--clearenv');
    for (const [name, value] of Object.entries(run.env)) options.push('--setenv', name, value);
    const argsBlob = Buffer.from(options.map((arg) => `${arg}\0`).join(''));

    let file = caps.bwrap;
    let argv = ['--args', '4', '--', ...run.command];
    if (run.mapRange && caps.identity) {
      const [setpriv, ...drop] = dropPrivilegesArgs(caps.identity, run.ids.first);
      argv = [...drop, file, ...argv];
      file = setpriv!;
    }
    if (lease.netnsPath !== null) {
      argv = [...joinNetworkArgs(lease), file, ...argv];
      file = 'nsenter';
    }
    if (caps.prlimit) {
      argv = [
        `--fsize=${limits.diskBytes}`,
        ...(caps.cgroup?.controllers.memory ? [] : [`--data=${memoryBytes}`]),
        '--',
        file,
        ...argv,
      ];
      file = caps.prlimit;
    }
    if (caps.cgroup) {
      cgroup = await createReplicaCgroup(caps.cgroup, run.id, {
        memoryBytes,
        maxProcesses: limits.maxProcesses,
        cpu: limits.cpu,
      });
      ({ file, args: argv } = cgroup.wrap(file, argv));
    }
    return await spawnStep(run, file, argv, argsBlob, dns ? lease.resolvConf : null, cgroup);
  } finally {
    await cgroup?.remove().catch(() => {});
    await lease.release();
  }
}

async function spawnStep(
  run: StepRun,
  file: string,
  argv: string[],
  argsBlob: Buffer,
  resolvConf: string | null,
  cgroup: ReplicaCgroup | null,
): Promise<StepResult> {
  const resolvFd = resolvConf !== null ? fsSync.openSync(resolvConf, 'r') : null;
  let child: ReturnType<typeof spawn>;
  try {
    child = spawn(file, argv, {
      cwd: '/',
      env: { ...WRAPPER_ENV },
      // 3: bwrap's info (child pid); 4: its options; 5: the user namespace's go-ahead; 6: resolv.conf.
      stdio: ['ignore', 'pipe', 'pipe', 'pipe', 'pipe', 'pipe', resolvFd ?? 'ignore'],
    });
  } finally {
    if (resolvFd !== null) fsSync.closeSync(resolvFd);
  }
  const kill = () => {
    child.kill('SIGKILL');
    void cgroup?.kill().catch(() => {});
  };
  let diskExceeded = false;
  const watch = setInterval(() => {
    void treeBytes(run.rootfs, run.limits.diskBytes).then((bytes) => {
      if (bytes > run.limits.diskBytes && !diskExceeded) {
        diskExceeded = true;
        run.onLine(
          `(the step passed the build's disk bound of ${Math.round(run.limits.diskBytes / 2 ** 20)} MiB: killed)`,
        );
        kill();
      }
    });
  }, DISK_WATCH_MS);
  const argsPipe = child.stdio[4] as Writable;
  argsPipe.on('error', () => {});
  argsPipe.end(argsBlob);
  const goAhead = (child.stdio as unknown as Array<Readable | Writable | null>)[5] as Writable;
  goAhead.on('error', () => {});
  if (run.mapRange) {
    void mapWhenReady(child.stdio[3] as Readable, run.ids)
      .then(() => goAhead.end('x'))
      .catch((err: Error) => {
        run.onLine(`(the build sandbox could not start: ${err.message})`);
        kill();
      });
  } else {
    (child.stdio[3] as Readable).resume();
    goAhead.end();
  }
  const onAbort = () => kill();
  run.signal.addEventListener('abort', onAbort, { once: true });
  try {
    const exit = await new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve, reject) => {
      for (const stream of [child.stdout, child.stderr]) {
        createInterface({ input: stream as Readable, crlfDelay: Number.POSITIVE_INFINITY }).on('line', run.onLine);
      }
      child.on('error', (err) => reject(new Error(`the build sandbox could not start (${err.message})`)));
      child.on('close', (code, signal) => resolve({ code, signal }));
      if (run.signal.aborted) onAbort();
    });
    if (run.signal.aborted) throw run.signal.reason;
    const oomKilled = cgroup ? await cgroup.oomKilled() : false;
    return { ...exit, oomKilled, diskExceeded };
  } finally {
    clearInterval(watch);
    run.signal.removeEventListener('abort', onAbort);
  }
}

export interface MadePoints {
  dirs: string[];
  /** Whether /etc/resolv.conf can take the lease's (a file, made empty here when missing). */
  resolvConf: boolean;
  resolvMade: boolean;
}

/**
 * Folders bwrap mounts on (and an empty /etc/resolv.conf) made in the root when the image has none,
 * owned by the namespace's root; the caller's snapshot of the root is taken after, and cleanMountPoints
 * removes them before the diff, so they never reach a layer.
 */
export async function prepareMountPoints(run: Pick<StepRun, 'rootfs' | 'ids'>): Promise<MadePoints> {
  const made: MadePoints = { dirs: [], resolvConf: false, resolvMade: false };
  for (const name of MOUNT_DIRS) {
    const target = path.join(run.rootfs, name);
    const st = await fs.lstat(target).catch(() => null);
    if (st === null) {
      await fs.mkdir(target, { mode: 0o755 });
      await fs.lchown(target, run.ids.first, run.ids.first);
      made.dirs.push(name);
    } else if (!st.isDirectory()) {
      await fs.rm(target, { force: true, recursive: true });
      await fs.mkdir(target, { mode: 0o755 });
      await fs.lchown(target, run.ids.first, run.ids.first);
    }
  }
  const etc = await fs.lstat(path.join(run.rootfs, 'etc')).catch(() => null);
  if (etc?.isDirectory()) {
    const target = path.join(run.rootfs, 'etc', 'resolv.conf');
    const st = await fs.lstat(target).catch(() => null);
    if (st === null) {
      await fs.writeFile(target, '', { flag: 'wx', mode: 0o644 });
      await fs.lchown(target, run.ids.first, run.ids.first);
      made.resolvMade = true;
      made.resolvConf = true;
    } else made.resolvConf = st.isFile();
  }
  return made;
}

/** Which paths prepareMountPoints made (relative to the root), for the diff to leave out. */
export function madePaths(made: MadePoints): string[] {
  return [...made.dirs, ...(made.resolvMade ? ['etc/resolv.conf'] : [])];
}

/** Removes what prepareMountPoints made (once the step has ended), before the diff. */
export async function cleanMountPoints(rootfs: string, made: MadePoints): Promise<void> {
  for (const name of made.dirs) await fs.rmdir(path.join(rootfs, name)).catch(() => {});
  // The step may have replaced /etc with a link to a host folder: nothing is removed through it.
  if (made.resolvMade && (await isRealFolder(rootfs, path.join(rootfs, 'etc')))) {
    const target = path.join(rootfs, 'etc', 'resolv.conf');
    const st = await fs.lstat(target).catch(() => null);
    if (st?.isFile() && st.size === 0) await fs.rm(target, { force: true });
  }
}

/** The file bytes under `root` (allocated blocks), never following a link; stops counting past `limit`. */
export async function treeBytes(root: string, limit: number): Promise<number> {
  let total = 0;
  const stack = [root];
  while (stack.length > 0 && total <= limit) {
    const dir = stack.pop()!;
    const entries = await fs.readdir(dir, { withFileTypes: true }).catch(() => []);
    for (const entry of entries) {
      const full = path.join(dir, entry.name);
      if (entry.isDirectory()) stack.push(full);
      else {
        const st = await fs.lstat(full).catch(() => null);
        if (st) total += st.blocks * 512;
      }
    }
  }
  return total;
}
