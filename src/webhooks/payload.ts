/**
 * The body Ferry POSTs to a run's webhook: the full response payload (spec 4.5 rule 6), not only the
 * function's result. Every member is documented in docs/webhooks.md. Every writer of a payload (the
 * invoker, cancellation, the async worker's failures, recovery) builds it here, so none can leave out a
 * member docs/webhooks.md promises in every payload (`state` is required by the type).
 */

import type { RunState } from '../store/schema.js';

/** How a run ended, as its webhook payload says. */
export type WebhookRunState = Exclude<RunState, 'queued' | 'running'>;

/** Results larger than this are left out of webhook payloads (`result` null, `result_omitted` says why). */
export const MAX_WEBHOOK_RESULT_BYTES = 1024 * 1024;

export interface WebhookPayload {
  run_id: string;
  /** How the run ended: success, failure, timeout or cancelled. */
  state: WebhookRunState;
  /** Unix seconds when the run finished. */
  timestamp: number;
  /** The HTTP status the run answered (or would have answered, for async runs). */
  status_code: number;
  run_time_ms: number | null;
  /** The function's result (sync and async); for a streaming call, the array of items it yielded. */
  result?: unknown;
  result_omitted?: string;
  /** `base64` when `result` is a custom server's non-text response body, base64-encoded. */
  result_encoding?: 'base64';
  error?: { code: string; message: string; type?: string };
  /** Runs of an app with `[retries]`: every attempt, the last one this ending (docs/functions.md, Retries). */
  attempts?: AttemptRecord[];
  /** Runs of an app with `[retries]`: true when the run ended after exhausting its attempts. */
  dead?: boolean;
}

/** One ended attempt of a run under a retry policy (the run record's `attempt_history`, the webhook's `attempts`). */
export interface AttemptRecord {
  attempt: number;
  started_at: string | null;
  ended_at: string;
  state: WebhookRunState;
  status_code: number | null;
  error_code: string | null;
}

export function buildWebhookPayload(input: {
  runId: string;
  /** How the run ended (success, failure, timeout, cancelled): in every payload. */
  state: WebhookRunState;
  finishedAt: number;
  statusCode: number;
  runTimeMs: number | null;
  result?: unknown;
  /** `result` as JSON when the caller has it already (the replica's bytes): spliced in, not made again. */
  resultJson?: string | undefined;
  /** Set when the caller already knows the result is too large to send (a long stream). */
  resultOmitted?: string | undefined;
  resultEncoding?: 'base64' | undefined;
  error?: { code: string; message: string; type?: string | undefined } | undefined;
  attempts?: AttemptRecord[] | undefined;
  dead?: boolean | undefined;
}): string {
  const payload: WebhookPayload = {
    run_id: input.runId,
    state: input.state,
    timestamp: Math.floor(input.finishedAt / 1000),
    status_code: input.statusCode,
    run_time_ms: input.runTimeMs,
  };
  if (input.attempts) payload.attempts = input.attempts;
  if (input.dead !== undefined) payload.dead = input.dead;
  if (input.error) {
    payload.error = { code: input.error.code, message: input.error.message };
    if (input.error.type) payload.error.type = input.error.type;
  } else if (input.resultOmitted) {
    payload.result = null;
    payload.result_omitted = input.resultOmitted;
  } else {
    const text = input.resultJson ?? JSON.stringify(input.result ?? null);
    if (Buffer.byteLength(text) > MAX_WEBHOOK_RESULT_BYTES) {
      payload.result = null;
      payload.result_omitted = `the result is larger than ${MAX_WEBHOOK_RESULT_BYTES} bytes`;
    } else {
      // `result` (and its encoding) come last in the payload either way: spliced as text after the rest.
      const rest = JSON.stringify(payload);
      const encoding = input.resultEncoding ? `,"result_encoding":${JSON.stringify(input.resultEncoding)}` : '';
      return `${rest.slice(0, -1)},"result":${text}${encoding}}`;
    }
  }
  return JSON.stringify(payload);
}
