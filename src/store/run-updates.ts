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
 *
 * `updateRuns` writes a batch of such updates (the recorder's flush: the ends of every run that finished
 * in the last few milliseconds). On SQLite it is one `updateRun` per run (in-process calls, one writer);
 * on PostgreSQL the updates that change the same columns under the same fence are one statement, `UPDATE
 * runs … FROM unnest(<one array per column>)`, one round trip for them all instead of one per run (issue
 * 31: the single-row UPDATEs and their round trips were most of the CPU PostgreSQL cost Ferry per run).
 */
import { CompiledQuery, type Kysely, type SqlBool, sql } from 'kysely';
import { dialectOf } from './index.js';
import { prepared } from './prepared.js';
import { pgArrayType } from './run-inserts.js';
import type { Database, Run } from './schema.js';
import { hiddenColumn, unfinishedRun } from './unfinished.js';

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

/** One run's changes in a batch of `updateRuns`, fenced by `attempt` when given (see updateRun). */
export interface RunUpdate {
  id: string;
  changes: Partial<Omit<Run, 'id'>>;
  attempt?: number | undefined;
}

/**
 * The statement an update of `updateRuns` goes into on PostgreSQL (updates of one shape share one): the
 * columns it changes and whether it is fenced by an attempt.
 */
export function updateShape(u: RunUpdate): string {
  return `${u.attempt !== undefined ? 'a' : ''}:${changedColumns(u.changes).join(',')}`;
}

/** The changed columns of an update (those with a value), sorted: the shape of its statement. */
function changedColumns(changes: Partial<Omit<Run, 'id'>>): Array<keyof Omit<Run, 'id'>> {
  return (Object.keys(changes) as Array<keyof typeof changes>).filter((c) => changes[c] !== undefined).sort();
}

/**
 * Applies a batch of updates, each fenced as `updateRun` fences it (by `owner` for all, by its `attempt`
 * when it has one); resolves with the ids of the runs the fence refused (or that do not exist). An update
 * with no column to set is left out, as `updateRun` leaves it. The ids must be distinct.
 */
export async function updateRuns(
  db: Kysely<Database>,
  updates: readonly RunUpdate[],
  owner?: string,
): Promise<Set<string>> {
  const refused = new Set<string>();
  if (dialectOf(db) !== 'postgres') {
    for (const u of updates) {
      if ((await updateRun(db, u.id, u.changes, owner, u.attempt)) === 0) refused.add(u.id);
    }
    return refused;
  }
  const shapes = new Map<string, { columns: Array<keyof Omit<Run, 'id'>>; fenced: boolean; rows: RunUpdate[] }>();
  for (const u of updates) {
    const columns = changedColumns(u.changes);
    if (columns.length === 0) continue;
    const fenced = u.attempt !== undefined;
    const key = `${fenced ? 'a' : ''}:${columns.join(',')}`;
    const shape = shapes.get(key);
    if (shape) shape.rows.push(u);
    else shapes.set(key, { columns, fenced, rows: [u] });
  }
  for (const [key, { columns, fenced, rows }] of shapes) {
    const changed = await updateUnnest(db, key, columns, fenced, rows, owner);
    for (const u of rows) if (!changed.has(u.id)) refused.add(u.id);
  }
  return refused;
}

/** PostgreSQL statement texts of updateRuns, by owner fence and shape. */
const unnestTexts = new Map<string, string>();

/**
 * `UPDATE runs AS r SET c = v.c, … FROM unnest($1::text[] (ids), [$2::int4[] (attempts),] …) AS v(…)
 * WHERE r.id = v.id AND r.id = any(array(select unnest($1))) AND <fence>`: the ids it changed.
 */
async function updateUnnest(
  db: Kysely<Database>,
  shapeKey: string,
  columns: ReadonlyArray<keyof Omit<Run, 'id'>>,
  fenced: boolean,
  rows: readonly RunUpdate[],
  owner: string | undefined,
): Promise<Set<string>> {
  const key = `${owner !== undefined ? 'o' : ''}:${shapeKey}`;
  let text = unnestTexts.get(key);
  if (text === undefined) {
    let n = 0;
    const arrays = [`$${++n}::text[]`];
    const names = ['"id"'];
    if (fenced) {
      arrays.push(`$${++n}::int4[]`);
      names.push('"fence_attempt"');
    }
    for (const c of columns) {
      arrays.push(`$${++n}::${pgArrayType(c)}`);
      names.push(`"${c}"`);
    }
    const set = columns.map((c) => `"${c}" = v."${c}"`).join(', ');
    // The ids a second time, through an InitPlan, so the rows are found by primary key however many they
    // are: joined on `unnest` alone, a few dozen were planned as a hash join over a sequential scan of runs
    // whenever its statistics were missing (store/claims.ts anyOf). Owner and state hidden from the planner:
    // never read every run this node holds through runs_owner_state or runs_state (store/unfinished.ts
    // hiddenColumn says why).
    const where = ['r."id" = v."id"', 'r."id" = any(array(select unnest($1::text[])))'];
    if (owner !== undefined) where.push(`${hiddenColumn('owner', 'r')} = $${++n}`);
    where.push(
      fenced
        ? `${hiddenColumn('state', 'r')} = 'running' and r."attempts" = v."fence_attempt"`
        : `${hiddenColumn('state', 'r')} in ('queued', 'running')`,
    );
    text = prepared(
      `update "runs" as r set ${set} from unnest(${arrays.join(', ')}) as v(${names.join(', ')}) where ${where.join(' and ')} returning r."id"`,
    );
    if (unnestTexts.size < MAX_SHAPES) unnestTexts.set(key, text);
  }
  const params: unknown[] = [rows.map((u) => u.id)];
  if (fenced) params.push(rows.map((u) => u.attempt));
  for (const c of columns) params.push(rows.map((u) => u.changes[c] ?? null));
  if (owner !== undefined) params.push(owner);
  const result = await db.executeQuery<{ id: string }>(CompiledQuery.raw(text, params));
  return new Set(result.rows.map((r) => r.id));
}
