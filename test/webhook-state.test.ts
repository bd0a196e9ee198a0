/**
 * Every webhook payload carries `state` (docs/webhooks.md promises it in every payload), also the ones
 * written outside the invoker: the async worker's failure paths (a held run whose app has no ready build,
 * or whose app changed runtime), cancel (a queued run, and the queued runs of a deleted app), recovery (a
 * running async run whose node's lease ended) and the held-runs sweep's end of a run this node never heard
 * it started. Issue 30, point 8: the first two lacked it; every path now asks runs/lifecycle.ts. The
 * invoker's own (sync, async and stream runs performed) are checked end to end in test/webhook-e2e.test.ts,
 * and every ending by itself in test/lifecycle.test.ts.
 *
 * Driven directly on a real store (SQLite, or PostgreSQL under test/postgres/ when it imports this file),
 * rows inserted as the run endpoint writes them.
 */
import assert from 'node:assert/strict';
import { describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { parseAppConfig } from '../src/apps/app-config.js';
import { createNodeLease, LEASE_ENDED } from '../src/cluster/node.js';
import { createRecovery, endUnfinished, heldAsyncRuns } from '../src/cluster/recovery.js';
import { uuidv7 } from '../src/ids.js';
import { createAsyncWorker } from '../src/runs/async-worker.js';
import type { Invoker } from '../src/runs/invoke.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { cancelQueued, cancelQueuedRun } from '../src/runs/runs.js';
import type { RunTargets } from '../src/runs/targets.js';
import type { Store } from '../src/store/index.js';
import { tempDir, waitFor } from './helpers/ferry.js';
import { openTestStore } from './helpers/store.js';

const HOOK = 'http://127.0.0.1:9/hook';
const BUILD = { projectId: 'p-0000state', appId: 'stateful', buildId: 'b-none' };

async function freshStore(t: TestContext): Promise<Store> {
  const opened = await openTestStore(await tempDir('ferry-webhook-state-'));
  t.after(() => opened.close());
  return opened.store;
}

/** The stored webhook payload of a run, once its outbox row is there. */
async function payloadOf(store: Store, runId: string): Promise<Record<string, unknown>> {
  const row = await waitFor(
    () => store.selectFrom('webhook_deliveries').select('payload').where('run_id', '=', runId).executeTakeFirst(),
    20_000,
    `the webhook row of ${runId}`,
  );
  return JSON.parse(row.payload) as Record<string, unknown>;
}

describe('webhook payloads written outside the invoker', () => {
  it("the async worker's failure path: a held run whose app has no ready build", async (t) => {
    const store = await freshStore(t);
    const logger = pino({ level: 'silent' });
    const recorder = createRunRecorder({ store, logger, owner: 'node-state' });
    const id = uuidv7();
    await store
      .insertInto('runs')
      .values({
        ...newRunRow({ id, build: BUILD, fn: 'work', mode: 'async', input: '{}', webhookUrl: HOOK }),
      })
      .execute();
    // No target for the app: the run cannot be performed and is ended with its webhook told why.
    const targets: RunTargets = { get: async () => undefined, peek: () => undefined, forget: () => {} };
    const worker = createAsyncWorker({
      store,
      targets,
      invoker: {} as Invoker,
      recorder,
      logger,
      owner: 'node-state',
      pollIntervalMs: 100,
    });
    await worker.start();
    t.after(async () => {
      await worker.close();
      await recorder.close();
    });
    const payload = await payloadOf(store, id);
    assert.equal(payload.run_id, id);
    assert.equal(payload.state, 'failure');
    assert.deepEqual(payload.error, {
      code: 'FERRY_NO_READY_BUILD',
      message: 'The app has no ready build (it was removed or never built)',
    });
    const run = await store.selectFrom('runs').select(['state', 'error_code']).where('id', '=', id).executeTakeFirst();
    assert.deepEqual(run, { state: 'failure', error_code: 'FERRY_NO_READY_BUILD' });
  });

  it('recovery: a running async run of a node whose lease ended', async (t) => {
    const store = await freshStore(t);
    const logger = pino({ level: 'silent' });
    const past = new Date(Date.now() - 60_000).toISOString();
    // A lease ended on purpose: judged over by any node, at once.
    await store
      .insertInto('nodes')
      .values({ id: 'stopped-node', started_at: past, lease_until: LEASE_ENDED, info: '{}' })
      .execute();
    const id = uuidv7();
    await store
      .insertInto('runs')
      .values({
        ...newRunRow({
          id,
          build: BUILD,
          fn: 'work',
          mode: 'async',
          input: '{}',
          webhookUrl: HOOK,
          owner: 'stopped-node',
        }),
        state: 'running',
        attempts: 1,
        started_at: past,
      })
      .execute();
    const node = createNodeLease({ store, dataDir: await tempDir('ferry-node-'), logger, ttlMs: 5_000 });
    await node.start();
    t.after(() => node.close());
    const recovery = createRecovery({ store, node, logger });
    assert.equal((await recovery.sweep()).interrupted, 1);
    const payload = await payloadOf(store, id);
    assert.equal(payload.run_id, id);
    assert.equal(payload.state, 'failure');
    assert.equal(payload.status_code, 502);
    assert.equal((payload.error as { code: string }).code, 'FERRY_REPLICA_DIED');
  });

  it("the async worker's failure path: a custom app's request whose app is a cortex app now", async (t) => {
    const store = await freshStore(t);
    const logger = pino({ level: 'silent' });
    const recorder = createRunRecorder({ store, logger, owner: 'node-state' });
    const id = uuidv7();
    await store
      .insertInto('runs')
      .values({
        ...newRunRow({
          id,
          build: BUILD,
          fn: '/predict',
          mode: 'async',
          input: null,
          webhookUrl: HOOK,
          httpRequest: JSON.stringify({ method: 'POST', path: '/predict', headers: {}, body_base64: '' }),
        }),
      })
      .execute();
    // The app's active build is a cortex app: the stored HTTP request cannot be forwarded.
    const config = parseAppConfig('[app]\nname = "stateful"\n');
    const targets: RunTargets = {
      get: async () => ({ appId: BUILD.appId, buildId: 'b-cortex', runtime: 'node', config, functions: undefined }),
      peek: () => undefined,
      forget: () => {},
    };
    const worker = createAsyncWorker({
      store,
      targets,
      invoker: {} as Invoker,
      recorder,
      logger,
      owner: 'node-state',
      pollIntervalMs: 100,
    });
    await worker.start();
    t.after(async () => {
      await worker.close();
      await recorder.close();
    });
    const payload = await payloadOf(store, id);
    assert.equal(payload.state, 'failure');
    assert.equal(payload.status_code, 405);
    assert.equal((payload.error as { code: string }).code, 'FERRY_CORTEX_CALL');
  });

  it('cancel: a queued async run, and the queued runs of a deleted app', async (t) => {
    const store = await freshStore(t);
    const queued = async () => {
      const row = newRunRow({ id: uuidv7(), build: BUILD, fn: 'work', mode: 'async', input: '{}', webhookUrl: HOOK });
      await store.insertInto('runs').values(row).execute();
      return row;
    };
    const one = await queued();
    assert.equal(await cancelQueuedRun(store, one), true);
    const cancelled = await payloadOf(store, one.id);
    assert.equal(cancelled.state, 'cancelled');
    assert.equal(cancelled.status_code, 409);
    assert.equal((cancelled.error as { code: string }).code, 'FERRY_RUN_CANCELLED');

    const [a, b] = [await queued(), await queued()];
    const ended = await store
      .transaction()
      .execute((trx) => cancelQueued(trx, [a, b], { message: 'deleted with its app', reason: 'app_deleted' }));
    assert.deepEqual(ended.sort(), [a.id, b.id].sort());
    for (const r of [a, b]) {
      const payload = await payloadOf(store, r.id);
      assert.equal(payload.state, 'cancelled');
      assert.deepEqual(payload.error, { code: 'FERRY_RUN_CANCELLED', message: 'deleted with its app' });
      const row = await store
        .selectFrom('runs')
        .select(['state', 'reason'])
        .where('id', '=', r.id)
        .executeTakeFirstOrThrow();
      assert.deepEqual(row, { state: 'cancelled', reason: 'app_deleted' });
    }
  });

  it("the held-runs sweep's end: a running async run this node holds but never heard it started", async (t) => {
    const store = await freshStore(t);
    const id = uuidv7();
    await store
      .insertInto('runs')
      .values({
        ...newRunRow({ id, build: BUILD, fn: 'work', mode: 'async', input: '{}', webhookUrl: HOOK, owner: 'node-me' }),
        state: 'running',
        attempts: 1,
        started_at: new Date(Date.now() - 1000).toISOString(),
      })
      .execute();
    const held = await heldAsyncRuns(store, 'node-me');
    const ended = await store.transaction().execute((trx) => endUnfinished(trx, 'node-me', held, Date.now()));
    assert.deepEqual(ended, { interrupted: 1, requeued: 0 });
    const payload = await payloadOf(store, id);
    assert.equal(payload.state, 'failure');
    assert.equal((payload.error as { code: string }).code, 'FERRY_REPLICA_DIED');
    assert.equal(typeof payload.run_time_ms, 'number');
  });

  it('recovery with retry_interrupted: queued again, and no webhook until the run ends', async (t) => {
    const store = await freshStore(t);
    const id = uuidv7();
    await store
      .insertInto('runs')
      .values({
        ...newRunRow({ id, build: BUILD, fn: 'work', mode: 'async', input: '{}', webhookUrl: HOOK, owner: 'node-me' }),
        state: 'running',
        attempts: 1,
        started_at: new Date().toISOString(),
      })
      .execute();
    const [held] = await heldAsyncRuns(store, 'node-me');
    assert.ok(held);
    const retried = { ...held, config_json: JSON.stringify({ app: { retry_interrupted: true } }) };
    const ended = await store.transaction().execute((trx) => endUnfinished(trx, 'node-me', [retried], Date.now()));
    assert.deepEqual(ended, { interrupted: 0, requeued: 1 });
    const row = await store
      .selectFrom('runs')
      .select(['state', 'owner', 'started_at', 'attempts'])
      .where('id', '=', id)
      .executeTakeFirstOrThrow();
    assert.deepEqual(row, { state: 'queued', owner: null, started_at: null, attempts: 1 });
    const hooks = await store.selectFrom('webhook_deliveries').select('run_id').where('run_id', '=', id).execute();
    assert.deepEqual(hooks, []);
  });
});
