/**
 * Async mode (spec 4.3): 202 with exactly {"run_id"} once the run is committed, nothing stored for
 * refused calls, the run's state following the internal call, timeouts, backlog overload (429), results
 * readable from the management API, and Idempotency-Key (a repeat answers the first run; the key reused for
 * another function is refused).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

describe('async runs', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const call = (app: string, fn: string, body: unknown, query = 'async=true', headers: Record<string, string> = {}) =>
    http(`${server.url}/v4/${auth.projectId}/${app}/${fn}?${query}`, {
      method: 'POST',
      token: auth.token,
      body,
      headers,
    });
  const record = (app: string, runId: string) =>
    http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}`, { token: auth.token });
  const settled = (app: string, runId: string) =>
    waitFor(
      async () => {
        const r = await record(app, runId);
        return ['success', 'failure', 'timeout', 'cancelled'].includes(r.json.state) ? r.json : undefined;
      },
      60_000,
      `run ${runId}`,
    );
  const countRuns = async () =>
    Number(
      (
        await server.services.store
          .selectFrom('runs')
          .select((eb) => eb.fn.countAll().as('n'))
          .executeTakeFirst()
      )?.n,
    );

  before(async () => {
    server = await startServer({ env: { FERRY_MAX_ASYNC_BACKLOG: '3' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'jobs', {
      // The grace period also covers waiting for the one slot and for a cold start (the timeout below retires
      // the replica): 20 s leaves room for those on a slow machine under the full suite, where 6 s did not
      // (the first run ended `timeout` in a CI run on PostgreSQL).
      'ferry.toml':
        '[app]\nname = "jobs"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\nresponse_grace_period = 20\n',
      'main.ts': `
export async function work({ ms = 10, value = 1 }: { ms?: number; value?: number }) { await new Promise((r) => setTimeout(r, ms)); return { doubled: value * 2 }; }
export function boom() { throw new RangeError('out of range'); }
`,
    });
  });
  after(() => server.close());

  it('answers 202 with exactly {"run_id"} and X-Request-Id, after the run is committed', async () => {
    const res = await call('jobs', 'work', { value: 21 });
    assert.equal(res.status, 202, res.text);
    assert.match(res.headers.get('content-type') ?? '', /^application\/json/);
    assert.deepEqual(Object.keys(res.json), ['run_id']);
    assert.equal(res.headers.get('x-request-id'), res.json.run_id);
    // Committed before the answer: the row is in the store the moment the 202 arrives.
    const row = await server.services.store
      .selectFrom('runs')
      .selectAll()
      .where('id', '=', res.json.run_id)
      .executeTakeFirst();
    assert.ok(row, 'the run was stored before 202');
    assert.equal(row.mode, 'async');
    assert.equal(row.input, JSON.stringify({ value: 21 }));
    const done = await settled('jobs', res.json.run_id);
    assert.equal(done.state, 'success');
    assert.deepEqual(done.result, { doubled: 42 });
    assert.equal(done.mode, 'async');
  });

  it('refuses unknown apps and functions, bad tokens and bad JSON without storing anything', async () => {
    const before = await countRuns();
    assert.equal((await call('nope', 'work', {})).status, 404);
    assert.equal((await call('jobs', 'missing', {})).status, 404);
    assert.equal((await call('jobs', '_private', {})).status, 404);
    const noToken = await http(`${server.url}/v4/${auth.projectId}/jobs/work?async=true`, { method: 'POST', body: {} });
    assert.equal(noToken.status, 401);
    const badJson = await http(`${server.url}/v4/${auth.projectId}/jobs/work?async=true`, {
      method: 'POST',
      token: auth.token,
      body: Buffer.from('{oops'),
      headers: { 'content-type': 'application/json' },
    });
    assert.equal(badJson.status, 400);
    const badHook = await call('jobs', 'work', {}, 'async=true&webhookEndpoint=ftp%3A%2F%2Fx');
    assert.equal(badHook.status, 400);
    assert.equal(badHook.json.error.code, 'FERRY_WEBHOOK_URL_INVALID');
    assert.equal(await countRuns(), before, 'nothing was stored');
  });

  it('treats any value of async other than "true" as absent', async () => {
    for (const value of ['1', 'yes', 'TRUE', '']) {
      const res = await call('jobs', 'work', { value: 2 }, `async=${value}`);
      assert.equal(res.status, 200, `async=${value}: ${res.text}`);
      assert.deepEqual(res.json.result, { doubled: 4 });
    }
  });

  it('records failure when the internal call fails, and timeout past response_grace_period', async () => {
    const failed = await settled('jobs', (await call('jobs', 'boom', {})).json.run_id);
    assert.equal(failed.state, 'failure');
    assert.equal(failed.error.code, 'FERRY_FUNCTION_ERROR');
    assert.match(failed.error.message, /RangeError: out of range/);
    // Far past the grace period; the timed-out replica is retired, so nothing waits for the sleep to end.
    const slow = await settled('jobs', (await call('jobs', 'work', { ms: 60_000 })).json.run_id);
    assert.equal(slow.state, 'timeout');
    assert.equal(slow.error.code, 'FERRY_RUN_TIMEOUT');
  });

  it('answers 429 with Retry-After past the async backlog, storing nothing', async () => {
    // Runs of earlier tests count until their worker lets go of them, a moment after their state is final.
    await waitFor(async () => server.services.asyncWorker.backlog === 0, 10_000, 'an empty backlog');
    // max 1 replica × concurrency 1: these runs wait in the backlog (limit 3). The first holds the one slot
    // for 2 s, so the backlog stays full while the next calls are made, however slowly (idle: a few ms each).
    const accepted = [];
    for (const ms of [2000, 1, 1]) accepted.push(await call('jobs', 'work', { ms }));
    for (const r of accepted) assert.equal(r.status, 202, r.text);
    const before = await countRuns();
    const refused = await call('jobs', 'work', { ms: 1 });
    assert.equal(refused.status, 429, refused.text);
    assert.equal(refused.json.error.code, 'FERRY_ASYNC_BACKLOG_FULL');
    assert.ok(refused.headers.get('retry-after'));
    assert.equal(await countRuns(), before);
    for (const r of accepted) assert.equal((await settled('jobs', r.json.run_id)).state, 'success');
  });

  it('returns the same run_id for a repeated Idempotency-Key and runs once', async () => {
    const key = `order-${Date.now()}`;
    const calls = await Promise.all(
      [1, 2, 3].map(() => call('jobs', 'work', { value: 5 }, 'async=true', { 'idempotency-key': key })),
    );
    for (const c of calls) assert.equal(c.status, 202, c.text);
    const ids = new Set(calls.map((c) => c.json.run_id));
    assert.equal(ids.size, 1, 'one run for one key');
    const again = await call('jobs', 'work', { value: 5 }, 'async=true', { 'idempotency-key': key });
    assert.equal(again.json.run_id, calls[0]!.json.run_id);
    const rows = await server.services.store
      .selectFrom('runs')
      .select('id')
      .where('idempotency_key', '=', key)
      .execute();
    assert.equal(rows.length, 1);
    const other = await call('jobs', 'work', { value: 5 }, 'async=true', { 'idempotency-key': `${key}-b` });
    assert.notEqual(other.json.run_id, calls[0]!.json.run_id);
    const bad = await call('jobs', 'work', {}, 'async=true', { 'idempotency-key': 'has space' });
    assert.equal(bad.status, 400);
    await settled('jobs', other.json.run_id);
  });

  it('refuses an Idempotency-Key reused for another function of the app (422), storing nothing', async () => {
    const key = `reused-${Date.now()}`;
    const first = await call('jobs', 'work', { value: 7 }, 'async=true', { 'idempotency-key': key });
    assert.equal(first.status, 202, first.text);
    const runId = first.json.run_id as string;
    const before = await countRuns();
    const res = await call('jobs', 'boom', { value: 7 }, 'async=true', { 'idempotency-key': key });
    assert.equal(res.status, 422, res.text);
    assert.equal(res.json.error.code, 'FERRY_IDEMPOTENCY_KEY_REUSED');
    assert.equal(res.json.error.held_by, runId);
    assert.equal(await countRuns(), before, 'nothing was stored');
    // The same function again is still a repeat (its body is not compared: the first call's stands).
    for (const body of [{ value: 7 }, { value: 8 }]) {
      const again = await call('jobs', 'work', body, 'async=true', { 'idempotency-key': key });
      assert.equal(again.status, 202, again.text);
      assert.equal(again.json.run_id, runId);
    }

    // Calls racing for a fresh key (one group commit, or one just after another): the call that took it
    // gets 202, a call of another function gets 422 naming that run, never the other's run id as its own.
    const raceKey = `race-${Date.now()}`;
    const raced = await Promise.all([
      call('jobs', 'work', { value: 1 }, 'async=true', { 'idempotency-key': raceKey }),
      call('jobs', 'boom', {}, 'async=true', { 'idempotency-key': raceKey }),
    ]);
    const won = raced.filter((r) => r.status === 202);
    const lost = raced.filter((r) => r.status === 422);
    assert.equal(won.length, 1, raced.map((r) => r.text).join(' | '));
    assert.equal(lost.length, 1, raced.map((r) => r.text).join(' | '));
    assert.equal(lost[0]!.json.error.held_by, won[0]!.json.run_id);
    const holder = await server.services.store
      .selectFrom('runs')
      .select('id')
      .where('idempotency_key', '=', raceKey)
      .execute();
    assert.deepEqual(
      holder.map((r) => r.id),
      [won[0]!.json.run_id],
    );
    await settled('jobs', runId);
    await settled('jobs', won[0]!.json.run_id);
  });
});
