/**
 * The UPDATE of one run record by the recorder (a run's state changes: running, then its end), the second
 * hottest statement of the store after the INSERT (run-inserts.ts). Built with Kysely per run it is parsed
 * into a query tree and compiled to text every time; the text depends only on the dialect, the columns
 * changed and the fence, so it is compiled by Kysely once per shape and kept (a few dozen shapes at most:
 * the recorder changes the same groups of columns), and later updates pass only their parameters.
 *
 * Every update is fenced (ARCHITECTURE invariant 7: once a run is settled nothing rewrites it): it changes
 * the run only while it is unfinished, held by `owner`, and, for an async run this node started, still in
 * the very start it made (`running` with `attempts` = that start). Recovery (cluster/recovery.ts) ends a
 * dead node's running run (a final state) or queues it again (not `running`; its next start counts one
 * more attempt), so a node that was frozen past its lease and comes back changes nothing of it.
 */
import { CompiledQuery, type Kysely, type SqlBool, sql } from 'kysely';
import { dialectOf } from './index.js';
import type { Database, Run } from './schema.js';
import { unfinishedRun } from './unfinished.js';

/** Statement texts by dialect, columns and fencing. */
const texts = new Map<string, string>();
/** Bounds the cache should a caller change columns in ever new combinations. */
const MAX_SHAPES = 256;

/**
 * `UPDATE runs SET <changes> WHERE id = ? AND <fence>`: the number of rows it changed (0: no such run, or
 * the fence refused it: the run is settled, another node holds it, or it is no longer in `attempt`); null
 * when no column has a value to set (columns whose value is undefined are left alone, as Kysely does), and
 * no statement is run. The fence: `state in ('queued', 'running')`, `owner = ?` when `owner` is given, and
 * `state = 'running' and attempts = ?` when `attempt` is (the start that this node's change belongs to).
 */
export async function updateRun(
  db: Kysely<Database>,
  id: string,
  changes: Partial<Omit<Run, 'id'>>,
  owner?: string,
  attempt?: number,
): Promise<number | null> {
  const columns = (Object.keys(changes) as Array<keyof typeof changes>).filter((c) => changes[c] !== undefined).sort();
  if (columns.length === 0) return null;
  const params: unknown[] = columns.map((c) => changes[c]);
  params.push(id);
  if (owner !== undefined) params.push(owner);
  if (attempt !== undefined) params.push(attempt);
  const key = `${dialectOf(db)}:${owner !== undefined ? 'o' : ''}:${attempt !== undefined ? 'a' : ''}:${columns.join(',')}`;
  const text = texts.get(key);
  let query: CompiledQuery;
  if (text !== undefined) query = CompiledQuery.raw(text, params);
  else {
    const set: Record<string, unknown> = {};
    for (const c of columns) set[c] = changes[c];
    let update = db.updateTable('runs').set(set).where('id', '=', id);
    if (owner !== undefined) update = update.where('owner', '=', owner);
    update =
      attempt !== undefined
        ? update.where(sql<SqlBool>`state = 'running'`).where('attempts', '=', attempt)
        : update.where(unfinishedRun());
    query = update.compile();
    // Kept only if Kysely's parameters are ours in our order, so a later update can pass its own.
    const same = query.parameters.length === params.length && query.parameters.every((p, i) => p === params[i]);
    if (same && texts.size < MAX_SHAPES) texts.set(key, query.sql);
  }
  const result = await db.executeQuery(query);
  return Number(result.numAffectedRows ?? 0n);
}
