/**
 * store/budget-lock.ts: two transactions that each check a shared budget and spend it (the check of
 * FERRY_VOLUMES_TOTAL_MIB when a volume is created) must run one after the other. Each transaction reads the
 * total, then waits (up to 1.5 s) for the other to have read it too before inserting: without the lock both
 * read the same total, both fit, and both insert (the race issue 27's note left open on PostgreSQL); with it
 * the second reads only after the first committed, sees its row, and stays out. Runs on SQLite here (its
 * write transactions are one at a time already) and on PostgreSQL (test/postgres/budget-lock.test.ts).
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import { lockBudget } from '../src/store/budget-lock.js';
import { openTestStore, type TestStore } from './helpers/store.js';

const BUDGET_MIB = 100;

describe('store/budget-lock: a budget checked and spent by two transactions at once', () => {
  let dir: string;
  let t: TestStore;
  before(async () => {
    dir = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-budget-'));
    t = await openTestStore(dir);
    await t.store
      .insertInto('projects')
      .values({ id: 'p-budget01', name: 'budget', created_at: new Date().toISOString() })
      .execute();
  });
  after(async () => {
    await t?.close();
    await fs.rm(dir, { recursive: true, force: true });
  });

  it('lets only one of two 60 MiB volumes into a 100 MiB budget', async () => {
    const read: string[] = [];
    const waiters: Array<() => void> = [];
    /** Resolves when both have read the total, or after 1.5 s (the other is waiting on the lock). */
    const bothRead = () =>
      new Promise<void>((resolve) => {
        if (read.length >= 2) return resolve();
        const timer = setTimeout(resolve, 1500);
        waiters.push(() => {
          clearTimeout(timer);
          resolve();
        });
      });
    const attempt = (name: string, gid: number) =>
      t.store.transaction().execute(async (trx) => {
        await lockBudget(trx, 'volumes_total');
        const total = await trx
          .selectFrom('volumes')
          .select((eb) => eb.fn.coalesce(eb.fn.sum<number>('size_mib'), eb.lit(0)).as('total'))
          .executeTakeFirstOrThrow();
        read.push(name);
        if (read.length >= 2) for (const wake of waiters.splice(0)) wake();
        await bothRead();
        if (Number(total.total) + 60 > BUDGET_MIB) return 'refused';
        await trx
          .insertInto('volumes')
          .values({ project_id: 'p-budget01', name, size_mib: 60, gid, created_at: new Date().toISOString() })
          .execute();
        return 'created';
      });
    const outcomes = await Promise.all([attempt('a', 1_900_001), attempt('b', 1_900_002)]);
    assert.deepEqual([...outcomes].sort(), ['created', 'refused'], `outcomes: ${outcomes.join(', ')}`);
    const rows = await sql<{ n: number }>`select count(*) as n from volumes`.execute(t.store);
    assert.equal(Number(rows.rows[0]?.n), 1);
  });
});
