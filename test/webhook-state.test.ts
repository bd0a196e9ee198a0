/**
 * Every webhook payload carries `state` (docs/webhooks.md promises it in every payload), also the ones
 * written outside the invoker: the async worker's failure path (a held run whose app has no ready build)
 * and recovery (a running async run whose node's lease ended). Issue 30, point 8: both lacked it.
 *
 * Driven directly on a real store (SQLite, or PostgreSQL under test/postgres/ when it imports this file),
 * rows inserted as the run endpoint writes them.
 */
import assert from 'node:assert/strict';
import { describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { createNodeLease, LEASE_ENDED } from '../src/cluster/node.js';
import { createRecovery } from '../src/cluster/recovery.js';
import { uuidv7 } from '../src/ids.js';
import { createAsyncWorker } from '../src/runs/async-worker.js';
import type { Invoker } from '../src/runs/invoke.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
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
});
