/**
 * Claiming shared work: each operation is one statement that picks free rows, stamps this node as their
 * `owner` and returns them, so two nodes can never take the same row (graphile-worker's way).
 *
 * On PostgreSQL the picking subquery locks with `FOR UPDATE SKIP LOCKED`: concurrent claimers skip each
 * other's rows instead of queueing behind them (and it is evaluated once: see `picked`). SQLite has one writer at a time, so the statement is
 * atomic there as it stands. This is the only place that knows the difference.
 *
 * Claims are polled, so each first looks (a plain read, which never waits for a writer) and writes only
 * when there is something to take: an idle server does not take the write lock every second.
 */
import { type Compilable, type Kysely, type RawBuilder, type SelectQueryBuilder, type SqlBool, sql } from 'kysely';
import { dialectOf } from './index.js';
import { prepared } from './prepared.js';
import type { Build, Database, Run } from './schema.js';
import { hiddenColumn, unfinishedRun } from './unfinished.js';

type Db = Kysely<Database>;

/**
 * `column` is one of the rows `pick` picks, locked for this claim. On PostgreSQL the pick locks with `FOR
 * UPDATE SKIP LOCKED` and runs as `= ANY(ARRAY(pick))`, an InitPlan evaluated once: as `IN (pick)` the
 * planner may evaluate the locking subquery again while the UPDATE runs, and a claim of 7 runs once took
 * 251 (test/leases.test.ts, several claimers at once). On SQLite (one writer) `IN (pick)` is atomic as it is.
 */
function picked<TB extends keyof Database, O>(
  db: Db,
  column: string,
  pick: SelectQueryBuilder<Database, TB, O>,
): RawBuilder<SqlBool> {
  return dialectOf(db) === 'postgres'
    ? sql<SqlBool>`${sql.ref(column)} = any(array(${pick.forUpdate().skipLocked()}))`
    : sql<SqlBool>`${sql.ref(column)} in (${pick})`;
}

/** `owner` is `owner` (null: none), hidden from the planner (store/unfinished.ts hiddenColumn says why). */
function ownerIs(owner: string | null): RawBuilder<SqlBool> {
  return sql<SqlBool>`${sql.raw(hiddenColumn('owner'))} = ${owner ?? ''}`;
}

/** `state` is one of `states`, hidden from the planner as ownerIs is. */
function stateIs(...states: Run['state'][]): RawBuilder<SqlBool> {
  const state = sql.raw(hiddenColumn('state'));
  return states.length === 1 ? sql<SqlBool>`${state} = ${states[0]}` : sql<SqlBool>`${state} in (${sql.join(states)})`;
}

/**
 * `column` is one of `values`, found by the column's index whatever the planner knows. On PostgreSQL one
 * array parameter, so the statement's text is the same whatever the number of values (one text for the
 * server to parse, and for pg_stat_statements to count), read back through an InitPlan (`= any(array(select
 * unnest($1)))`): the planner cannot count its elements and plans a scan of the primary key. Written as `=
 * any($1::text[])` or `in ($1, …)`, a list of a few hundred ids (a second's publishes marked together), or
 * of 64 on a table never analyzed (a fetch's claim on a young database), was planned as a sequential scan,
 * and the claim's locking subquery as a nested loop over it: 86 ms and 190,000 buffers for 64 runs of 20,000
 * (bench/README.md, bench:cluster (c); test/postgres/id-list-plans). SQLite binds no arrays, so there it is
 * `in (?, ?, …)`, which it reads by primary key.
 */
function anyOf(db: Db, column: string, values: readonly string[]): RawBuilder<SqlBool> {
  return dialectOf(db) === 'postgres'
    ? sql<SqlBool>`${sql.ref(column)} = any(array(select unnest(${[...values]}::text[])))`
    : sql<SqlBool>`${sql.ref(column)} in (${sql.join(values.map((v) => sql`${v}`))})`;
}

/**
 * Runs `query` and returns its rows; on PostgreSQL as a named prepared statement (store/prepared.ts): for the
 * statements of every batch of runs, whose text does not vary (their ids are one array parameter).
 */
async function runPrepared<O>(db: Db, query: Compilable<O>): Promise<O[]> {
  const compiled = query.compile();
  if (dialectOf(db) === 'postgres') prepared(compiled.sql);
  return (await db.executeQuery(compiled)).rows;
}

/**
 * A queued run is due: not waiting out its retry policy's delay (`not_before`, runs/lifecycle.ts), an ISO
 * time compared by bytes on both stores.
 */
function dueAt(now: number): RawBuilder<SqlBool> {
  const at = new Date(now).toISOString();
  return sql<SqlBool>`(not_before is null or not_before <= ${at})`;
}

export interface ClaimedRun {
  id: string;
  project_id: string;
  app_id: string;
}

/**
 * Takes up to `limit` queued async runs nobody holds, oldest first, leaving out the apps in `skipApps`
 * (`project/app` keys this node has enough of already). They stay `queued` until `startRun`.
 */
export async function claimQueuedRuns(
  db: Db,
  owner: string,
  limit: number,
  skipApps: ReadonlyArray<{ projectId: string; appId: string }> = [],
  now = Date.now(),
): Promise<ClaimedRun[]> {
  if (limit <= 0) return [];
  let pick = db
    .selectFrom('runs')
    .select('id')
    .where('state', '=', 'queued')
    .where('mode', '=', 'async')
    .where('owner', 'is', null)
    .where(unfinishedRun())
    .where(dueAt(now))
    .orderBy('id')
    .limit(limit);
  if (skipApps.length > 0) {
    pick = pick.where((eb) =>
      eb.not(eb.or(skipApps.map((a) => eb.and([eb('project_id', '=', a.projectId), eb('app_id', '=', a.appId)])))),
    );
  }
  if ((await pick.execute()).length === 0) return [];
  return db
    .updateTable('runs')
    .set({ owner })
    .where(picked(db, 'id', pick))
    .where(ownerIs(null))
    .where(stateIs('queued'))
    .returning(['id', 'project_id', 'app_id'])
    .execute();
}

/**
 * Marks claimed runs `running` (one more start each) before they are performed, so a crash from here on is
 * an interruption, never a silent second run. Returns the runs it marked, each with its start's number
 * (`attempts` now: the fence of this start's later changes, store/run-updates.ts): a run missing from it is
 * no longer this node's queued run (it was cancelled, or this node lost its lease and another took it).
 */
export async function startRuns(
  db: Db,
  owner: string,
  runIds: readonly string[],
  startedAt: string,
): Promise<Map<string, number>> {
  if (runIds.length === 0) return new Map();
  const rows = await runPrepared(
    db,
    db
      .updateTable('runs')
      .set((eb) => ({ state: 'running', started_at: startedAt, attempts: eb('attempts', '+', 1) }))
      .where(anyOf(db, 'id', runIds))
      .where(ownerIs(owner))
      .where(stateIs('queued'))
      .returning(['id', 'attempts']),
  );
  return new Map(rows.map((r) => [r.id, Number(r.attempts)]));
}

/**
 * Lets go of queued runs this node claimed but will not start (it is stopping): any node may take them.
 * Their message is no longer known to be in the runs stream (--nats-url), so the relay publishes them again.
 */
export async function releaseQueuedRuns(db: Db, owner: string, runIds: readonly string[]): Promise<void> {
  if (runIds.length === 0) return;
  await db
    .updateTable('runs')
    .set({ owner: null, published_at: null })
    .where(anyOf(db, 'id', runIds))
    .where(ownerIs(owner))
    .where(stateIs('queued'))
    .execute();
}

/**
 * A claimed run's call, returned by the claim itself so the worker needs no read of the record before it
 * performs the run (one statement per run, most of a cluster's transactions: bench/README.md). Only when
 * its input and HTTP request together are at most MAX_RETURNED_CALL characters (`whole`); a larger call is
 * read when the run is performed, so a node holding a thousand queued runs does not hold their bodies too.
 */
export interface ClaimedCall {
  function_name: string;
  input: string | null;
  webhook_endpoint: string | null;
  http_request: string | null;
  attempt_log: string | null;
  /** 1: input and http_request are the record's; 0: they were left out (too large) and are null here. */
  whole: number;
}

/** The most characters of input and HTTP request a claim returns with its runs (ClaimedCall). */
export const MAX_RETURNED_CALL = 32 * 1024;

/**
 * The runs of a batch of messages fetched from the runs stream (--nats-url), claimed by this node in one
 * statement: those still queued, due and held by nobody, with their call, at most `limit` of them (the room
 * this node has for their app; a message carries the runs accepted together), lowest ids first. A run
 * missing from the answer is finished, or held by another node (which runs it, or whose death frees it for
 * the relay to publish again), or was left for another node (over `limit`: freeQueuedRunsOf tells).
 */
export async function claimPublishedRuns(
  db: Db,
  owner: string,
  runIds: readonly string[],
  now = Date.now(),
  limit = runIds.length,
): Promise<Array<ClaimedRun & ClaimedCall>> {
  if (runIds.length === 0 || limit <= 0) return [];
  // These exact runs: wait for a row another statement holds (the publisher marking it published), never
  // skip it, or a free run would look taken (PostgreSQL checks the conditions again on the row it waited
  // for). Locked in id order, so two claimers never deadlock; on PostgreSQL through an InitPlan, read once
  // by primary key (anyOf says why).
  const pick = db
    .selectFrom('runs')
    .select('id')
    .where(anyOf(db, 'id', runIds))
    .where(ownerIs(null))
    .where(stateIs('queued'))
    .where('mode', '=', 'async')
    .where(dueAt(now))
    .orderBy('id')
    .limit(limit);
  const small = sql<SqlBool>`coalesce(length(input), 0) + coalesce(length(http_request), 0) <= ${MAX_RETURNED_CALL}`;
  const claim = db
    .updateTable('runs')
    .set({ owner })
    .where(
      dialectOf(db) === 'postgres' ? sql<SqlBool>`id = any(array(${pick.forUpdate()}))` : sql<SqlBool>`id in (${pick})`,
    )
    .where(ownerIs(null))
    .where(stateIs('queued'))
    .where('mode', '=', 'async')
    // A message of a run now waiting for its next attempt (an older one, redelivered): the relay publishes
    // the run again once it is due.
    .where(dueAt(now))
    .returning([
      'id',
      'project_id',
      'app_id',
      'function_name',
      'webhook_endpoint',
      'attempt_log',
      sql<string | null>`case when ${small} then input end`.as('input'),
      sql<string | null>`case when ${small} then http_request end`.as('http_request'),
      sql<number>`case when ${small} then 1 else 0 end`.as('whole'),
    ]);
  const rows = await runPrepared(db, claim);
  return rows.map((r) => ({ ...r, whole: Number(r.whole) }));
}

/** Of these runs, the ones this node still holds unfinished (their message is not to be acknowledged yet). */
export async function unfinishedRunsOf(db: Db, owner: string, runIds: readonly string[]): Promise<Set<string>> {
  if (runIds.length === 0) return new Set();
  const rows = await db
    .selectFrom('runs')
    .select('id')
    .where(anyOf(db, 'id', runIds))
    .where(ownerIs(owner))
    .where(stateIs('queued', 'running'))
    .execute();
  return new Set(rows.map((r) => r.id));
}

/** Of these runs, the ones still queued and held by nobody. */
export async function freeQueuedRunsOf(db: Db, runIds: readonly string[]): Promise<Set<string>> {
  if (runIds.length === 0) return new Set();
  const rows = await db
    .selectFrom('runs')
    .select('id')
    .where(anyOf(db, 'id', runIds))
    .where(ownerIs(null))
    .where(stateIs('queued'))
    .execute();
  return new Set(rows.map((r) => r.id));
}

/**
 * Records that these runs' messages are in the runs stream (the ones still waiting for a node). Only runs
 * never started: the marks are written up to a second after the publish, and a run fetched, started and
 * queued again meanwhile (a retry, its first attempt failing at once) had that message acknowledged; marked
 * published, the relay would leave it waiting for `republishAfterMs` (ten minutes) instead of publishing it
 * once due (test/contract-run-queue.test.ts).
 */
export async function markRunsPublished(db: Db, runIds: readonly string[], at: string): Promise<void> {
  if (runIds.length === 0) return;
  await db
    .updateTable('runs')
    .set({ published_at: at })
    .where(anyOf(db, 'id', runIds))
    .where('published_at', 'is', null)
    .where(stateIs('queued'))
    .where(ownerIs(null))
    .where('attempts', '=', 0)
    .execute();
}

export interface RunToPublish {
  id: string;
  project_id: string;
  app_id: string;
  publishes: number;
}

/**
 * The relay's claim (--nats-url): up to `limit` queued runs held by nobody whose message is not known to be
 * in the runs stream, created before `createdBefore` (younger ones are being published by the process that
 * accepted them), or last published before `staleBefore` when given. Marks them published now and counts
 * the publish (`publishes` names the new message), so two relays never publish one run at once; a publish
 * that fails is undone with `unmarkRunsPublished`.
 */
export async function claimRunsToPublish(
  db: Db,
  options: { now: string; createdBefore: string; staleBefore?: string; limit: number },
): Promise<RunToPublish[]> {
  let pick = db
    .selectFrom('runs')
    .select('id')
    .where('state', '=', 'queued')
    .where('mode', '=', 'async')
    .where('owner', 'is', null)
    .where(dueAt(Date.parse(options.now)))
    .limit(options.limit);
  const { staleBefore } = options;
  // Unpublished runs: runs_unpublished holds just them. Stale ones: runs_state, the free queued runs.
  pick =
    staleBefore === undefined
      ? pick.where('published_at', 'is', null).where('created_at', '<', options.createdBefore).orderBy('created_at')
      : pick.where(unfinishedRun()).where('published_at', '<', staleBefore).orderBy('published_at');
  if ((await pick.execute()).length === 0) return [];
  return db
    .updateTable('runs')
    .set((eb) => ({ published_at: options.now, publishes: eb('publishes', '+', 1) }))
    .where(picked(db, 'id', pick))
    .where(stateIs('queued'))
    .where(ownerIs(null))
    .returning(['id', 'project_id', 'app_id', 'publishes'])
    .execute();
}

/** The relay could not publish these runs: their message is not in the stream, and the next pass tries again. */
export async function unmarkRunsPublished(db: Db, runIds: readonly string[], at: string): Promise<void> {
  if (runIds.length === 0) return;
  await db
    .updateTable('runs')
    .set({ published_at: null })
    .where(anyOf(db, 'id', runIds))
    .where('published_at', '=', at)
    .execute();
}

export interface ClaimedDelivery {
  run_id: string;
  url: string;
  payload: string;
  attempts: number;
}

/** Takes up to `limit` webhook deliveries due by `now`, earliest first: `pending` → `sending`, owned. */
export async function claimDueDeliveries(
  db: Db,
  owner: string,
  now: string,
  limit: number,
): Promise<ClaimedDelivery[]> {
  if (limit <= 0) return [];
  const pick = db
    .selectFrom('webhook_deliveries')
    .select('run_id')
    .where('state', '=', 'pending')
    .where('next_attempt_at', '<=', now)
    .orderBy('next_attempt_at')
    .limit(limit);
  if ((await pick.execute()).length === 0) return [];
  return db
    .updateTable('webhook_deliveries')
    .set({ state: 'sending', owner, updated_at: now })
    .where(picked(db, 'run_id', pick))
    .where('state', '=', 'pending')
    .returning(['run_id', 'url', 'payload', 'attempts'])
    .execute();
}

/** A delivery the store says `owner` is sending, and when it was claimed (its `updated_at`). */
export interface HeldDelivery {
  run_id: string;
  updated_at: string;
}

/** The deliveries `owner` holds `sending` (webhooks/deliverer.ts compares them with its attempts in flight). */
export function heldDeliveries(db: Db, owner: string): Promise<HeldDelivery[]> {
  return db
    .selectFrom('webhook_deliveries')
    .select(['run_id', 'updated_at'])
    .where('state', '=', 'sending')
    .where('owner', '=', owner)
    .execute();
}

/**
 * Lets go of deliveries `owner` holds `sending` but is not sending (their claim's answer was lost): pending
 * again, due `now`, attempts unchanged (no attempt was made). Each only while it is still the one that was
 * read, claimed at the same `updated_at`: a delivery sent and claimed again since is left alone. Returns how
 * many were let go.
 */
export async function releaseHeldDeliveries(
  db: Db,
  owner: string,
  held: readonly HeldDelivery[],
  now: string,
): Promise<number> {
  let released = 0;
  for (const d of held) {
    const result = await db
      .updateTable('webhook_deliveries')
      .set({ state: 'pending', owner: null, next_attempt_at: now, updated_at: now })
      .where('run_id', '=', d.run_id)
      .where('state', '=', 'sending')
      .where('owner', '=', owner)
      .where('updated_at', '=', d.updated_at)
      .executeTakeFirst();
    released += Number(result.numUpdatedRows);
  }
  return released;
}

/** Starts building a pending build this node holds: `pending` → `building`. False when it is not one. */
export async function startBuild(db: Db, owner: string, buildId: string, startedAt: string): Promise<boolean> {
  const result = await db
    .updateTable('builds')
    .set({ state: 'building', started_at: startedAt })
    .where('id', '=', buildId)
    .where('owner', '=', owner)
    .where('state', '=', 'pending')
    .executeTakeFirst();
  return Number(result.numUpdatedRows) === 1;
}

/** Takes up to `limit` pending builds nobody holds (their node died or stopped), oldest first. */
export async function claimFreeBuilds(db: Db, owner: string, limit: number): Promise<Build[]> {
  const pick = db
    .selectFrom('builds')
    .select('id')
    .where('state', '=', 'pending')
    .where('owner', 'is', null)
    .orderBy('id')
    .limit(limit);
  if ((await pick.execute()).length === 0) return [];
  const rows = await db
    .updateTable('builds')
    .set({ owner })
    .where(picked(db, 'id', pick))
    .where('owner', 'is', null)
    .where('state', '=', 'pending')
    .returningAll()
    .execute();
  return rows.sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
}
