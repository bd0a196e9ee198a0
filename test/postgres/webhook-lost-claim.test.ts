/**
 * A webhook delivery held by a live owner that is not sending it is taken up again (issue 43 point 4).
 *
 * The report: PostgreSQL was stopped for 10 s, and one delivery stayed `sending` (attempts 0) for 4 min 19 s,
 * owned by a live worker, until that worker lost its lease. `claimDueDeliveries` had marked it `sending` and
 * committed, and the store went away before its answer came back: the deliverer never heard of the row, and
 * recovery resets only dead owners' deliveries.
 *
 * Here that happens for real: the deliverer reaches its database through a proxy (test/helpers/
 * lossy-store-proxy.ts) that lets the claim's UPDATE reach PostgreSQL and commit, resets the deliverer's
 * connection before the answer, and refuses connections for 3 s. The owner stays alive all along (no lease,
 * no recovery here): its own held-deliveries sweep must find the row and let it go, within its bound
 * (docs/operations.md: two sweeps, 5 s apart by default), and the delivery then goes out once.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { describe, it } from 'node:test';
import { pino } from 'pino';
import { uuidv7 } from '../../src/ids.js';
import { newRunRow } from '../../src/runs/recorder.js';
import { openPostgresStore } from '../../src/store/index.js';
import { createWebhookDeliverer } from '../../src/webhooks/deliverer.js';
import { waitFor } from '../helpers/ferry.js';
import { startLossyStoreProxy } from '../helpers/lossy-store-proxy.js';
import { startReceiver } from '../helpers/receiver.js';
import { createTestDatabase } from '../helpers/store.js';

const OWNER = 'node-alive';
/** The claim's UPDATE (store/claims.ts claimDueDeliveries), as Kysely writes it. */
const CLAIM_TEXT = 'update "webhook_deliveries" set "state" = $1, "owner" = $2';

describe('a delivery claimed while the store went away', () => {
  it('is let go by its live owner and sent once', { timeout: 120_000 }, async (t) => {
    const db = await createTestDatabase();
    t.after(() => db.drop());
    const direct = new URL(db.url);
    const proxy = await startLossyStoreProxy({ host: direct.hostname, port: Number(direct.port || 5432) });
    t.after(() => proxy.close());
    const viaProxy = new URL(db.url);
    viaProxy.port = String(proxy.port);
    // The test reads the truth directly; the deliverer's store is the one behind the proxy.
    const observer = await openPostgresStore({ databaseUrl: db.url, poolSize: 2 });
    t.after(() => observer.destroy());
    const store = await openPostgresStore({ databaseUrl: viaProxy.toString(), poolSize: 2 });
    t.after(() => store.destroy());
    const receiver = await startReceiver();
    t.after(() => receiver.close());

    const logs: Array<Record<string, unknown>> = [];
    const logger = pino({ level: 'debug' }, { write: (line: string) => void logs.push(JSON.parse(line)) });
    const deliverer = createWebhookDeliverer({
      store,
      logger,
      secretsKey: randomBytes(32),
      allow: '127.0.0.0/8',
      owner: OWNER,
      attemptTimeoutMs: 5_000,
    });
    deliverer.start();
    t.after(() => deliverer.close());

    // A finished run and its outbox row, as the recorder writes them.
    const runId = uuidv7();
    const now = new Date().toISOString();
    const build = { projectId: 'p-0000held', appId: 'hooks', buildId: 'b-none' };
    await observer
      .insertInto('runs')
      .values({
        ...newRunRow({ id: runId, build, fn: 'main', mode: 'async', input: '{}', webhookUrl: `${receiver.url}/hook` }),
        state: 'success',
        status_code: 200,
        started_at: now,
        finished_at: now,
      })
      .execute();
    const lost = proxy.loseAnswerOf(CLAIM_TEXT, 3_000);
    await observer
      .insertInto('webhook_deliveries')
      .values({
        run_id: runId,
        url: `${receiver.url}/hook`,
        payload: JSON.stringify({ run_id: runId, status_code: 200, result: { ok: true } }),
        state: 'pending',
        attempts: 0,
        next_attempt_at: now,
        created_at: now,
        updated_at: now,
      })
      .execute();
    deliverer.wake();
    await lost;
    assert.equal(proxy.lost(), 1, 'the claim committed and its answer was lost');

    // The store is back; the row is held by the live owner, with nothing sent.
    const held = await observer
      .selectFrom('webhook_deliveries')
      .select(['state', 'owner', 'attempts'])
      .where('run_id', '=', runId)
      .executeTakeFirstOrThrow();
    assert.deepEqual(held, { state: 'sending', owner: OWNER, attempts: 0 });
    assert.equal(receiver.requests.length, 0);

    // Its owner lets it go and it is sent, once (generous bound: the sweep's is seconds).
    const row = await waitFor(
      async () => {
        const r = await observer
          .selectFrom('webhook_deliveries')
          .select(['state', 'attempts', 'owner'])
          .where('run_id', '=', runId)
          .executeTakeFirstOrThrow();
        return r.state === 'delivered' ? r : undefined;
      },
      60_000,
      'the delivery held by its live owner to be sent',
    );
    assert.deepEqual(row, { state: 'delivered', attempts: 1, owner: null });
    assert.equal(receiver.requests.length, 1, 'sent once');
    const released = logs.findIndex((l) => String(l.msg).includes('held in the store but not in flight'));
    assert.ok(released >= 0, 'the owner says it let the delivery go');
    assert.deepEqual(logs[released]?.runs, [runId]);
  });
});
