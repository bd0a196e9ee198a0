/**
 * All replica pools of the server: one current pool per app (for its active build) plus older pools that
 * drain after a redeploy. Reaps idle replicas on a timer and keeps `min_replicas` running.
 *
 * A build switch hands the runs waiting in the old pool to the new one (pool.ts `drain`), and the same
 * timer tends every pool (`tend`): runs waiting in a draining pool go to the app's current pool once it has
 * one, and runs waiting with no replica ready or starting for them get one. So a run this node holds waits
 * at most about a second (`reapEveryMs`) with nothing coming for it (issue 43).
 */
import type { Logger } from 'pino';
import { type AppConfig, withScalingOverride } from '../apps/app-config.js';
import { FerryError } from '../errors.js';
import { uuidv7 } from '../ids.js';
import { runtimeOf } from '../runtimes/index.js';
import type { Store } from '../store/index.js';
import { type PoolBuild, ReplicaPool } from './pool.js';
import { type LaunchPlan, type Replica, startReplica } from './replica.js';

export interface ReplicaManagerDeps {
  store: Store;
  /** Prepares the process of one replica of `build` (sandbox, runtime, environment). */
  launch(build: PoolBuild, replicaId: string): Promise<LaunchPlan>;
  logger: Logger;
  /** Runs that may wait per app when every replica is busy. */
  maxQueue: number;
  startTimeoutMs: number;
  reapEveryMs?: number;
  /**
   * How often the pools' builds are checked against the store (default 10 s): a pool whose build was
   * deleted drains, whether or not this node heard the delete (a call may have made the pool just after).
   */
  verifyEveryMs?: number;
  onChange?: () => void;
  /** A draining pool (an old build, or a deleted app's) stopped its last replica: its build runs here no more. */
  onDrained?: (buildId: string) => void;
  onColdStart?: (build: PoolBuild, ms: number) => void;
  /** Lines replicas print outside runs, and what happened to them (`system`): the app's log. */
  onReplicaOutput?: (build: PoolBuild, replicaId: string, stream: 'stdout' | 'stderr' | 'system', line: string) => void;
  /**
   * A replica of `build` from the warm pool (warm-pool.ts), already loading the app; undefined when there
   * is none to be had, and the replica starts cold.
   */
  claimWarm?: (
    build: PoolBuild,
    onOutput: (replicaId: string, stream: 'stdout' | 'stderr', line: string) => void,
  ) => Promise<Replica | undefined>;
  /** `FERRY_WORKER_MAX_REPLICAS`: replicas of all apps this node runs at once; 0 or unset: no cap. */
  maxReplicas?: number;
  /**
   * In a cluster: whether this worker is the app's home (the first in rendezvous order of the live
   * workers), which keeps the app's `min_replicas`. Unset: this node keeps every app's minimum.
   */
  isHome?: (projectId: string, appId: string) => boolean;
  /**
   * In a cluster: the replicas of the app the other workers last announced, so `max_replicas` bounds the
   * whole cluster (a replica starts here only while this worker's plus theirs are fewer).
   */
  elsewhere?: (projectId: string, appId: string) => number;
}

export interface ReplicaManager {
  /** The pool serving `build`; a newer build replaces the app's pool (the old one drains). */
  pool(build: PoolBuild): ReplicaPool;
  /** Starts min_replicas for every app with an active build (at server start). */
  warmUp(): Promise<void>;
  /** A build became active: switch the app to it now (old replicas drain) and start its minimum. */
  activate(projectId: string, appId: string): Promise<void>;
  pools(): ReplicaPool[];
  /**
   * The app was deleted: its replicas take no new runs and stop once their runs are done (each within
   * the response grace period); calls naming its builds are refused from now on.
   */
  remove(projectId: string, appId: string): void;
  /**
   * Stops the app's current replicas (they take no new runs and stop once their runs are done), keeping
   * the app: its next call or min_replicas starts new ones. `reason` goes to the log.
   */
  stop(projectId: string, appId: string, reason: string): void;
  /** Build ids any pool here runs (a build in use keeps its files). */
  buildsInUse(): Set<string>;
  close(graceMs?: number): Promise<void>;
}

export function createReplicaManager(deps: ReplicaManagerDeps): ReplicaManager {
  const current = new Map<string, ReplicaPool>();
  const draining = new Set<ReplicaPool>();

  const cap = deps.maxReplicas ?? 0;
  const keyOf = (build: PoolBuild) => `${build.projectId}/${build.appId}`;
  const liveTotal = (): number => {
    let n = 0;
    for (const p of current.values()) n += p.liveReplicas;
    for (const p of draining) n += p.liveReplicas;
    return n;
  };
  let rescaling = false;
  /** A replica started or stopped somewhere: pools waiting on the node's cap may start one now. */
  function changed(): void {
    deps.onChange?.();
    if (cap <= 0 || rescaling) return;
    rescaling = true;
    try {
      for (const p of current.values()) p.rescale();
      // A draining pool may still serve runs it had waiting (its app was deleted: no pool to hand them to).
      for (const p of draining) p.rescale();
    } finally {
      rescaling = false;
    }
  }

  function makePool(build: PoolBuild): ReplicaPool {
    // A custom server gets its own start_timeout (the supervisor enforces it), plus time to start the sandbox.
    const startTimeoutMs = runtimeOf(build).startTimeoutMs(build.config, deps.startTimeoutMs);
    const pool = new ReplicaPool({
      build,
      maxQueue: deps.maxQueue,
      startTimeoutMs,
      logger: deps.logger,
      onChange: changed,
      ...(cap > 0 || deps.elsewhere
        ? {
            mayStart: () =>
              (cap <= 0 || liveTotal() < cap) &&
              // A worker with none of the app's replicas still starts one for a call sent to it (the
              // gateways send calls elsewhere while others run max_replicas): a call never waits for nothing.
              (!deps.elsewhere ||
                pool.liveReplicas === 0 ||
                pool.liveReplicas + deps.elsewhere(build.projectId, build.appId) <
                  pool.build.config.scaling.max_replicas),
          }
        : {}),
      ...(deps.isHome
        ? {
            minReplicas: () =>
              deps.isHome!(build.projectId, build.appId) ? pool.build.config.scaling.min_replicas : 0,
          }
        : {}),
      onColdStart: (ms) => deps.onColdStart?.(build, ms),
      onEvent: (replicaId, line) => deps.onReplicaOutput?.(build, replicaId, 'system', line),
      async startReplica(): Promise<Replica> {
        const warm = await deps.claimWarm?.(build, (replicaId, stream, line) =>
          deps.onReplicaOutput?.(build, replicaId, stream, line),
        );
        if (warm) return warm;
        const id = uuidv7().slice(-12);
        const plan = await deps.launch(build, id);
        return startReplica({
          id,
          plan,
          concurrency: build.config.scaling.replica_concurrency,
          startTimeoutMs,
          onOutput: (stream, line) => deps.onReplicaOutput?.(build, id, stream, line),
        });
      },
    });
    return pool;
  }

  /** The active build of each app as last read from the store here (rollback: not always the newest). */
  const activeIds = new Map<string, string>();

  /** Builds of deleted apps: a call still naming one (a run target a moment old) is refused. */
  const removed = new Set<string>();

  function pool(build: PoolBuild): ReplicaPool {
    if (removed.has(build.buildId))
      throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${build.appId}" in this project`);
    const key = keyOf(build);
    const existing = current.get(key);
    if (existing) {
      if (existing.build.buildId === build.buildId) return existing;
      // A call may name a build from a run target up to a second old: switch only to the app's active
      // build as the store last said (an activate may have rolled back), else to a newer one.
      const known = activeIds.get(key);
      if (known !== undefined ? build.buildId !== known : existing.build.buildId > build.buildId) return existing;
    }
    return switchTo(build, existing);
  }

  /**
   * The pool that takes the runs waiting in `old` when it drains: `next`, the app's current pool, when its
   * replicas take the same calls (a function call never goes to a custom server, nor an HTTP request to a
   * cortex bootstrap); else none, and `old` serves them itself.
   */
  function successorOf(old: ReplicaPool, next: ReplicaPool | undefined): ReplicaPool | undefined {
    return next && runtimeOf(next.build).calls === runtimeOf(old.build).calls ? next : undefined;
  }

  /**
   * A new pool for `build` (its replicas start as needed); the old one drains: its runs finish first, and the
   * runs waiting in it for a replica go to the new pool at once.
   */
  function switchTo(build: PoolBuild, existing: ReplicaPool | undefined): ReplicaPool {
    const key = keyOf(build);
    const fresh = makePool(build);
    current.set(key, fresh);
    if (existing) {
      deps.logger.info(
        { app: build.appId, from: existing.build.buildId, to: build.buildId },
        existing.build.buildId === build.buildId
          ? 'replacing replicas for the new replica_concurrency'
          : 'switching to the new build',
      );
      existing.drain(successorOf(existing, fresh));
      draining.add(existing);
    }
    return fresh;
  }

  async function activeBuild(projectId: string, appId: string): Promise<PoolBuild | undefined> {
    const row = await deps.store
      .selectFrom('apps')
      .innerJoin('builds', 'builds.id', 'apps.active_build_id')
      .select(['builds.id', 'builds.runtime', 'builds.config_json', 'apps.scaling_json'])
      .where('apps.project_id', '=', projectId)
      .where('apps.id', '=', appId)
      .executeTakeFirst();
    if (!row) return undefined;
    activeIds.set(`${projectId}/${appId}`, row.id);
    const config = withScalingOverride(JSON.parse(row.config_json) as AppConfig, row.scaling_json);
    return { projectId, appId, buildId: row.id, runtime: row.runtime, config };
  }

  /** Drains the app's pool if the build it runs is no longer in the store (deleted, alone or with its app). */
  function retire(p: ReplicaPool): void {
    const key = keyOf(p.build);
    if (current.get(key) !== p) return;
    if (removed.size >= 10_000) removed.clear();
    removed.add(p.build.buildId);
    current.delete(key);
    activeIds.delete(key);
    p.drain();
    draining.add(p);
    deps.logger.info(
      { app: p.build.appId, build: p.build.buildId },
      'build deleted: its replicas stop once their runs are done',
    );
    changed();
  }

  let verifying = false;
  async function verifyBuilds(): Promise<void> {
    const pools = [...current.values()];
    if (verifying || pools.length === 0) return;
    verifying = true;
    try {
      const ids = [...new Set(pools.map((p) => p.build.buildId))];
      const alive = new Set<string>();
      for (let i = 0; i < ids.length; i += 500) {
        const rows = await deps.store
          .selectFrom('builds')
          .select('id')
          .where('id', 'in', ids.slice(i, i + 500))
          .execute();
        for (const r of rows) alive.add(r.id);
      }
      for (const p of pools) if (!alive.has(p.build.buildId)) retire(p);
    } finally {
      verifying = false;
    }
  }
  const verifyTimer = setInterval(
    () => void verifyBuilds().catch((err: unknown) => deps.logger.debug({ err }, 'checking pools’ builds failed')),
    deps.verifyEveryMs ?? 10_000,
  );
  verifyTimer.unref();

  const timer = setInterval(() => {
    for (const p of current.values()) {
      p.reapIdle();
      p.tend();
    }
    for (const p of draining) {
      p.reapIdle();
      p.tend(successorOf(p, current.get(keyOf(p.build))));
      if (p.replicas.size === 0 && p.liveReplicas === 0 && p.queueDepth === 0) {
        draining.delete(p);
        deps.onDrained?.(p.build.buildId);
      }
    }
  }, deps.reapEveryMs ?? 1000);
  timer.unref();

  return {
    pool,
    async warmUp() {
      const apps = await deps.store
        .selectFrom('apps')
        .select(['project_id', 'id'])
        .where('active_build_id', 'is not', null)
        .execute();
      for (const app of apps) {
        const build = await activeBuild(app.project_id, app.id);
        if (!build || build.config.scaling.min_replicas === 0) continue;
        if (deps.isHome && !deps.isHome(app.project_id, app.id)) continue;
        pool(build).ensureMinimum();
      }
    },
    async activate(projectId, appId) {
      const build = await activeBuild(projectId, appId);
      if (!build) return;
      const key = `${projectId}/${appId}`;
      const existing = current.get(key);
      if (existing && existing.build.buildId === build.buildId) {
        // The same build with other scaling (PATCH .../apps/{app}): in place, or new replicas for a new
        // replica_concurrency (a replica is started for its concurrency).
        const before = existing.build.config.scaling;
        const after = build.config.scaling;
        if (before.replica_concurrency !== after.replica_concurrency) switchTo(build, existing).ensureMinimum();
        else existing.updateScaling(after);
        changed();
        return;
      }
      // Only switch eagerly when replicas are running or wanted; a scaled-to-zero app switches on its next run.
      const wanted = build.config.scaling.min_replicas > 0 && (!deps.isHome || deps.isHome(projectId, appId));
      if (current.has(key) || wanted) pool(build).ensureMinimum();
    },
    pools: () => [...current.values(), ...draining],
    stop(projectId, appId, reason) {
      const key = `${projectId}/${appId}`;
      const p = current.get(key);
      if (!p) return;
      current.delete(key);
      p.drain();
      draining.add(p);
      deps.logger.info({ app: appId, reason }, 'the app’s replicas stop once their runs are done');
      changed();
    },
    remove(projectId, appId) {
      const key = `${projectId}/${appId}`;
      activeIds.delete(key);
      const pools = [...current.values(), ...draining].filter(
        (p) => p.build.projectId === projectId && p.build.appId === appId,
      );
      for (const p of pools) {
        if (removed.size >= 10_000) removed.clear();
        removed.add(p.build.buildId);
        p.drain();
        draining.add(p);
      }
      current.delete(key);
      if (pools.length > 0) deps.logger.info({ app: appId }, 'app deleted: its replicas stop once their runs are done');
      changed();
    },
    buildsInUse() {
      const ids = new Set<string>();
      for (const p of current.values()) ids.add(p.build.buildId);
      for (const p of draining) ids.add(p.build.buildId);
      return ids;
    },
    async close(graceMs) {
      clearInterval(timer);
      clearInterval(verifyTimer);
      await Promise.all([...current.values(), ...draining].map((p) => p.close(graceMs)));
    },
  };
}
