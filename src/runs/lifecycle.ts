/**
 * How a run ends, in one place: the run states, which of them are final, and `endRun`, which turns a way
 * of ending (`RunEnding`) into the changes of the run's record and its webhook outbox entry.
 *
 * Every place that ends a run asks `endRun` and only applies what it answers: the invoker (a run performed
 * here), the async worker (a run it cannot perform), cancel (a queued run, or every queued run of a deleted
 * app) and recovery (a run whose node stopped running it, also the held-runs sweep's). The writers keep
 * their own fences (the recorder: this node's, in this start, store/run-updates.ts; cancel: still queued;
 * recovery: still the dead node's, in the state read), so a late result is still discarded and counted.
 *
 * An ending either ends the run (a final state, with its webhook: docs/webhooks.md promises `state` in
 * every payload) or starts it again (`retry`: queued for any node, no webhook yet, the next start counts
 * one more attempt). Recovery's `retry_interrupted` is the first retry; the retries with back-off of issue
 * 28 are another `retry` (with its delay) chosen by a policy next to `interruption`, so the webhook of a
 * retried run is still only written by the ending that ends it.
 *
 * A pure module (types from the store, the error table, the payload builder): the CLI imports the states.
 */
import { ERRORS, type ErrorCode } from '../errors.js';
import { isoTime } from '../ids.js';
import type { Run, RunMode, RunState } from '../store/schema.js';
import { type AttemptRecord, buildWebhookPayload, type WebhookRunState } from '../webhooks/payload.js';
import { nextAttempt, type RetryableEnding, type RetryPolicy } from './retries.js';

export type { AttemptRecord };

/** A run's final state: success, failure, timeout or cancelled (the state its webhook reports). */
export type FinalRunState = WebhookRunState;

/** Every state a run record has; a state the store's type gains and this list lacks fails to compile. */
const STATES: Record<RunState, boolean> = {
  queued: false,
  running: false,
  success: true,
  failure: true,
  timeout: true,
  cancelled: true,
};

/** Every run state, in the order a run goes through them (queued, running, then how it ended). */
export const RUN_STATES = Object.keys(STATES) as readonly RunState[];
/** The states a run ends in; once in one, nothing rewrites the run (ARCHITECTURE invariant 7). */
export const FINAL_RUN_STATES = RUN_STATES.filter((s) => STATES[s]) as readonly FinalRunState[];
const FINAL = new Set<string>(FINAL_RUN_STATES);

/** Whether `state` is one a run ends in. */
export function isFinalState(state: string): state is FinalRunState {
  return FINAL.has(state);
}

/** A run whose custom server (or WebSocket session) answered this status ends `failure`. */
export function failedAnswer(statusCode: number): boolean {
  return statusCode >= 500;
}

/** An interrupted async run of an app with `retry_interrupted` starts at most this many times in all. */
export const MAX_RUN_STARTS = 3;

/** The changes of one run record (every column but its id). */
export type RunChanges = Partial<Omit<Run, 'id'>>;

/** A webhook delivery to write in the same transaction as the run's final state (invariant 2). */
export interface OutboxEntry {
  runId: string;
  url: string;
  payload: string;
}

/** The error a run ended with: recorded (code, message) and sent in its webhook (with `type`). */
export interface RunError {
  code: ErrorCode;
  message: string;
  /** The type of the exception a function raised (FERRY_FUNCTION_ERROR, FERRY_ARGUMENT_ERROR). */
  type?: string | undefined;
}

/** What an answered run produced. */
export interface RunResult {
  /** The result as the record keeps it (JSON text), or null when it is too large to keep. */
  stored: string | null;
  /** For the webhook: the value (a custom app's body decoded, a stream's items). */
  value?: unknown;
  /** `value` as JSON when it is known already (the replica's bytes): sent as it is. */
  json?: string | undefined;
  /** Why the webhook leaves the result out (a long stream, a large body); set instead of `value`. */
  omitted?: string | undefined;
  /** `base64` when `value` is a custom server's non-text body, base64-encoded. */
  encoding?: 'base64' | undefined;
}

/**
 * The ways a run ends. `runTimeMs` is from its start to its end; null when it never started.
 *
 * | kind            | state     | status                | reason                   | error                     |
 * |-----------------|-----------|-----------------------|--------------------------|---------------------------|
 * | answered        | success   | the answer's          | (none)                   | (none: `result`)          |
 * | answered (5xx)  | failure   | the answer's          | `http_<status>`          | (none: `result`)          |
 * | failed          | failure   | the error code's      | the error code           | the error                 |
 * | internal-error  | failure   | 500                   | (none)                   | FERRY_INTERNAL            |
 * | timed-out       | timeout   | 504                   | FERRY_RUN_TIMEOUT        | FERRY_RUN_TIMEOUT         |
 * | cancelled       | cancelled | 409                   | `cancelled`/`app_deleted`| FERRY_RUN_CANCELLED       |
 * | caller-gone     | cancelled | 499                   | `client_disconnected`    | FERRY_CLIENT_GONE         |
 * | not-performed   | failure   | the error code's      | (none)                   | the error                 |
 * | interrupted     | failure   | 502                   | `interrupted`            | FERRY_REPLICA_DIED        |
 * | retry           | queued    | (unchanged)           | (unchanged)              | (unchanged), no webhook   |
 */
export type RunEnding =
  /** The function (or a custom app's server) answered. */
  | { kind: 'answered'; statusCode: number; runTimeMs: number; result: RunResult }
  /** The call failed with an error Ferry knows: the function raised, its replica died, a limit was passed. */
  | { kind: 'failed'; error: RunError; runTimeMs: number | null }
  /** The call failed with an error Ferry did not expect (logged where it happened). */
  | { kind: 'internal-error'; runTimeMs: number | null }
  /** Past the app's response_grace_period; `message` says how long that is. */
  | { kind: 'timed-out'; message: string; runTimeMs: number | null }
  /** Cancelled through the API (`cancelled`), or still queued when its app was deleted (`app_deleted`). */
  | { kind: 'cancelled'; why: 'cancelled' | 'app_deleted'; message?: string | undefined; runTimeMs: number | null }
  /** The caller of a sync or stream run went away (and did not come back in time). */
  | { kind: 'caller-gone'; runTimeMs: number | null }
  /** The async worker could not begin it: its app has no ready build, or changed runtime since it was accepted. */
  | { kind: 'not-performed'; error: RunError }
  /** The node running it stopped (recovery, or a start the node never heard of: the held-runs sweep). */
  | { kind: 'interrupted'; runTimeMs: number | null }
  /** Started again: queued for any node, its next start one more attempt; nothing is sent yet. */
  | { kind: 'retry'; why: 'interrupted' }
  /**
   * The app's `[retries]` policy tries it again after `delayMs`: queued, not claimed before then; `after`
   * is how this attempt ended (recorded in the run's attempts). See `withRetries`.
   */
  | { kind: 'retry'; why: 'policy'; delayMs: number; after: RunEnding };

/**
 * A run under a retry policy (`[retries]` with max_attempts above 1), as the place ending an attempt of it
 * knows it: the policy, the attempts that ended before (the record's `attempt_log`) and this one.
 */
export interface RetryContext {
  policy: RetryPolicy;
  /** The record's `attempt_log` before this ending (JSON of AttemptRecord[]), or null. */
  log: string | null;
  /** This attempt's number (the run's starts so far). */
  attempt: number;
  /** When this attempt started, or null when it never did. */
  startedAt: string | null;
}

/** The run being ended, as the place that ends it knows it. */
export interface EndingRun {
  id: string;
  /** Where its webhook goes (none: no outbox entry). */
  webhookUrl: string | null | undefined;
  /**
   * The start this ending belongs to, for an async run this node started (its `attempts` then): the
   * recorder fences the changes by it. Undefined when the run was not started by the one ending it.
   */
  attempt?: number | undefined;
  /** Set for an async run under a retry policy: its attempts are recorded, and the last one says `dead`. */
  retries?: RetryContext | undefined;
}

/** The endings a retry policy's `on` names, from the way an attempt ended; null: never retried. */
export function retryableAs(ending: RunEnding): RetryableEnding | null {
  switch (ending.kind) {
    case 'answered':
      return failedAnswer(ending.statusCode) ? 'failure' : null;
    case 'failed':
    case 'internal-error':
      return 'failure';
    case 'timed-out':
      return 'timeout';
    case 'interrupted':
      return 'interrupted';
    default:
      // Cancelled, a caller gone, not performed (no ready build), or already a retry.
      return null;
  }
}

/**
 * `ending` under the run's retry policy: a `retry` after the policy's delay when the ending is one the
 * policy retries and attempts are left, else `ending` itself (endRun then marks an exhausted run `dead`).
 */
export function withRetries(ending: RunEnding, retries: RetryContext | undefined): RunEnding {
  if (!retries) return ending;
  const as = retryableAs(ending);
  if (as === null) return ending;
  const next = nextAttempt(retries.policy, retries.attempt, as);
  return next.retry ? { kind: 'retry', why: 'policy', delayMs: next.delayMs, after: ending } : ending;
}

/** The run's attempts with this one appended (for the record and the webhook). */
function attemptsWith(retries: RetryContext, entry: AttemptRecord): AttemptRecord[] {
  let earlier: AttemptRecord[] = [];
  if (retries.log) {
    try {
      const parsed = JSON.parse(retries.log) as unknown;
      if (Array.isArray(parsed)) earlier = parsed as AttemptRecord[];
    } catch {
      // A log that does not parse (hand-edited) starts again from this attempt.
    }
  }
  return [...earlier, entry];
}

/** What `endRun` answers: the writers apply it as it is. */
export interface RunEnd {
  runId: string;
  /** The run's state after it: a final state, or `queued` again (a retry). */
  state: RunState;
  /** Whether the run has ended (its final state); false for a retry. */
  final: boolean;
  /** The status the run answered (or would have, for async runs); null for a retry. */
  statusCode: number | null;
  /** The record's changes: for a final state always the same columns, whatever the ending. */
  changes: RunChanges;
  /** The start the changes apply to (EndingRun.attempt). */
  attempt: number | undefined;
  /** The webhook delivery to write with the changes, in the same transaction; only with a final state. */
  outbox: OutboxEntry | undefined;
}

const CALLER_GONE_MESSAGE = 'the caller went away';
const INTERNAL_MESSAGE = 'internal error';
/** What an interrupted run's record and webhook say. */
export const INTERRUPTED_MESSAGE = 'The server running this run stopped while the run was in progress';

/**
 * The changes of the run's record and its webhook outbox entry for `ending`, at `now` (ms). The changes
 * depend on the ending and `now` only, not on the run: runs ended alike at once (cancel of many queued
 * runs) may share one statement.
 *
 * @example
 *   recorder.finish(endRun({ id, webhookUrl }, { kind: 'caller-gone', runTimeMs: 12 }));
 */
export function endRun(run: EndingRun, ending: RunEnding, now: number = Date.now()): RunEnd {
  if (ending.kind === 'retry' && ending.why === 'policy') {
    const ended = endRun({ id: run.id, webhookUrl: undefined }, ending.after, now);
    const attempts = run.retries
      ? attemptsWith(run.retries, attemptRecord(run.retries, ended.state as FinalRunState, ended.changes, now))
      : null;
    return {
      runId: run.id,
      state: 'queued',
      final: false,
      statusCode: null,
      changes: {
        state: 'queued',
        owner: null,
        started_at: null,
        published_at: null,
        not_before: isoTime(now + ending.delayMs),
        attempt_log: attempts ? JSON.stringify(attempts) : null,
      },
      attempt: run.attempt,
      outbox: undefined,
    };
  }
  if (ending.kind === 'retry') {
    return {
      runId: run.id,
      state: 'queued',
      final: false,
      statusCode: null,
      // published_at: the run's message was acknowledged (or dropped) by whoever fetched it; the relay
      // publishes it again at once (--nats-url).
      changes: { state: 'queued', owner: null, started_at: null, published_at: null },
      attempt: run.attempt,
      outbox: undefined,
    };
  }
  let state: FinalRunState;
  let statusCode: number;
  let reason: string | null;
  let error: RunError | null = null;
  let result: RunResult | null = null;
  let runTimeMs: number | null;
  switch (ending.kind) {
    case 'answered':
      statusCode = ending.statusCode;
      state = failedAnswer(statusCode) ? 'failure' : 'success';
      reason = state === 'failure' ? `http_${statusCode}` : null;
      result = ending.result;
      runTimeMs = ending.runTimeMs;
      break;
    case 'failed':
      state = 'failure';
      error = ending.error;
      statusCode = ERRORS[error.code].status;
      reason = error.code;
      runTimeMs = ending.runTimeMs;
      break;
    case 'internal-error':
      state = 'failure';
      error = { code: 'FERRY_INTERNAL', message: INTERNAL_MESSAGE };
      statusCode = ERRORS.FERRY_INTERNAL.status;
      reason = null;
      runTimeMs = ending.runTimeMs;
      break;
    case 'timed-out':
      state = 'timeout';
      error = { code: 'FERRY_RUN_TIMEOUT', message: ending.message };
      statusCode = ERRORS.FERRY_RUN_TIMEOUT.status;
      reason = 'FERRY_RUN_TIMEOUT';
      runTimeMs = ending.runTimeMs;
      break;
    case 'cancelled':
      state = 'cancelled';
      error = { code: 'FERRY_RUN_CANCELLED', message: ending.message ?? ERRORS.FERRY_RUN_CANCELLED.message };
      statusCode = ERRORS.FERRY_RUN_CANCELLED.status;
      reason = ending.why;
      runTimeMs = ending.runTimeMs;
      break;
    case 'caller-gone':
      state = 'cancelled';
      error = { code: 'FERRY_CLIENT_GONE', message: CALLER_GONE_MESSAGE };
      statusCode = ERRORS.FERRY_CLIENT_GONE.status;
      reason = 'client_disconnected';
      runTimeMs = ending.runTimeMs;
      break;
    case 'not-performed':
      state = 'failure';
      error = ending.error;
      statusCode = ERRORS[error.code].status;
      reason = null;
      runTimeMs = null;
      break;
    case 'interrupted':
      state = 'failure';
      error = { code: 'FERRY_REPLICA_DIED', message: INTERRUPTED_MESSAGE };
      statusCode = ERRORS.FERRY_REPLICA_DIED.status;
      reason = 'interrupted';
      runTimeMs = ending.runTimeMs;
      break;
  }
  // Under a retry policy: this attempt joins the record's attempts, and a run whose last attempt ended in a
  // way the policy retries has exhausted them (`dead`).
  const retries = run.retries;
  let attempts: AttemptRecord[] | undefined;
  let dead = false;
  if (retries) {
    attempts = attemptsWith(
      retries,
      attemptRecord(retries, state, { error_code: error?.code ?? null, status_code: statusCode }, now),
    );
    const as = retryableAs(ending);
    dead = as !== null && retries.policy.on.includes(as) && retries.policy.max_attempts > 1;
  }
  const outbox = run.webhookUrl
    ? {
        runId: run.id,
        url: run.webhookUrl,
        payload: buildWebhookPayload({
          runId: run.id,
          state,
          finishedAt: now,
          statusCode,
          runTimeMs,
          result: result?.value,
          resultJson: result?.json,
          resultOmitted: result?.omitted,
          resultEncoding: result?.encoding,
          error: error ?? undefined,
          attempts,
          dead: retries ? dead : undefined,
        }),
      }
    : undefined;
  return {
    runId: run.id,
    state,
    final: true,
    statusCode,
    // Always the same columns in the same order (one object shape: a spread of varying fields cost a
    // property-definition miss per run, issue 15).
    changes: {
      state,
      status_code: statusCode,
      finished_at: isoTime(now),
      result: result?.stored ?? null,
      run_time_ms: runTimeMs,
      reason,
      error_code: error?.code ?? null,
      error_message: error?.message ?? null,
      // Left alone (undefined) for a run with no retry policy: a cancel does not erase earlier attempts.
      attempt_log: attempts ? JSON.stringify(attempts) : undefined,
      dead: retries ? (dead ? 1 : null) : undefined,
    },
    attempt: run.attempt,
    outbox,
  };
}

/** One attempt as the run's attempts record it. */
function attemptRecord(
  retries: RetryContext,
  state: FinalRunState,
  changes: { error_code?: string | null | undefined; status_code?: number | null | undefined },
  now: number,
): AttemptRecord {
  return {
    attempt: retries.attempt,
    started_at: retries.startedAt,
    ended_at: isoTime(now),
    state,
    status_code: changes.status_code ?? null,
    error_code: changes.error_code ?? null,
  };
}

/**
 * How a run whose node stopped running it ends: an async run of an app with `retry_interrupted` that has
 * started fewer than MAX_RUN_STARTS times is started again; any other ends `interrupted` (a sync or stream
 * run's caller is gone with the node; an async run may have done part of its work).
 */
export function interruption(
  run: { mode: RunMode; attempts: number; started_at: string | null },
  retryInterrupted: boolean,
  now: number,
): RunEnding {
  if (run.mode === 'async' && retryInterrupted && run.attempts < MAX_RUN_STARTS) {
    return { kind: 'retry', why: 'interrupted' };
  }
  return { kind: 'interrupted', runTimeMs: run.started_at ? now - Date.parse(run.started_at) : null };
}
