/**
 * Recovery's sweep as its callers see it (cluster/recovery.ts): a sweep asked for while another is under
 * way is a pass of its own, begun after that one. The pass under way may have read the leases before the
 * caller's change (a node that had just stopped), and a caller given its result would find that node's
 * work still held: how test/shared-state's build hand-over failed once under load, when the server's
 * periodic sweep was under way as the test asked for one.
 *
 * The recovery's clock (read as a pass begins) tells the passes apart: the first pass reads a time before
 * the other node's lease ends, the pass asked for next a time after it.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { createRecovery } from '../src/cluster/recovery.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { tempDir } from './helpers/ferry.js';
import { judgingLease } from './helpers/recovery.js';
import { openTestStore } from './helpers/store.js';

const OTHER = 'node-other';
const build = { projectId: 'p-sweep', appId: 'sweep', buildId: 'b-sweep' };

const live = judgingLease('node-live');

describe('recovery: a sweep asked for during another', () => {
  it('is a pass begun after the one under way, and callers asking meanwhile share it', async (t) => {
    const opened = await openTestStore(await tempDir('ferry-recovery-sweep-'));
    t.after(() => opened.close());
    const { store } = opened;
    const logger = createLogger({ level: 'silent' });
    const leaseEnds = Date.now() + 3_600_000;
    await store
      .insertInto('nodes')
      .values({
        id: OTHER,
        started_at: new Date().toISOString(),
        lease_until: new Date(leaseEnds).toISOString(),
        info: '{}',
      })
      .execute();
    // The other node has claimed an async run and not started it: a pass that finds the node dead frees it.
    const recorder = createRunRecorder({ store, logger, owner: OTHER });
    const id = uuidv7();
    await recorder.insertNow(newRunRow({ id, build, fn: 'work', mode: 'async', input: '{}', owner: OTHER }));
    await recorder.close();

    let now = leaseEnds - 60_000;
    const recovery = createRecovery({ store, node: live, logger, clock: () => now });
    t.after(() => recovery.close());
    const first = recovery.sweep(); // begins now: the other node's lease has an hour to run
    now = leaseEnds + 60_000; // ... and has ended by the next pass
    const second = recovery.sweep();
    const third = recovery.sweep();
    assert.notEqual(second, first, 'a pass of its own');
    assert.equal(third, second, 'one pass for the callers that asked while the first was under way');

    assert.equal((await first).requeued, 0, 'the first pass found the other node alive');
    assert.equal((await second).requeued, 1, 'the second pass found it dead and freed its run');
    const row = await store
      .selectFrom('runs')
      .select(['owner', 'state'])
      .where('id', '=', id)
      .executeTakeFirstOrThrow();
    assert.deepEqual([row.owner, row.state], [null, 'queued']);
    // Nothing under way: a sweep asked for now begins at once.
    assert.equal((await recovery.sweep()).requeued, 0);
  });
});
