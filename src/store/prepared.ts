/**
 * The hot statements of a run's life on PostgreSQL (its insert, its start, its end: store/run-inserts.ts,
 * store/run-updates.ts, store/claims.ts) run as named prepared statements: each connection parses a text
 * once, then binds, plans and executes it. Unnamed, the server parsed and planned the group commit's
 * INSERT (36 array parameters) again every time: 575 µs of a backend's CPU per statement of 9 runs against
 * 345 µs prepared (bench/README.md, bench:cluster (c)).
 *
 * They are planned again at every execution all the same (`plan_cache_mode = force_custom_plan`, set on each
 * connection by openPostgresStore). After five executions PostgreSQL may keep one generic plan for a named
 * statement, made for the table as it was then, until runs is next analyzed. Made on a young, near empty
 * runs table, that plan was a sequential scan, and it stayed one while the table grew under load:
 * bench:cluster (c) read 334 to 811 rows per run by sequential scans, its claims took 10.5 ms each (64 runs
 * of 14,000, 3,234 buffers) and its starts 4.9 ms. Planned each time, they read by primary key (an InitPlan,
 * store/claims.ts anyOf) once the table is larger than a few pages; the planning costs the backends about
 * 7 µs per run of bench:async (83-84 against 90-91 µs).
 *
 * A text is named by its hash, so one name never stands for two texts on a connection (node-postgres
 * refuses that). Only texts registered here are prepared, at most MAX_PREPARED of them: the texts that vary
 * with a list's length (SQLite's `in (?, …)`; a few Kysely statements) stay unnamed and cannot fill the
 * server's memory per connection. A connection through PgBouncer in transaction mode needs PgBouncer 1.21
 * or later with `max_prepared_statements` set (docs/scaling-out.md).
 */
import { createHash } from 'node:crypto';

const MAX_PREPARED = 512;
const names = new Map<string, string>();

/** Registers `text` to run as a named prepared statement on PostgreSQL; returns it unchanged. */
export function prepared(text: string): string {
  if (!names.has(text) && names.size < MAX_PREPARED) {
    names.set(text, `ferry_${createHash('sha1').update(text).digest('hex').slice(0, 20)}`);
  }
  return text;
}

/** The statement name of a registered text, or undefined (then it runs unnamed). */
export function preparedName(text: string): string | undefined {
  return names.get(text);
}
