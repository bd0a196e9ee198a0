/**
 * The store: one Kysely instance over the embedded SQLite file (or PostgreSQL later), migrated at open.
 *
 * Business code receives a `Store` and writes portable Kysely queries; only this folder knows which
 * dialect is underneath.
 */
import path from 'node:path';
import SqliteDatabase from 'better-sqlite3';
import { Kysely, Migrator, PostgresAdapter, SqliteDialect } from 'kysely';
import { migrationProvider } from './migrations.js';
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

/** Opens the PostgreSQL store at `databaseUrl` and brings its schema up to date. */
export async function openPostgresStore(_options: { databaseUrl: string }): Promise<Store> {
  throw new Error('The PostgreSQL store is not built yet');
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

export type { Database } from './schema.js';
