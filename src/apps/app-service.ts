/**
 * The app service: what the apps routes (and the stats route) ask of apps, behind one object. The reads,
 * scaling without a build (the app's `[scaling]` override, in force on every process at once), deleting
 * an app (apps/housekeeping.ts does the work), the app log this process keeps, and the live replica counts
 * with the limits in force.
 */
import type { ChangeFeed } from '../cluster/change-feed.js';
import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import type { ReplicaManager } from '../replicas/manager.js';
import type { Store } from '../store/index.js';
import {
  AppConfigError,
  DEFAULT_SCALING,
  parseScalingOverride,
  type ScalingOverride,
  storedScalingOverride,
} from './app-config.js';
import type { AppLog } from './app-log.js';
import { type AppView, activeConfig, findApp, getApp, listApps } from './apps.js';
import type { Housekeeping } from './housekeeping.js';

export interface AppServiceDeps {
  store: Store;
  changes: Pick<ChangeFeed, 'publish'>;
  replicas: Pick<ReplicaManager, 'activate' | 'pools'>;
  housekeeping: Pick<Housekeeping, 'deleteApp'>;
  /** Wakes the webhook deliverer: a deleted app's queued runs end cancelled, with their webhooks. */
  wakeWebhooks: () => void;
  appLog: Pick<AppLog, 'read'>;
}

/** Live replica counts of an app in this process, and the min/max replicas in force (null: no active build). */
export interface AppReplicas {
  starting: number;
  ready: number;
  inflight: number;
  queued: number;
  min: number | null;
  max: number | null;
}

export interface AppService {
  /** The project's apps by name; with `limit`, a page of them after the name `after`. */
  list(projectId: string, page?: { limit?: number | undefined; after?: string | undefined }): Promise<AppView[]>;
  get(projectId: string, appId: string): Promise<AppView>;
  /**
   * Merges `scaling` (keys of `[scaling]`, checked as in ferry.toml) into the app's override, or clears it
   * (null); every process (this one before it resolves) rescales the app's replicas.
   */
  scale(
    projectId: string,
    appId: string,
    scaling: object | null,
  ): Promise<{
    app: AppView;
    override: ScalingOverride | null;
  }>;
  delete(projectId: string, appId: string): Promise<{ builds: number; cancelledRuns: number; deletedRuns: number }>;
  /** What this process's replicas of the app printed outside runs (after `after`, at most `limit` lines). */
  log(projectId: string, appId: string, after: number, limit: number): Promise<ReturnType<AppLog['read']>>;
  replicas(projectId: string, appId: string): Promise<AppReplicas>;
}

export function createAppService(deps: AppServiceDeps): AppService {
  const { store } = deps;
  return {
    list: (projectId, page) => listApps(store, projectId, page),
    get: (projectId, appId) => getApp(store, projectId, appId),

    async scale(projectId, appId, scaling) {
      const found = await findApp(store, projectId, appId);
      let override: ScalingOverride | null = null;
      if (scaling !== null) {
        let patch: ScalingOverride;
        try {
          patch = parseScalingOverride(scaling);
        } catch (err) {
          if (err instanceof AppConfigError) throw new FerryError('FERRY_SCALING_INVALID', err.message);
          throw err;
        }
        override = { ...(storedScalingOverride(found.scaling_json) ?? {}), ...patch };
        const base = (await activeConfig(store, { ...found, scaling_json: null }))?.scaling ?? DEFAULT_SCALING;
        const merged = { ...base, ...override };
        if (merged.min_replicas > merged.max_replicas) {
          throw new FerryError(
            'FERRY_SCALING_INVALID',
            `scaling.min_replicas: ${merged.min_replicas} is more than scaling.max_replicas (${merged.max_replicas})`,
          );
        }
        if (Object.keys(override).length === 0) override = null;
      }
      await store
        .updateTable('apps')
        .set({ scaling_json: override ? JSON.stringify(override) : null, updated_at: nowIso() })
        .where('project_id', '=', projectId)
        .where('id', '=', appId)
        .execute();
      // Every process (this one before the answer) reloads the app's target and rescales its replicas.
      await deps.changes.publish({ type: 'app.changed', projectId, appId });
      await deps.replicas.activate(projectId, appId);
      return { app: await getApp(store, projectId, appId), override };
    },

    async delete(projectId, appId) {
      const done = await deps.housekeeping.deleteApp(projectId, appId);
      deps.wakeWebhooks();
      return done;
    },

    async log(projectId, appId, after, limit) {
      await getApp(store, projectId, appId);
      return deps.appLog.read(projectId, appId, after, limit);
    },

    async replicas(projectId, appId) {
      const found = await findApp(store, projectId, appId);
      // Live replicas: every pool of the app (the current one and any draining one).
      const live = { starting: 0, ready: 0, inflight: 0, queued: 0 };
      for (const pool of deps.replicas.pools()) {
        if (pool.build.projectId !== projectId || pool.build.appId !== appId) continue;
        const s = pool.stats;
        live.starting += s.starting;
        live.ready += s.ready;
        live.inflight += s.inflight;
        live.queued += s.queued;
      }
      // The limits in force: the active build's ferry.toml with the app's scaling override (PATCH .../apps).
      const config = await activeConfig(store, found);
      return { ...live, min: config?.scaling.min_replicas ?? null, max: config?.scaling.max_replicas ?? null };
    },
  };
}
