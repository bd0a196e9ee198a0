/**
 * Text in the store compares by bytes on both stores, as SQLite's BINARY collation does: the run and
 * build lists page with `id < before` and sort by id, the deliverer picks due rows with
 * `next_attempt_at <= now`, apps are listed by name. PostgreSQL compares text by the database's collation
 * instead, so on PostgreSQL this test runs on a database created with an ICU en-US default collation,
 * under which 'a' sorts before 'A' and '_' before '-' (migration 0007 makes Ferry's columns "C").
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import { tempDir } from './helpers/ferry.js';
import { openTestStore, type TestStore } from './helpers/store.js';

/** Values whose byte order differs from en-US order: case, and punctuation against letters and digits. */
const VALUES = ['a', 'A', 'a-b', 'a_b', 'ab', 'a-c', 'B', '0', 'a.b', 'Z', 'a b', 'a~', 'é', 'e'];
const byBytes = (values: string[]) => [...values].sort((x, y) => Buffer.compare(Buffer.from(x), Buffer.from(y)));

describe('text order in the store', () => {
  let opened: TestStore;

  before(async () => {
    opened = await openTestStore(await tempDir('ferry-collation-'), { icuLocale: 'en-US' });
    await opened.store
      .insertInto('projects')
      .values(VALUES.map((v) => ({ id: v, name: `name ${v}`, created_at: v })))
      .execute();
  });
  after(() => opened?.close());

  it('sorts by bytes', async () => {
    const ids = await opened.store.selectFrom('projects').select('id').orderBy('id').execute();
    assert.deepEqual(
      ids.map((r) => r.id),
      byBytes(VALUES),
    );
    const times = await opened.store
      .selectFrom('projects')
      .select('created_at')
      .orderBy('created_at', 'desc')
      .execute();
    assert.deepEqual(
      times.map((r) => r.created_at),
      byBytes(VALUES).reverse(),
    );
  });

  it('compares with < and <= by bytes', async () => {
    for (const pivot of ['a-b', 'A', 'a_b', 'e']) {
      const below = await opened.store.selectFrom('projects').select('id').where('id', '<', pivot).execute();
      assert.deepEqual(
        byBytes(below.map((r) => r.id)),
        byBytes(VALUES.filter((v) => Buffer.compare(Buffer.from(v), Buffer.from(pivot)) < 0)),
        `id < ${pivot}`,
      );
      const upTo = await opened.store.selectFrom('projects').select('id').where('created_at', '<=', pivot).execute();
      assert.equal(upTo.length, below.length + 1, `created_at <= ${pivot}`);
    }
  });

  it('declares no other order for any text column of Ferry’s tables', async () => {
    if (opened.kind === 'sqlite') {
      // SQLite compares by bytes (BINARY) unless a column or index names another collation.
      const schema = await sql<{ name: string; sql: string | null }>`
        select name, sql from sqlite_master where name not like 'sqlite_%'`.execute(opened.store);
      assert.ok(schema.rows.length > 10, 'the schema is listed');
      const other = schema.rows.filter((r) => /\bcollate\b/i.test(r.sql ?? '')).map((r) => r.name);
      assert.deepEqual(other, []);
      return;
    }
    // The database really is one where order differs (else the tests above prove nothing here).
    const icu = await sql<{ before: boolean }>`select 'a' < 'A' as before`.execute(opened.store);
    assert.equal(icu.rows[0]?.before, true, 'the database default collation is not byte order');
    const columns = await sql<{ table_name: string; column_name: string; collation_name: string | null }>`
      select table_name, column_name, collation_name from information_schema.columns
      where table_schema = current_schema() and data_type = 'text'
        and table_name not in ('kysely_migration', 'kysely_migration_lock')`.execute(opened.store);
    assert.ok(columns.rows.length > 20, 'the text columns are listed');
    const other = columns.rows.filter((c) => c.collation_name !== 'C').map((c) => `${c.table_name}.${c.column_name}`);
    assert.deepEqual(other, [], 'new text columns on PostgreSQL need COLLATE "C" (see migration 0007)');
  });
});
