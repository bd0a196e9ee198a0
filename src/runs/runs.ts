/**
 * Runs as the management API shows them: list (newest first, filtered, paged), one run, its logs.
 */

import type { ExpressionBuilder } from 'kysely';
import { ERRORS, FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { Database, Run, RunMode, RunState } from '../store/schema.js';
import { deadRun, notSuccessRun } from '../store/unfinished.js';
import { type AttemptRecord, endRun } from './lifecycle.js';

export interface RunView {
  run_id: string;
  project_id: string;
  app_id: string;
  build_id: string | null;
  function: string;
  mode: RunMode;
  state: RunState;
  status_code: number | null;
  cold_start: boolean;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  run_time_ms: number | null;
  error: { code: string; message: string } | null;
  reason: string | null;
  /** How many times the run was started (an interrupted async run may start again: retry_interrupted). */
  attempts: number;
  /** What started it: `call` (the run endpoint), `schedule` (a schedule's tick) or `retry` (`runs retry`). */
  trigger: 'call' | 'schedule' | 'retry';
  /** A schedule's run: the schedule's name and the tick's time. */
  schedule: { name: string; tick: string } | null;
  /** A `runs retry` run: the run it repeats. */
  retry_of: string | null;
  /** Runs of an app with `[retries]`: each attempt that ended, oldest first; empty for other runs. */
  attempt_history: AttemptRecord[];
  /** A run waiting for its next attempt: not started before this time. */
  next_attempt_at: string | null;
  /** True when the run ended after exhausting its retry attempts. */
  dead: boolean;
  /** Only on a single run: the stored input and result (JSON), when they were small enough to keep. */
  input?: unknown;
  result?: unknown;
}

function parse(text: string | null): unknown {
  if (text === null) return null;
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function attemptHistory(log: string | null): AttemptRecord[] {
  if (!log) return [];
  try {
    const parsed = JSON.parse(log) as unknown;
    return Array.isArray(parsed) ? (parsed as AttemptRecord[]) : [];
  } catch {
    return [];
  }
}

export function viewRun(run: Run, full = false): RunView {
  return {
    run_id: run.id,
    project_id: run.project_id,
    app_id: run.app_id,
    build_id: run.build_id,
    function: run.function_name,
    mode: run.mode,
    state: run.state,
    status_code: run.status_code,
    cold_start: run.cold_start === 1,
    created_at: run.created_at,
    started_at: run.started_at,
    finished_at: run.finished_at,
    run_time_ms: run.run_time_ms,
    error: run.error_code ? { code: run.error_code, message: run.error_message ?? '' } : null,
    reason: run.reason,
    attempts: run.attempts,
    trigger: run.trigger === 'schedule' || run.trigger === 'retry' ? run.trigger : 'call',
    schedule: run.schedule_name && run.scheduled_for ? { name: run.schedule_name, tick: run.scheduled_for } : null,
    retry_of: run.retry_of ?? null,
    attempt_history: attemptHistory(run.attempt_log ?? null),
    next_attempt_at: run.state === 'queued' ? (run.not_before ?? null) : null,
    dead: run.dead === 1,
    ...(full ? { input: parse(run.input), result: parse(run.result) } : {}),
  };
}

/**
 * Runs made since the app (of this name) was created: an app deleted and deployed again starts afresh,
 * though records of the old app's last runs stay until retention removes them.
 */
function sinceTheApp(projectId: string, appId: string) {
  return (eb: ExpressionBuilder<Database, 'runs'>) =>
    eb(
      'runs.created_at',
      '>=',
      // No app row (records kept by themselves): every run counts.
      eb.fn.coalesce(
        eb
          .selectFrom('apps')
          .select('apps.created_at')
          .where('apps.project_id', '=', projectId)
          .where('apps.id', '=', appId),
        eb.val(''),
      ),
    );
}

export async function listRuns(
  store: Store,
  projectId: string,
  appId: string,
  options: {
    limit: number;
    before?: string | undefined;
    state?: RunState | undefined;
    mode?: RunMode | undefined;
    dead?: boolean | undefined;
  },
): Promise<Run[]> {
  // Only the runs of this app, not of a deleted app of the same name (their records wait for retention).
  let query = store
    .selectFrom('runs')
    .selectAll('runs')
    .where('runs.project_id', '=', projectId)
    .where('runs.app_id', '=', appId)
    .where(sinceTheApp(projectId, appId))
    .orderBy('runs.id', 'desc')
    .limit(options.limit);
  if (options.before) query = query.where('runs.id', '<', options.before);
  // Each filter also writes out the condition of the partial index that serves it (store/unfinished.ts), so a
  // rare state is a seek and not a scan of the app's runs; success, most of them, is found by scanning.
  if (options.state) {
    query = query.where('runs.state', '=', options.state);
    if (options.state !== 'success') query = query.where(notSuccessRun());
  }
  if (options.mode) query = query.where('runs.mode', '=', options.mode);
  if (options.dead) query = query.where(deadRun());
  return query.execute();
}

export async function findRun(store: Store, projectId: string, appId: string, runId: string): Promise<Run> {
  const run = await store
    .selectFrom('runs')
    .selectAll('runs')
    .where('runs.project_id', '=', projectId)
    .where('runs.app_id', '=', appId)
    .where('runs.id', '=', runId)
    .where(sinceTheApp(projectId, appId))
    .executeTakeFirst();
  if (!run) throw new FerryError('FERRY_RUN_NOT_FOUND', `No run ${runId} of app "${appId}"`);
  return run;
}

export async function runLogs(
  store: Store,
  runId: string,
  after: number,
): Promise<Array<{ seq: number; at: string; stream: string; line: string }>> {
  return store
    .selectFrom('run_log_lines')
    .select(['seq', 'at', 'stream', 'line'])
    .where('run_id', '=', runId)
    .where('seq', '>', after)
    .orderBy('seq')
    .limit(10_000)
    .execute();
}

/** What a run's log lost: past the per-run bound, or to the project's log budget (0 and 0: nothing). */
export async function runLogDrops(
  store: Store,
  runId: string,
): Promise<{ dropped_lines: number; dropped_bytes: number }> {
  const row = await store
    .selectFrom('run_log_stats')
    .select(['dropped_lines', 'dropped_bytes'])
    .where('run_id', '=', runId)
    .executeTakeFirst();
  return { dropped_lines: Number(row?.dropped_lines ?? 0), dropped_bytes: Number(row?.dropped_bytes ?? 0) };
}

/**
 * Ends these runs `cancelled` (runs/lifecycle.ts), those still queued only (no node has started them:
 * starting one checks it is queued, store/claims.ts), with their webhook deliveries, in the caller's
 * transaction. Resolves with the ids it ended.
 */
export async function cancelQueued(
  trx: Store,
  runs: ReadonlyArray<Pick<Run, 'id' | 'webhook_endpoint'>>,
  why: { message: string; reason: 'cancelled' | 'app_deleted' },
  now = Date.now(),
): Promise<string[]> {
  const ends = runs.map((r) =>
    endRun(
      { id: r.id, webhookUrl: r.webhook_endpoint },
      { kind: 'cancelled', why: why.reason, message: why.message, runTimeMs: null },
      now,
    ),
  );
  const first = ends[0];
  if (first === undefined) return [];
  // Ended alike at once: their changes are the same (endRun), one statement for them all.
  const ended = (
    await trx
      .updateTable('runs')
      .set(first.changes)
      .where(
        'id',
        'in',
        runs.map((r) => r.id),
      )
      .where('state', '=', 'queued')
      .returning('id')
      .execute()
  ).map((r) => r.id);
  const done = new Set(ended);
  const at = new Date(now).toISOString();
  const hooks = ends.flatMap((end) =>
    end.outbox && done.has(end.runId)
      ? [
          {
            run_id: end.runId,
            url: end.outbox.url,
            payload: end.outbox.payload,
            state: 'pending',
            attempts: 0,
            next_attempt_at: at,
            created_at: at,
            updated_at: at,
          },
        ]
      : [],
  );
  if (hooks.length > 0) {
    await trx
      .insertInto('webhook_deliveries')
      .values(hooks)
      .onConflict((oc) => oc.doNothing())
      .execute();
  }
  return ended;
}

/** Ends a queued async run `cancelled` if it is still queued (POST .../runs/{run_id}/cancel). */
export async function cancelQueuedRun(store: Store, run: Run): Promise<boolean> {
  if (run.mode !== 'async' || run.state !== 'queued') return false;
  const { message } = ERRORS.FERRY_RUN_CANCELLED;
  const ended = await store.transaction().execute((trx) => cancelQueued(trx, [run], { message, reason: 'cancelled' }));
  return ended.length > 0;
}
