/**
 * Leases, not resets (issue 12 item 2), on the real PostgreSQL with real processes:
 * - claims: several nodes claiming queued async runs and due webhook deliveries at once, each on its own
 *   connection pool, take every row exactly once;
 * - a process that starts leaves the work of a live one alone;
 * - a process that is SIGKILLed: its running async run ends `failure`, reason `interrupted`, with its
 *   webhook (or, with `retry_interrupted = true`, runs again elsewhere: attempts 2), and the runs it had
 *   claimed but not started run exactly once on the survivor.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { uuidv7 } from '../src/ids.js';
import { claimDueDeliveries, claimQueuedRuns } from '../src/store/claims.js';
import { openPostgresStore, type Store } from '../src/store/index.js';
import {
  deployFiles,
  http,
  type ServeProcess,
  spawnServe,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';
import { createTestDatabase, type TestDatabase } from './helpers/store.js';

const APP_TOML = (name: string, retry: boolean) =>
  `[app]\nname = "${name}"\nretry_interrupted = ${retry}\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n`;
const MAIN_TS = `
export async function work({ ms }: { ms: number }) {
  await new Promise((r) => setTimeout(r, ms));
  return { slept: ms };
}
`;

describe('claims on PostgreSQL: concurrent nodes take each row once', () => {
  let database: TestDatabase;
  const stores: Store[] = [];
  before(async () => {
    database = await createTestDatabase();
    for (let i = 0; i < 3; i++) stores.push(await openPostgresStore({ databaseUrl: database.url, poolSize: 4 }));
  });
  after(async () => {
    for (const s of stores) await s.destroy();
    await database.drop();
  });

  it('queued async runs and due webhook deliveries', async () => {
    const now = new Date().toISOString();
    const ids = Array.from({ length: 300 }, () => uuidv7());
    const store = stores[0]!;
    await store
      .insertInto('runs')
      .values(
        ids.map((id) => ({
          id,
          project_id: 'p-claims',
          app_id: `app-${id.slice(-1)}`,
          build_id: null,
          function_name: 'work',
          mode: 'async' as const,
          state: 'queued' as const,
          status_code: null,
          input: '{}',
          result: null,
          error_code: null,
          error_message: null,
          reason: null,
          cold_start: 0,
          webhook_endpoint: null,
          webhook_secret: null,
          idempotency_key: null,
          http_request: null,
          created_at: now,
          started_at: null,
          finished_at: null,
          run_time_ms: null,
        })),
      )
      .execute();
    await store
      .insertInto('webhook_deliveries')
      .values(
        ids.map((id) => ({
          run_id: id,
          url: 'http://127.0.0.1:9/',
          payload: '{}',
          state: 'pending',
          attempts: 0,
          next_attempt_at: now,
          created_at: now,
          updated_at: now,
        })),
      )
      .execute();

    const runsTaken = new Map<string, string>();
    const deliveriesTaken = new Map<string, string>();
    /** One claim of each kind by `owner`; how many rows it got. */
    const claimOnce = async (s: Store, owner: string): Promise<number> => {
      const [runs, deliveries] = await Promise.all([
        claimQueuedRuns(s, owner, 7),
        claimDueDeliveries(s, owner, new Date().toISOString(), 7),
      ]);
      // A claim never takes more than it asked for (it once took 251 of 7: claims.ts, `picked`).
      assert.ok(runs.length <= 7, `a claim of 7 runs took ${runs.length}`);
      assert.ok(deliveries.length <= 7, `a claim of 7 deliveries took ${deliveries.length}`);
      for (const r of runs) {
        assert.equal(runsTaken.get(r.id), undefined, `run ${r.id} claimed twice`);
        runsTaken.set(r.id, owner);
      }
      for (const d of deliveries) {
        assert.equal(deliveriesTaken.get(d.run_id), undefined, `delivery ${d.run_id} claimed twice`);
        deliveriesTaken.set(d.run_id, owner);
      }
      return runs.length + deliveries.length;
    };
    // Six claimers (two per store) race in rounds: in each round all of them claim at once, so every one
    // takes part from the first round (free-running loops depended on timing: in CI, under load, one
    // claimer once took all 300 runs before the others' first claim). Bounded: 300 rows in batches of 7
    // need at most 43 rounds even for one claimer alone.
    const claimers = stores.flatMap((s, i) => [
      [s, `node-${i}a`],
      [s, `node-${i}b`],
    ]) as Array<[Store, string]>;
    for (let round = 0; round < 100; round++) {
      const got = await Promise.all(claimers.map(([s, owner]) => claimOnce(s, owner)));
      if (got.every((n) => n === 0)) break;
    }
    assert.equal(runsTaken.size, 300);
    assert.equal(deliveriesTaken.size, 300);
    // Every claimer got a share: they really ran side by side.
    assert.ok(new Set(runsTaken.values()).size > 1, 'more than one claimer took runs');
    const owners = await store.selectFrom('runs').select(['id', 'owner']).execute();
    for (const o of owners) assert.equal(o.owner, runsTaken.get(o.id));
    const sending = await store.selectFrom('webhook_deliveries').select(['run_id', 'state', 'owner']).execute();
    for (const d of sending) assert.deepEqual([d.state, d.owner], ['sending', deliveriesTaken.get(d.run_id)]);
  });
});

describe('nodes on one PostgreSQL: a live node keeps its work, a dead one loses it', () => {
  let database: TestDatabase;
  let shared: string;
  let receiver: Receiver;
  let b: TestServer;
  let a: ServeProcess | undefined;
  let auth: { projectId: string; token: string };
  const settings = () => ({
    FERRY_DATABASE_URL: database.url,
    FERRY_KEYS_DIR: path.join(shared, 'keys'),
    FERRY_ARTIFACTS_DIR: path.join(shared, 'artifacts'),
    FERRY_LEASE_SECONDS: '2',
    FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
  });

  before(async () => {
    database = await createTestDatabase();
    shared = await tempDir('ferry-leases-shared-');
    receiver = await startReceiver();
    b = await startServer({
      databaseUrl: database.url,
      keysDir: path.join(shared, 'keys'),
      artifactsDir: path.join(shared, 'artifacts'),
      leaseMs: 2000,
      env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' },
    });
    auth = await b.bootstrap();
    await deployFiles(b, auth, 'once', { 'ferry.toml': APP_TOML('once', false), 'main.ts': MAIN_TS });
    await deployFiles(b, auth, 'again', { 'ferry.toml': APP_TOML('again', true), 'main.ts': MAIN_TS });
  });
  after(async () => {
    await a?.stop('SIGKILL');
    await b.close();
    await receiver.close();
    await database.drop();
    await fs.rm(shared, { recursive: true, force: true });
  });

  const runOf = async (app: string, id: string) =>
    (await http(`${b.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${id}`, { token: auth.token })).json;
  const accept = async (url: string, app: string, ms: number) => {
    const hook = encodeURIComponent(`${receiver.url}/${app}`);
    const res = await http(`${url}/v4/${auth.projectId}/${app}/work?async=true&webhookEndpoint=${hook}`, {
      method: 'POST',
      token: auth.token,
      body: { ms },
    });
    assert.equal(res.status, 202, res.text);
    return res.json.run_id as string;
  };

  it('a process that starts leaves the running work of another alone', async () => {
    const id = await accept(b.url, 'once', 6000);
    await waitFor(async () => (await runOf('once', id)).state === 'running', 30_000, 'the run to start on B');
    a = await spawnServe(await tempDir('ferry-leases-a-'), settings());
    const done = await waitFor(
      async () => {
        const run = await runOf('once', id);
        return ['success', 'failure', 'timeout', 'cancelled'].includes(run.state) ? run : undefined;
      },
      60_000,
      'the run to end',
    );
    assert.deepEqual([done.state, done.attempts, done.reason], ['success', 1, null]);
  });

  it('SIGKILL: the running run is interrupted (or run again when the app opts in); held runs run once', async () => {
    assert.ok(a, 'A runs (from the test before)');
    // Through A: one run of each app that will be running when A dies, and two of `once` that A holds
    // queued behind it (one replica, one run at a time).
    const running = await accept(a.url, 'once', 15_000);
    const retried = await accept(a.url, 'again', 15_000);
    const held = [await accept(a.url, 'once', 10), await accept(a.url, 'once', 10)];
    await waitFor(
      async () =>
        (await runOf('once', running)).state === 'running' && (await runOf('again', retried)).state === 'running',
      60_000,
      'both long runs to be running on A',
    );
    const owners = await b.services.store.selectFrom('runs').select(['id', 'owner']).where('id', 'in', held).execute();
    assert.ok(
      owners.every((o) => o.owner !== b.services.node.id),
      'A holds the queued runs',
    );
    await a.stop('SIGKILL');
    a = undefined;

    const ended = async (app: string, id: string) =>
      waitFor(
        async () => {
          const run = await runOf(app, id);
          return ['success', 'failure', 'timeout', 'cancelled'].includes(run.state) ? run : undefined;
        },
        90_000,
        `run ${id} of ${app} to end`,
      );
    const interrupted = await ended('once', running);
    assert.deepEqual(
      [interrupted.state, interrupted.reason, interrupted.error?.code, interrupted.attempts],
      ['failure', 'interrupted', 'FERRY_REPLICA_DIED', 1],
    );
    for (const id of held) {
      const run = await ended('once', id);
      assert.deepEqual([run.state, run.attempts], ['success', 1], `held run ${id} ran once, on B`);
    }
    const again = await ended('again', retried);
    assert.deepEqual([again.state, again.attempts], ['success', 2], 'retry_interrupted: run again on B');

    // The interrupted run's webhook says so.
    const hooks = await waitFor(
      async () => {
        const got = receiver.requests.filter((r) => r.path === '/once');
        return got.find((r) => JSON.parse(r.body.toString()).run_id === running);
      },
      30_000,
      'the interrupted run webhook',
    );
    const payload = JSON.parse(hooks.body.toString());
    assert.equal(payload.error.code, 'FERRY_REPLICA_DIED');
  });
});
