/**
 * The condition that lets a query use the partial indexes over runs' state (migration 0010): `state in
 * ('queued', 'running')`, with the values written out. SQLite picks a partial index only when the query
 * has the index's own condition as one of its terms (it does not prove `state = 'queued'` implies it, and
 * bound values would not match a term either), so every query about unfinished runs that should use
 * runs_state, runs_project_state or runs_owner_state adds this term; PostgreSQL reads it the same way.
 */
import { type RawBuilder, type SqlBool, sql } from 'kysely';

/** `state in ('queued', 'running')` on `column` (default `state`; `runs.state` in a join). */
export function unfinishedRun(column: 'state' | 'runs.state' = 'state'): RawBuilder<SqlBool> {
  return sql<SqlBool>`${sql.ref(column)} in ('queued', 'running')`;
}
