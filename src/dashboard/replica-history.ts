/**
 * A small in-memory history of how many replicas each app had, for the dashboard's "replicas over time"
 * chart. Replicas are not stored anywhere (they live and die with the server), so the server samples its
 * pools every 10 seconds and keeps, per app and per minute, the most replicas (starting or ready) it saw.
 * A minute the server sampled without seeing an app counts as 0 for it; a minute it never sampled (it was
 * not running) is unknown (`null`). At most one day is kept; it is lost on restart.
 */
import type { ReplicaPool } from '../replicas/pool.js';

const MINUTE_MS = 60_000;
/** How far back the history reaches, in minutes (also the stats route's largest window). */
export const HISTORY_MINUTES = 1440;

export interface ReplicaHistory {
  /** Samples the pools now. */
  sample(): void;
  /** Records one sample taken at `at` (ms): the replica count of each app seen, keyed `project/app`. */
  record(at: number, counts: ReadonlyMap<string, number>): void;
  /** The most replicas of the app in each of `minutes` minutes starting at `fromMinute` (ms, minute-aligned). */
  perMinute(projectId: string, appId: string, fromMinute: number, minutes: number): Array<number | null>;
  /** Samples every `everyMs` (default 10 s) on an unref'd timer until `stop`. */
  start(everyMs?: number): void;
  stop(): void;
}

export function minuteOf(ms: number): number {
  return Math.floor(ms / MINUTE_MS) * MINUTE_MS;
}

export function createReplicaHistory(deps: { pools: () => Iterable<ReplicaPool>; now?: () => number }): ReplicaHistory {
  const now = deps.now ?? Date.now;
  const sampled = new Set<number>();
  const maxima = new Map<string, Map<number, number>>();
  let timer: NodeJS.Timeout | undefined;

  function prune(current: number): void {
    const oldest = current - HISTORY_MINUTES * MINUTE_MS;
    for (const minute of sampled) if (minute < oldest) sampled.delete(minute);
    for (const [key, perMinute] of maxima) {
      for (const minute of perMinute.keys()) if (minute < oldest) perMinute.delete(minute);
      if (perMinute.size === 0) maxima.delete(key);
    }
  }

  const history: ReplicaHistory = {
    record(at, counts) {
      const minute = minuteOf(at);
      if (!sampled.has(minute)) {
        sampled.add(minute);
        prune(minute);
      }
      for (const [key, count] of counts) {
        const perMinute = maxima.get(key) ?? new Map<number, number>();
        maxima.set(key, perMinute);
        perMinute.set(minute, Math.max(perMinute.get(minute) ?? 0, count));
      }
    },
    sample() {
      const counts = new Map<string, number>();
      for (const pool of deps.pools()) {
        const key = `${pool.build.projectId}/${pool.build.appId}`;
        const { starting, ready } = pool.stats;
        counts.set(key, (counts.get(key) ?? 0) + starting + ready);
      }
      history.record(now(), counts);
    },
    perMinute(projectId, appId, fromMinute, minutes) {
      const perMinute = maxima.get(`${projectId}/${appId}`);
      const out: Array<number | null> = [];
      for (let i = 0; i < minutes; i++) {
        const minute = fromMinute + i * MINUTE_MS;
        out.push(sampled.has(minute) ? (perMinute?.get(minute) ?? 0) : null);
      }
      return out;
    },
    start(everyMs = 10_000) {
      history.stop();
      history.sample();
      timer = setInterval(() => history.sample(), everyMs);
      timer.unref();
    },
    stop() {
      if (timer) clearInterval(timer);
      timer = undefined;
    },
  };
  return history;
}
