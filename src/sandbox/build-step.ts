/**
 * One build step (esbuild, npm, pip, the Python syntax check) in a bubblewrap sandbox like a replica's
 * (sandbox/launch.ts: the same namespaces, system folders, /etc masking and memory cgroup).
 *
 * Inside, the step is uid/gid 65534 in its own user, PID, IPC, UTS and mount namespaces and sees:
 *   /app/source   the app's extracted archive, read-only
 *   /app/out      the build's output folder, writable
 *   /app/cache    this build's own scratch cache (HOME, npm's cache), writable; removed after the build
 *   /tmp          a private tmpfs
 *   /usr, /etc (unreadable entries masked), the system links, Node's own folder, and the extra files a
 *   step names (Ferry's esbuild agent), read-only; or, for a step on an image (`imageRoot`), the image's
 *   unpacked root instead of all the host's system folders, read-only.
 * Nothing else of the host: not the data folder, its keys or database, nor any other build. The network
 * is a lease from the server's SandboxNetwork (sandbox/network.ts): a namespace to join with nsenter, or
 * bwrap's own empty one (loopback only). Memory and processes are bounded by cgroups; the pipeline
 * bounds the build's wall-clock time.
 *
 * Without bwrap (missing, or FERRY_SANDBOX=off) the step runs as a plain process with the host paths,
 * as replicas do; the pipeline says so loudly in the build log.
 *
 * The caller builds the command with `stepPaths(ctx)`, so it is right in either mode.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { createInterface } from 'node:readline';
import type { Readable } from 'node:stream';
import { abortError, type ChildExit, runChild, throwIfAborted } from '../builds/run-child.js';
import { createReplicaCgroup, type ReplicaCgroup } from './cgroups.js';
import { acquireSandboxUid, dropPrivilegesArgs, releaseSandboxUid, unreachableByOthers } from './identity.js';
import { baseBwrapArgs, resolvConfArgs, type SandboxCapabilities, spawnReplica, WRAPPER_ENV } from './launch.js';
import { joinNetworkArgs, type SandboxNetwork } from './network.js';
import { mirror, stagingRoot } from './views.js';

export interface BuildLimits {
  /** Memory of one step, tmpfs included (memory cgroup; RLIMIT_DATA without one). */
  memoryMiB: number;
  /** Processes and threads of one step (pids cgroup). */
  maxProcesses: number;
  /** Wall-clock time of a whole build (enforced by the pipeline). */
  timeoutMs: number;
}

export const DEFAULT_BUILD_LIMITS: BuildLimits = { memoryMiB: 2048, maxProcesses: 1024, timeoutMs: 15 * 60_000 };

/** What every build step runs in: the server's sandbox capabilities, its network provider, the limits. */
/**
 * What a build step needs of its build: the part of a builder's context (builds/builder.ts,
 * `BuildContext`) that is about where and how it runs. Declared here so the sandbox does not depend on
 * the builders that use it.
 */
export interface BuildStepContext {
  buildId: string;
  sourceDir: string;
  outputDir: string;
  cacheDir: string;
  sandbox: BuildSandbox;
  signal: AbortSignal;
}

export interface BuildSandbox {
  caps: SandboxCapabilities;
  network: SandboxNetwork;
  limits: BuildLimits;
}

export const STEP_SOURCE_DIR = '/app/source';
export const STEP_OUT_DIR = '/app/out';
export const STEP_CACHE_DIR = '/app/cache';
/** PATH inside the sandbox: the system's, never a folder of the app. */
const SANDBOX_PATH = '/usr/local/bin:/usr/bin:/bin';

/** Paths as the step sees them: sandbox paths under bwrap, host paths without it. */
export interface StepPaths {
  sandboxed: boolean;
  source: string;
  out: string;
  cache: string;
  /** PATH for the step: the system's inside the sandbox, the server's own without it. */
  searchPath: string;
}

/** The host folder of a build's scratch cache: `<cacheDir>/builds/<buildId>`. */
export function buildCacheDir(cacheDir: string, buildId: string): string {
  return path.join(cacheDir, 'builds', buildId);
}

export function stepPaths(ctx: BuildStepContext): StepPaths {
  const sandboxed = ctx.sandbox.caps.bwrap !== null;
  if (sandboxed) {
    const nodeDir = path.dirname(process.execPath);
    const searchPath = SANDBOX_PATH.split(':').includes(nodeDir) ? SANDBOX_PATH : `${SANDBOX_PATH}:${nodeDir}`;
    return { sandboxed, source: STEP_SOURCE_DIR, out: STEP_OUT_DIR, cache: STEP_CACHE_DIR, searchPath };
  }
  return {
    sandboxed,
    source: path.resolve(ctx.sourceDir),
    out: path.resolve(ctx.outputDir),
    cache: path.resolve(buildCacheDir(ctx.cacheDir, ctx.buildId)),
    searchPath: process.env.PATH ?? SANDBOX_PATH,
  };
}

export interface StepMount {
  host: string;
  /** Absolute path inside the sandbox (ignored without bwrap, where the step uses `host`). */
  sandbox: string;
}

const SYSTEM_PREFIXES = ['/usr/', '/bin/', '/sbin/', '/lib/', '/lib64/', '/etc/'];

/**
 * A tool configured by an absolute path outside the folders the sandbox shows (an operator's npm, a
 * test's stand-in), bound read-only at the same path. Nothing for a name looked up on PATH.
 */
export function toolMounts(paths: StepPaths, command: string): StepMount[] {
  if (!paths.sandboxed || !path.isAbsolute(command)) return [];
  const nodeDir = `${path.dirname(process.execPath)}/`;
  if (SYSTEM_PREFIXES.some((prefix) => command.startsWith(prefix)) || command.startsWith(nodeDir)) return [];
  return [{ host: command, sandbox: command }];
}

export interface BuildStep {
  /** For messages: `npm ci`, `pip install`, `esbuild`. */
  label: string;
  /** argv as the step sees it (build it with stepPaths()). */
  command: string[];
  /** The step's whole environment: nothing of the server's own is added. */
  env: Record<string, string>;
  /** Working folder as the step sees it. */
  cwd: string;
  /** Extra read-only files or folders (Ferry's own: the esbuild agent, a configured tool). */
  readOnly?: StepMount[];
  /** Extra writable folders, bound over a path inside /app (node_modules). */
  writable?: StepMount[];
  /**
   * An image's unpacked root as the step's `/` (read-only, as replicas have it: sandbox/launch.ts
   * ImageRoot) instead of the host's system folders: a check run with the image's own tools (Python's
   * syntax check with the image's python3). Needs bwrap.
   */
  imageRoot?: string;
  onLine: (stream: 'stdout' | 'stderr', line: string) => void;
}

export interface StepExit extends ChildExit {
  /** The memory cgroup recorded an OOM kill. */
  oomKilled: boolean;
}

/**
 * Runs one step and resolves with how it exited; rejects with the abort reason when the build is
 * cancelled (after everything the step started is gone), or with an Error when it cannot start.
 */
export async function runBuildStep(ctx: BuildStepContext, step: BuildStep): Promise<StepExit> {
  throwIfAborted(ctx.signal);
  const cacheHost = buildCacheDir(ctx.cacheDir, ctx.buildId);
  await fs.mkdir(cacheHost, { recursive: true });
  const { caps, network, limits } = ctx.sandbox;
  if (caps.bwrap === null) {
    if (step.imageRoot !== undefined) throw new Error(`${step.label} runs on an image, which needs the sandbox`);
    const exit = await runChild(step.command[0]!, step.command.slice(1), {
      cwd: step.cwd,
      env: step.env,
      onLine: step.onLine,
      signal: ctx.signal,
    });
    return { ...exit, oomKilled: false };
  }

  const memoryBytes = Math.floor(limits.memoryMiB * 1024 * 1024);
  stepCounter = (stepCounter + 1) % 1_000_000;
  // The pid too: cgroups are machine-wide, and another server (or a test) may run a build of the same id.
  const stepId = `build-${ctx.buildId}-${process.pid}-${stepCounter}`;
  for (const mount of step.writable ?? []) checkTarget(mount.sandbox, true);
  for (const mount of step.readOnly ?? []) {
    checkTarget(mount.sandbox, false);
    await fs.access(mount.host);
  }
  const stage = await StepStage.open(ctx, cacheHost, step);
  const lease = await network.acquire(stepId.replace(/[^A-Za-z0-9_-]/g, '-'));
  let cgroup: ReplicaCgroup | null = null;
  try {
    const options = [
      ...(await baseBwrapArgs(
        caps.bwrapFeatures,
        lease.netnsPath === null ? 'isolated' : 'host',
        caps.identity !== null,
        stage.imageRoot !== null ? { rootfs: stage.imageRoot, files: [] } : undefined,
        // Its private /tmp, mounted before every bind (baseBwrapArgs says why).
        memoryBytes,
      )),
      '--ro-bind',
      stage.source,
      STEP_SOURCE_DIR,
      '--bind',
      stage.out,
      STEP_OUT_DIR,
      '--bind',
      stage.cache,
      STEP_CACHE_DIR,
    ];
    // fd 5, the first after bwrap's status (3) and arguments (4): see spawnReplica.
    if (lease.resolvConf !== null) options.push(...(await resolvConfArgs(5, stage.imageRoot ?? undefined)));
    for (const [i, mount] of (step.writable ?? []).entries()) options.push('--bind', stage.writable[i]!, mount.sandbox);
    for (const [i, mount] of (step.readOnly ?? []).entries())
      options.push('--ro-bind', stage.readOnly[i]!, mount.sandbox);
    options.push('--chdir', step.cwd, '--info-fd', '3', '--clearenv');
    for (const [name, value] of Object.entries(step.env)) options.push('--setenv', name, value);
    // Every option (host paths, the environment) goes through a pipe: the step's /proc/1/cmdline shows none.
    const argsBlob = Buffer.from(options.map((arg) => `${arg}\0`).join(''));

    // The wrappers run outside the sandbox, each exec'ing the next: join the cgroups, enter the
    // network namespace, then bwrap.
    let file = caps.bwrap;
    let argv = ['--args', '4', '--', ...step.command];
    if (stage.uid !== null && caps.identity) {
      // As root: bwrap runs as the step's own unprivileged uid (sandbox/identity.ts), after the cgroup
      // and the network namespace are joined as root.
      const [setpriv, ...drop] = dropPrivilegesArgs(caps.identity, stage.uid);
      argv = [...drop, file, ...argv];
      file = setpriv!;
    }
    if (lease.netnsPath !== null) {
      argv = [...joinNetworkArgs(lease), file, ...argv];
      file = 'nsenter';
    }
    if (caps.cgroup) {
      // One cgroup over the controllers this machine lets Ferry write (memory, pids; no CPU quota).
      cgroup = await createReplicaCgroup(caps.cgroup, stepId, { memoryBytes, maxProcesses: limits.maxProcesses });
    }
    if (!cgroup?.dirs.memory && caps.prlimit) {
      // RLIMIT_NPROC would count the server user's processes too, so it is no pids limit here.
      argv = [`--data=${memoryBytes}`, '--', file, ...argv];
      file = caps.prlimit;
    }
    if (cgroup) ({ file, args: argv } = cgroup.wrap(file, argv));

    const stepCgroup = cgroup;
    const replica = spawnReplica({
      file,
      args: argv,
      env: { ...WRAPPER_ENV },
      cwd: '/',
      stdio: ['ignore', 'pipe', 'pipe'],
      argsBlob,
      runtimeFiles: lease.resolvConf !== null ? [lease.resolvConf] : [],
      hostSocketPath: null,
      killAll: stepCgroup ? () => stepCgroup.kill() : undefined,
    });
    const exit = await new Promise<ChildExit>((resolve, reject) => {
      const { child } = replica;
      let settled = false;
      const onAbort = () => replica.kill('SIGKILL');
      const finish = (action: () => void) => {
        if (settled) return;
        settled = true;
        ctx.signal.removeEventListener('abort', onAbort);
        action();
      };
      for (const stream of ['stdout', 'stderr'] as const) {
        createInterface({ input: child[stream] as Readable, crlfDelay: Number.POSITIVE_INFINITY }).on('line', (line) =>
          step.onLine(stream, line),
        );
      }
      child.on('error', (err) => {
        finish(() => reject(new Error(`Could not start the build sandbox: ${err.message}`, { cause: err })));
      });
      child.on('close', (code, signal) => {
        finish(() => {
          if (ctx.signal.aborted) reject(abortError(ctx.signal));
          else resolve({ code, signal });
        });
      });
      ctx.signal.addEventListener('abort', onAbort, { once: true });
      // Aborted while the cgroups and the network were being set up: the event has already fired.
      if (ctx.signal.aborted) onAbort();
    });
    const oomKilled = cgroup ? await cgroup.oomKilled() : false;
    return { ...exit, oomKilled };
  } finally {
    // Removing a cgroup kills whatever is left in it (a daemon the step started and detached).
    await cgroup?.remove().catch(() => {});
    await lease.release();
    // Only now, with nothing of the step left, are its folders handed back and its uid freed.
    await stage.close();
  }
}

/**
 * The host side of one step's sandbox. A bind mount shows its source in the sandbox's
 * /proc/self/mountinfo, so a step does not bind the data directory's folders: for the step's time its
 * writable folders (output, cache, node_modules) are moved (renamed: same filesystem) into a fresh folder
 * of the staging root, and the source is mirrored there as hard links, as replicas' views are. Mountinfo
 * then names `<tmp>/ferry-view-<random>/step-<random>/...` only. When Ferry is root the step also gets a
 * sandbox uid of its own (sandbox/identity.ts): its writable folders are handed to that uid and the
 * source made readable by others, and the folders bwrap opens must be searchable by it. The staging root
 * is in `<data dir>/staging` when no folder outside the data directory is on its filesystem (views.ts);
 * without any (not even that could be made) a step binds the folders themselves, except as root, where
 * that is refused.
 */
class StepStage {
  readonly writable: string[] = [];
  readonly readOnly: string[] = [];
  /** The image root the step binds as `/` (a mirror in the stage when there is one), or null. */
  imageRoot: string | null = null;
  private readonly moved: Array<{ from: string; to: string }> = [];

  private constructor(
    readonly uid: number | null,
    private readonly dir: string | null,
    readonly source: string,
    readonly out: string,
    readonly cache: string,
  ) {}

  static async open(ctx: BuildStepContext, cacheHost: string, step: BuildStep): Promise<StepStage> {
    const { identity } = ctx.sandbox.caps;
    const othersRead = identity !== null;
    const root = await stagingRoot(path.dirname(path.resolve(ctx.cacheDir)), othersRead);
    if (!root) {
      if (identity) {
        throw new Error(
          'Ferry runs as root, and build steps run as an unprivileged uid that needs a staging folder on the data directory’s filesystem that it can reach (the system temporary folder, the data directory’s parent, or <data directory>/staging): none could be made',
        );
      }
      const stage = new StepStage(
        null,
        null,
        path.resolve(ctx.sourceDir),
        path.resolve(ctx.outputDir),
        path.resolve(cacheHost),
      );
      for (const mount of step.writable ?? []) stage.writable.push(path.resolve(mount.host));
      for (const mount of step.readOnly ?? []) stage.readOnly.push(path.resolve(mount.host));
      if (step.imageRoot !== undefined) stage.imageRoot = path.resolve(step.imageRoot);
      return stage;
    }
    const dir = await fs.mkdtemp(path.join(root, 'step-'));
    await fs.chmod(dir, othersRead ? 0o711 : 0o700);
    const uid = identity ? acquireSandboxUid(identity) : null;
    const stage = new StepStage(uid, dir, path.join(dir, 'source'), path.join(dir, 'out'), path.join(dir, 'cache'));
    try {
      await stage.moveIn(path.resolve(ctx.outputDir), stage.out);
      await stage.moveIn(path.resolve(cacheHost), stage.cache);
      for (const [i, mount] of (step.writable ?? []).entries()) {
        const to = path.join(dir, `w${i}`);
        await stage.moveIn(path.resolve(mount.host), to);
        stage.writable.push(to);
      }
      await mirror(path.resolve(ctx.sourceDir), stage.source, othersRead);
      if (step.imageRoot !== undefined) {
        // The image's unpacked root lives in the data directory, which the step's uid cannot enter and
        // whose path a bind would show in mountinfo: the step binds a mirror of hard links instead, as
        // replicas bind an image view (images/image-views.ts).
        stage.imageRoot = path.join(dir, 'image');
        await mirror(path.resolve(step.imageRoot), stage.imageRoot, othersRead);
      }
      // Writable folders bound inside the (read-only) source need a folder to be mounted on.
      for (const mount of step.writable ?? []) {
        const inside = path.posix.relative(STEP_SOURCE_DIR, mount.sandbox);
        if (!inside.startsWith('..') && inside !== '')
          await fs.mkdir(path.join(stage.source, inside), { recursive: true });
      }
      for (const [i, mount] of (step.readOnly ?? []).entries()) {
        const host = path.resolve(mount.host);
        if (uid !== null && (await unreachableByOthers(host))) {
          // Ferry's own files (a tool under root's home): copied, since the step's uid cannot reach them.
          const to = path.join(dir, `r${i}`);
          await fs.cp(host, to, { recursive: true, dereference: true });
          await mirrorModes(to);
          stage.readOnly.push(to);
        } else stage.readOnly.push(host);
      }
      if (uid !== null) {
        for (const folder of [stage.out, stage.cache, ...stage.writable]) await chownTree(folder, uid);
        await stage.checkReachable(path.dirname(process.execPath));
      }
    } catch (err) {
      await stage.close();
      throw err;
    }
    return stage;
  }

  private async moveIn(from: string, to: string): Promise<void> {
    await fs.mkdir(from, { recursive: true });
    await fs.rename(from, to);
    this.moved.push({ from, to });
  }

  async checkReachable(host: string): Promise<void> {
    const blocked = await unreachableByOthers(host);
    if (blocked) {
      throw new Error(
        `Build steps run as an unprivileged uid, which cannot enter ${blocked} (on the way to ${host}): give it o+x, or move the folder`,
      );
    }
  }

  /** Moves the folders back (the output is the build's), removes the stage and frees the uid. */
  async close(): Promise<void> {
    for (const { from, to } of this.moved.splice(0).reverse()) {
      await fs.rm(from, { recursive: true, force: true }).catch(() => {});
      await fs.rename(to, from);
    }
    if (this.dir) await fs.rm(this.dir, { recursive: true, force: true }).catch(() => {});
    releaseSandboxUid(this.uid);
  }
}

/** Hands a folder written by Ferry or an earlier, ended, step to the step's uid; never follows a link. */
async function chownTree(folder: string, uid: number): Promise<void> {
  await fs.lchown(folder, uid, uid);
  for (const entry of await fs.readdir(folder, { withFileTypes: true })) {
    const full = path.join(folder, entry.name);
    if (entry.isDirectory()) await chownTree(full, uid);
    else await fs.lchown(full, uid, uid);
  }
}

/** Makes a copied tool readable (and searchable) by others. */
async function mirrorModes(target: string): Promise<void> {
  const stat = await fs.lstat(target);
  if (stat.isSymbolicLink()) return;
  await fs.chmod(target, (stat.mode & 0o777) | 0o444 | (stat.mode & 0o100 || stat.isDirectory() ? 0o111 : 0));
  if (stat.isDirectory()) for (const name of await fs.readdir(target)) await mirrorModes(path.join(target, name));
}

let stepCounter = 0;

const RESERVED = ['/usr', '/etc', '/proc', '/dev', '/bin', '/sbin', '/lib', '/lib64', '/lib32', '/libx32'];

function checkTarget(target: string, writable: boolean): void {
  if (!path.posix.isAbsolute(target) || target.split('/').includes('..')) {
    throw new Error(`Sandbox path ${target} must be absolute without ".."`);
  }
  if (RESERVED.some((dir) => target === dir || target.startsWith(`${dir}/`))) {
    throw new Error(`Sandbox path ${target} is inside a system folder of the sandbox`);
  }
  if (writable && !target.startsWith('/app/')) throw new Error(`Writable sandbox path ${target} must be under /app`);
}

/** How a step ended, for the build log and the error: `exit code 1`, `killed: out of memory (2048 MiB)`. */
export function describeStepExit(exit: StepExit, limits: BuildLimits): string {
  if (exit.oomKilled) return `was killed: it ran out of memory (the limit is ${limits.memoryMiB} MiB)`;
  if (exit.code === null) return `was killed by ${exit.signal ?? 'a signal'}`;
  return `failed (exit code ${exit.code})`;
}
