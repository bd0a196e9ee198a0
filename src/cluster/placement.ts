/**
 * Which worker gets a call (ARCHITECTURE.md, "Scaling out"): rendezvous hashing of the app over the live
 * workers, so every gateway sends an app's calls to the same worker (its **home**), whose warm replicas
 * are reused, and a worker leaving moves only the apps it was home to. A worker with no room for the app
 * moves behind those with room, so a full worker spills over to the next.
 */
import type { WorkerAnnouncement } from './workers.js';

/** A 32-bit hash of `text` (FNV-1a, then murmur3's finaliser for a good spread of similar keys). */
function hash(text: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** The rendezvous (highest random weight) order of `workers` for `appKey` (`${projectId}/${appId}`). */
export function rankWorkers<T extends { id: string }>(appKey: string, workers: readonly T[]): T[] {
  return workers
    .map((worker) => ({ worker, weight: hash(`${appKey}\0${worker.id}`) }))
    .sort((a, b) => b.weight - a.weight || (a.worker.id < b.worker.id ? -1 : 1))
    .map((w) => w.worker);
}

/**
 * The worker that keeps an app's `min_replicas` (its home for that purpose): the first in rendezvous order
 * that runs replicas of the app; failing that, the first with room for one more replica (below its
 * FERRY_WORKER_MAX_REPLICAS); failing that, the first. Every worker reads the same announcements, so they
 * agree on one home; a full worker's new apps go to the next worker with room, and a home that runs the
 * app's replicas stays home while it does (no churn when a worker with a better rank comes back).
 */
export function homeOf(appKey: string, workers: readonly WorkerAnnouncement[]): WorkerAnnouncement | undefined {
  const ranked = rankWorkers(appKey, workers);
  return (
    ranked.find((w) => (w.load.apps[appKey]?.replicas ?? 0) > 0) ??
    ranked.find((w) => w.load.capacity <= 0 || w.load.replicas < w.load.capacity) ??
    ranked[0]
  );
}

/**
 * Whether a worker, as last announced, has no free slot for the app: every slot it has or could start for
 * the app is taken (or, without replicas of it, it is at its cap of replicas over all apps).
 */
export function isFull(worker: WorkerAnnouncement, appKey: string): boolean {
  const app = worker.load.apps[appKey];
  if (app) return app.inflight >= app.capacity;
  return worker.load.capacity > 0 && worker.load.replicas >= worker.load.capacity;
}

/**
 * The workers to try for a call, in order: rendezvous order, those without room for the app last (least
 * loaded first among them). With
 * `maxReplicas` (the app's `max_replicas`, which bounds the whole cluster): once the workers together run
 * that many replicas of the app, the workers that run them come first, as no other may start one.
 */
export function placeCall(
  appKey: string,
  workers: readonly WorkerAnnouncement[],
  options: { exclude?: ReadonlySet<string>; maxReplicas?: number } = {},
): WorkerAnnouncement[] {
  const ranked = rankWorkers(appKey, options.exclude ? workers.filter((w) => !options.exclude!.has(w.id)) : workers);
  const room: WorkerAnnouncement[] = [];
  const full: WorkerAnnouncement[] = [];
  for (const w of ranked) (isFull(w, appKey) ? full : room).push(w);
  // When every worker is full, calls wait where the wait is shortest: the least loaded for its slots first
  // (rendezvous order among equals), so a burst spreads over the workers instead of piling on the home.
  const loadOf = (w: WorkerAnnouncement) => {
    const app = w.load.apps[appKey];
    return app ? app.inflight / Math.max(1, app.capacity) : Number.POSITIVE_INFINITY;
  };
  const rank = new Map(ranked.map((w, i) => [w.id, i]));
  full.sort((a, b) => loadOf(a) - loadOf(b) || rank.get(a.id)! - rank.get(b.id)!);
  const order = room.concat(full);
  if (options.maxReplicas === undefined) return order;
  const replicasOf = (w: WorkerAnnouncement) => w.load.apps[appKey]?.replicas ?? 0;
  const total = order.reduce((n, w) => n + replicasOf(w), 0);
  if (total < options.maxReplicas) return order;
  return order.filter((w) => replicasOf(w) > 0).concat(order.filter((w) => replicasOf(w) === 0));
}

/**
 * A worker's announcement as this gateway should weigh it for `appKey`. The announcement is up to a
 * second old: of its calls in flight, the other gateways' part (announced minus this gateway's, `by`) is
 * taken as announced, and this gateway's own part is what it has in flight there now (`mine`), so a burst
 * spreads and a worker that just freed slots is seen to have room. A worker not announcing the app yet
 * (its first calls are on the way) gets the slots it could start, as far as known here.
 */
export function withOwnCalls(
  worker: WorkerAnnouncement,
  appKey: string,
  own: {
    nodeId: string;
    mine: number;
    mineOnWorker: number;
    scaling: { max_replicas: number; replica_concurrency: number };
  },
): WorkerAnnouncement {
  const announced = worker.load.apps[appKey];
  const mineThen = announced?.by?.[own.nodeId] ?? 0;
  if (own.mine === mineThen) return worker;
  const { scaling } = own;
  const room =
    worker.load.capacity > 0 ? Math.max(0, worker.load.capacity - worker.load.replicas) : scaling.max_replicas;
  const app = announced ?? {
    replicas: 0,
    inflight: 0,
    capacity: Math.min(room, scaling.max_replicas) * scaling.replica_concurrency,
  };
  return {
    ...worker,
    load: {
      ...worker.load,
      inflight: Math.max(0, worker.load.inflight - mineThen) + own.mineOnWorker,
      apps: {
        ...worker.load.apps,
        [appKey]: {
          replicas: app.replicas,
          capacity: app.capacity,
          inflight: Math.max(0, app.inflight - mineThen) + own.mine,
        },
      },
    },
  };
}
