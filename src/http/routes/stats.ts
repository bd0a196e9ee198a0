/**
 * `GET /v2/projects/{project_id}/apps/{app_id}/stats?minutes=60`: what the dashboard's Apps page and charts
 * show. Live replica counts come from the replica pools, with the limits of the active build; the per-minute
 * series is computed from the `runs` table over a bounded window (grouped in JavaScript, so the query stays
 * portable between SQLite and PostgreSQL) and from the in-memory replica history.
 */
import { Type } from 'typebox';
import type { AppService } from '../../apps/app-service.js';
import { NODE_NAME } from '../../cluster/node-name.js';
import { HISTORY_MINUTES, minuteOf, type ReplicaHistory } from '../../dashboard/replica-history.js';
import { isFinalState } from '../../runs/lifecycle.js';
import type { RunService } from '../../runs/run-service.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { AppParams, errors, Nullable } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const MINUTE_MS = 60_000;
/** At most this many runs are read for one window; older runs of a busier window are left out. */
export const STATS_MAX_RUNS = 100_000;

const Count = (description: string) => Type.Integer({ minimum: 0, description });

const Stats = Type.Object({
  node: Type.String({
    description: "The process that answered (hostname:pid): `replicas` and the series' `replicas` are what it saw",
  }),
  replicas: Type.Object(
    {
      starting: Count('Replicas starting now'),
      ready: Count('Replicas ready now'),
      inflight: Count('Runs in flight now'),
      queued: Count('Runs waiting for a replica slot now'),
      min: Nullable(
        Type.Integer({
          description: 'min_replicas in force: the active build’s, or the app’s override (null: no active build)',
        }),
      ),
      max: Nullable(
        Type.Integer({
          description: 'max_replicas in force: the active build’s, or the app’s override (null: no active build)',
        }),
      ),
    },
    {
      description:
        'Live counts over every replica pool of the app in the answering process (including one draining after a redeploy)',
    },
  ),
  series: Type.Array(
    Type.Object({
      minute: Type.String({ format: 'date-time', description: 'Start of the minute (UTC)' }),
      success: Count('Runs created in this minute that ended success'),
      failure: Count('... that ended failure'),
      timeout: Count('... that ended timeout'),
      cancelled: Count('... that ended cancelled'),
      p50_ms: Nullable(Type.Integer({ description: 'Median run time of the finished runs created in this minute' })),
      p95_ms: Nullable(Type.Integer({ description: '95th percentile run time (nearest rank)' })),
      replicas: Nullable(
        Type.Integer({
          description: 'Most replicas (starting or ready) seen in this minute; null when the server was not sampling',
        }),
      ),
    }),
    { description: 'One entry per minute of the window, oldest first; the last is the current minute' },
  ),
});

/** The `p` quantile (0..1) of sorted values, nearest rank; null for none. */
export function percentile(sorted: readonly number[], p: number): number | null {
  if (sorted.length === 0) return null;
  const rank = Math.max(1, Math.ceil(p * sorted.length));
  return sorted[Math.min(rank, sorted.length) - 1] ?? null;
}

export interface StatsRouteDeps extends AuthDeps {
  apps: Pick<AppService, 'replicas'>;
  runs: Pick<RunService, 'recentRuns'>;
}

export function registerStatsRoutes(app: TypedServer, services: StatsRouteDeps, history: ReplicaHistory): void {
  const manage = requireScope(services, 'manage');

  app.get(
    '/v2/projects/:project_id/apps/:app_id/stats',
    {
      onRequest: manage,
      schema: {
        summary: "An app's live replica counts and its per-minute run statistics",
        description:
          'For the dashboard. `replicas` is live; `series` has one entry per minute of the last `minutes` minutes, ' +
          'counting the runs created in that minute by final state (runs still queued or running are not counted), ' +
          'their p50 and p95 run time (`run_time_ms`, or finished minus started when the run has none), and the ' +
          'most replicas the server saw in that minute (sampled every 10 seconds, kept in memory for a day). ' +
          'Run counts and times come from the store, so they cover every process sharing it; replica counts are ' +
          "the answering process's own (`node`).",
        params: AppParams,
        querystring: Type.Object({
          minutes: Type.Optional(
            Type.Integer({ minimum: 1, maximum: HISTORY_MINUTES, default: 60, description: 'Window length, minutes' }),
          ),
        }),
        response: { 200: Stats, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      const minutes = request.query.minutes ?? 60;
      const { min, max, ...live } = await services.apps.replicas(project_id, app_id);
      const limits = { min, max };

      // The window: `minutes` whole minutes, the last one being the current minute.
      const now = Date.now();
      const from = minuteOf(now) - (minutes - 1) * MINUTE_MS;
      const rows = await services.runs.recentRuns(project_id, app_id, from, STATS_MAX_RUNS);

      const buckets = Array.from({ length: minutes }, () => ({
        success: 0,
        failure: 0,
        timeout: 0,
        cancelled: 0,
        durations: [] as number[],
      }));
      for (const run of rows) {
        const index = Math.floor((Date.parse(run.created_at) - from) / MINUTE_MS);
        const bucket = buckets[index];
        if (!bucket || !isFinalState(run.state)) continue;
        bucket[run.state as 'success' | 'failure' | 'timeout' | 'cancelled'] += 1;
        let ms = run.run_time_ms;
        if (ms === null && run.started_at && run.finished_at) {
          ms = Date.parse(run.finished_at) - Date.parse(run.started_at);
        }
        if (ms !== null && Number.isFinite(ms)) bucket.durations.push(Math.max(0, Math.round(ms)));
      }

      history.sample(); // so the current minute includes what is running right now
      const replicas = history.perMinute(project_id, app_id, from, minutes);
      const series = buckets.map((bucket, i) => {
        const sorted = bucket.durations.sort((a, b) => a - b);
        return {
          minute: new Date(from + i * MINUTE_MS).toISOString(),
          success: bucket.success,
          failure: bucket.failure,
          timeout: bucket.timeout,
          cancelled: bucket.cancelled,
          p50_ms: percentile(sorted, 0.5),
          p95_ms: percentile(sorted, 0.95),
          replicas: replicas[i] ?? null,
        };
      });
      return { node: NODE_NAME, replicas: { ...live, ...limits }, series };
    },
  );
}
