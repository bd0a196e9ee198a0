/** What a worker announces of its load (cluster/workers.ts): what gateways place calls by. */
import type { ReplicaPool } from '../replicas/pool.js';
import type { CallerTally } from './caller-tally.js';
import type { WorkerLoad } from './workers.js';

/** What a worker announces of its load: per app, replicas, runs in flight and the slots it could have. */
export function workerLoad(
  pools: Iterable<ReplicaPool>,
  maxReplicas: number,
  elsewhere?: (projectId: string, appId: string) => number,
  callers?: CallerTally,
): WorkerLoad {
  const all = [...pools];
  let replicas = 0;
  let inflight = 0;
  for (const pool of all) {
    replicas += pool.liveReplicas;
    inflight += pool.stats.inflight;
  }
  const room = maxReplicas > 0 ? Math.max(0, maxReplicas - replicas) : Number.POSITIVE_INFINITY;
  const apps: WorkerLoad['apps'] = {};
  for (const pool of all) {
    if (pool.isDraining) continue;
    const { scaling } = pool.build.config;
    const key = `${pool.build.projectId}/${pool.build.appId}`;
    // The replicas it could have: bounded by its own cap and by what the other workers run of the app.
    const others = elsewhere?.(pool.build.projectId, pool.build.appId) ?? 0;
    const possible = Math.max(pool.liveReplicas, Math.min(scaling.max_replicas - others, pool.liveReplicas + room));
    const by = callers?.of(key);
    apps[key] = {
      replicas: pool.liveReplicas,
      inflight: pool.stats.inflight + pool.stats.queued,
      capacity: possible * scaling.replica_concurrency,
      ...(by ? { by } : {}),
    };
  }
  return { capacity: maxReplicas, inflight, replicas, apps };
}
