/**
 * The embedded SQLite store: better-sqlite3 under Kysely, through a driver of our own that never lets
 * SQLite wait for a lock on the event loop.
 *
 * better-sqlite3 is synchronous. With SQLite's own `busy_timeout`, a statement that finds the file locked
 * by another process (`sqlite3`, `ferry admin`, a backup) sleeps inside the call, and the whole server
 * (every route, `/healthz` included) stalls with it. Here `busy_timeout` is 0: a locked file fails the
 * statement at once with SQLITE_BUSY, and the driver retries it from a timer (1 ms, doubling to 50 ms)
 * until `busyTimeoutMs` (FERRY_STORE_BUSY_TIMEOUT_MS) has passed, then throws FERRY_STORE_BUSY (503,
 * `Retry-After`). A statement that succeeds at once costs no promise or timer more than Kysely's own driver.
 *
 * Transactions begin with `BEGIN IMMEDIATE`, which takes the write lock at the start: only the BEGIN can
 * then be busy, and retrying it is safe. (A deferred transaction that has read and then fails to upgrade
 * to a write lock cannot be saved by retrying one statement.)
 *
 * SQLite has one connection here, guarded by a mutex as in Kysely's own driver. A statement outside a
 * transaction (or a BEGIN) gives the connection up while it waits for its next try, so reads, the health
 * probe and other requests go on meanwhile; code that needs statements to run with nothing in between
 * uses a transaction, as it must anyway with other processes on the file.
 */
import fs from 'node:fs';
import path from 'node:path';
import SqliteDatabase from 'better-sqlite3';
import {
  CompiledQuery,
  type DatabaseConnection,
  type DatabaseIntrospector,
  type Dialect,
  type DialectAdapter,
  type Driver,
  Kysely,
  type QueryCompiler,
  type QueryResult,
  SelectQueryNode,
  SqliteAdapter,
  SqliteIntrospector,
  SqliteQueryCompiler,
} from 'kysely';
import { FerryError } from '../errors.js';
import { migrate } from './migrate.js';
import type { Database } from './schema.js';
import { SqliteCheckpointer, type SqliteCheckpointerOptions } from './sqlite-checkpointer.js';

/** FERRY_STORE_BUSY_TIMEOUT_MS's default: how long a statement waits for a locked file before a 503. */
export const DEFAULT_BUSY_TIMEOUT_MS = 5000;
const FIRST_RETRY_MS = 1;
const MAX_RETRY_MS = 50;
/** Prepared statements kept per connection (Kysely's driver prepares every statement anew). */
const STATEMENT_CACHE_SIZE = 500;

export interface OpenSqliteStoreOptions {
  /** The data directory; the SQLite file is `<dataDir>/ferry.db`. */
  dataDir: string;
  /** How long a statement retries while the file is locked before FERRY_STORE_BUSY (default 5000). */
  busyTimeoutMs?: number | undefined;
  /**
   * Checkpoint the write-ahead log in a thread of its own, not in the commits of the server's thread
   * (sqlite-checkpointer.ts): what a server sets; a short-lived command keeps SQLite's default.
   */
  checkpointInThread?: SqliteCheckpointerOptions | undefined;
}

/**
 * Opens (creating if needed) the embedded SQLite store and brings its schema up to date. A statement that
 * finds the file locked by another process waits off the event loop, up to `busyTimeoutMs`, then fails
 * with FERRY_STORE_BUSY.
 */
export async function openSqliteStore(options: OpenSqliteStoreOptions): Promise<Kysely<Database>> {
  const busyTimeoutMs = options.busyTimeoutMs ?? DEFAULT_BUSY_TIMEOUT_MS;
  const file = path.join(options.dataDir, 'ferry.db');
  const sqlite = new SqliteDatabase(file);
  // For Ferry's user alone, whatever the umask: the data directory may be searchable by the sandboxes'
  // uids (sandbox/views.ts, `<data>/staging`). SQLite gives the -wal and -shm files the database's mode.
  for (const one of [file, `${file}-wal`, `${file}-shm`]) {
    try {
      if ((fs.statSync(one).mode & 0o077) !== 0) fs.chmodSync(one, 0o600);
    } catch {
      // Not there yet (made with the database's mode), or not ours to change: left as it is.
    }
  }
  // Opening happens once, before the server listens: here SQLite may wait for a lock itself.
  sqlite.pragma(`busy_timeout = ${busyTimeoutMs}`);
  // WAL lets `ferry admin bootstrap` and the CLI read and write while `ferry serve` runs, and readers are
  // not blocked by another process's write transaction.
  sqlite.pragma('journal_mode = WAL');
  sqlite.pragma('synchronous = NORMAL');
  sqlite.pragma('foreign_keys = ON');
  // From now on a locked file fails at once; the driver waits, off the event loop.
  sqlite.pragma('busy_timeout = 0');
  const checkpointer = options.checkpointInThread
    ? new SqliteCheckpointer(sqlite, file, options.checkpointInThread)
    : undefined;
  const db = new Kysely<Database>({ dialect: new BusyRetryingSqliteDialect(sqlite, busyTimeoutMs, checkpointer) });
  try {
    await migrate(db);
  } catch (err) {
    await db.destroy();
    throw err;
  }
  return db;
}

/** What the health probe found (see probeSqlite). */
export type SqliteProbe = 'ok' | 'busy' | 'unresponsive';

const drivers = new WeakMap<DialectAdapter, BusyRetryingSqliteDriver>();

/**
 * Probes an SQLite store for `/healthz` without waiting on a lock: `busy` while another process holds
 * the write lock (reads still work), `unresponsive` when the connection is not free within `timeoutMs`,
 * undefined when `db` is not a store opened here. Throws when SQLite fails otherwise.
 */
export function probeSqlite(db: Kysely<Database>, timeoutMs: number): Promise<SqliteProbe> | undefined {
  return drivers.get(db.getExecutor().adapter)?.probe(timeoutMs);
}

/** Kysely's SQLite dialect with BusyRetryingSqliteDriver in place of its driver. */
class BusyRetryingSqliteDialect implements Dialect {
  readonly #driver: BusyRetryingSqliteDriver;

  constructor(sqlite: SqliteDatabase.Database, busyTimeoutMs: number, checkpointer?: SqliteCheckpointer) {
    this.#driver = new BusyRetryingSqliteDriver(sqlite, busyTimeoutMs, checkpointer);
  }
  createDriver(): Driver {
    return this.#driver;
  }
  createQueryCompiler(): QueryCompiler {
    return new SqliteQueryCompiler();
  }
  createAdapter(): DialectAdapter {
    const adapter = new SqliteAdapter();
    drivers.set(adapter, this.#driver);
    return adapter;
  }
  createIntrospector(db: Kysely<unknown>): DatabaseIntrospector {
    return new SqliteIntrospector(db);
  }
}

/** A FIFO lock on the one connection; a waiter may give up (lockWithin) without taking it later. */
class Mutex {
  #held = false;
  readonly #waiters: Array<() => void> = [];

  lock(): Promise<void> {
    if (!this.#held) {
      this.#held = true;
      return Promise.resolve();
    }
    return new Promise((resolve) => this.#waiters.push(resolve));
  }

  /** Resolves true once locked, or false after `ms` (and then never takes the lock). */
  lockWithin(ms: number): Promise<boolean> {
    if (!this.#held) {
      this.#held = true;
      return Promise.resolve(true);
    }
    return new Promise((resolve) => {
      const waiter = () => {
        clearTimeout(timer);
        resolve(true);
      };
      const timer = setTimeout(() => {
        const at = this.#waiters.indexOf(waiter);
        if (at >= 0) this.#waiters.splice(at, 1);
        resolve(false);
      }, ms);
      this.#waiters.push(waiter);
    });
  }

  unlock(): void {
    const next = this.#waiters.shift();
    if (next) next();
    else this.#held = false;
  }
}

function isBusy(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === 'string' && (code.startsWith('SQLITE_BUSY') || code.startsWith('SQLITE_LOCKED'));
}

function storeBusy(waitedMs: number, cause: unknown): FerryError {
  const waited = waitedMs > 0 ? ` (waited ${waitedMs} ms)` : '';
  return new FerryError(
    'FERRY_STORE_BUSY',
    `The store is busy: another process holds a lock on the database${waited}; retry later`,
    { cause, headers: { 'retry-after': '1' } },
  );
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

class BusyRetryingSqliteDriver implements Driver {
  readonly #db: SqliteDatabase.Database;
  readonly #mutex = new Mutex();
  readonly #connection: BusyRetryingConnection;
  readonly #checkpointer: SqliteCheckpointer | undefined;

  constructor(db: SqliteDatabase.Database, busyTimeoutMs: number, checkpointer?: SqliteCheckpointer) {
    this.#db = db;
    this.#connection = new BusyRetryingConnection(db, this.#mutex, busyTimeoutMs);
    this.#checkpointer = checkpointer;
    checkpointer?.holdWith(async () => {
      await this.#mutex.lock();
      return () => this.#mutex.unlock();
    });
  }

  async init(): Promise<void> {}

  async acquireConnection(): Promise<DatabaseConnection> {
    await this.#mutex.lock();
    return this.#connection;
  }

  async beginTransaction(connection: DatabaseConnection): Promise<void> {
    // IMMEDIATE: the write lock is taken here or not at all, so a busy file fails only this statement.
    await connection.executeQuery(CompiledQuery.raw('begin immediate'));
  }

  async commitTransaction(connection: DatabaseConnection): Promise<void> {
    await connection.executeQuery(CompiledQuery.raw('commit'));
  }

  async rollbackTransaction(connection: DatabaseConnection): Promise<void> {
    // After some errors SQLite has rolled the transaction back itself (SQLITE_FULL, SQLITE_IOERR,
    // SQLITE_NOMEM: sqlite.org/lang_transaction.html): a ROLLBACK then fails with "no transaction is
    // active", and Kysely would throw that instead of the statement's own error, which says what happened
    // (issue 43: a full disk answered 500 FERRY_INTERNAL instead of 507 FERRY_STORAGE_FULL).
    if (this.#db.inTransaction) await connection.executeQuery(CompiledQuery.raw('rollback'));
  }

  async releaseConnection(): Promise<void> {
    this.#mutex.unlock();
  }

  async destroy(): Promise<void> {
    await this.#checkpointer?.close();
    this.#db.close();
  }

  /** See probeSqlite. */
  async probe(timeoutMs: number): Promise<SqliteProbe> {
    if (!(await this.#mutex.lockWithin(timeoutMs))) return 'unresponsive';
    try {
      return this.#connection.probe();
    } finally {
      this.#mutex.unlock();
    }
  }
}

/** Most parameters a statement is given as separate arguments (see #run). */
const SPREAD_MAX = 16_384;

class BusyRetryingConnection implements DatabaseConnection {
  readonly #db: SqliteDatabase.Database;
  readonly #mutex: Mutex;
  readonly #busyTimeoutMs: number;
  readonly #statements = new Map<string, SqliteDatabase.Statement>();
  /** Statements waiting now for their next try. */
  #waiting = 0;
  /** A statement found the file locked and no write has succeeded since. */
  #sawBusy = false;

  constructor(db: SqliteDatabase.Database, mutex: Mutex, busyTimeoutMs: number) {
    this.#db = db;
    this.#mutex = mutex;
    this.#busyTimeoutMs = busyTimeoutMs;
  }

  executeQuery<R>(query: CompiledQuery): Promise<QueryResult<R>> {
    try {
      return Promise.resolve(this.#run<R>(query));
    } catch (err) {
      if (!isBusy(err)) return Promise.reject(err);
      return this.#retry<R>(query, err);
    }
  }

  async *streamQuery<R>(query: CompiledQuery): AsyncIterableIterator<QueryResult<R>> {
    if (!SelectQueryNode.is(query.query)) throw new Error('Sqlite driver only supports streaming of select queries');
    // Not from the cache: a statement that is being iterated cannot run anything else meanwhile.
    const iterator = this.#db.prepare(query.sql).iterate(query.parameters as unknown[]) as IterableIterator<R>;
    try {
      for (const row of iterator) yield { rows: [row] };
    } catch (err) {
      throw isBusy(err) ? storeBusy(0, err) : err;
    }
  }

  /** Runs the statement once, synchronously; throws SQLite's error as it is. */
  #run<R>(query: CompiledQuery): QueryResult<R> {
    let stmt = this.#statements.get(query.sql);
    if (!stmt) {
      stmt = this.#db.prepare(query.sql);
      if (this.#statements.size >= STATEMENT_CACHE_SIZE) {
        const oldest = this.#statements.keys().next().value;
        if (oldest !== undefined) this.#statements.delete(oldest);
      }
      this.#statements.set(query.sql, stmt);
    }
    const parameters = query.parameters as unknown[];
    if (stmt.reader) return { rows: stmt.all(parameters) as R[] };
    // As arguments, not one array: better-sqlite3 reads an array's values one property get at a time, about
    // 0.7 µs of a run's 27-value row (issue 15, bench/README.md); a batch's thousands of arguments are well
    // within what a call takes, and past SPREAD_MAX (never reached by the store's own batches) the array is used.
    const { changes, lastInsertRowid } =
      parameters.length <= SPREAD_MAX ? stmt.run(...parameters) : stmt.run(parameters);
    this.#sawBusy = false;
    return { numAffectedRows: BigInt(changes), insertId: BigInt(lastInsertRowid), rows: [] };
  }

  /**
   * Tries a statement that found the file locked again from a timer until the busy timeout. Outside a
   * transaction (a single statement or a BEGIN) the connection is given up between tries. Inside one, only
   * a COMMIT is retried (holding the connection, whose transaction is in progress): SQLite's advice for any
   * other statement is to roll back, which Kysely does when this throws.
   */
  async #retry<R>(query: CompiledQuery, first: unknown): Promise<QueryResult<R>> {
    this.#sawBusy = true;
    const inTransaction = this.#db.inTransaction;
    if (inTransaction && !/^\s*commit\b/i.test(query.sql)) throw storeBusy(0, first);
    const started = Date.now();
    const deadline = started + this.#busyTimeoutMs;
    let delay = FIRST_RETRY_MS;
    let last = first;
    this.#waiting += 1;
    try {
      for (;;) {
        const left = deadline - Date.now();
        if (left <= 0) throw storeBusy(Date.now() - started, last);
        if (inTransaction) await sleep(Math.min(delay, left));
        else {
          this.#mutex.unlock();
          try {
            await sleep(Math.min(delay, left));
          } finally {
            // Kysely releases the connection after this returns or throws: hold it again either way.
            await this.#mutex.lock();
          }
        }
        try {
          const result = this.#run<R>(query);
          this.#sawBusy = false;
          return result;
        } catch (err) {
          if (!isBusy(err)) throw err;
          last = err;
        }
        delay = Math.min(delay * 2, MAX_RETRY_MS);
      }
    } finally {
      this.#waiting -= 1;
    }
  }

  /**
   * The health probe, run holding the connection. A statement waiting for the lock means busy. After a
   * busy spell it checks whether the write lock is free now (BEGIN IMMEDIATE, then ROLLBACK: never
   * waiting); otherwise it reads the schema, as any request would.
   */
  probe(): SqliteProbe {
    if (this.#waiting > 0) return 'busy';
    try {
      if (this.#sawBusy && !this.#db.inTransaction) {
        this.#db.exec('BEGIN IMMEDIATE');
        this.#db.exec('ROLLBACK');
        this.#sawBusy = false;
      } else {
        this.#db.prepare('SELECT count(*) FROM sqlite_master').get();
      }
      return 'ok';
    } catch (err) {
      if (isBusy(err)) return 'busy';
      throw err;
    }
  }
}
