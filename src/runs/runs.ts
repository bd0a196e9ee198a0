/**
 * Runs as the management API shows them: list (newest first, filtered, paged), one run, its logs.
 */
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { Run, RunMode, RunState } from '../store/schema.js';

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
    ...(full ? { input: parse(run.input), result: parse(run.result) } : {}),
  };
}

export async function listRuns(
  store: Store,
  projectId: string,
  appId: string,
  options: { limit: number; before?: string | undefined; state?: RunState | undefined; mode?: RunMode | undefined },
): Promise<Run[]> {
  let query = store
    .selectFrom('runs')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('app_id', '=', appId)
    .orderBy('id', 'desc')
    .limit(options.limit);
  if (options.before) query = query.where('id', '<', options.before);
  if (options.state) query = query.where('state', '=', options.state);
  if (options.mode) query = query.where('mode', '=', options.mode);
  return query.execute();
}

export async function findRun(store: Store, projectId: string, appId: string, runId: string): Promise<Run> {
  const run = await store
    .selectFrom('runs')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('app_id', '=', appId)
    .where('id', '=', runId)
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
