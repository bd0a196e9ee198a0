/**
 * The idempotency race (issue 12): 20 async calls fired at once on connections opened beforehand, 3 of
 * them sharing one Idempotency-Key. They land in one group commit; every call must get its 202, the three
 * must get one run id, and only one run may exist for the key. And the same race with the key shared by
 * calls of two functions: the function whose call took the key gets its run id, the other one 422
 * FERRY_IDEMPOTENCY_KEY_REUSED naming that run (before, it silently got the other function's run id).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { Client } from 'undici';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

const CALLS = 20;
const SHARING = 3;
const BURSTS = 5;

describe('idempotency race', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let clients: Client[] = [];

  /** Every run id of the app, through the runs list (paged). */
  const listRuns = async (): Promise<Set<string>> => {
    const ids = new Set<string>();
    let beforeId = '';
    for (let page = 0; page < 20; page++) {
      const res = await http(
        `${server.url}/v2/projects/${auth.projectId}/apps/race/runs?limit=500${beforeId ? `&before=${beforeId}` : ''}`,
        { token: auth.token },
      );
      assert.equal(res.status, 200, res.text);
      for (const r of res.json.runs) ids.add(r.run_id);
      if (!res.json.next_before) return ids;
      beforeId = res.json.next_before;
    }
    throw new Error('the runs list did not end within 20 pages');
  };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'race', {
      'ferry.toml': '[app]\nname = "race"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 8\n',
      'main.ts':
        'export function run({ i }: { i: number }) { return { i }; }\n' +
        'export function other({ i }: { i: number }) { return { other: i }; }\n',
    });
    const origin = new URL(server.url).origin;
    // One client per call, each with its one connection opened and used before the burst.
    clients = Array.from({ length: CALLS }, () => new Client(origin, { pipelining: 1, keepAliveTimeout: 60_000 }));
    await Promise.all(
      clients.map(async (c) => {
        const res = await c.request({ path: '/healthz', method: 'GET' });
        await res.body.text();
        assert.equal(res.statusCode, 200);
      }),
    );
  });
  after(async () => {
    await Promise.all(clients.map((c) => c.close()));
    await server.close();
  });

  it('answers 202 to every call and one run id to the calls sharing a key', { timeout: 120_000 }, async () => {
    for (let burst = 0; burst < BURSTS; burst++) {
      const before = await listRuns();
      const key = `race-${burst}-${Date.now()}`;
      const body = JSON.stringify({ i: burst });
      // Built first, then released in one synchronous loop: the requests leave together.
      const requests = clients.map((c, i) =>
        c.request({
          path: `/v4/${auth.projectId}/race/run?async=true`,
          method: 'POST',
          headers: {
            authorization: `Bearer ${auth.token}`,
            'content-type': 'application/json',
            ...(i < SHARING ? { 'idempotency-key': key } : {}),
          },
          body,
          headersTimeout: 30_000,
          bodyTimeout: 30_000,
        }),
      );
      const answers = await Promise.all(
        requests.map(async (p) => {
          const res = await p;
          const text = await res.body.text();
          return { status: res.statusCode, text };
        }),
      );
      for (const [i, a] of answers.entries()) assert.equal(a.status, 202, `burst ${burst}, call ${i}: ${a.text}`);
      const ids = answers.map((a) => (JSON.parse(a.text) as { run_id: string }).run_id);
      const shared = new Set(ids.slice(0, SHARING));
      assert.equal(shared.size, 1, `burst ${burst}: the calls sharing a key got ${[...shared].join(', ')}`);
      const distinct = new Set(ids);
      assert.equal(distinct.size, CALLS - SHARING + 1, `burst ${burst}: one run per call, one for the key`);

      const keyed = await server.services.store
        .selectFrom('runs')
        .select('id')
        .where('idempotency_key', '=', key)
        .execute();
      assert.deepEqual(
        keyed.map((r) => r.id),
        [...shared],
        `burst ${burst}: one run row holds the key`,
      );
      const afterBurst = await listRuns();
      const added = [...afterBurst].filter((id) => !before.has(id));
      assert.equal(added.length, CALLS - SHARING + 1, `burst ${burst}: new runs in the list`);
      assert.deepEqual(new Set(added), distinct);
    }
  });

  it('refuses the calls of the other function when calls of two functions race for one key', {
    timeout: 120_000,
  }, async () => {
    for (let burst = 0; burst < BURSTS; burst++) {
      const key = `race-two-${burst}-${Date.now()}`;
      const body = JSON.stringify({ i: burst });
      // Calls 0 to SHARING-1 share the key: call 0 is of `other`, the rest of `run`.
      const fnOf = (i: number) => (i === 0 ? 'other' : 'run');
      const requests = clients.map((c, i) =>
        c.request({
          path: `/v4/${auth.projectId}/race/${fnOf(i)}?async=true`,
          method: 'POST',
          headers: {
            authorization: `Bearer ${auth.token}`,
            'content-type': 'application/json',
            ...(i < SHARING ? { 'idempotency-key': key } : {}),
          },
          body,
          headersTimeout: 30_000,
          bodyTimeout: 30_000,
        }),
      );
      const answers = await Promise.all(
        requests.map(async (p) => {
          const res = await p;
          const text = await res.body.text();
          return {
            status: res.statusCode,
            json: JSON.parse(text) as { run_id?: string; error?: { code: string; held_by?: string } },
          };
        }),
      );
      const keyed = await server.services.store
        .selectFrom('runs')
        .select(['id', 'function_name'])
        .where('idempotency_key', '=', key)
        .execute();
      assert.equal(keyed.length, 1, `burst ${burst}: one run holds the key`);
      const holder = keyed[0]!;
      for (const [i, a] of answers.entries()) {
        const what = `burst ${burst}, call ${i} (${fnOf(i)}): ${JSON.stringify(a.json)}`;
        if (i >= SHARING) {
          assert.equal(a.status, 202, what);
        } else if (fnOf(i) === holder.function_name) {
          assert.equal(a.status, 202, what);
          assert.equal(a.json.run_id, holder.id, what);
        } else {
          assert.equal(a.status, 422, what);
          assert.equal(a.json.error?.code, 'FERRY_IDEMPOTENCY_KEY_REUSED', what);
          assert.equal(a.json.error?.held_by, holder.id, what);
        }
      }
    }
    // Every accepted run is performed (nothing left queued by the race).
    await waitFor(
      async () => {
        const left = await server.services.store
          .selectFrom('runs')
          .select('id')
          .where('state', 'in', ['queued', 'running'])
          .execute();
        return left.length === 0 || undefined;
      },
      60_000,
      'every run to finish',
    );
  });
});
