/**
 * The multi-row INSERT of run records, the hottest statement of the store (every run is one row of one).
 * Building it with Kysely for each batch means parsing every value of every row into a query tree and
 * compiling it to text again, several times a millisecond under load. The text depends only on the
 * dialect, the number of rows and whether ids are returned, so it is compiled by Kysely once per shape and
 * kept: later batches of that shape pass only their parameters (and the SQLite driver's statement cache,
 * keyed by the text, keeps the prepared statement too).
 *
 * On PostgreSQL a batch of any size is one statement of one text: each column's values go as one array
 * parameter and `unnest` turns them back into rows (graphile-worker's `add_jobs` does the same with a
 * JSON array). One statement needs no transaction around it to be atomic, so a group of async runs is one
 * round trip to the server instead of a BEGIN, a few INSERTs of the fixed shapes and a COMMIT, and the
 * server parses one text whatever the group's size (issue 31). Arrays, not JSON: the driver encodes each
 * string as it encodes a plain parameter (a lone UTF-16 surrogate becomes U+FFFD), where PostgreSQL's JSON
 * parser would refuse the whole statement for one bad escape.
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

/** The run columns PostgreSQL holds as `integer`; every other column of runs is `text`. */
const INTEGER_COLUMNS: ReadonlySet<keyof Run> = new Set([
  'status_code',
  'cold_start',
  'attempts',
  'publishes',
  'run_time_ms',
  'dead',
] satisfies Array<keyof Run>);

/** The PostgreSQL array type of a run column's values (`unnest` parameters). */
export function pgArrayType(column: keyof Run): 'int4[]' | 'text[]' {
  return INTEGER_COLUMNS.has(column) ? 'int4[]' : 'text[]';
}

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
  if (rows.length === 0) return { inserted: 0, ids: [] };
  if (dialectOf(db) === 'postgres') return insertUnnest(db, rows, returning);
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

/** The PostgreSQL statement texts, with and without `returning id`. */
const unnestTexts: Record<'r' | '', string> = { r: '', '': '' };

/** PostgreSQL: every row in one `INSERT … SELECT * FROM unnest(<one array per column>)`. */
async function insertUnnest(
  db: Kysely<Database>,
  rows: readonly Run[],
  returning: boolean,
): Promise<{ inserted: number; ids: string[] }> {
  const key = returning ? 'r' : '';
  let text = unnestTexts[key];
  if (text === '') {
    const columns = COLUMNS.map((c) => `"${c}"`).join(', ');
    const arrays = COLUMNS.map((c, i) => `$${i + 1}::${pgArrayType(c)}`).join(', ');
    text = `insert into "runs" (${columns}) select * from unnest(${arrays}) on conflict do nothing${returning ? ' returning "id"' : ''}`;
    unnestTexts[key] = text;
  }
  const params = new Array<unknown[]>(COLUMNS.length);
  for (let c = 0; c < COLUMNS.length; c++) {
    const column = COLUMNS[c]!;
    const values = new Array<unknown>(rows.length);
    for (let r = 0; r < rows.length; r++) values[r] = rows[r]![column] ?? null;
    params[c] = values;
  }
  const result = await db.executeQuery<{ id: string }>(CompiledQuery.raw(text, params));
  return {
    inserted: returning ? result.rows.length : Number(result.numAffectedRows ?? 0n),
    ids: result.rows.map((r) => r.id),
  };
}
