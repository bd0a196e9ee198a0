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
import { prepared } from './prepared.js';
import type { Database, Run } from './schema.js';
import { hiddenColumn } from './unfinished.js';

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

/** Starts to make in the statement of `insertRunsAndStart` (store/claims.ts startRuns says what a start is). */
export interface RunStarts {
  owner: string;
  runIds: readonly string[];
  startedAt: string;
}

/**
 * PostgreSQL: inserts `rows` (ignoring rows already there, as insertRunsIgnoring with `returning`) and
 * starts `starts` (as store/claims.ts startRuns: this owner's queued runs, one more attempt each) in ONE
 * statement, so both are one commit and one round trip: the group commit of async runs on PostgreSQL
 * (runs/recorder.ts), as SQLite puts both in one transaction. The starts never concern the rows inserted
 * here (a run is started only once its insert was committed), so the two parts cannot see each other's
 * rows and need not.
 */
export async function insertRunsAndStart(
  db: Kysely<Database>,
  rows: readonly Run[],
  starts: RunStarts,
): Promise<{ ids: string[]; started: Map<string, number> }> {
  if (dialectOf(db) !== 'postgres') throw new Error('insertRunsAndStart is for PostgreSQL');
  if (combinedText === '') {
    const n = COLUMNS.length;
    combinedText = prepared(
      // Owner and state hidden from the planner, the ids read through an InitPlan: the runs are found by primary
      // key (store/unfinished.ts hiddenColumn, store/claims.ts anyOf).
      `with "started" as (update "runs" set "state" = 'running', "started_at" = $${n + 3}, "attempts" = "attempts" + 1` +
        ` where "id" = any(array(select unnest($${n + 2}::text[]))) and ${hiddenColumn('owner')} = $${n + 1} and ${hiddenColumn('state')} = 'queued' returning "id", "attempts"),` +
        ` "inserted" as (${unnestText(true)})` +
        ` select "id", "attempts" from "started" union all select "id", null from "inserted"`,
    );
  }
  const params: unknown[] = columnArrays(rows);
  params.push(starts.owner, [...starts.runIds], starts.startedAt);
  const result = await db.executeQuery<{ id: string; attempts: number | null }>(
    CompiledQuery.raw(combinedText, params),
  );
  const ids: string[] = [];
  const started = new Map<string, number>();
  for (const r of result.rows) {
    if (r.attempts === null) ids.push(r.id);
    else started.set(r.id, Number(r.attempts));
  }
  return { ids, started };
}

let combinedText = '';

/** The PostgreSQL statement texts, with and without `returning id`. */
const unnestTexts: Record<'r' | '', string> = { r: '', '': '' };

/** The text of the PostgreSQL INSERT of any number of rows (its parameters: columnArrays). */
function unnestText(returning: boolean): string {
  const key = returning ? 'r' : '';
  let text = unnestTexts[key];
  if (text === '') {
    const columns = COLUMNS.map((c) => `"${c}"`).join(', ');
    const arrays = COLUMNS.map((c, i) => `$${i + 1}::${pgArrayType(c)}`).join(', ');
    text = prepared(
      `insert into "runs" (${columns}) select * from unnest(${arrays}) on conflict do nothing${returning ? ' returning "id"' : ''}`,
    );
    unnestTexts[key] = text;
  }
  return text;
}

/** One array of values per column, in COLUMNS' order. */
function columnArrays(rows: readonly Run[]): unknown[][] {
  const params = new Array<unknown[]>(COLUMNS.length);
  for (let c = 0; c < COLUMNS.length; c++) {
    const column = COLUMNS[c]!;
    const values = new Array<unknown>(rows.length);
    for (let r = 0; r < rows.length; r++) values[r] = rows[r]![column] ?? null;
    params[c] = values;
  }
  return params;
}

/** PostgreSQL: every row in one `INSERT … SELECT * FROM unnest(<one array per column>)`. */
async function insertUnnest(
  db: Kysely<Database>,
  rows: readonly Run[],
  returning: boolean,
): Promise<{ inserted: number; ids: string[] }> {
  const text = unnestText(returning);
  const params = columnArrays(rows);
  const result = await db.executeQuery<{ id: string }>(CompiledQuery.raw(text, params));
  return {
    inserted: returning ? result.rows.length : Number(result.numAffectedRows ?? 0n),
    ids: result.rows.map((r) => r.id),
  };
}
