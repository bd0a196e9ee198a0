/**
 * The multi-row INSERT of run records, the hottest statement of the store (every run is one row of one).
 * Building it with Kysely for each batch means parsing every value of every row into a query tree and
 * compiling it to text again, several times a millisecond under load. The text depends only on the
 * dialect, the number of rows and whether ids are returned, so it is compiled by Kysely once per shape and
 * kept: later batches of that shape pass only their parameters (and the SQLite driver's statement cache,
 * keyed by the text, keeps the prepared statement too).
 */
import { CompiledQuery, type Kysely } from 'kysely';
import { dialectOf } from './index.js';
import type { Database, Run } from './schema.js';

/** Every column of a run record, in the order of the statement's parameters. */
const COLUMNS = [
  'id',
  'project_id',
  'app_id',
  'build_id',
  'function_name',
  'mode',
  'state',
  'status_code',
  'input',
  'result',
  'error_code',
  'error_message',
  'reason',
  'cold_start',
  'webhook_endpoint',
  'webhook_secret',
  'idempotency_key',
  'http_request',
  'owner',
  'attempts',
  'published_at',
  'publishes',
  'created_at',
  'started_at',
  'finished_at',
  'run_time_ms',
  'trigger',
  'schedule_name',
  'scheduled_for',
  'retry_of',
  'not_before',
  'dead',
  'attempt_log',
] as const satisfies ReadonlyArray<keyof Run>;

// A column added to runs and not here would not be written: the type check fails instead.
type Missing = Exclude<keyof Run, (typeof COLUMNS)[number]>;
const complete: Missing extends never ? true : Missing = true;
void complete;

/**
 * Row counts of the statements: a batch is written as a few statements of these sizes (37 rows: 32, 4, 1),
 * so only these shapes are compiled and prepared, whatever the batch.
 */
const SHAPES = [256, 32, 4, 1];

/** Statement texts by dialect, row count and returning: at most 16. */
const texts = new Map<string, string>();

function normalized(row: Run): Run {
  const out: Record<string, unknown> = {};
  for (const c of COLUMNS) out[c] = row[c] ?? null;
  return out as Run;
}

function parameters(rows: readonly Run[]): unknown[] {
  const out = new Array<unknown>(rows.length * COLUMNS.length);
  let i = 0;
  for (const row of rows) for (const c of COLUMNS) out[i++] = row[c] ?? null;
  return out;
}

/** INSERT … ON CONFLICT DO NOTHING of `rows`; with `returning`, the ids of the rows it inserted. */
export async function insertRunsIgnoring(
  db: Kysely<Database>,
  rows: readonly Run[],
  returning = false,
): Promise<{ inserted: number; ids: string[] }> {
  let inserted = 0;
  const ids: string[] = [];
  let at = 0;
  for (const size of SHAPES) {
    while (rows.length - at >= size) {
      const done = await insertShape(db, rows.slice(at, at + size), returning);
      inserted += done.inserted;
      for (const id of done.ids) ids.push(id);
      at += size;
    }
  }
  return { inserted, ids };
}

async function insertShape(
  db: Kysely<Database>,
  rows: readonly Run[],
  returning: boolean,
): Promise<{ inserted: number; ids: string[] }> {
  const key = `${dialectOf(db)}:${rows.length}:${returning ? 'r' : ''}`;
  const params = parameters(rows);
  const text = texts.get(key);
  let query: CompiledQuery;
  if (text !== undefined) query = CompiledQuery.raw(text, params);
  else {
    const insert = db
      .insertInto('runs')
      .values(rows.map(normalized))
      .onConflict((oc) => oc.doNothing());
    query = returning ? insert.returning('id').compile() : insert.compile();
    // Kept only if Kysely's parameters are ours in our order, so a later batch can pass its own.
    const same = query.parameters.length === params.length && query.parameters.every((p, i) => p === params[i]);
    if (same) texts.set(key, query.sql);
  }
  const result = await db.executeQuery<{ id: string }>(query);
  return {
    inserted: returning ? result.rows.length : Number(result.numAffectedRows ?? 0n),
    ids: result.rows.map((r) => r.id),
  };
}
