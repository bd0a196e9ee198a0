/**
 * The conditions that let a query use the partial indexes over runs' state: `state in ('queued',
 * 'running')` (migration 0010), `state <> 'success'` and `dead = 1` (migration 0016), with the values
 * written out. SQLite picks a partial index only when the query
 * has the index's own condition as one of its terms (it does not prove `state = 'queued'` implies it, and
 * bound values would not match a term either), so every query about unfinished runs that should use
 * runs_state, runs_project_state or runs_owner_state adds this term; PostgreSQL reads it the same way.
 * The lists of an app's runs filtered by an unsuccessful end or by `dead` add theirs (runs/runs.ts).
 */
import { type RawBuilder, type SqlBool, sql } from 'kysely';

/** `state in ('queued', 'running')` on `column` (default `state`; `runs.state` in a join). */
export function unfinishedRun(column: 'state' | 'runs.state' = 'state'): RawBuilder<SqlBool> {
  return sql<SqlBool>`${sql.ref(column)} in ('queued', 'running')`;
}

/** `runs.state <> 'success'`: the condition of runs_app_state (queued, running and unsuccessful runs). */
export function notSuccessRun(): RawBuilder<SqlBool> {
  return sql<SqlBool>`runs.state <> 'success'`;
}

/** `runs.dead = 1`: the condition of runs_app_dead (a bound 1 would not match it on SQLite). */
export function deadRun(): RawBuilder<SqlBool> {
  return sql<SqlBool>`runs.dead = 1`;
}

/**
 * Conditions on a run's owner and state that no index can serve, for the statements that name their runs by
 * id: those must find the rows by primary key and test owner and state on the rows found, at a cost bounded
 * by the ids asked for. Written plainly (`owner = $owner and state = 'queued'`), PostgreSQL planned them
 * through the small partial indexes over unfinished runs (runs_owner_state, runs_state) whenever its
 * statistics of runs were missing or stale (a young database under load), and read every run the node
 * holds, or the whole backlog of free queued runs, to keep the few asked for (bench/README.md,
 * bench:cluster (c)). `coalesce` hides the column from the planner (a node id is never empty, a state
 * never null); `is not distinct from null` would not, PostgreSQL reads it back as `is null`. Used by
 * store/claims.ts, and by the raw statements of run-inserts.ts and run-updates.ts.
 */
export function hiddenColumn(column: 'owner' | 'state', table?: string): string {
  return `coalesce(${table ? `${table}.` : ''}"${column}", '')`;
}
