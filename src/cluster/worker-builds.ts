/**
 * A worker's view of the builds gateways name in their calls (http/worker-api.ts): each a ready build of
 * the app it says, with the app's scaling in force.
 */
import { type AppConfig, withScalingOverride } from '../apps/app-config.js';
import { FerryError } from '../errors.js';
import type { PoolBuild } from '../replicas/pool.js';
import type { Store } from '../store/index.js';
import type { CallMeta } from './protocol.js';

export interface WorkerBuilds {
  /** The build `meta` names; FERRY_NO_READY_BUILD when it is not a ready build of that app. */
  get(meta: CallMeta): Promise<PoolBuild>;
}

/**
 * The builds named by calls, with the app's scaling in force (an override set through the API applies to
 * every build): kept for a second, as run targets are, so a scaling change reaches this worker's pools.
 */
export function createWorkerBuilds(store: Store): WorkerBuilds {
  const cache = new Map<string, { build: PoolBuild; until: number }>();
  return {
    async get(meta: CallMeta): Promise<PoolBuild> {
      const now = Date.now();
      const hit = cache.get(meta.buildId);
      if (hit && hit.until > now && hit.build.projectId === meta.projectId && hit.build.appId === meta.appId) {
        return hit.build;
      }
      const row = await store
        .selectFrom('builds')
        .leftJoin('apps', (j) =>
          j.onRef('apps.project_id', '=', 'builds.project_id').onRef('apps.id', '=', 'builds.app_id'),
        )
        .select([
          'builds.id',
          'builds.project_id',
          'builds.app_id',
          'builds.state',
          'builds.runtime',
          'builds.config_json',
          'apps.scaling_json',
        ])
        .where('builds.id', '=', meta.buildId)
        .executeTakeFirst();
      if (!row || row.project_id !== meta.projectId || row.app_id !== meta.appId || row.state !== 'ready') {
        throw new FerryError('FERRY_NO_READY_BUILD', 'The build the gateway named is not a ready build of this app', {
          headers: { 'retry-after': '1' },
        });
      }
      const build: PoolBuild = {
        projectId: row.project_id,
        appId: row.app_id,
        buildId: row.id,
        runtime: row.runtime,
        config: withScalingOverride(JSON.parse(row.config_json ?? '{}') as AppConfig, row.scaling_json),
      };
      if (cache.size >= 1000) cache.delete(cache.keys().next().value as string);
      cache.set(row.id, { build, until: now + 1000 });
      return build;
    },
  };
}
