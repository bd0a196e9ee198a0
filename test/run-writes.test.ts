/**
 * The store's batched run writes (issue 31): on PostgreSQL a batch of run rows is one INSERT of one array
 * per column, a batch of run changes one UPDATE per shape of change, and a batch of starts one UPDATE with
 * an array of ids (SQLite keeps its statements). What must hold whatever the batching: every value is
 * stored as a single-row insert stores it, each run of a batch is fenced on its own (owner, state, the
 * start its change belongs to), and the recorder counts the refused ends as late and reports only the
 * written ones as finished. Runs on SQLite here and on PostgreSQL through test/postgres/run-writes.test.ts.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { endRun, type RunEnding } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { startRuns } from '../src/store/claims.js';
import { insertRunsIgnoring } from '../src/store/run-inserts.js';
import { updateRuns } from '../src/store/run-updates.js';
import type { Run } from '../src/store/schema.js';
import { tempDir } from './helpers/ferry.js';
import { openTestStore, type TestStore } from './helpers/store.js';

const OWNER = 'node-writes';
const build = { projectId: 'p-writes', appId: 'writes', buildId: 'b-writes' };

/** Strings an array literal must escape or could misread (quotes, backslashes, braces, commas, NULL). */
const AWKWARD = [
  '',
  'NULL',
  'null',
  '"',
  '\\',
  '\\"',
  '{}',
  '{"a":"b\\\\c","q":"\\"x\\""}',
  'a,b',
  ' leading and trailing ',
  'line\nbreak\ttab',
  'é ü 漢字 🚀',
  '\ud83d lone high surrogate',
  `${'x'.repeat(70_000)}`,
];

function answered(json: string): RunEnding {
  return { kind: 'answered', statusCode: 200, runTimeMs: 3, result: { stored: json, json } };
}

describe('batched run writes', () => {
  let t: TestStore;
  const logger = createLogger({ level: 'silent' });

  before(async () => {
    t = await openTestStore(await tempDir('ferry-run-writes-'));
  });
  after(async () => {
    await t?.close();
  });

  const rowOf = (id: string) => t.store.selectFrom('runs').selectAll().where('id', '=', id).executeTakeFirstOrThrow();

  it('stores every value of a batch as a single-row insert stores it', async () => {
    const rows = AWKWARD.map((text, i) => ({
      ...newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: text, owner: OWNER }),
      error_message: text,
      status_code: i === 0 ? null : 200 + i,
      idempotency_key: i % 2 === 0 ? `key ${text.slice(0, 40)} ${i}` : null,
    })) satisfies Run[];
    // The same values, one row per statement, through Kysely's own insert.
    const single = rows.map((r) => ({ ...r, id: uuidv7(), idempotency_key: null }));
    const { inserted, ids } = await insertRunsIgnoring(t.store, rows, true);
    assert.equal(inserted, rows.length);
    assert.deepEqual(new Set(ids), new Set(rows.map((r) => r.id)));
    for (const r of single) await t.store.insertInto('runs').values(r).execute();
    for (let i = 0; i < rows.length; i++) {
      const batched = await rowOf(rows[i]!.id);
      const alone = await rowOf(single[i]!.id);
      assert.deepEqual({ ...batched, id: '', idempotency_key: null }, { ...alone, id: '' }, `value ${i}`);
      if (i !== 12) assert.equal(batched.input, AWKWARD[i], `value ${i} as written`);
      assert.equal(batched.status_code, rows[i]!.status_code);
    }
    // Inserted again (a retried batch whose commit happened): nothing twice, no error.
    assert.deepEqual(await insertRunsIgnoring(t.store, rows, true), { inserted: 0, ids: [] });
  });

  it('fences each update of a batch on its own: owner, unfinished, and the start it belongs to', async () => {
    const ids = Array.from({ length: 6 }, () => uuidv7());
    await insertRunsIgnoring(
      t.store,
      ids.map((id) => newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: OWNER })),
    );
    // All started once; then run 3 is held by another node and run 4 is already settled.
    const started = await startRuns(t.store, OWNER, ids, new Date().toISOString());
    assert.deepEqual([...started.values()], [1, 1, 1, 1, 1, 1]);
    await t.store.updateTable('runs').set({ owner: 'node-other' }).where('id', '=', ids[3]!).execute();
    await t.store
      .updateTable('runs')
      .set({ state: 'failure', reason: 'interrupted' })
      .where('id', '=', ids[4]!)
      .execute();
    const end = { state: 'success' as const, status_code: 200, finished_at: new Date().toISOString() };
    const refused = await updateRuns(
      t.store,
      [
        { id: ids[0]!, changes: end, attempt: 1 },
        { id: ids[1]!, changes: { ...end, result: '"two shapes"' }, attempt: 1 },
        { id: ids[2]!, changes: end, attempt: 0 }, // a stale start
        { id: ids[3]!, changes: end, attempt: 1 }, // another owner's now
        { id: ids[4]!, changes: end, attempt: 1 }, // settled
        { id: ids[5]!, changes: { reason: 'not fenced by a start' } }, // unfinished and ours: written
        { id: uuidv7(), changes: end, attempt: 1 }, // no such run
        { id: uuidv7(), changes: {} }, // nothing to set: left out
      ],
      OWNER,
    );
    assert.equal(refused.size, 4);
    for (const i of [2, 3, 4]) assert.ok(refused.has(ids[i]!), `run ${i} refused`);
    const after = await Promise.all(ids.map(rowOf));
    assert.deepEqual(
      after.map((r) => r.state),
      ['success', 'success', 'running', 'running', 'failure', 'running'],
    );
    assert.equal(after[1]!.result, '"two shapes"');
    assert.equal(after[4]!.reason, 'interrupted', 'a settled run keeps its end');
    assert.equal(after[5]!.reason, 'not fenced by a start');
    // Settled runs are never rewritten, by any batch.
    assert.equal((await updateRuns(t.store, [{ id: ids[0]!, changes: { state: 'failure' } }], OWNER)).size, 1);
    assert.equal((await rowOf(ids[0]!)).state, 'success');
  });

  it('starts only this owner’s queued runs of a batch, each with its number', async () => {
    const ids = Array.from({ length: 5 }, () => uuidv7());
    await insertRunsIgnoring(
      t.store,
      ids.map((id, i) =>
        newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: i === 4 ? 'node-other' : OWNER }),
      ),
    );
    await t.store.updateTable('runs').set({ attempts: 2 }).where('id', '=', ids[1]!).execute();
    await t.store.updateTable('runs').set({ state: 'cancelled' }).where('id', '=', ids[2]!).execute();
    const started = await startRuns(t.store, OWNER, ids, new Date().toISOString());
    assert.deepEqual(
      ids.map((id) => started.get(id)),
      [1, 3, undefined, 1, undefined],
    );
    // Started already: not started twice.
    assert.equal((await startRuns(t.store, OWNER, [ids[0]!], new Date().toISOString())).size, 0);
  });

  it('the recorder commits a group of inserts and the starts that came meanwhile together, keys resolved', async () => {
    const recorder = createRunRecorder({ store: t.store, logger, owner: OWNER });
    const row = (id: string, key?: string) =>
      newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: OWNER, idempotencyKey: key });
    const first = Array.from({ length: 10 }, () => uuidv7());
    const key = `group-key-${uuidv7()}`;
    assert.deepEqual(
      await Promise.all(first.map((id, i) => recorder.insertNow(row(id, i === 0 ? key : undefined)))),
      first,
    );
    // In one turn: the first ten start, ten more arrive (one with the first run's key), and one start is
    // of a run not this node's queued run any more (cancelled meanwhile).
    await t.store.updateTable('runs').set({ state: 'cancelled' }).where('id', '=', first[9]!).execute();
    const second = Array.from({ length: 10 }, () => uuidv7());
    const [starts, inserts] = await Promise.all([
      Promise.all(first.map((id) => recorder.startNow(id, OWNER))),
      Promise.all(second.map((id, i) => recorder.insertNow(row(id, i === 3 ? key : undefined)))),
    ]);
    assert.deepEqual(starts, [1, 1, 1, 1, 1, 1, 1, 1, 1, undefined]);
    assert.deepEqual(
      inserts,
      second.map((id, i) => (i === 3 ? first[0] : id)),
      'the key resolves to the run that holds it',
    );
    const states = await t.store
      .selectFrom('runs')
      .select(['id', 'state'])
      .where('id', 'in', [...first, ...second])
      .execute();
    const byId = new Map(states.map((r) => [r.id, r.state]));
    assert.ok(first.slice(0, 9).every((id) => byId.get(id) === 'running'));
    assert.equal(byId.get(first[9]!), 'cancelled');
    assert.ok(second.every((id, i) => (i === 3 ? !byId.has(id) : byId.get(id) === 'queued')));
    await recorder.close();
  });

  it('the recorder writes many ends in one flush, counts the refused ones late and reports the rest finished', async () => {
    let late = 0;
    const finished: string[] = [];
    const recorder = createRunRecorder({
      store: t.store,
      logger,
      owner: OWNER,
      onLateResults: (n) => {
        late += n;
      },
      onFinished: (runIds) => finished.push(...runIds),
    });
    const ids = Array.from({ length: 40 }, () => uuidv7());
    const accepted = await Promise.all(
      ids.map((id) =>
        recorder.insertNow(newRunRow({ id, build, fn: 'work', mode: 'async', input: `{"i":"${id}"}`, owner: OWNER })),
      ),
    );
    assert.deepEqual(accepted, ids);
    const attempts = await Promise.all(ids.map((id) => recorder.startNow(id, OWNER)));
    assert.ok(attempts.every((a) => a === 1));
    // Ten of them settled meanwhile by someone else (recovery, say).
    const settled = ids.slice(0, 10);
    await t.store
      .updateTable('runs')
      .set({ state: 'failure', reason: 'interrupted' })
      .where('id', 'in', settled)
      .execute();
    for (const [i, id] of ids.entries()) {
      recorder.finish(endRun({ id, webhookUrl: null, attempt: 1 }, answered(i % 3 === 0 ? 'null' : `"${i}"`)));
    }
    await recorder.flush();
    const rows = await t.store.selectFrom('runs').select(['id', 'state', 'result']).where('id', 'in', ids).execute();
    const byId = new Map(rows.map((r) => [r.id, r]));
    for (const [i, id] of ids.entries()) {
      const r = byId.get(id)!;
      if (i < 10) assert.equal(r.state, 'failure', `run ${i} keeps its end`);
      else {
        assert.equal(r.state, 'success', `run ${i}`);
        assert.equal(r.result, i % 3 === 0 ? 'null' : `"${i}"`);
      }
    }
    assert.equal(late, 10);
    assert.deepEqual(new Set(finished), new Set(ids.slice(10)));
    await recorder.close();
  });
});
