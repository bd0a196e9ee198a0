/**
 * The statements that name their runs by id (a worker's starts and ends, the JetStream queue's claims, its
 * acks' check, the relay's marks) must find those runs by primary key on PostgreSQL, whatever the
 * statistics say. Written plainly, PostgreSQL planned them through the small partial indexes over unfinished
 * runs (runs_owner_state, runs_state) whenever runs had no statistics or stale ones (a young database under
 * load), and read every run the node held, or the whole backlog of free queued runs, to keep the few asked
 * for: bench:cluster (c) read 1,317 entries of runs_owner_state per run (bench/README.md). Here a database
 * that was never analyzed holds a backlog of queued runs, some held by this node and most by nobody; every
 * statement each function runs is captured and EXPLAINed with its own parameters, and no scan of runs may
 * use an index but its primary key.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { type CompiledQuery, Kysely, PostgresDialect, sql } from 'kysely';
import pg from 'pg';
import { newRunRow } from '../../src/runs/recorder.js';
import {
  claimPublishedRuns,
  freeQueuedRunsOf,
  markRunsPublished,
  releaseQueuedRuns,
  startRuns,
  unfinishedRunsOf,
} from '../../src/store/claims.js';
import { openPostgresStore, type Store } from '../../src/store/index.js';
import { insertRunsAndStart, insertRunsIgnoring } from '../../src/store/run-inserts.js';
import { updateRuns } from '../../src/store/run-updates.js';
import type { Database } from '../../src/store/schema.js';
import { createTestDatabase, type TestDatabase } from '../helpers/store.js';

const ME = 'node-me';
const BACKLOG = 6_000;

describe('statements on a list of run ids use the primary key (PostgreSQL, no statistics)', () => {
  let database: TestDatabase;
  let pool: pg.Pool;
  let db: Kysely<Database>;
  let captured: CompiledQuery[] = [];
  const build = { projectId: 'p1', appId: 'a1', buildId: 'b1' };
  const ids: string[] = [];

  before(async () => {
    database = await createTestDatabase();
    pool = new pg.Pool({ connectionString: database.url, max: 2 });
    db = new Kysely<Database>({
      dialect: new PostgresDialect({ pool }),
      log: (event) => {
        if (event.level === 'query') captured.push(event.query);
      },
    });
    await pool.query('alter table runs set (autovacuum_enabled = false)');
    // A backlog: a third held by this node, the rest free, all queued; a few thousand finished runs beside.
    const rows = [];
    for (let i = 0; i < BACKLOG; i++) {
      const id = `0190a000-0000-7000-8000-${String(i).padStart(12, '0')}`;
      ids.push(id);
      rows.push({
        ...newRunRow({ id, build, fn: 'f', mode: 'async', input: '{}', owner: i % 3 === 0 ? ME : null }),
        state: i < BACKLOG / 2 ? ('success' as const) : ('queued' as const),
      });
    }
    await insertRunsIgnoring(db, rows);
    const stats = await pool.query(
      `select last_analyze, last_autoanalyze from pg_stat_user_tables where relname = 'runs'`,
    );
    assert.equal(
      stats.rows[0]?.last_analyze ?? null,
      null,
      'runs was analyzed: the test needs a table without statistics',
    );
    assert.equal(stats.rows[0]?.last_autoanalyze ?? null, null);
  });
  after(async () => {
    await db?.destroy();
    await database?.drop();
  });

  /** The indexes of runs the plans of the statements `work` runs read (`Seq Scan`: the table itself). */
  async function scansOf(work: () => Promise<unknown>): Promise<string[]> {
    captured = [];
    await work();
    assert.ok(captured.length > 0, 'no statement was run');
    const scans: string[] = [];
    const client = await pool.connect();
    try {
      for (const query of captured) {
        const text = query.sql.trim();
        // Only the statements that touch runs; EXPLAIN without ANALYZE runs nothing.
        if (!/"?runs"?/.test(text) || /^(begin|commit|rollback)/i.test(text)) continue;
        const plan = await client.query(`explain (format json) ${text}`, query.parameters as unknown[]);
        const walk = (node: Record<string, unknown>): void => {
          // Every index a plan reads (index, index-only and bitmap index scans name it), and any sequential
          // scan of runs; the other indexes' names start with runs_ too.
          const index = node['Index Name'];
          if (typeof index === 'string' && index.startsWith('runs')) scans.push(index);
          if (node['Node Type'] === 'Seq Scan' && node['Relation Name'] === 'runs') scans.push('Seq Scan');
          for (const child of (node.Plans as Array<Record<string, unknown>> | undefined) ?? []) walk(child);
        };
        walk((plan.rows[0]['QUERY PLAN'] as Array<{ Plan: Record<string, unknown> }>)[0]!.Plan);
      }
    } finally {
      client.release();
    }
    return scans;
  }

  // As many runs as a claim or a mark names under load (a fetch brings up to 64 messages; a second's
  // publishes are marked together): the planner's choice turns to a sequential scan as the list grows.
  const LIST = Number(process.env.LIST ?? 300);
  const mine = () => ids.filter((_, i) => i >= BACKLOG / 2 && i % 3 === 0).slice(0, LIST);
  const free = () => ids.filter((_, i) => i >= BACKLOG / 2 && i % 3 !== 0).slice(0, LIST);

  const cases: Array<[string, () => Promise<unknown>]> = [
    ['startRuns', () => startRuns(db, ME, mine(), new Date().toISOString())],
    ['releaseQueuedRuns', () => releaseQueuedRuns(db, ME, mine())],
    ['unfinishedRunsOf', () => unfinishedRunsOf(db, ME, mine())],
    ['freeQueuedRunsOf', () => freeQueuedRunsOf(db, free())],
    ['markRunsPublished', () => markRunsPublished(db, free(), new Date().toISOString())],
    ['claimPublishedRuns', () => claimPublishedRuns(db, ME, free())],
    [
      'insertRunsAndStart (the recorder group commit)',
      () =>
        insertRunsAndStart(
          db,
          [newRunRow({ id: `0190b000-0000-7000-8000-000000000001`, build, fn: 'f', mode: 'async', input: '{}' })],
          {
            owner: ME,
            runIds: mine(),
            startedAt: new Date().toISOString(),
          },
        ),
    ],
    [
      'updateRuns, fenced by the start (a run ends)',
      () =>
        updateRuns(
          db,
          mine().map((id) => ({
            id,
            changes: { state: 'success' as const, finished_at: new Date().toISOString() },
            attempt: 1,
          })),
          ME,
        ),
    ],
    [
      'updateRuns, unfenced',
      () =>
        updateRuns(
          db,
          mine().map((id) => ({ id, changes: { result: '1' } })),
          ME,
        ),
    ],
  ];
  for (const [name, work] of cases) {
    it(name, async () => {
      const scans = await scansOf(work);
      assert.ok(scans.length > 0, 'no scan of runs in the plans');
      for (const scan of scans) assert.equal(scan, 'runs_pkey', `${name} scans runs with ${scan}: ${scans.join(', ')}`);
    });
  }
});

/**
 * After five executions PostgreSQL may keep a generic plan for a named prepared statement, made for the
 * table as it was then. Ferry's hot statements are named (store/prepared.ts), so on a young database each
 * connection kept plans made while runs was near empty: sequential scans, which stayed while the table grew
 * under load (bench:cluster (c): 334 to 811 rows read per run, 10.5 ms per claim of 64 runs). Ferry's
 * connections plan every execution (`plan_cache_mode = force_custom_plan`): here the store's one connection
 * runs the statements on a near empty table, then after it grew, and none may have been run with a generic
 * plan (the describe above shows the plans made for a grown table read runs by primary key).
 */
describe('named statements are planned for the table as it is, not as it was (PostgreSQL)', () => {
  let database: TestDatabase;
  let store: Store;
  const build = { projectId: 'p1', appId: 'a1', buildId: 'b1' };
  const id = (i: number) => `0190c000-0000-7000-8000-${String(i).padStart(12, '0')}`;

  before(async () => {
    database = await createTestDatabase();
    // One connection: the statements below and the questions about them share one session.
    store = await openPostgresStore({ databaseUrl: database.url, poolSize: 1 });
    await sql`alter table runs set (autovacuum_enabled = false)`.execute(store);
  });
  after(async () => {
    await store?.destroy();
    await database?.drop();
  });

  /** A worker's round on runs `from` to `to`: claimed, started and ended, as the JetStream queue does it. */
  async function round(from: number, to: number): Promise<void> {
    const ids = Array.from({ length: to - from }, (_, k) => id(from + k));
    await claimPublishedRuns(store, ME, ids);
    await startRuns(store, ME, ids, new Date().toISOString());
    await updateRuns(
      store,
      ids.map((runId) => ({ id: runId, changes: { state: 'success' as const }, attempt: 1 })),
      ME,
    );
  }

  it('runs none of the claim, start and end with a generic plan, young or grown', async () => {
    const queued = (from: number, n: number) =>
      Array.from({ length: n }, (_, k) => newRunRow({ id: id(from + k), build, fn: 'f', mode: 'async', input: '{}' }));
    // Young: ten rounds of four runs each on a table of forty.
    await insertRunsIgnoring(store, queued(0, 40));
    for (let r = 0; r < 10; r++) await round(r * 4, r * 4 + 4);
    // Grown: 20,000 runs more, never analyzed, then one more round.
    for (let i = 0; i < 20_000; i += 2_000) await insertRunsIgnoring(store, queued(1_000 + i, 2_000));
    await round(1_000, 1_064);
    const { rows } = await sql<{ statement: string; generic_plans: string; custom_plans: string }>`
      select statement, generic_plans, custom_plans from pg_prepared_statements where statement like '%"runs"%'`.execute(
      store,
    );
    assert.ok(rows.length >= 3, `the claim, start and end are prepared: ${rows.length} statements`);
    for (const row of rows) {
      assert.equal(
        Number(row.generic_plans),
        0,
        `run with a generic plan ${row.generic_plans} times (${row.custom_plans} custom): ${row.statement.slice(0, 120)}`,
      );
    }
    const mode = await sql<{ plan_cache_mode: string }>`show plan_cache_mode`.execute(store);
    assert.equal(mode.rows[0]?.plan_cache_mode, 'force_custom_plan');
  });
});
