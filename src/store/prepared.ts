/**
 * The hot statements of a run's life on PostgreSQL (its insert, its start, its end: store/run-inserts.ts,
 * store/run-updates.ts, store/claims.ts) run as named prepared statements: each connection parses and plans
 * a text once, then only binds and executes it. Unnamed, the server parsed and planned the group commit's
 * INSERT (36 array parameters) again every time: 575 µs of a backend's CPU per statement of 9 runs against
 * 345 µs prepared (bench/README.md, bench:cluster (c)). Their plans cannot go wrong generically: every one
 * finds its runs by primary key through an InitPlan (store/claims.ts anyOf) or inserts by `unnest`.
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
