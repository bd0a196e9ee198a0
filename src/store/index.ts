/**
 * The store: one Kysely instance over the embedded SQLite file (or PostgreSQL later), migrated at open.
 *
 * Business code receives a `Store` and writes portable Kysely queries; only this folder knows which
 * dialect is underneath.
 */
import path from 'node:path';
import SqliteDatabase from 'better-sqlite3';
import { Kysely, Migrator, PostgresAdapter, PostgresDialect, SqliteDialect } from 'kysely';
import pg from 'pg';
import { migrationProvider } from './migrations.js';
import { isStoreUnavailable, reportingOutages, unreachableAt } from './outage.js';
import type { Database } from './schema.js';

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
const pgTypes = {
  getTypeParser(oid: number, format?: 'text' | 'binary') {
    if (oid === INT8_OID && format !== 'binary') return (value: string) => Number(value);
    // biome-ignore lint/suspicious/noExplicitAny: pg's overloads take the format as a union only at runtime
    return pg.types.getTypeParser(oid, format as any);
  },
} as pg.CustomTypesConfig;

/**
 * Opens the PostgreSQL store at `databaseUrl` and brings its schema up to date. Several processes may
 * start at once: Kysely's migrator takes a lock in the database, so the migrations run exactly once.
 *
 * The driver is node-postgres (`pg`) in its pure-JavaScript mode, the driver Kysely's own PostgreSQL
 * dialect is written for: see docs/scaling-out.md for why it and not postgres.js or libpq.
 */
export async function openPostgresStore(options: { databaseUrl: string; poolSize?: number }): Promise<Store> {
  const pool = new pg.Pool({
    connectionString: options.databaseUrl,
    max: options.poolSize ?? 10,
    types: pgTypes,
    // A server that does not answer is reported (503) rather than waited on forever.
    connectionTimeoutMillis: 10_000,
    application_name: 'ferry',
  });
  // An idle connection that breaks (the server restarted) is dropped from the pool; the next query that
  // needs one opens a new connection. Without a listener this event would end the process.
  pool.on('error', () => {});
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

export interface OpenStoreOptions {
  /** The data directory; the SQLite file is `<dataDir>/ferry.db`. */
  dataDir: string;
}

/** Opens (creating if needed) the embedded SQLite store and brings its schema up to date. */
export async function openSqliteStore(options: OpenStoreOptions): Promise<Store> {
  const file = path.join(options.dataDir, 'ferry.db');
  const sqlite = new SqliteDatabase(file);
  // WAL lets `ferry admin bootstrap` and the CLI read and write while `ferry serve` runs;
  // busy_timeout makes a concurrent writer wait instead of failing with SQLITE_BUSY.
  sqlite.pragma('journal_mode = WAL');
  sqlite.pragma('synchronous = NORMAL');
  sqlite.pragma('busy_timeout = 5000');
  sqlite.pragma('foreign_keys = ON');
  const db = new Kysely<Database>({ dialect: new SqliteDialect({ database: sqlite }) });
  await migrate(db);
  return db;
}

export async function migrate(db: Kysely<Database>): Promise<void> {
  const migrator = new Migrator({ db, provider: migrationProvider });
  const { error, results } = await migrator.migrateToLatest();
  const failed = results?.find((r) => r.status === 'Error');
  if (error || failed) {
    const reason = error instanceof Error ? error.message : String(error ?? failed?.migrationName);
    throw new Error(`Store migration failed: ${reason}`, { cause: error });
  }
}

export { isStoreUnavailable, StoreUnavailableError } from './outage.js';
export type { Database } from './schema.js';
