/**
 * All replica pools of the server: one current pool per app (for its active build) plus older pools that
 * drain after a redeploy. Reaps idle replicas on a timer and keeps `min_replicas` running.
 */
import type { Logger } from 'pino';
import type { AppConfig } from '../apps/app-config.js';
import { uuidv7 } from '../ids.js';
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
  onChange?: () => void;
  onColdStart?: (build: PoolBuild, ms: number) => void;
  /** Lines replicas print outside runs, and what happened to them (`system`): the app's log. */
  onReplicaOutput?: (build: PoolBuild, replicaId: string, stream: 'stdout' | 'stderr' | 'system', line: string) => void;
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
  close(graceMs?: number): Promise<void>;
}

export function createReplicaManager(deps: ReplicaManagerDeps): ReplicaManager {
  const current = new Map<string, ReplicaPool>();
  const draining = new Set<ReplicaPool>();

  const cap = deps.maxReplicas ?? 0;
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
    } finally {
      rescaling = false;
    }
  }

  function makePool(build: PoolBuild): ReplicaPool {
    // A custom server gets its own start_timeout (the supervisor enforces it), plus time to start the sandbox.
    const custom = build.config.runtime.custom;
    const startTimeoutMs = custom ? custom.start_timeout * 1000 + deps.startTimeoutMs : deps.startTimeoutMs;
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
                pool.liveReplicas + deps.elsewhere(build.projectId, build.appId) < build.config.scaling.max_replicas),
          }
        : {}),
      ...(deps.isHome
        ? { minReplicas: () => (deps.isHome!(build.projectId, build.appId) ? build.config.scaling.min_replicas : 0) }
        : {}),
      onColdStart: (ms) => deps.onColdStart?.(build, ms),
      onEvent: (replicaId, line) => deps.onReplicaOutput?.(build, replicaId, 'system', line),
      async startReplica(): Promise<Replica> {
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

  function pool(build: PoolBuild): ReplicaPool {
    const key = `${build.projectId}/${build.appId}`;
    const existing = current.get(key);
    if (existing && existing.build.buildId >= build.buildId) return existing;
    const fresh = makePool(build);
    current.set(key, fresh);
    if (existing) {
      deps.logger.info(
        { app: build.appId, from: existing.build.buildId, to: build.buildId },
        'switching to the new build',
      );
      existing.drain();
      draining.add(existing);
    }
    return fresh;
  }

  async function activeBuild(projectId: string, appId: string): Promise<PoolBuild | undefined> {
    const row = await deps.store
      .selectFrom('apps')
      .innerJoin('builds', 'builds.id', 'apps.active_build_id')
      .select(['builds.id', 'builds.config_json'])
      .where('apps.project_id', '=', projectId)
      .where('apps.id', '=', appId)
      .executeTakeFirst();
    if (!row) return undefined;
    return { projectId, appId, buildId: row.id, config: JSON.parse(row.config_json) as AppConfig };
  }

  const timer = setInterval(() => {
    for (const p of current.values()) p.reapIdle();
    for (const p of draining) {
      p.reapIdle();
      if (p.replicas.size === 0 && p.queueDepth === 0) draining.delete(p);
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
      // Only switch eagerly when replicas are running or wanted; a scaled-to-zero app switches on its next run.
      const wanted = build.config.scaling.min_replicas > 0 && (!deps.isHome || deps.isHome(projectId, appId));
      if (current.has(key) || wanted) pool(build).ensureMinimum();
    },
    pools: () => [...current.values(), ...draining],
    async close(graceMs) {
      clearInterval(timer);
      await Promise.all([...current.values(), ...draining].map((p) => p.close(graceMs)));
    },
  };
}
