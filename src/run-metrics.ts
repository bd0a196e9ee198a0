/**
 * The metrics the composition feeds from its parts: runs ended (by app, state and status, each metric child
 * found once: hot-metrics.ts) and the gauges read from the replica pools and the warm pool before /metrics
 * is rendered.
 */
import type { Metrics } from './metrics.js';
import type { PoolBuild, ReplicaPool } from './replicas/pool.js';

/** Counts a run that ended and observes its duration. */
export function createRunTally(
  metrics: Pick<Metrics, 'runs' | 'runDuration'>,
): (build: Pick<PoolBuild, 'projectId' | 'appId'>, state: string, statusCode: number, seconds: number) => void {
  const tallies = new Map<
    string,
    { ended: ReturnType<Metrics['runs']['child']>; took: ReturnType<Metrics['runDuration']['child']> }
  >();
  return function tallyRun(build, state, statusCode, seconds) {
    const key = `${build.projectId}/${build.appId}/${state}/${statusCode}`;
    let tally = tallies.get(key);
    if (!tally) {
      tally = {
        ended: metrics.runs.child(build.projectId, build.appId, state, String(statusCode)),
        took: metrics.runDuration.child(build.projectId, build.appId),
      };
      tallies.set(key, tally);
    }
    tally.ended.inc();
    tally.took.observe(seconds);
  };
}

/** Brings the gauges (replicas, queue depth, runs in flight, warm sandboxes) up to date. */
export function refreshGauges(
  metrics: Pick<Metrics, 'replicas' | 'queueDepth' | 'runsInFlight' | 'warmSandboxes'>,
  pools: Iterable<ReplicaPool>,
  warm: Record<string, { ready: number; starting: number }> | undefined,
): void {
  metrics.replicas.reset();
  metrics.queueDepth.reset();
  metrics.runsInFlight.reset();
  metrics.warmSandboxes.reset();
  if (warm) {
    for (const [runtime, counts] of Object.entries(warm)) {
      metrics.warmSandboxes.set({ runtime, state: 'ready' }, counts.ready);
      metrics.warmSandboxes.set({ runtime, state: 'starting' }, counts.starting);
    }
  }
  for (const pool of pools) {
    const labels = { project: pool.build.projectId, app: pool.build.appId };
    const { starting, ready, inflight, queued } = pool.stats;
    metrics.replicas.inc({ ...labels, state: 'starting' }, starting);
    metrics.replicas.inc({ ...labels, state: 'ready' }, ready);
    metrics.queueDepth.inc(labels, queued);
    metrics.runsInFlight.inc(labels, inflight);
  }
}
