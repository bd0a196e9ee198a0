/**
 * Apps as the API shows them: the app, its active build and a state derived from its builds.
 */

import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { App } from '../store/schema.js';
import type { AppConfig } from './app-config.js';
import { type Scaling, type ScalingOverride, storedScalingOverride, withScalingOverride } from './app-config.js';

export type AppState = 'active' | 'building' | 'failed' | 'pending' | 'cancelled';

export interface AppView {
  id: string;
  name: string;
  project_id: string;
  state: AppState;
  active_build_id: string | null;
  latest_build_id: string | null;
  latest_build_state: string | null;
  scaling_override: ScalingOverride | null;
  /** Single app only: the scaling in force; null without a ready build. */
  scaling?: Scaling | null;
  created_at: string;
  updated_at: string;
}

async function latestBuild(store: Store, app: App): Promise<{ id: string; state: string } | undefined> {
  return store
    .selectFrom('builds')
    .select(['id', 'state'])
    .where('project_id', '=', app.project_id)
    .where('app_id', '=', app.id)
    .orderBy('id', 'desc')
    .limit(1)
    .executeTakeFirst();
}

function view(app: App, latest: { id: string; state: string } | undefined): AppView {
  let state: AppState;
  if (latest && (latest.state === 'pending' || latest.state === 'building')) state = 'building';
  else if (app.active_build_id) state = 'active';
  else state = (latest?.state as AppState | undefined) === 'cancelled' ? 'cancelled' : latest ? 'failed' : 'pending';
  return {
    id: app.id,
    name: app.name,
    project_id: app.project_id,
    state,
    active_build_id: app.active_build_id,
    latest_build_id: latest?.id ?? null,
    latest_build_state: latest?.state ?? null,
    scaling_override: storedScalingOverride(app.scaling_json),
    created_at: app.created_at,
    updated_at: app.updated_at,
  };
}

/**
 * A project's apps by name (an app's id is its name); with `limit`, one page of them after the name
 * `after` (a seek on the apps' primary key, and the newest builds of that page's apps only).
 */
export async function listApps(
  store: Store,
  projectId: string,
  page: { limit?: number | undefined; after?: string | undefined } = {},
): Promise<AppView[]> {
  let query = store.selectFrom('apps').selectAll().where('project_id', '=', projectId).orderBy('id');
  if (page.after !== undefined) query = query.where('id', '>', page.after);
  if (page.limit !== undefined) query = query.limit(page.limit);
  const apps = await query.execute();
  if (apps.length === 0) return [];
  const paged = page.limit !== undefined;
  // Every app's newest build in one query (build ids sort by time), not one query per app.
  const latest = await store
    .selectFrom('builds')
    .select(['app_id', 'id', 'state'])
    .where('project_id', '=', projectId)
    .where('id', 'in', (eb) =>
      eb
        .selectFrom('builds')
        .select((b) => b.fn.max('id').as('id'))
        .where('project_id', '=', projectId)
        .$if(paged, (q) =>
          q.where(
            'app_id',
            'in',
            apps.map((a) => a.id),
          ),
        )
        .groupBy('app_id'),
    )
    .execute();
  const byApp = new Map(latest.map((b) => [b.app_id, { id: b.id, state: b.state }]));
  return apps.map((app) => view(app, byApp.get(app.id)));
}

export async function findApp(store: Store, projectId: string, appId: string): Promise<App> {
  const app = await store
    .selectFrom('apps')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('id', '=', appId)
    .executeTakeFirst();
  if (!app) throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${appId}" in this project`);
  return app;
}

export async function getApp(store: Store, projectId: string, appId: string): Promise<AppView> {
  const app = await findApp(store, projectId, appId);
  const active = await activeConfig(store, app);
  return { ...view(app, await latestBuild(store, app)), scaling: active ? active.scaling : null };
}

/** The active build's config with the app's scaling override applied, or undefined without one. */
export async function activeConfig(store: Store, app: App): Promise<AppConfig | undefined> {
  if (!app.active_build_id) return undefined;
  const row = await store
    .selectFrom('builds')
    .select('config_json')
    .where('id', '=', app.active_build_id)
    .executeTakeFirst();
  return row ? withScalingOverride(JSON.parse(row.config_json) as AppConfig, app.scaling_json) : undefined;
}
