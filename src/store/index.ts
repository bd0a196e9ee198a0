/**
 * The store: one Kysely instance over the embedded SQLite file (sqlite.ts) or PostgreSQL, migrated at open.
 *
 * Business code receives a `Store` and writes portable Kysely queries; only this folder knows which
 * dialect is underneath.
 */
import { Kysely, PostgresAdapter, PostgresDialect, sql } from 'kysely';
import type pg from 'pg';
import { migrate } from './migrate.js';
import { isStoreUnavailable, reportingOutages, unreachableAt } from './outage.js';
import type { Database } from './schema.js';
import { type OpenSqliteStoreOptions, openSqliteStore, probeSqlite } from './sqlite.js';

export type Store = Kysely<Database>;

/** Which database is underneath a store (or a transaction of it). */
export type StoreDialect = 'sqlite' | 'postgres';

/**
 * The dialect under `db` (a store or one of its transactions). Only `src/store/` may branch on it: business
 * code asks for an operation (a claim, a lock) from this folder and never writes dialect-specific SQL.
 */
export function dialectOf(db: Kysely<Database>): StoreDialect {
  return db.getExecutor().adapter instanceof PostgresAdapter ? 'postgres' : 'sqlite';
}

/**
 * Whether the store writes one statement at a time (SQLite: one connection, one writer). Writes that must
 * be committed soon are then best put in one transaction, since each waits for the one before it anyway;
 * on PostgreSQL they run side by side on connections of the pool, and joining them would make one wait.
 */
export function writesOneAtATime(db: Kysely<Database>): boolean {
  return dialectOf(db) === 'sqlite';
}

/**
 * Opens the store the settings name: PostgreSQL when `databaseUrl` is set (`--database-url`,
 * `FERRY_DATABASE_URL`), else the embedded SQLite file in the data directory.
 */
export async function openStore(options: OpenStoreOptions & { databaseUrl?: string | undefined }): Promise<Store> {
  if (options.databaseUrl) return openPostgresStore({ databaseUrl: options.databaseUrl });
  return openSqliteStore(options);
}

/** The OIDs of PostgreSQL's 64-bit integer type: `bigint` columns and every COUNT(*). */
const INT8_OID = 20;

/**
 * Type parsers for the PostgreSQL driver: `bigint` (and COUNT) arrive as numbers, as they do from SQLite,
 * so business code sees the same types on both. Ferry's bigints (byte counts, row counts) stay far below
 * 2^53.
 */
function pgTypes(driver: typeof pg): pg.CustomTypesConfig {
  return {
    getTypeParser(oid: number, format?: 'text' | 'binary') {
      if (oid === INT8_OID && format !== 'binary') return (value: string) => Number(value);
      // biome-ignore lint/suspicious/noExplicitAny: pg's overloads take the format as a union only at runtime
      return driver.types.getTypeParser(oid, format as any);
    },
  } as pg.CustomTypesConfig;
}

/**
 * Opens the PostgreSQL store at `databaseUrl` and brings its schema up to date. Several processes may
 * start at once: Kysely's migrator takes a lock in the database, so the migrations run exactly once.
 *
 * The driver is node-postgres (`pg`) in its pure-JavaScript mode, the driver Kysely's own PostgreSQL
 * dialect is written for: see docs/scaling-out.md for why it and not postgres.js or libpq.
 */
/** How long PostgreSQL lets one of Ferry's sessions sit idle inside a transaction before ending it. */
export const PG_IDLE_IN_TRANSACTION_MS = 15_000;

export async function openPostgresStore(options: { databaseUrl: string; poolSize?: number }): Promise<Store> {
  // Loaded here: a server on SQLite never loads the PostgreSQL driver.
  const { default: driver } = await import('pg');
  const pool = new driver.Pool({
    connectionString: options.databaseUrl,
    max: options.poolSize ?? 10,
    types: pgTypes(driver),
    // A server that does not answer is reported (503) rather than waited on forever.
    connectionTimeoutMillis: 10_000,
    application_name: 'ferry',
    // A process frozen inside a transaction (SIGSTOP, a stalled VM) would hold its row locks for as long
    // as it is frozen, and the recovery of its runs would wait on them: the server ends such a session
    // (and its transaction) after this long. Ferry's own transactions never wait on anything but the store.
    idle_in_transaction_session_timeout: PG_IDLE_IN_TRANSACTION_MS,
  });
  // An idle connection that breaks (the server restarted) is dropped from the pool; the next query that
  // needs one opens a new connection. Without a listener this event would end the process.
  pool.on('error', () => {});
  // Every statement is planned for the table as it is when it runs (store/prepared.ts says why): queued on
  // the new connection before anything the pool hands it out for. A server that refuses (none Ferry
  // supports) keeps its default.
  pool.on('connect', (client) => {
    client.query('set plan_cache_mode = force_custom_plan').catch(() => {});
  });
  // Errors meaning the server cannot be reached are thrown as StoreUnavailableError (a 503, not a 500).
  const db = new Kysely<Database>({ dialect: new PostgresDialect({ pool: reportingOutages(pool) }) });
  try {
    await migrate(db);
  } catch (err) {
    await db.destroy();
    throw isStoreUnavailable(err) ? unreachableAt(options.databaseUrl, err) : err;
  }
  return db;
}

/** What `/healthz` reports of the store: see probeStore. */
export type StoreHealth = 'ok' | 'busy' | 'unresponsive';

/**
 * Probes the store for `/healthz`, answering within about `timeoutMs` whatever the store does: `ok`;
 * `busy` when SQLite's file is write-locked by another process (reads still answer; writes wait up to the
 * busy timeout, then 503); `unresponsive` when the store did not answer in time. Throws when it failed.
 */
export async function probeStore(db: Store, timeoutMs: number): Promise<StoreHealth> {
  const sqlite = probeSqlite(db, timeoutMs);
  if (sqlite) return sqlite;
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'unresponsive'>((resolve) => {
    timer = setTimeout(() => resolve('unresponsive'), timeoutMs);
  });
  try {
    return await Promise.race([sql`select 1`.execute(db).then(() => 'ok' as const), late]);
  } finally {
    clearTimeout(timer);
  }
}

export { migrate } from './migrate.js';
export { isStoreUnavailable, StoreUnavailableError } from './outage.js';
export type { Database } from './schema.js';
export { openSqliteStore } from './sqlite.js';

export type OpenStoreOptions = OpenSqliteStoreOptions;
