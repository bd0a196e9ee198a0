/**
 * `GET /v2/projects/{project_id}/apps/{app_id}/stats` with real runs: live replica counts and limits, the
 * per-minute series (counts by state, p50/p95) checked against the runs themselves, the window bound,
 * validation and auth; and the in-memory replica history with a fake clock.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { createReplicaHistory, HISTORY_MINUTES, minuteOf } from '../src/dashboard/replica-history.js';
import { percentile } from '../src/http/routes/stats.js';
import { uuidv7 } from '../src/ids.js';
import type { ReplicaPool } from '../src/replicas/pool.js';
import { uuidv7Floor } from '../src/runs/run-service.js';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

const MINUTE = 60_000;

interface Point {
  minute: string;
  success: number;
  failure: number;
  timeout: number;
  cancelled: number;
  p50_ms: number | null;
  p95_ms: number | null;
  replicas: number | null;
}

describe('stats route', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const stats = (query = '', token = auth.token, app = 'stats') =>
    http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/stats${query}`, { token });
  const run = (fn: string, body: unknown = {}) =>
    http(`${server.url}/v4/${auth.projectId}/stats/${fn}`, { method: 'POST', token: auth.token, body });

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'stats', {
      // The grace period also covers cold starts (the first run, and the one after the timeout retired the
      // replica): 5 s leaves room for a replica starting on a busy machine.
      'ferry.toml': '[app]\nname = "stats"\n[scaling]\nmin_replicas = 0\nmax_replicas = 3\nresponse_grace_period = 5\n',
      'main.ts': `
export async function sleep({ ms }: { ms: number }) { await new Promise((r) => setTimeout(r, ms)); return ms; }
export function fail() { throw new Error('no'); }
`,
    });
  });
  after(() => server.close());

  it('counts real runs per minute by final state, with p50 and p95 from their run times', async () => {
    const sleeps = [10, 40, 80, 150, 300];
    for (const ms of sleeps) assert.equal((await run('sleep', { ms })).status, 200);
    assert.equal((await run('fail')).status, 500);
    assert.equal((await run('fail')).status, 500);
    assert.equal((await run('sleep', { ms: 60_000 })).status, 504);

    const asked = minuteOf(Date.now());
    const res = await stats('?minutes=5');
    const answered = minuteOf(Date.now());
    assert.equal(res.status, 200, res.text);
    const series = res.json.series as Point[];
    assert.equal(series.length, 5);
    const totals = { success: 0, failure: 0, timeout: 0, cancelled: 0 };
    for (const p of series) for (const k of Object.keys(totals) as Array<keyof typeof totals>) totals[k] += p[k];
    assert.deepEqual(totals, { success: 5, failure: 2, timeout: 1, cancelled: 0 });

    // The minutes: aligned, consecutive, the last one now.
    for (const [i, p] of series.entries()) {
      assert.equal(Date.parse(p.minute) % MINUTE, 0);
      if (i > 0) assert.equal(Date.parse(p.minute) - Date.parse(series[i - 1]!.minute), MINUTE);
    }
    // The minute the server answered in: a new minute may have begun while the request was on its way.
    assert.ok([asked, answered].includes(Date.parse(series.at(-1)!.minute)), series.at(-1)!.minute);

    // The percentiles, recomputed from the runs as the API lists them.
    const runs = (await http(`${server.url}/v2/projects/${auth.projectId}/apps/stats/runs`, { token: auth.token })).json
      .runs as Array<{ created_at: string; run_time_ms: number | null; started_at: string; finished_at: string }>;
    for (const p of series) {
      const inMinute = runs.filter((r) => minuteOf(Date.parse(r.created_at)) === Date.parse(p.minute));
      const times = inMinute
        .map((r) => r.run_time_ms ?? Date.parse(r.finished_at) - Date.parse(r.started_at))
        .sort((a, b) => a - b);
      assert.equal(p.p50_ms, percentile(times, 0.5), p.minute);
      assert.equal(p.p95_ms, percentile(times, 0.95), p.minute);
    }
    const p95 = Math.max(...series.map((p) => p.p95_ms ?? 0));
    assert.ok(p95 >= 300, `p95 ${p95} covers the slowest run`);
  });

  it('shows live replicas with the limits of the active build, and the replicas of this minute', async () => {
    assert.equal((await run('sleep', { ms: 1 })).status, 200); // a replica is up (the timeout retired one)
    const res = await stats();
    assert.equal(res.status, 200);
    const { replicas, series } = res.json as { replicas: Record<string, number | null>; series: Point[] };
    assert.deepEqual(Object.keys(replicas).sort(), ['inflight', 'max', 'min', 'queued', 'ready', 'starting']);
    assert.equal(replicas.min, 0);
    assert.equal(replicas.max, 3);
    assert.ok((replicas.ready ?? 0) >= 1, JSON.stringify(replicas));
    assert.equal(replicas.queued, 0);
    assert.equal(series.length, 60, 'the default window is 60 minutes');
    assert.ok((series.at(-1)!.replicas ?? 0) >= 1, 'the current minute counts the running replicas');
    // The server started sampling when it started: older minutes are unknown, not zero.
    assert.equal(series[0]!.replicas, null);
  });

  it('counts only runs inside the window', async () => {
    const twoHoursAgo = Date.now() - 120 * MINUTE;
    const at = new Date(twoHoursAgo).toISOString();
    await server.services.store
      .insertInto('runs')
      .values({
        id: uuidv7(twoHoursAgo),
        project_id: auth.projectId,
        app_id: 'stats',
        build_id: null,
        function_name: 'sleep',
        mode: 'sync',
        state: 'cancelled',
        status_code: 499,
        input: null,
        result: null,
        error_code: null,
        error_message: null,
        reason: null,
        cold_start: 0,
        webhook_endpoint: null,
        webhook_secret: null,
        idempotency_key: null,
        created_at: at,
        started_at: at,
        finished_at: at,
        run_time_ms: 7,
      })
      .execute();
    const count = (series: Point[]) => series.reduce((n, p) => n + p.cancelled, 0);
    assert.equal(count((await stats('?minutes=60')).json.series), 0);
    const wide = (await stats('?minutes=180')).json.series as Point[];
    assert.equal(count(wide), 1);
    assert.equal(wide.find((p) => p.cancelled === 1)?.minute, new Date(minuteOf(twoHoursAgo)).toISOString());
  });

  it('validates the window and needs a manage token of the project', async () => {
    for (const q of ['?minutes=0', `?minutes=${HISTORY_MINUTES + 1}`, '?minutes=abc', '?minutes=1.5']) {
      const res = await stats(q);
      assert.equal(res.status, 400, q);
      assert.equal(res.json.error.code, 'FERRY_VALIDATION', q);
    }
    assert.equal((await stats(`?minutes=${HISTORY_MINUTES}`)).json.series.length, HISTORY_MINUTES);
    assert.equal((await stats('', '')).status, 401, 'no token');
    const runOnly = await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'runner', scopes: ['run'] },
    });
    const forbidden = await stats('', runOnly.json.token);
    assert.equal(forbidden.status, 403);
    assert.equal(forbidden.json.error.code, 'FERRY_MISSING_SCOPE');
    const missing = await stats('', auth.token, 'nope');
    assert.equal(missing.status, 404);
    assert.equal(missing.json.error.code, 'FERRY_APP_NOT_FOUND');
  });

  it('is in the OpenAPI document with its response schema', async () => {
    const doc = (await http(`${server.url}/v2/openapi.json`)).json;
    const op = doc.paths['/v2/projects/{project_id}/apps/{app_id}/stats']?.get;
    assert.ok(op, 'documented');
    const schema = op.responses['200'].content['application/json'].schema;
    assert.deepEqual(Object.keys(schema.properties).sort(), ['node', 'replicas', 'series']);
    assert.deepEqual(Object.keys(schema.properties.series.items.properties).sort(), [
      'cancelled',
      'failure',
      'minute',
      'p50_ms',
      'p95_ms',
      'replicas',
      'success',
      'timeout',
    ]);
    assert.ok(op.parameters.some((p: { name: string; in: string }) => p.name === 'minutes' && p.in === 'query'));
  });
});

describe('replica history', () => {
  const pool = (appId: string, starting: number, ready: number) =>
    ({
      build: { projectId: 'p-00000000', appId, buildId: 'b', config: {} },
      stats: { starting, ready, inflight: 0, queued: 0 },
    }) as unknown as ReplicaPool;

  it('keeps the most replicas per minute; unsampled minutes are null, sampled ones without the app 0', () => {
    let now = Date.UTC(2026, 0, 1, 12, 0, 5);
    let pools: ReplicaPool[] = [pool('a', 1, 0)];
    const history = createReplicaHistory({ pools: () => pools, now: () => now });
    const t0 = minuteOf(now);
    history.sample();
    pools = [pool('a', 0, 3), pool('a', 1, 0)]; // a draining pool counts too
    now += 10_000;
    history.sample();
    pools = [pool('a', 0, 1)];
    now += 10_000;
    history.sample();
    now = t0 + 2 * MINUTE + 1000; // minute 1 was never sampled
    pools = [pool('b', 0, 2)];
    history.sample();
    assert.deepEqual(history.perMinute('p-00000000', 'a', t0 - MINUTE, 4), [null, 4, null, 0]);
    assert.deepEqual(history.perMinute('p-00000000', 'b', t0 - MINUTE, 4), [null, 0, null, 2]);
  });

  it('forgets minutes older than a day', () => {
    let now = Date.UTC(2026, 0, 1, 0, 0, 0);
    const history = createReplicaHistory({ pools: () => [pool('a', 0, 1)], now: () => now });
    const t0 = now;
    history.sample();
    now += (HISTORY_MINUTES + 1) * MINUTE;
    history.sample();
    assert.deepEqual(history.perMinute('p-00000000', 'a', t0, 1), [null]);
    assert.deepEqual(history.perMinute('p-00000000', 'a', minuteOf(now), 1), [1]);
  });

  it('samples on an unref’d timer that stops', async () => {
    let samples = 0;
    const history = createReplicaHistory({
      pools: () => {
        samples++;
        return [];
      },
    });
    history.start(20);
    // Polled, not slept: on a busy machine the timer may fire late, never fewer times than it should.
    await waitFor(async () => samples >= 3, 5_000, 'three samples');
    history.stop();
    const seen = samples;
    // Timers fire in the order they are due: a sample still scheduled every 20 ms would come before this.
    await new Promise((r) => setTimeout(r, 200));
    assert.equal(samples, seen, 'no samples after stop');
  });
});

describe('stats helpers', () => {
  it('percentile is nearest-rank', () => {
    assert.equal(percentile([], 0.5), null);
    assert.equal(percentile([7], 0.95), 7);
    assert.equal(percentile([1, 2, 3, 4], 0.5), 2);
    assert.equal(percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.95), 10);
    assert.equal(percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.5), 5);
  });

  it('uuidv7Floor bounds the run ids of a millisecond from below', () => {
    const ms = Date.now();
    const floor = uuidv7Floor(ms);
    assert.match(floor, /^[0-9a-f]{8}-[0-9a-f]{4}-0000-0000-000000000000$/);
    assert.ok(uuidv7(ms + 1) >= floor);
    assert.ok(uuidv7Floor(ms - 1) < floor);
    assert.ok(floor > uuidv7Floor(ms - 60_000));
  });
});
