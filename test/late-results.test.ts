/**
 * Fencing of late results (issue 30 point 4), at the store: a node frozen past its lease comes back with
 * the results of runs recovery already settled, or queued again and started anew. Its recorder's writes
 * carry the start they belong to and must change nothing: the run keeps the end recovery gave it (and
 * its one webhook), a run started again keeps running, and the discarded results are counted. Runs on
 * SQLite here and on PostgreSQL through test/postgres/late-results.test.ts.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { createRecovery } from '../src/cluster/recovery.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { endRun, type RunEnding } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { claimQueuedRuns, startRuns } from '../src/store/claims.js';
import { updateRun } from '../src/store/run-updates.js';
import { tempDir } from './helpers/ferry.js';
import { judgingLease } from './helpers/recovery.js';
import { openTestStore, type TestStore } from './helpers/store.js';

const FROZEN = 'node-frozen';
const build = { projectId: 'p-late', appId: 'late', buildId: 'b-late' };

/** A run that answered 200 with this result (JSON): how a late node's result comes in. */
function answered(json: string): RunEnding {
  return { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: json, json } };
}

describe('a late node’s writes are fenced', () => {
  let t: TestStore;
  const logger = createLogger({ level: 'silent' });
  let late = 0;

  before(async () => {
    t = await openTestStore(await tempDir('ferry-late-'));
  });
  after(async () => {
    await t?.close();
  });

  const recorderOf = () =>
    createRunRecorder({
      store: t.store,
      logger,
      owner: FROZEN,
      onLateResults: (n) => {
        late += n;
      },
    });

  /** The frozen node's lease ran out: a live node's recovery takes its work over. */
  async function recoverFrozen(): Promise<void> {
    const past = new Date(Date.now() - 60_000).toISOString();
    await t.store
      .insertInto('nodes')
      .values({ id: FROZEN, started_at: past, lease_until: past, info: '{}' })
      .onConflict((oc) => oc.column('id').doUpdateSet({ lease_until: past }))
      .execute();
    const live = judgingLease('node-live');
    const recovery = createRecovery({ store: t.store, node: live, logger });
    await recovery.sweep();
    await recovery.close();
  }

  const row = (id: string) => t.store.selectFrom('runs').selectAll().where('id', '=', id).executeTakeFirstOrThrow();
  const hooks = (id: string) =>
    t.store.selectFrom('webhook_deliveries').select('payload').where('run_id', '=', id).execute();

  it('an async run recovery ended interrupted keeps that end and its one webhook', async () => {
    const recorder = recorderOf();
    const id = uuidv7();
    await recorder.insertNow(
      newRunRow({
        id,
        build,
        fn: 'work',
        mode: 'async',
        input: '{}',
        owner: FROZEN,
        webhookUrl: 'http://127.0.0.1:9/h',
      }),
    );
    const attempt = await recorder.startNow(id, FROZEN);
    assert.equal(attempt, 1);
    recorder.update(id, { state: 'running', started_at: new Date().toISOString() });
    await recorder.flush();
    // Frozen here, past its lease: recovery settles the run.
    await recoverFrozen();
    const settled = await row(id);
    assert.equal(settled.state, 'failure');
    assert.equal(settled.reason, 'interrupted');
    const hooksBefore = await hooks(id);
    assert.equal(hooksBefore.length, 1);
    // Thawed: the run's result comes in and is written late.
    const before = late;
    recorder.finish(endRun({ id, webhookUrl: 'http://127.0.0.1:9/h', attempt }, answered('"late"')));
    await recorder.flush();
    const after = await row(id);
    assert.equal(after.state, 'failure', 'the settled run is not rewritten');
    assert.equal(after.reason, 'interrupted');
    assert.equal(after.result, null);
    assert.equal(after.finished_at, settled.finished_at);
    assert.deepEqual(await hooks(id), hooksBefore, 'no second webhook');
    assert.equal(late - before, 1, 'the discarded result is counted');
    await recorder.close();
  });

  it('a run queued again and started anew by the same node is not ended by the old start', async () => {
    const recorder = recorderOf();
    const id = uuidv7();
    await recorder.insertNow(newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: FROZEN }));
    assert.equal(await recorder.startNow(id, FROZEN), 1);
    const first = await row(id);
    assert.equal(first.attempts, 1);
    // Recovery queued it again (retry_interrupted), and the node, back, claimed and started it again.
    await t.store
      .updateTable('runs')
      .set({ state: 'queued', owner: null, started_at: null, published_at: null })
      .where('id', '=', id)
      .execute();
    assert.deepEqual(
      (await claimQueuedRuns(t.store, FROZEN, 1000)).map((r) => r.id).filter((r) => r === id),
      [id],
    );
    const second = await startRuns(t.store, FROZEN, [id], new Date().toISOString());
    assert.equal(second.get(id), 2);
    // The first start's result comes in late: same owner, still unfinished, but not its start.
    const before = late;
    recorder.finish(endRun({ id, webhookUrl: null, attempt: 1 }, answered('"old"')));
    await recorder.flush();
    const now = await row(id);
    assert.equal(now.state, 'running', 'the second start is still running');
    assert.equal(now.result, null);
    assert.equal(now.attempts, 2);
    assert.equal(late - before, 1);
    await recorder.close();
  });

  it('a sync run recovery ended is not rewritten either', async () => {
    const recorder = recorderOf();
    const id = uuidv7();
    recorder.start(newRunRow({ id, build, fn: 'work', mode: 'sync', input: '{}' }));
    recorder.update(id, { state: 'running', started_at: new Date().toISOString() });
    await recorder.flush();
    assert.equal((await row(id)).owner, FROZEN);
    await recoverFrozen();
    assert.equal((await row(id)).state, 'failure');
    recorder.finish(endRun({ id, webhookUrl: null }, answered('1')));
    await recorder.flush();
    const now = await row(id);
    assert.equal(now.state, 'failure');
    assert.equal(now.reason, 'interrupted');
    await recorder.close();
  });

  it('updateRun with a stale token changes nothing; with the current one it writes', async () => {
    const recorder = recorderOf();
    const id = uuidv7();
    await recorder.insertNow(newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: FROZEN }));
    assert.equal(await recorder.startNow(id, FROZEN), 1);
    await recorder.close();
    const end = { state: 'success' as const, status_code: 200, finished_at: new Date().toISOString() };
    assert.equal(await updateRun(t.store, id, end, FROZEN, 0), 0, 'a stale start');
    assert.equal(await updateRun(t.store, id, end, 'node-other', 1), 0, 'another owner');
    assert.equal((await row(id)).state, 'running');
    assert.equal(await updateRun(t.store, id, end, FROZEN, 1), 1, 'its own start');
    assert.equal((await row(id)).state, 'success');
    // Settled: nothing rewrites it, whatever the token.
    const again = { state: 'failure' as const, status_code: 500 };
    assert.equal(await updateRun(t.store, id, again, FROZEN, 1), 0);
    assert.equal(await updateRun(t.store, id, again, FROZEN), 0);
    assert.equal(await updateRun(t.store, id, again), 0);
    assert.equal((await row(id)).state, 'success');
  });
});
