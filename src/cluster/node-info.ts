/**
 * What a node tells the cluster about itself, in the `info` of its row in `nodes` (cluster/node.ts writes it
 * at every lease renewal): Ferry version, role, the address it listens on, and its load (runs in flight,
 * async backlog, replicas, and the apps it has replicas of). `GET /v2/cluster` reads it back with
 * `parseNodeInfo`, tolerating rows written by older Ferry versions (hostname, pid and data_dir only).
 *
 * Kept small, as it is written every third of a lease by every node: at most MAX_APPS apps, busiest first.
 */
import fs from 'node:fs';

/** The node's role (`ferry serve --role`): `gateway`, `worker`, or `all` (every part in one process). */
export type { NodeRole } from '../config.js';

/** Apps listed in a node's info, at most (the busiest); `apps_total` counts them all. */
export const MAX_APPS = 50;

/** The version in Ferry's package.json (found from source and from dist/ alike), or `unknown`. */
export const FERRY_VERSION: string = readVersion();

function readVersion(): string {
  for (const candidate of ['../../package.json', '../../../package.json']) {
    try {
      const parsed = JSON.parse(fs.readFileSync(new URL(candidate, import.meta.url), 'utf8')) as {
        name?: unknown;
        version?: unknown;
      };
      if (parsed.name === 'ferry' && typeof parsed.version === 'string') return parsed.version;
    } catch {
      // not there: the other layout
    }
  }
  return 'unknown';
}

export interface NodeLoad {
  /** Runs executing in this node's replicas. */
  runs_in_flight: number;
  /** Runs waiting here for a replica slot. */
  runs_queued: number;
  /** Async runs this node holds and has not finished (queued here or running). */
  async_backlog: number;
  replicas_starting: number;
  replicas_ready: number;
}

export interface NodeAppLoad {
  project_id: string;
  app_id: string;
  replicas_starting: number;
  replicas_ready: number;
  runs_in_flight: number;
}

export interface NodeInfo {
  hostname: string | null;
  pid: number | null;
  data_dir: string | null;
  version: string | null;
  role: string | null;
  /** The address the node's HTTP server listens on (null before it listens, or when it does not). */
  url: string | null;
  load: NodeLoad | null;
  apps: NodeAppLoad[];
  /** Apps with replicas or runs on the node, listed or not. */
  apps_total: number;
}

/** A replica pool as the replica manager shows it (replicas/pool.ts): what `describeLoad` reads. */
export interface PoolView {
  build: { projectId: string; appId: string };
  stats: { starting: number; ready: number; inflight: number; queued: number };
}

/** The load part of a node's info, from its replica pools and its async worker's backlog. */
export function describeLoad(
  pools: Iterable<PoolView>,
  asyncBacklog: number,
): { load: NodeLoad; apps: NodeAppLoad[]; apps_total: number } {
  const load: NodeLoad = {
    runs_in_flight: 0,
    runs_queued: 0,
    async_backlog: asyncBacklog,
    replicas_starting: 0,
    replicas_ready: 0,
  };
  // An app may have two pools for a while (the current build and one draining after a redeploy).
  const apps = new Map<string, NodeAppLoad>();
  for (const pool of pools) {
    const { starting, ready, inflight, queued } = pool.stats;
    load.runs_in_flight += inflight;
    load.runs_queued += queued;
    load.replicas_starting += starting;
    load.replicas_ready += ready;
    if (starting + ready + inflight === 0) continue;
    const key = `${pool.build.projectId}/${pool.build.appId}`;
    const app = apps.get(key) ?? {
      project_id: pool.build.projectId,
      app_id: pool.build.appId,
      replicas_starting: 0,
      replicas_ready: 0,
      runs_in_flight: 0,
    };
    app.replicas_starting += starting;
    app.replicas_ready += ready;
    app.runs_in_flight += inflight;
    apps.set(key, app);
  }
  const busiest = [...apps.values()].sort(
    (a, b) =>
      b.replicas_ready + b.replicas_starting - (a.replicas_ready + a.replicas_starting) ||
      b.runs_in_flight - a.runs_in_flight ||
      (a.project_id + a.app_id < b.project_id + b.app_id ? -1 : 1),
  );
  return { load, apps: busiest.slice(0, MAX_APPS), apps_total: apps.size };
}

const count = (value: unknown): number => (typeof value === 'number' && Number.isFinite(value) ? value : 0);
const text = (value: unknown): string | null => (typeof value === 'string' ? value : null);

/** A row's `info` read back; what is missing or malformed (an older Ferry's row) is null or empty. */
export function parseNodeInfo(raw: string): NodeInfo {
  let data: Record<string, unknown> = {};
  try {
    const parsed = JSON.parse(raw) as unknown;
    if (parsed && typeof parsed === 'object' && !Array.isArray(parsed)) data = parsed as Record<string, unknown>;
  } catch {
    // not JSON: nothing is known
  }
  const rawLoad = data.load && typeof data.load === 'object' ? (data.load as Record<string, unknown>) : undefined;
  const apps: NodeAppLoad[] = [];
  if (Array.isArray(data.apps)) {
    for (const item of data.apps.slice(0, MAX_APPS)) {
      if (!item || typeof item !== 'object') continue;
      const app = item as Record<string, unknown>;
      const project = text(app.project_id);
      const id = text(app.app_id);
      if (project === null || id === null) continue;
      apps.push({
        project_id: project,
        app_id: id,
        replicas_starting: count(app.replicas_starting),
        replicas_ready: count(app.replicas_ready),
        runs_in_flight: count(app.runs_in_flight),
      });
    }
  }
  return {
    hostname: text(data.hostname),
    pid: typeof data.pid === 'number' ? data.pid : null,
    data_dir: text(data.data_dir),
    version: text(data.version),
    role: text(data.role),
    url: text(data.url),
    load: rawLoad
      ? {
          runs_in_flight: count(rawLoad.runs_in_flight),
          runs_queued: count(rawLoad.runs_queued),
          async_backlog: count(rawLoad.async_backlog),
          replicas_starting: count(rawLoad.replicas_starting),
          replicas_ready: count(rawLoad.replicas_ready),
        }
      : null,
    apps,
    apps_total: typeof data.apps_total === 'number' ? data.apps_total : apps.length,
  };
}
