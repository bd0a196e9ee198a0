/**
 * What a run of an app resolves to: the app's active build, its validated config and its public
 * functions. Looked up on every run (the run endpoint, the async worker), so each answer is reused for a
 * second; `forget` drops an app's entry when one of its builds becomes active.
 */
import { type AppConfig, withScalingOverride } from '../apps/app-config.js';
import type { Store } from '../store/index.js';

export interface AppTarget {
  appId: string;
  /** Null while the app has no ready build. */
  buildId: string | null;
  /** The active build's runtime (`builds.runtime`). */
  runtime: string | null;
  config: AppConfig | undefined;
  /** Public function names known from the build, or undefined when the builder could not tell. */
  functions: string[] | undefined;
}

export interface RunTargets {
  /** The app's target, or undefined when the project has no such app. */
  get(projectId: string, appId: string): Promise<AppTarget | undefined>;
  /** The app's target when it is cached and fresh, without a Promise; undefined otherwise (then `get`). */
  peek(projectId: string, appId: string): AppTarget | undefined;
  forget(projectId: string, appId: string): void;
}

const CACHE_MS = 1000;

export function createRunTargets(deps: { store: Store }): RunTargets {
  const cache = new Map<string, { value: AppTarget; until: number }>();
  return {
    async get(projectId, appId) {
      const key = `${projectId}/${appId}`;
      const now = Date.now();
      const cached = cache.get(key);
      if (cached && cached.until > now) return cached.value;
      const row = await deps.store
        .selectFrom('apps')
        .leftJoin('builds', 'builds.id', 'apps.active_build_id')
        .select([
          'apps.id',
          'apps.scaling_json',
          'builds.id as build_id',
          'builds.runtime',
          'builds.config_json',
          'builds.functions',
        ])
        .where('apps.project_id', '=', projectId)
        .where('apps.id', '=', appId)
        .executeTakeFirst();
      if (!row) return undefined;
      const value: AppTarget = {
        appId: row.id,
        buildId: row.build_id,
        runtime: row.runtime,
        config: row.config_json
          ? withScalingOverride(JSON.parse(row.config_json) as AppConfig, row.scaling_json)
          : undefined,
        functions: row.functions ? (JSON.parse(row.functions) as string[]) : undefined,
      };
      // Apps without a ready build are not cached: a first deploy must be callable at once.
      if (value.buildId) cache.set(key, { value, until: now + CACHE_MS });
      return value;
    },
    peek(projectId, appId) {
      const cached = cache.get(`${projectId}/${appId}`);
      return cached && cached.until > Date.now() ? cached.value : undefined;
    },
    forget(projectId, appId) {
      cache.delete(`${projectId}/${appId}`);
    },
  };
}
