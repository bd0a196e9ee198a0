/**
 * Tells a store that cannot be reached from a store that answered with an error: the first is an outage
 * the caller may retry (503 `FERRY_STORE_UNAVAILABLE` with `Retry-After`, src/http/errors.ts), the second
 * a bug (500).
 *
 * Only PostgreSQL is reached over the network: the driver (node-postgres) reports a server that is down,
 * restarting, full or gone by a Node socket error code, a PostgreSQL SQLSTATE, or (for a connection that
 * ends mid-query or never completes) a bare message. `reportingOutages` wraps the pool Kysely uses so that
 * exactly those errors, and only when they come from the store, become a `StoreUnavailableError`: a socket
 * error from a replica or a webhook receiver is not a store outage. (The SQLite file is always there; its
 * lock is another matter, a busy store.)
 */
import type { PostgresCursor, PostgresPool, PostgresPoolClient } from 'kysely';
import type pg from 'pg';
import { preparedName } from './prepared.js';

/** The store could not be reached; `cause` is the driver's error. */
export class StoreUnavailableError extends Error {
  constructor(cause: unknown, message?: string) {
    super(message ?? `The store cannot be reached: ${cause instanceof Error ? cause.message : String(cause)}`, {
      cause,
    });
    this.name = 'StoreUnavailableError';
  }
}

/** Socket errors of a connection attempt or of an open connection (Node's `err.code`). */
const SOCKET_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'ETIMEDOUT',
  'EPIPE',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'EHOSTDOWN',
  'EAI_AGAIN',
]);

/**
 * SQLSTATEs meaning "cannot serve connections now": class 08 (connection exception), 53300
 * too_many_connections, 57P01 admin_shutdown (the backend was terminated, or the server is stopping),
 * 57P02 crash_shutdown, 57P03 cannot_connect_now (starting up, or in recovery).
 */
const SQLSTATES = new Set(['08000', '08001', '08003', '08004', '08006', '53300', '57P01', '57P02', '57P03']);

/** node-postgres's own errors for a connection that ended or never came up; they carry no code. */
const DRIVER_MESSAGES = [
  /^Connection terminated/, // unexpectedly (the server went away mid-query), or due to connection timeout
  /^timeout exceeded when trying to connect$/, // the pool's connectionTimeoutMillis
  /^Client has encountered a connection error and is not queryable$/,
];

/** Whether a driver error says the server cannot serve this connection (see the lists above). */
function isOutage(err: unknown): boolean {
  const errors = err instanceof AggregateError ? [err, ...err.errors] : [err];
  return errors.some((e) => {
    if (!(e instanceof Error)) return false;
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && (SOCKET_CODES.has(code) || SQLSTATES.has(code))) return true;
    return DRIVER_MESSAGES.some((re) => re.test(e.message));
  });
}

function rethrow(err: unknown): never {
  throw isOutage(err) ? new StoreUnavailableError(err) : err;
}

/**
 * The pool as Kysely's PostgreSQL dialect uses it, with connection and query failures that mean an
 * outage thrown as `StoreUnavailableError` (other errors, such as a unique violation, pass unchanged).
 *
 * A connection that failed that way is destroyed when Kysely hands it back, not pooled again: a backend
 * terminated mid-query (57P01) closes its socket only after the error, and would otherwise fail the next
 * query given that connection. And every connection gets an `error` listener for as long as it lives:
 * node-postgres emits `error` on a connection that drops while checked out of the pool (between two
 * queries of a transaction, say), which without a listener would end the process. The queries on it
 * fail all the same and the pool drops it.
 */
export function reportingOutages(pool: pg.Pool): PostgresPool {
  pool.on('connect', (client) => client.on('error', () => {}));
  // One wrapper per pooled client: Kysely keys its connections by the client object.
  const wrappers = new WeakMap<pg.PoolClient, PostgresPoolClient>();
  return {
    async connect() {
      const client = await pool.connect().catch(rethrow);
      let wrapper = wrappers.get(client);
      if (!wrapper) {
        let broken: Error | undefined;
        const failed = (err: unknown): never => {
          if (isOutage(err)) broken = err as Error;
          return rethrow(err);
        };
        const query = (sqlOrCursor: string | PostgresCursor<unknown>, parameters?: ReadonlyArray<unknown>) => {
          if (typeof sqlOrCursor === 'string') {
            const name = preparedName(sqlOrCursor);
            const values = parameters as unknown[];
            return (
              name === undefined ? client.query(sqlOrCursor, values) : client.query({ name, text: sqlOrCursor, values })
            ).catch(failed);
          }
          const cursor = client.query(sqlOrCursor as unknown as pg.Submittable) as unknown as PostgresCursor<unknown>;
          return { read: (n: number) => cursor.read(n).catch(failed), close: () => cursor.close() };
        };
        wrapper = {
          query: query as PostgresPoolClient['query'],
          release: () => {
            const err = broken;
            broken = undefined;
            if (err) wrappers.delete(client);
            client.release(err);
          },
        };
        wrappers.set(client, wrapper);
      }
      return wrapper;
    },
    end: () => pool.end(),
  };
}

/** Whether `err`, or an error in its `cause` chain, is a `StoreUnavailableError`. */
export function isStoreUnavailable(err: unknown): boolean {
  let e = err;
  for (let depth = 0; depth < 8 && e instanceof Error; depth++) {
    if (e instanceof StoreUnavailableError) return true;
    e = e.cause;
  }
  return false;
}

/**
 * The error for a store that could not be opened because the database cannot be reached: names the
 * database (without its password) and the driver's reason, e.g. "Cannot reach the PostgreSQL store at
 * postgres://ferry@db:5432/ferry: connect ECONNREFUSED 10.0.0.5:5432".
 */
export function unreachableAt(databaseUrl: string, err: unknown): StoreUnavailableError {
  let e = err;
  while (e instanceof Error && !(e instanceof StoreUnavailableError)) e = e.cause;
  const driver = e instanceof StoreUnavailableError ? e.cause : err;
  const reason = driver instanceof Error ? driver.message : String(driver);
  return new StoreUnavailableError(
    driver,
    `Cannot reach the PostgreSQL store at ${withoutPassword(databaseUrl)}: ${reason}`,
  );
}

/** The URL with its password (if any) replaced by ***, for messages and logs. */
export function withoutPassword(databaseUrl: string): string {
  try {
    const url = new URL(databaseUrl);
    if (url.password) url.password = '***';
    return url.toString();
  } catch {
    return '(the database URL)';
  }
}
