/**
 * The warm pool: a few sandboxes per cortex runtime (Node, Python), started before any app needs them, so
 * a scaled-to-zero app's first run does not wait for a runtime to start (issue 15, cold start).
 *
 * A warm sandbox is a replica sandbox like any other (bwrap, uid 65534, its own network namespace lease,
 * its replica cgroup with the default [resources]) whose bootstrap runs with `FERRY_WARM=1` and knows no
 * app: its /app is an empty folder of its own (a "slot", sandbox/views.ts), its environment is Ferry's base
 * variables only (no app's, no secrets). When an app needs a replica, `claim`:
 *   1. takes one ready warm sandbox of the app's runtime out of the pool, for good;
 *   2. links the build's files into its slot from the host side (the read-only bind shows them at once);
 *   3. sends `POST /_ferry/load` with the entry and the environment a replica started for the app would
 *      have had; the bootstrap takes that environment and imports the entry (replica.ts `beginLoad`).
 * From then on it is that build's replica, handled by the app's pool like any other, and stopped like any
 * other: it never comes back here. The pool is refilled in the background, bounded by `size` per runtime.
 *
 * Not pre-warmed (they start cold, as before): custom runtime apps; apps whose [resources] differ from the
 * defaults (Node's heap size and the cgroup's limits are set when a sandbox starts); apps whose
 * environment sets a variable the runtime reads only as it starts (NODE_OPTIONS, PYTHONPATH, ...). No warm
 * pool without the sandbox (bwrap) or without a views folder (the slot must be on the builds' filesystem).
 */
import type { Logger } from 'pino';
import { DEFAULT_MAX_PROCESSES, volumesOf } from '../apps/app-config.js';
import { uuidv7 } from '../ids.js';
import { RUNTIMES, runtimeOf } from '../runtimes/index.js';
import { prepareLaunch, type SandboxCapabilities, sandboxPaths } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import type { BuildViews } from '../sandbox/views.js';
import type { Store } from '../store/index.js';
import { baseEnvironment, recipeCommand, replicaEnvironment } from './launcher.js';
import type { PoolBuild } from './pool.js';
import { describeExit, type LaunchPlan, type Replica, type ReplicaExit, startReplica } from './replica.js';

/** The runtimes kept warm: those whose `Runtime.warm` is set (runtimes/). */
export const WARM_RUNTIMES = ['node', 'python'] as const satisfies readonly (keyof typeof RUNTIMES)[];
export type WarmRuntime = (typeof WARM_RUNTIMES)[number];

/** The [resources] warm sandboxes are started with: the defaults, which most apps keep. */
export const WARM_RESOURCES: PoolBuild['config']['resources'] = {
  cpu: 1,
  memory: 1024,
  max_processes: DEFAULT_MAX_PROCESSES,
};

/** Restart back-off after a warm sandbox failed to start or died while waiting: 1 s, doubling, at most 60 s. */
const BACKOFF_MS = { first: 1_000, max: 60_000 };
/**
 * After a claim, the pool is refilled once the claimed sandbox has loaded its app and a moment more: starting
 * a runtime takes a core for tens of ms, which the app's load and first run should not share.
 */
const REFILL_AFTER_LOAD_MS = 50;
/** How long a warm sandbox has to stop at shutdown before SIGKILL (it runs no user code). */
const STOP_GRACE_MS = 2_000;

export interface WarmPoolDeps {
  /** Warm sandboxes kept per runtime (FERRY_WARM_POOL); at least 1. */
  size: number;
  store: Store;
  sandbox: SandboxCapabilities;
  views: BuildViews;
  network: SandboxNetwork;
  startTimeoutMs: number;
  logger: Logger;
  ensureLocal?: (buildId: string) => Promise<void>;
  secrets(projectId: string): Promise<Record<string, string>>;
  /** The runtimes to keep warm (default both; Python only where an interpreter is found). */
  runtimes?: readonly WarmRuntime[];
}

export interface WarmPool {
  /**
   * A replica of `build` made from a warm sandbox, loading the app (`waitReady` says when it is ready); or
   * undefined when none fits or none is ready: the caller starts one cold. `onOutput` gets what it prints
   * outside runs from now on.
   */
  claim(
    build: PoolBuild,
    onOutput: (replicaId: string, stream: 'stdout' | 'stderr', line: string) => void,
  ): Promise<Replica | undefined>;
  /** Warm sandboxes per runtime: ready (waiting for an app) and starting. */
  stats(): Record<WarmRuntime, { ready: number; starting: number }>;
  /** The warm sandboxes ready and not claimed: replica id and the host pid of its sandbox (tests, doctor). */
  list(): Array<{ id: string; runtime: WarmRuntime; pid: number | undefined }>;
  /** Stops every warm sandbox not claimed, and starts no more. */
  close(): Promise<void>;
}

interface WarmSandbox {
  id: string;
  runtime: WarmRuntime;
  replica: Replica;
  slot: string;
  /** Where its output outside runs goes from now on: the server log until claimed, the app's log after. */
  setOutput(output: (stream: 'stdout' | 'stderr', line: string) => void): void;
  claimed: boolean;
}

export function createWarmPool(deps: WarmPoolDeps): WarmPool {
  const runtimes = new Set<WarmRuntime>(deps.runtimes ?? WARM_RUNTIMES);
  const idle: Record<WarmRuntime, WarmSandbox[]> = { node: [], python: [] };
  const starting: Record<WarmRuntime, number> = { node: 0, python: 0 };
  const failures: Record<WarmRuntime, number> = { node: 0, python: 0 };
  const backoff: Partial<Record<WarmRuntime, NodeJS.Timeout>> = {};
  /** Taken out of the pool, not yet handed to the app's pool (its slot being filled). */
  const handing = new Set<WarmSandbox>();
  const launches = new Set<Promise<void>>();
  let closed = false;
  const logger = deps.logger;

  function refill(runtime: WarmRuntime): void {
    if (closed || !runtimes.has(runtime) || backoff[runtime]) return;
    while (idle[runtime].length + starting[runtime] < deps.size) {
      starting[runtime] += 1;
      const launch = startOne(runtime).finally(() => launches.delete(launch));
      launches.add(launch);
    }
  }

  function retryLater(runtime: WarmRuntime): void {
    failures[runtime] += 1;
    const delay = Math.min(BACKOFF_MS.max, BACKOFF_MS.first * 2 ** (failures[runtime] - 1));
    if (closed || backoff[runtime]) return;
    const timer = setTimeout(() => {
      delete backoff[runtime];
      refill(runtime);
    }, delay);
    timer.unref();
    backoff[runtime] = timer;
  }

  async function startOne(runtime: WarmRuntime): Promise<void> {
    const id = uuidv7().slice(-12);
    let slot: string | null = null;
    let release: (() => Promise<void>) | undefined;
    let replica: Replica | undefined;
    try {
      slot = await deps.views.newSlot(id);
      if (!slot) throw new Error(`no folder for warm slots: ${deps.views.reason ?? 'views are off'}`);
      const slotDir = slot;
      // Until the process is started, a failure undoes here what was made; after, its exit does.
      release = () => deps.views.dropSlot(slotDir);
      const recipe = await RUNTIMES[runtime].launchRecipe({
        entry: RUNTIMES[runtime].defaultEntry,
        resources: WARM_RESOURCES,
        sandboxed: true,
      });
      const layout = { buildDir: slot, socketDir: slot, runtimeFiles: [recipe.program] };
      const paths = sandboxPaths(layout, true);
      const lease = await deps.network.acquire(id);
      release = async () => {
        await lease.release();
        await deps.views.dropSlot(slotDir);
      };
      const prepared = await prepareLaunch(
        {
          ...layout,
          replicaId: id,
          memoryMiB: WARM_RESOURCES.memory,
          maxProcesses: WARM_RESOURCES.max_processes,
          cpu: WARM_RESOURCES.cpu,
          command: recipeCommand(recipe, paths),
          // Ferry's variables only: no app's, no secrets, until an app claims it.
          env: { ...baseEnvironment(recipe, paths.socketPath), FERRY_WARM: '1' },
          network: lease,
        },
        deps.sandbox,
      );
      const releaseAll = release;
      const plan: LaunchPlan = {
        spawn: () => prepared.spawn(['ignore', 'pipe', 'pipe']),
        sandboxed: prepared.sandboxed,
        wasOomKilled: () => prepared.wasOomKilled(),
        async cleanup() {
          await prepared.cleanup();
          await releaseAll();
        },
      };
      release = () => plan.cleanup();
      let output = (stream: 'stdout' | 'stderr', line: string): void => {
        logger.info({ replica: id, runtime, stream }, line);
      };
      replica = startReplica({
        id,
        plan,
        concurrency: 1,
        startTimeoutMs: deps.startTimeoutMs,
        onOutput: (stream, line) => output(stream, line),
      });
      const sandbox: WarmSandbox = {
        id,
        runtime,
        slot: slotDir,
        replica,
        claimed: false,
        setOutput(next) {
          output = next;
        },
      };
      replica.once('exit', (exit) => onExit(sandbox, exit));
      await replica.waitReady(deps.startTimeoutMs);
      await replica.warmUp();
      starting[runtime] -= 1;
      if (closed) {
        await replica.stop(STOP_GRACE_MS);
        return;
      }
      failures[runtime] = 0;
      idle[runtime].push(sandbox);
      logger.debug({ replica: id, runtime }, 'warm sandbox ready');
    } catch (err) {
      starting[runtime] -= 1;
      if (!replica) await release?.().catch(() => {});
      if (!closed) {
        (failures[runtime] === 0 ? logger.warn : logger.debug).call(
          logger,
          { err, runtime },
          'a warm sandbox failed to start; retrying later (apps start cold meanwhile)',
        );
      }
      retryLater(runtime);
    }
  }

  function onExit(sandbox: WarmSandbox, exit: ReplicaExit): void {
    // A claimed sandbox is its app's replica: its pool hears of its exit.
    if (sandbox.claimed) return;
    const list = idle[sandbox.runtime];
    const at = list.indexOf(sandbox);
    if (at < 0) return; // never became ready: startOne's waitReady reports it
    list.splice(at, 1);
    if (closed) return;
    logger.warn(
      { replica: sandbox.id, runtime: sandbox.runtime, detail: describeExit(exit) },
      'a warm sandbox exited while waiting for an app',
    );
    retryLater(sandbox.runtime);
  }

  /** The first ready sandbox of the runtime, out of the pool for good. */
  function take(runtime: WarmRuntime): WarmSandbox | undefined {
    const list = idle[runtime];
    while (list.length > 0) {
      const sandbox = list.shift()!;
      if (sandbox.replica.state === 'ready') return sandbox;
      // Exiting: its exit handler finds it gone from the list; stop it anyway.
      void sandbox.replica.kill();
    }
    return undefined;
  }

  for (const runtime of runtimes) {
    if (!RUNTIMES[runtime].warm) {
      runtimes.delete(runtime);
      continue;
    }
    // Python needs an interpreter (Runtime.available): without one, Python apps fail to build anyway.
    void RUNTIMES[runtime].available().then((available) => {
      if (available) refill(runtime);
      else runtimes.delete(runtime);
    });
  }

  return {
    async claim(build, onOutput) {
      const kind = runtimeOf(build);
      // A warm sandbox started before it knew its app: it has no volume bound, nor the volumes' groups,
      // and the host's root as `/`: an app on an image (`[image]`) always starts cold, on its image.
      if (closed || !kind.warm || volumesOf(build.config).length > 0 || build.config.image) return undefined;
      const resources = build.config.resources;
      if (
        resources.memory !== WARM_RESOURCES.memory ||
        resources.cpu !== WARM_RESOURCES.cpu ||
        resources.max_processes !== WARM_RESOURCES.max_processes
      ) {
        return undefined;
      }
      // Side by side: each is a wait a cold start has too, and here they are most of the claim's time.
      const [row, secrets] = await Promise.all([
        deps.store.selectFrom('builds').select(['entry']).where('id', '=', build.buildId).executeTakeFirst(),
        deps.secrets(build.projectId),
        deps.ensureLocal?.(build.buildId),
      ]);
      const runtime = kind.name as WarmRuntime;
      if (!row || !runtimes.has(runtime) || idle[runtime].length === 0) return undefined;
      const startup = kind.warm.startupVariables;
      if ([...Object.keys(secrets), ...Object.keys(build.config.env)].some((name) => startup.test(name))) {
        return undefined;
      }
      const entry = row.entry ?? kind.defaultEntry;
      const recipe = await kind.launchRecipe({ build, entry, resources: WARM_RESOURCES, sandboxed: true });
      const paths = sandboxPaths({ buildDir: '/', socketDir: '/', runtimeFiles: [recipe.program] }, true);
      const env = { ...replicaEnvironment(build, kind, recipe, secrets, paths, row.entry), ...recipe.overrides };
      if (closed) return undefined;
      const sandbox = take(runtime);
      if (!sandbox) {
        refill(runtime);
        return undefined;
      }
      // From here on the sandbox is this build's, whatever happens: it never goes back to the pool.
      sandbox.claimed = true;
      handing.add(sandbox);
      const refillLater = () => {
        const timer = setTimeout(() => refill(runtime), REFILL_AFTER_LOAD_MS);
        timer.unref();
      };
      try {
        await deps.views.fillSlot(sandbox.slot, build.buildId);
        sandbox.setOutput((stream, line) => onOutput(sandbox.id, stream, line));
        void sandbox.replica
          .beginLoad(JSON.stringify({ entry: env.FERRY_ENTRY, env }), build.config.scaling.replica_concurrency)
          .then(refillLater);
      } catch (err) {
        refillLater();
        await sandbox.replica.kill();
        throw err;
      } finally {
        handing.delete(sandbox);
      }
      logger.debug(
        { replica: sandbox.id, runtime, app: build.appId, build: build.buildId },
        'warm sandbox claimed by an app',
      );
      return sandbox.replica;
    },
    stats() {
      return {
        node: { ready: idle.node.length, starting: starting.node },
        python: { ready: idle.python.length, starting: starting.python },
      };
    },
    list() {
      return [...idle.node, ...idle.python].map((s) => ({ id: s.id, runtime: s.runtime, pid: s.replica.pid }));
    },
    async close() {
      closed = true;
      for (const runtime of WARM_RUNTIMES) {
        clearTimeout(backoff[runtime]);
        delete backoff[runtime];
      }
      // Sandboxes still starting stop themselves once ready (startOne sees `closed`).
      await Promise.allSettled([...launches]);
      const left = [...idle.node, ...idle.python, ...handing];
      idle.node = [];
      idle.python = [];
      await Promise.all(left.map((s) => s.replica.stop(STOP_GRACE_MS)));
    },
  };
}
