/**
 * runs/lifecycle.ts, in process and in milliseconds: every way a run ends gives the record's changes (the
 * same columns whatever the ending) and, with a webhook, an outbox entry whose payload says the run's
 * `state` (docs/webhooks.md promises it in every payload); a retry changes only what starts the run again
 * and sends nothing; `interruption` decides between the two as `retry_interrupted` says.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  endRun,
  FINAL_RUN_STATES,
  INTERRUPTED_MESSAGE,
  interruption,
  isFinalState,
  MAX_RUN_STARTS,
  RUN_STATES,
  type RunEnding,
  retryableAs,
  withRetries,
} from '../src/runs/lifecycle.js';
import type { RunState } from '../src/store/schema.js';

const NOW = Date.parse('2026-01-02T03:04:05.678Z');
const HOOK = 'http://127.0.0.1:9/hook';
const run = { id: '01a20bd5-2d74-72e0-9ad8-52788bca559a', webhookUrl: HOOK };

interface Expected {
  state: RunState;
  status: number;
  reason: string | null;
  error: { code: string; message: string; type?: string } | null;
  result: string | null;
  runTimeMs: number | null;
  /** The payload's `result` member (absent when it has `error`). */
  payloadResult?: unknown;
}

const cases: Array<[string, RunEnding, Expected]> = [
  [
    'answered',
    {
      kind: 'answered',
      statusCode: 200,
      runTimeMs: 12,
      result: { stored: '{"x":1}', value: { x: 1 }, json: '{"x":1}' },
    },
    {
      state: 'success',
      status: 200,
      reason: null,
      error: null,
      result: '{"x":1}',
      runTimeMs: 12,
      payloadResult: { x: 1 },
    },
  ],
  [
    "answered 5xx (a custom app's server)",
    { kind: 'answered', statusCode: 502, runTimeMs: 3, result: { stored: '"bad gateway"', value: 'bad gateway' } },
    {
      state: 'failure',
      status: 502,
      reason: 'http_502',
      error: null,
      result: '"bad gateway"',
      runTimeMs: 3,
      payloadResult: 'bad gateway',
    },
  ],
  [
    'answered, the result too large to keep',
    { kind: 'answered', statusCode: 200, runTimeMs: 5, result: { stored: null, omitted: 'the items are large' } },
    { state: 'success', status: 200, reason: null, error: null, result: null, runTimeMs: 5, payloadResult: null },
  ],
  [
    'failed',
    {
      kind: 'failed',
      error: { code: 'FERRY_FUNCTION_ERROR', message: 'Error: boom', type: 'Error' },
      runTimeMs: 7,
    },
    {
      state: 'failure',
      status: 500,
      reason: 'FERRY_FUNCTION_ERROR',
      error: { code: 'FERRY_FUNCTION_ERROR', message: 'Error: boom', type: 'Error' },
      result: null,
      runTimeMs: 7,
    },
  ],
  [
    'internal-error',
    { kind: 'internal-error', runTimeMs: null },
    {
      state: 'failure',
      status: 500,
      reason: null,
      error: { code: 'FERRY_INTERNAL', message: 'internal error' },
      result: null,
      runTimeMs: null,
    },
  ],
  [
    'timed-out',
    { kind: 'timed-out', message: 'too long (1 s)', runTimeMs: 1000 },
    {
      state: 'timeout',
      status: 504,
      reason: 'FERRY_RUN_TIMEOUT',
      error: { code: 'FERRY_RUN_TIMEOUT', message: 'too long (1 s)' },
      result: null,
      runTimeMs: 1000,
    },
  ],
  [
    'cancelled',
    { kind: 'cancelled', why: 'cancelled', runTimeMs: 40 },
    {
      state: 'cancelled',
      status: 409,
      reason: 'cancelled',
      error: { code: 'FERRY_RUN_CANCELLED', message: 'The run was cancelled' },
      result: null,
      runTimeMs: 40,
    },
  ],
  [
    'cancelled, its app deleted',
    { kind: 'cancelled', why: 'app_deleted', message: 'gone with its app', runTimeMs: null },
    {
      state: 'cancelled',
      status: 409,
      reason: 'app_deleted',
      error: { code: 'FERRY_RUN_CANCELLED', message: 'gone with its app' },
      result: null,
      runTimeMs: null,
    },
  ],
  [
    'caller-gone',
    { kind: 'caller-gone', runTimeMs: 9 },
    {
      state: 'cancelled',
      status: 499,
      reason: 'client_disconnected',
      error: { code: 'FERRY_CLIENT_GONE', message: 'the caller went away' },
      result: null,
      runTimeMs: 9,
    },
  ],
  [
    'not-performed',
    { kind: 'not-performed', error: { code: 'FERRY_NO_READY_BUILD', message: 'no build' } },
    {
      state: 'failure',
      status: 503,
      reason: null,
      error: { code: 'FERRY_NO_READY_BUILD', message: 'no build' },
      result: null,
      runTimeMs: null,
    },
  ],
  [
    'not-performed (the app changed runtime)',
    { kind: 'not-performed', error: { code: 'FERRY_CORTEX_CALL', message: 'redeployed' } },
    {
      state: 'failure',
      status: 405,
      reason: null,
      error: { code: 'FERRY_CORTEX_CALL', message: 'redeployed' },
      result: null,
      runTimeMs: null,
    },
  ],
  [
    'interrupted',
    { kind: 'interrupted', runTimeMs: 2500 },
    {
      state: 'failure',
      status: 502,
      reason: 'interrupted',
      error: { code: 'FERRY_REPLICA_DIED', message: INTERRUPTED_MESSAGE },
      result: null,
      runTimeMs: 2500,
    },
  ],
];

describe('runs/lifecycle: endRun', () => {
  for (const [name, ending, expected] of cases) {
    it(`${name}: the record's changes and a webhook payload with state ${expected.state}`, () => {
      const end = endRun({ ...run, attempt: 2 }, ending, NOW);
      assert.equal(end.runId, run.id);
      assert.equal(end.state, expected.state);
      assert.equal(end.final, true);
      assert.equal(end.statusCode, expected.status);
      assert.equal(end.attempt, 2);
      // Every final ending writes the same columns, in the same order.
      assert.deepEqual(end.changes, {
        state: expected.state,
        status_code: expected.status,
        finished_at: '2026-01-02T03:04:05.678Z',
        result: expected.result,
        run_time_ms: expected.runTimeMs,
        reason: expected.reason,
        error_code: expected.error?.code ?? null,
        error_message: expected.error?.message ?? null,
        // No retry policy: the attempts and `dead` are left alone (a cancel keeps earlier attempts).
        attempt_log: undefined,
        dead: undefined,
      });
      assert.deepEqual(Object.keys(end.changes), [
        'state',
        'status_code',
        'finished_at',
        'result',
        'run_time_ms',
        'reason',
        'error_code',
        'error_message',
        'attempt_log',
        'dead',
      ]);
      assert.ok(end.outbox);
      assert.equal(end.outbox.runId, run.id);
      assert.equal(end.outbox.url, HOOK);
      const payload = JSON.parse(end.outbox.payload) as Record<string, unknown>;
      assert.equal(payload.state, expected.state, 'the payload says how the run ended');
      assert.equal(payload.run_id, run.id);
      assert.equal(payload.timestamp, Math.floor(NOW / 1000));
      assert.equal(payload.status_code, expected.status);
      assert.equal(payload.run_time_ms, expected.runTimeMs);
      if (expected.error) {
        assert.deepEqual(payload.error, expected.error);
        assert.equal('result' in payload, false);
      } else {
        assert.deepEqual(payload.result, expected.payloadResult);
        assert.equal('error' in payload, false);
      }
    });
  }

  it('no webhook: no outbox entry, the same changes', () => {
    const ending: RunEnding = { kind: 'caller-gone', runTimeMs: 1 };
    const withHook = endRun(run, ending, NOW);
    const without = endRun({ id: run.id, webhookUrl: null }, ending, NOW);
    assert.equal(without.outbox, undefined);
    assert.equal(endRun({ id: run.id, webhookUrl: undefined }, ending, NOW).outbox, undefined);
    assert.deepEqual(without.changes, withHook.changes);
  });

  it("a custom app's base64 body and a long stream's omitted result reach the payload", () => {
    const encoded = endRun(
      run,
      {
        kind: 'answered',
        statusCode: 200,
        runTimeMs: 1,
        result: { stored: '"AAE="', value: 'AAE=', encoding: 'base64' },
      },
      NOW,
    );
    const body = JSON.parse(encoded.outbox?.payload ?? '{}') as Record<string, unknown>;
    assert.equal(body.result, 'AAE=');
    assert.equal(body.result_encoding, 'base64');
    const omitted = endRun(
      run,
      { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: null, omitted: 'too many items' } },
      NOW,
    );
    const long = JSON.parse(omitted.outbox?.payload ?? '{}') as Record<string, unknown>;
    assert.equal(long.result, null);
    assert.equal(long.result_omitted, 'too many items');
  });

  it('retry: queued again for any node, nothing recorded of an end, no webhook', () => {
    const end = endRun({ ...run, attempt: 1 }, { kind: 'retry', why: 'interrupted' }, NOW);
    assert.equal(end.state, 'queued');
    assert.equal(end.final, false);
    assert.equal(end.statusCode, null);
    assert.equal(end.attempt, 1);
    assert.equal(end.outbox, undefined, 'the webhook waits for the ending that ends the run');
    assert.deepEqual(end.changes, { state: 'queued', owner: null, started_at: null, published_at: null });
  });

  it('the changes of one ending at one moment are the same for every run (cancel ends many in one statement)', () => {
    const ending: RunEnding = { kind: 'cancelled', why: 'app_deleted', message: 'deleted', runTimeMs: null };
    const a = endRun({ id: 'a', webhookUrl: HOOK }, ending, NOW);
    const b = endRun({ id: 'b', webhookUrl: null }, ending, NOW);
    assert.deepEqual(a.changes, b.changes);
  });
});

describe('runs/lifecycle: interruption', () => {
  const startedAt = new Date(NOW - 1500).toISOString();

  it('an async run of an app with retry_interrupted and starts left is started again', () => {
    for (let attempts = 1; attempts < MAX_RUN_STARTS; attempts++) {
      assert.deepEqual(interruption({ mode: 'async', attempts, started_at: startedAt }, true, NOW), {
        kind: 'retry',
        why: 'interrupted',
      });
    }
  });

  it('ends interrupted: its last start, no retry_interrupted, or a sync or stream run', () => {
    const ended = { kind: 'interrupted', runTimeMs: 1500 };
    assert.deepEqual(
      interruption({ mode: 'async', attempts: MAX_RUN_STARTS, started_at: startedAt }, true, NOW),
      ended,
    );
    assert.deepEqual(interruption({ mode: 'async', attempts: 1, started_at: startedAt }, false, NOW), ended);
    assert.deepEqual(interruption({ mode: 'sync', attempts: 1, started_at: startedAt }, true, NOW), ended);
    assert.deepEqual(interruption({ mode: 'stream', attempts: 1, started_at: startedAt }, true, NOW), ended);
    assert.deepEqual(interruption({ mode: 'sync', attempts: 1, started_at: null }, false, NOW), {
      kind: 'interrupted',
      runTimeMs: null,
    });
  });
});

describe('runs/lifecycle: the states', () => {
  it('lists every state once, the final ones last', () => {
    assert.deepEqual(RUN_STATES, ['queued', 'running', 'success', 'failure', 'timeout', 'cancelled']);
    assert.deepEqual(FINAL_RUN_STATES, ['success', 'failure', 'timeout', 'cancelled']);
    for (const s of RUN_STATES) assert.equal(isFinalState(s), FINAL_RUN_STATES.includes(s as never), s);
    assert.equal(isFinalState('constructor'), false);
  });
});

describe('runs/lifecycle: retries', () => {
  const policy = {
    max_attempts: 3,
    initial_delay: 2,
    backoff: 3,
    max_delay: 300,
    on: ['failure', 'timeout'] as ('failure' | 'timeout' | 'interrupted')[],
  };
  const failed: RunEnding = { kind: 'failed', error: { code: 'FERRY_FUNCTION_ERROR', message: 'boom' }, runTimeMs: 5 };
  const startedAt = new Date(NOW - 5).toISOString();

  it('a failed attempt with attempts left is queued again after the delay, with no webhook', () => {
    const retries = { policy, log: null, attempt: 1, startedAt };
    const ending = withRetries(failed, retries);
    assert.equal(ending.kind, 'retry');
    const end = endRun({ ...run, attempt: 1, retries }, ending, NOW);
    assert.equal(end.final, false);
    assert.equal(end.state, 'queued');
    assert.equal(end.outbox, undefined, 'the webhook waits for the last attempt');
    assert.equal(end.changes.not_before, new Date(NOW + 2000).toISOString());
    assert.equal(end.changes.owner, null);
    assert.deepEqual(JSON.parse(end.changes.attempt_log ?? 'null'), [
      {
        attempt: 1,
        started_at: startedAt,
        ended_at: new Date(NOW).toISOString(),
        state: 'failure',
        status_code: 500,
        error_code: 'FERRY_FUNCTION_ERROR',
      },
    ]);
    // The second attempt's delay grows by the backoff.
    const second = endRun(
      { ...run, attempt: 2, retries: { ...retries, attempt: 2, log: end.changes.attempt_log ?? null } },
      withRetries({ kind: 'timed-out', message: 'late', runTimeMs: 9 }, { ...retries, attempt: 2 }),
      NOW,
    );
    assert.equal(second.changes.not_before, new Date(NOW + 6000).toISOString());
    assert.equal((JSON.parse(second.changes.attempt_log ?? '[]') as unknown[]).length, 2);
  });

  it('the last attempt ends the run dead, its webhook once with every attempt', () => {
    const log = JSON.stringify([
      { attempt: 1, started_at: null, ended_at: 'a', state: 'failure', status_code: 500, error_code: 'X' },
      { attempt: 2, started_at: null, ended_at: 'b', state: 'timeout', status_code: 504, error_code: 'Y' },
    ]);
    const retries = { policy, log, attempt: 3, startedAt };
    const end = endRun({ ...run, attempt: 3, retries }, withRetries(failed, retries), NOW);
    assert.equal(end.final, true);
    assert.equal(end.state, 'failure');
    assert.equal(end.changes.dead, 1);
    const payload = JSON.parse(end.outbox?.payload ?? '{}') as { dead: boolean; attempts: { attempt: number }[] };
    assert.equal(payload.dead, true);
    assert.deepEqual(
      payload.attempts.map((a) => a.attempt),
      [1, 2, 3],
    );
  });

  it('an ending the policy does not list, or a success, ends the run at once and not dead', () => {
    const retries = { policy, log: null, attempt: 1, startedAt };
    const interrupted: RunEnding = { kind: 'interrupted', runTimeMs: 1 };
    assert.equal(withRetries(interrupted, retries), interrupted);
    const end = endRun({ ...run, attempt: 1, retries }, withRetries(interrupted, retries), NOW);
    assert.equal(end.changes.dead, null);
    const ok = endRun(
      { ...run, attempt: 1, retries },
      withRetries({ kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: '1', value: 1 } }, retries),
      NOW,
    );
    assert.equal(ok.state, 'success');
    const payload = JSON.parse(ok.outbox?.payload ?? '{}') as { dead: boolean; attempts: unknown[] };
    assert.equal(payload.dead, false);
    assert.equal(payload.attempts.length, 1);
    // Cancelled and caller-gone endings are never retried.
    assert.equal(retryableAs({ kind: 'cancelled', why: 'cancelled', runTimeMs: null }), null);
  });
});
