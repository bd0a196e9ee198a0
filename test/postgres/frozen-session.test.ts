/**
 * A Ferry process frozen inside a PostgreSQL transaction (SIGSTOP, a stalled VM) must not hold its row
 * locks for as long as it is frozen: the recovery of its runs would wait on them (issue 30, point 4). The
 * store's sessions have `idle_in_transaction_session_timeout`, so PostgreSQL ends such a session and its
 * transaction. Here a store's session takes a row lock in a transaction and then sits idle (as a frozen
 * process's would); another connection's update of that row must go through once the timeout ends it.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import pg from 'pg';
import { openPostgresStore, PG_IDLE_IN_TRANSACTION_MS, type Store } from '../../src/store/index.js';
import { createTestDatabase, type TestDatabase } from '../helpers/store.js';

describe('a session frozen inside a transaction (PostgreSQL)', () => {
  let database: TestDatabase;
  let store: Store;

  before(async () => {
    database = await createTestDatabase();
    store = await openPostgresStore({ databaseUrl: database.url, poolSize: 2 });
  });
  after(async () => {
    await store?.destroy();
    await database?.drop();
  });

  it('is ended by the server, releasing its locks', { timeout: 120_000 }, async () => {
    const shown = await sql<{
      idle_in_transaction_session_timeout: string;
    }>`show idle_in_transaction_session_timeout`.execute(store);
    assert.equal(shown.rows[0]?.idle_in_transaction_session_timeout, `${PG_IDLE_IN_TRANSACTION_MS / 1000}s`);

    await sql`create table frozen_probe (id int primary key, v int)`.execute(store);
    await sql`insert into frozen_probe values (1, 0)`.execute(store);
    // The "frozen" holder: a transaction of the store's own pool that locks the row and then does nothing.
    let holderEnded: Promise<unknown> | undefined;
    let wake = () => {};
    const locked = new Promise<void>((resolve) => {
      holderEnded = store
        .connection()
        .execute(async (conn) => {
          await sql`begin`.execute(conn);
          await sql`select v from frozen_probe where id = 1 for update`.execute(conn);
          resolve();
          // Idle in its transaction well past the timeout; the server ends the session meanwhile.
          await new Promise<void>((r) => {
            wake = r;
            setTimeout(r, PG_IDLE_IN_TRANSACTION_MS * 2 + 5_000);
          });
          await sql`rollback`.execute(conn).catch(() => undefined);
        })
        .catch(() => undefined);
    });
    await locked;
    const other = new pg.Client({ connectionString: database.url });
    other.on('error', () => {});
    await other.connect();
    try {
      const started = Date.now();
      // Waits on the lock until the server ends the idle holder; a generous bound, not a tight one.
      await other.query("set statement_timeout = '90s'");
      const updated = await other.query('update frozen_probe set v = 1 where id = 1');
      assert.equal(updated.rowCount, 1);
      assert.ok(Date.now() - started < 90_000, 'the update went through before its own timeout');
    } finally {
      await other.end();
      wake();
    }
    await holderEnded;
  });
});
