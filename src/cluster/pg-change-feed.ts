/**
 * The change feed over PostgreSQL LISTEN/NOTIFY, for processes that share a PostgreSQL store.
 *
 * One dedicated `pg.Client` per process listens on the channel (a pooled connection cannot: LISTEN
 * belongs to a session, and a pool hands sessions around). Publishing goes through a separate
 * one-connection pool, so a broken listener never stops this process's changes reaching the others.
 * Each message is `{"origin": <this feed's id>, "event": {...}}`; a process skips its own messages,
 * having told its subscribers already when it published.
 *
 * NOTIFY is fire-and-forget: a process whose listener is down misses what is sent meanwhile. So the
 * listener reconnects with back-off (and a ping notices a connection that died silently), and after any
 * break it tells its subscribers `resync`: everything may have changed.
 *
 * Needs a session connection: through a pooler in transaction mode (PgBouncer's default) LISTEN
 * succeeds but no notification ever arrives.
 */
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import type { Logger } from 'pino';
import { type ChangeFeed, createFanOut, parseChangeEvent } from './change-feed.js';

export const CHANGE_CHANNEL = 'ferry_changes';
/** How the listener's connection is named in pg_stat_activity (operators, and the reconnect test, find it so). */
export const LISTENER_APPLICATION_NAME = 'ferry-changes';

export interface PgChangeFeedOptions {
  databaseUrl: string;
  logger: Logger;
  /** First wait before reconnecting, doubled after each failed attempt up to `maxBackoffMs`. */
  minBackoffMs?: number;
  maxBackoffMs?: number;
  /** How often the listener's connection is checked with a query (a dead peer sends no error). */
  pingEveryMs?: number;
}

/** NOTIFY payloads must stay under 8000 bytes; Ferry's events are a few hundred. */
const MAX_PAYLOAD_BYTES = 7900;

/**
 * Starts listening and returns the feed. A first connection that fails is retried in the background
 * (start does not wait on it); the subscribers then get `resync` once it is up.
 */
export async function createPgChangeFeed(options: PgChangeFeedOptions): Promise<ChangeFeed> {
  const { databaseUrl, logger } = options;
  const minBackoffMs = options.minBackoffMs ?? 100;
  const maxBackoffMs = options.maxBackoffMs ?? 5000;
  const pingEveryMs = options.pingEveryMs ?? 10_000;
  const origin = randomUUID();
  const fanOut = createFanOut(logger);
  // Loaded here: a server on SQLite never loads the PostgreSQL driver.
  const { default: pgDriver } = await import('pg');
  const publisher = new pgDriver.Pool({
    connectionString: databaseUrl,
    max: 1,
    idleTimeoutMillis: 30_000,
    connectionTimeoutMillis: 10_000,
    application_name: 'ferry-changes-publish',
  });
  // An idle connection that breaks is dropped; the next publish opens another.
  publisher.on('error', () => {});

  let listener: pg.Client | undefined;
  let closed = false;
  let failures = 0;
  /** Set by a break or a failed attempt: the next connection must tell subscribers `resync`. */
  let missed = false;
  let retry: NodeJS.Timeout | undefined;

  function receive(payload: string | undefined): void {
    let message: { origin?: unknown; event?: unknown };
    try {
      message = JSON.parse(payload ?? '') as typeof message;
    } catch {
      logger.warn('ignored a change notification that is not JSON');
      return;
    }
    if (message.origin === origin) return;
    const event = parseChangeEvent(message.event);
    if (!event) {
      // Another version of Ferry may send events this one does not know: caches still expire on their own.
      logger.warn({ payload: payload?.slice(0, 200) }, 'ignored an unknown change notification');
      return;
    }
    fanOut.deliver(event);
  }

  function broken(client: pg.Client, reason: string): void {
    if (listener !== client) return; // already handled, or closing
    listener = undefined;
    missed = true;
    logger.warn({ reason }, 'change feed: lost the PostgreSQL listener connection; reconnecting');
    client.end().catch(() => {});
    schedule();
  }

  function schedule(): void {
    if (closed || retry) return;
    const backoff = Math.min(maxBackoffMs, minBackoffMs * 2 ** Math.min(failures, 16));
    // Jitter, so a fleet that lost its database together does not reconnect in lockstep.
    const delay = backoff / 2 + Math.random() * (backoff / 2);
    retry = setTimeout(() => {
      retry = undefined;
      connect().catch((err: unknown) => {
        failures++;
        missed = true;
        logger.warn({ err, failures }, 'change feed: cannot reach PostgreSQL to listen; retrying');
        schedule();
      });
    }, delay);
    retry.unref();
  }

  async function connect(): Promise<void> {
    const client = new pgDriver.Client({
      connectionString: databaseUrl,
      application_name: LISTENER_APPLICATION_NAME,
      keepAlive: true,
      connectionTimeoutMillis: 10_000,
    });
    client.on('error', (err) => broken(client, err.message));
    client.on('end', () => broken(client, 'connection ended'));
    client.on('notification', (message) => {
      if (listener === client && message.channel === CHANGE_CHANNEL) receive(message.payload);
    });
    try {
      await client.connect();
      await client.query(`LISTEN ${CHANGE_CHANNEL}`);
    } catch (err) {
      await client.end().catch(() => {});
      throw err;
    }
    if (closed) {
      await client.end().catch(() => {});
      return;
    }
    listener = client;
    failures = 0;
    if (missed) {
      missed = false;
      logger.info('change feed: listening again; treating everything as changed');
      fanOut.deliver({ type: 'resync', reason: 'the change feed reconnected; changes sent meanwhile were lost' });
    }
  }

  const ping = setInterval(() => {
    const client = listener;
    if (!client) return;
    const timeout = setTimeout(() => broken(client, 'ping timed out'), Math.min(5000, pingEveryMs));
    client
      .query('SELECT 1')
      .catch((err: unknown) => broken(client, (err as Error).message))
      .finally(() => clearTimeout(timeout));
  }, pingEveryMs);
  ping.unref();

  try {
    await connect();
  } catch (err) {
    missed = true;
    logger.warn({ err }, 'change feed: cannot reach PostgreSQL to listen; retrying');
    schedule();
  }

  return {
    async publish(event) {
      if (closed) return;
      fanOut.deliver(event);
      const payload = JSON.stringify({ origin, event });
      if (Buffer.byteLength(payload) > MAX_PAYLOAD_BYTES) {
        logger.error({ event: event.type }, 'change feed: event too large to send; other processes learn late');
        return;
      }
      try {
        await publisher.query('SELECT pg_notify($1, $2)', [CHANGE_CHANNEL, payload]);
      } catch (err) {
        // Other processes' caches expire within a second on their own; the change itself is committed.
        logger.warn({ err, event: event.type }, 'change feed: could not tell the other processes');
      }
    },
    subscribe: (handler) => fanOut.subscribe(handler),
    async close() {
      closed = true;
      clearInterval(ping);
      if (retry) clearTimeout(retry);
      fanOut.clear();
      const client = listener;
      listener = undefined;
      await client?.end().catch(() => {});
      await publisher.end().catch(() => {});
    },
  };
}
