/**
 * Writes run records and run logs to the store in batches, off the request path.
 *
 * A sync run changes state three times (queued, running, finished) in a few milliseconds; writing each
 * change as its own statement would make SQLite the bottleneck of the run endpoint. The recorder keeps a
 * run's pending changes in memory and writes every few milliseconds in one transaction: a run that starts
 * and finishes between two flushes becomes one row in one multi-row INSERT. Runs that must be durable
 * before they are acknowledged (async) use `insertNow`.
 */
import type { Logger } from 'pino';
import { isoTime } from '../ids.js';
import { startRuns } from '../store/claims.js';
import { type Store, writesOneAtATime } from '../store/index.js';
import { insertRunsAndStart, insertRunsIgnoring } from '../store/run-inserts.js';
import { type RunUpdate, updateRuns, updateShape } from '../store/run-updates.js';
import type { Run } from '../store/schema.js';
import { isFinalState, type OutboxEntry, type RunChanges, type RunEnd } from './lifecycle.js';

export type { OutboxEntry, RunChanges } from './lifecycle.js';
export type RunRow = Run;

/** A new run record, state `queued`: what the caller knows at acceptance; the rest starts empty. */
export function newRunRow(fields: NewRunFields & { mode: RunRow['mode']; owner?: string | null | undefined }): RunRow;
/** The same with the mode and owner apart: the async path builds no object merging them in. */
export function newRunRow(fields: NewRunFields, mode: RunRow['mode'], owner?: string | null): RunRow;
export function newRunRow(
  fields: NewRunFields & { mode?: RunRow['mode']; owner?: string | null | undefined },
  modeApart?: RunRow['mode'],
  ownerApart?: string | null,
): RunRow {
  const mode = (modeApart ?? fields.mode) as RunRow['mode'];
  const owner = modeApart === undefined ? fields.owner : ownerApart;
  const origin = fields.origin;
  return {
    id: fields.id,
    project_id: fields.build.projectId,
    app_id: fields.build.appId,
    build_id: fields.build.buildId,
    function_name: fields.fn,
    mode,
    state: 'queued',
    status_code: null,
    input: fields.input,
    result: null,
    error_code: null,
    error_message: null,
    reason: null,
    cold_start: 0,
    webhook_endpoint: fields.webhookUrl ?? null,
    webhook_secret: fields.webhookSecret ?? null,
    idempotency_key: fields.idempotencyKey ?? null,
    http_request: fields.httpRequest ?? null,
    // The node that holds the run (cluster/node.ts); sync and stream runs are stamped by the recorder.
    owner: owner ?? null,
    // A sync or stream run starts once, when it is called; an async run counts its starts (startRun).
    attempts: mode === 'async' ? 0 : 1,
    published_at: null,
    publishes: 0,
    created_at: isoTime(fields.createdAt ?? Date.now()),
    started_at: null,
    finished_at: null,
    run_time_ms: null,
    trigger: origin?.trigger ?? null,
    schedule_name: origin?.trigger === 'schedule' ? origin.schedule : null,
    scheduled_for: origin?.trigger === 'schedule' ? origin.tick : null,
    retry_of: origin?.trigger === 'retry' ? origin.retryOf : null,
    not_before: null,
    dead: null,
    attempt_log: null,
  };
}

/** What a new run row is made from (newRunRow), besides its mode and owner. */
export interface NewRunFields {
  id: string;
  build: { projectId: string; appId: string; buildId: string };
  fn: string;
  input: string | null;
  webhookUrl?: string | undefined;
  webhookSecret?: string | undefined;
  idempotencyKey?: string | undefined;
  httpRequest?: string | undefined;
  createdAt?: number;
  /** Where the run comes from, when not a call: a schedule's tick, or `runs retry` of an earlier run. */
  origin?: { trigger: 'schedule'; schedule: string; tick: string } | { trigger: 'retry'; retryOf: string };
}

interface Pending {
  row: RunRow;
  /** True once the row exists in the store; later changes are UPDATEs. */
  inserted: boolean;
  changes: RunChanges;
  /** When the oldest unwritten change of a row already inserted was made (see takeBatch). */
  changedAt?: number;
  /** A row not yet inserted: when the recorder got it (see takeBatch; parsing created_at per flush cost more). */
  since?: number;
}

export interface RunRecorder {
  /** Records a new run (written at the next flush). */
  start(row: RunRow): void;
  /**
   * Inserts a run and resolves once it is committed (async runs: nothing is acknowledged before it is
   * durable). Concurrent calls share one transaction (group commit). Resolves with the id of the run that
   * holds the row's idempotency key: the row's own, or, when another run took the key first (in this
   * group or before it), that run's id and nothing is inserted.
   */
  insertNow(row: RunRow): Promise<string>;
  /**
   * Marks a queued async run `owner` holds `running` (one more start, store/claims.ts startRuns) and
   * resolves, once that is committed, with the start's number (its `attempts`, the fence of its later
   * changes), or undefined when it was not: the run is no longer that node's queued run. Starts share the
   * commit of insertNow's group: on SQLite (one writer) its transaction, the starts of a turn of the event
   * loop one statement; on PostgreSQL its one statement, with the starts that came while the group before
   * it was written. Under load the inserts and starts are one commit instead of two.
   */
  startNow(runId: string, owner: string): Promise<number | undefined>;
  update(runId: string, changes: RunChanges): void;
  /**
   * Records how the run ended (runs/lifecycle.ts endRun): its record's changes and its webhook delivery
   * together, in one transaction, fenced by this node and by the start the end names (or the one startNow
   * made here).
   */
  finish(end: RunEnd): void;
  /** Called after each flush that wrote outbox entries (wakes the webhook deliverer). */
  onOutbox?: () => void;
  /** Called after each flush that committed runs' final states, with their ids (wakes waiting callers). */
  onFinished?: (runIds: string[]) => void;
  /** Runs whose record is held in memory here: waiting to be written, or in progress on this node. */
  pendingRuns(): number;
  /** Whether this run has changes here not yet committed (waiting, or being written now). */
  holds(runId: string): boolean;
  /** Appends a log line of the run. */
  log(runId: string, stream: 'stdout' | 'stderr' | 'system', line: string): void;
  /**
   * Attempt `attempt` (of at most `of`) of a run under a retry policy starts here: its log lines are
   * numbered after the earlier attempts' (which another node may have written), with a note first.
   */
  attemptStarted(runId: string, attempt: number, of: number): void;
  /** UTF-8 bytes of the log lines this recorder has taken to store, since it was made. */
  loggedBytes(): number;
  /**
   * Writes everything pending; resolves when it is committed, or when the write failed (what failed stays
   * pending and is retried with back-off; while the store fails, this does not try again before then).
   */
  flush(force?: boolean): Promise<void>;
  /** Writes what is pending, retrying for up to `closeRetryMs`; logs what could not be written. */
  close(): Promise<void>;
}

/** The longest line kept, in UTF-16 units (a longer one is cut, and says so). */
export const MAX_LINE = 16_384;
/** Lines kept per run; past it (or past the run's byte bound) the rest are counted and dropped. */
export const MAX_LINES_PER_RUN = 10_000;
const INSERT_CHUNK = 400;
/** How long a run in progress may stay unwritten (see flush). */
const HOLD_MS = 250;

export interface RecorderLimits {
  /** First wait after a failed write; it doubles per failure up to `retryMaxMs`. */
  retryFirstMs: number;
  retryMaxMs: number;
  /**
   * Log-line bytes kept in memory while the store fails; past it new log lines are dropped (and counted in
   * the log). Run records and webhook deliveries are never dropped: they are one per run.
   */
  maxBufferedLogBytes: number;
  /** Runs waiting in memory past which each failed write is logged as an error with the counts. */
  warnBufferedRuns: number;
  /** How long `close` keeps retrying a failing store. */
  closeRetryMs: number;
  /**
   * UTF-8 bytes of log lines stored per run (FERRY_RUN_LOG_BYTES); the lines past it are counted, not
   * stored, and the run's log ends with a line saying how many were dropped.
   */
  maxRunLogBytes: number;
}

export const DEFAULT_RECORDER_LIMITS: RecorderLimits = {
  retryFirstMs: 50,
  retryMaxMs: 5000,
  maxBufferedLogBytes: 64 * 1024 * 1024,
  warnBufferedRuns: 10_000,
  closeRetryMs: 15_000,
  maxRunLogBytes: 1024 * 1024,
};

/** Log line numbers per attempt of a retried run: attempt N's lines are numbered from (N - 1) × this. */
export const ATTEMPT_SEQ_STRIDE = 100_000;

type LogRow = { run_id: string; seq: number; at: string; stream: string; line: string };

/** A run's log so far, on the node recording it (written to run_log_stats with its lines). */
interface LogAccount {
  runId: string;
  /** The last line's seq, within this attempt's lines. */
  seq: number;
  /** Added to `seq` in the store: a later attempt's lines follow the earlier ones' (ATTEMPT_SEQ_STRIDE). */
  base?: number;
  /** UTF-8 bytes of the lines kept. */
  bytes: number;
  droppedLines: number;
  droppedBytes: number;
  /** Lines were dropped because the store was failing and the memory bound was reached. */
  storeFailing?: boolean;
}
type StatsRow = { run_id: string; bytes: number; dropped_lines: number; dropped_bytes: number };

/** The last line of a run's log when lines were dropped. */
export function droppedMarker(lines: number, bytes: number, why: string): string {
  return `… ${lines} line${lines === 1 ? '' : 's'} (${bytes} bytes) dropped: ${why}`;
}

export function createRunRecorder(deps: {
  store: Store;
  logger: Logger;
  /**
   * This node's id (cluster/node.ts). Runs started here are stamped with it, and every change the recorder
   * writes is fenced by it, by the run being unfinished and, for an async run started here, by the start
   * (store/run-updates.ts): a run another node took over or recovery settled (this one lost its lease) is
   * left alone, and so is its webhook.
   */
  owner?: string;
  /** Told of the runs' final states the fence refused (results of a node that came back too late). */
  onLateResults?: (count: number) => void;
  /** Called after each flush that wrote outbox entries (wakes the webhook deliverer). */
  onOutbox?: () => void;
  /** Called after each flush that committed runs' final states, with their ids (wakes waiting callers). */
  onFinished?: (runIds: string[]) => void;
  flushEveryMs?: number;
  limits?: Partial<RecorderLimits>;
}): RunRecorder {
  const { store, logger, owner } = deps;
  const every = deps.flushEveryMs ?? 5;
  const limits = { ...DEFAULT_RECORDER_LIMITS, ...deps.limits };
  /** PostgreSQL underneath (several connections, a round trip per statement), not SQLite (one writer, in process). */
  const pgStore = !writesOneAtATime(store);
  let pending = new Map<string, Pending>();
  let logs: LogRow[] = [];
  let logBytes = 0;
  let outbox: OutboxEntry[] = [];
  let durable: Array<{ row: RunRow; resolve(id: string): void; reject(err: unknown): void }> = [];
  let starts: Array<{
    id: string;
    owner: string;
    resolve(attempt: number | undefined): void;
    reject(err: unknown): void;
  }> = [];
  /**
   * Async runs started here (startNow) whose end is not written yet: the start's number, which fences their
   * changes (store/run-updates.ts). A null-prototype object, not a Map (runs/invoke.ts says why: `cancels`).
   */
  const startedAttempts: Record<string, number> = Object.create(null);
  let durableScheduled = false;
  // Per run with log lines: a null-prototype object, not a Map (runs/invoke.ts says why: `cancels`).
  const accounts: Record<string, LogAccount> = Object.create(null);
  /** Runs in `accounts`: while none has lines, a run's end does not look itself up there (issue 15). */
  let accountRuns = 0;
  /** Runs whose account changed since the last write (their run_log_stats row is written with the lines). */
  let dirty = new Map<string, LogAccount>();
  let timer: NodeJS.Timeout | undefined;
  let writing: Promise<void> = Promise.resolve();
  /** The batch being written now (out of `pending` until it is committed, or put back if it fails). */
  let writingBatch: Map<string, Pending> | undefined;
  /** Consecutive failed writes (0: the store is writing). */
  let failures = 0;
  let failingSince = 0;
  let droppedLines = 0;
  /** See loggedBytes. */
  let totalLogBytes = 0;

  function schedule(): void {
    if (!timer) {
      timer = setTimeout(() => {
        timer = undefined;
        void flush(false);
      }, every);
    }
  }

  function backoffMs(): number {
    return Math.min(limits.retryMaxMs, limits.retryFirstMs * 2 ** Math.min(failures - 1, 20));
  }

  /**
   * Writes a batch in one transaction (on PostgreSQL, a batch that is one statement is written without
   * one: it is atomic as it is, and BEGIN and COMMIT would be two more round trips); resolves with the ids
   * of the runs whose final state it committed.
   */
  async function write(
    batch: Map<string, Pending>,
    lines: LogRow[],
    deliveries: OutboxEntry[],
    stats: StatsRow[],
  ): Promise<string[]> {
    const inserts: RunRow[] = [];
    const updates: RunUpdate[] = [];
    for (const [id, p] of batch) {
      if (!p.inserted) inserts.push(isEmpty(p.changes) ? p.row : { ...p.row, ...p.changes });
      else if (!isEmpty(p.changes)) updates.push({ id, changes: p.changes, attempt: startedAttempts[id] });
    }
    // PostgreSQL inserts any number of rows in one statement (store/run-inserts.ts); SQLite in chunks.
    const insertChunk = pgStore ? Math.max(1, inserts.length) : INSERT_CHUNK;
    const oneStatement =
      pgStore &&
      lines.length === 0 &&
      stats.length === 0 &&
      deliveries.length === 0 &&
      (inserts.length === 0 ? updates.length > 0 && sameShape(updates) : updates.length === 0);
    // Every INSERT ignores rows already there: a retried batch whose earlier commit did happen (a lost
    // connection after COMMIT) writes nothing twice and does not fail on its own rows.
    let fenced = new Set<string>();
    const writeIn = async (trx: Store) => {
      for (let i = 0; i < inserts.length; i += insertChunk) {
        await insertRunsIgnoring(trx, inserts.slice(i, i + insertChunk));
      }
      // Fenced per run (store/run-updates.ts): on PostgreSQL one statement per shape of change.
      if (updates.length > 0) fenced = await updateRuns(trx, updates, owner);
      for (let i = 0; i < lines.length; i += INSERT_CHUNK) {
        await trx
          .insertInto('run_log_lines')
          .values(lines.slice(i, i + INSERT_CHUNK))
          .onConflict((oc) => oc.doNothing())
          .execute();
      }
      // The counts are the run's totals so far: a retried batch writes the same values again.
      for (let i = 0; i < stats.length; i += INSERT_CHUNK) {
        await trx
          .insertInto('run_log_stats')
          .values(stats.slice(i, i + INSERT_CHUNK))
          .onConflict((oc) =>
            oc.column('run_id').doUpdateSet((eb) => ({
              bytes: eb.ref('excluded.bytes'),
              dropped_lines: eb.ref('excluded.dropped_lines'),
              dropped_bytes: eb.ref('excluded.dropped_bytes'),
            })),
          )
          .execute();
      }
      // A run this node no longer holds (or in this start) is finished by whoever took it over, webhook
      // included; a run already settled keeps its end.
      const mine = fenced.size === 0 ? deliveries : deliveries.filter((d) => !fenced.has(d.runId));
      if (mine.length > 0) {
        const now = new Date().toISOString();
        const rows = mine.map((d) => ({
          run_id: d.runId,
          url: d.url,
          payload: d.payload,
          state: 'pending',
          attempts: 0,
          next_attempt_at: now,
          created_at: now,
          updated_at: now,
        }));
        for (let i = 0; i < rows.length; i += INSERT_CHUNK) {
          await trx
            .insertInto('webhook_deliveries')
            .values(rows.slice(i, i + INSERT_CHUNK))
            .onConflict((oc) => oc.doNothing())
            .execute();
        }
      }
    };
    if (oneStatement) await writeIn(store);
    else await store.transaction().execute(writeIn);
    const finished: string[] = [];
    let late = 0;
    for (const [id, p] of batch) {
      const done = isFinalState(p.row.state) || (p.changes.state !== undefined && isFinalState(p.changes.state));
      if (!done) continue;
      if (startedAttempts[id] !== undefined) delete startedAttempts[id];
      if (!fenced.has(id)) finished.push(id);
      else late += 1;
    }
    if (fenced.size > 0) {
      logger.warn(
        { runs: [...fenced].slice(0, 20), count: fenced.size, results: late },
        'run changes discarded: these runs were settled or taken over while this node could not renew its lease',
      );
      if (late > 0) deps.onLateResults?.(late);
    }
    return finished;
  }

  /** Puts a batch whose write failed back in front of what came since, so the next write has it all. */
  function requeue(batch: Map<string, Pending>, lines: LogRow[], deliveries: OutboxEntry[], stats: StatsRow[]): void {
    // A run's totals only grow: one that changed since keeps its newer account.
    for (const st of stats) {
      if (!dirty.has(st.run_id)) {
        dirty.set(st.run_id, {
          runId: st.run_id,
          seq: 0,
          bytes: st.bytes,
          droppedLines: st.dropped_lines,
          droppedBytes: st.dropped_bytes,
        });
      }
    }
    for (const [id, p] of batch) {
      const later = pending.get(id);
      pending.set(
        id,
        later
          ? {
              row: p.row,
              inserted: p.inserted,
              changes: { ...p.changes, ...later.changes },
              changedAt: p.changedAt,
              since: p.since,
            }
          : p,
      );
    }
    logs = lines.concat(logs);
    for (const l of lines) logBytes += l.line.length;
    outbox = deliveries.concat(outbox);
  }

  function failed(err: unknown): void {
    failures += 1;
    if (failures === 1) failingSince = Date.now();
    const wait = backoffMs();
    const counts = {
      err,
      failures,
      failingMs: Date.now() - failingSince,
      runs: pending.size,
      logLines: logs.length,
      webhooks: outbox.length,
      retryInMs: wait,
    };
    if (pending.size + outbox.length >= limits.warnBufferedRuns) {
      logger.error(counts, 'writing run records failed; runs are piling up in memory until the store comes back');
    } else {
      // One line per attempt: the back-off keeps it to one every retryMaxMs while the store stays down.
      logger.warn(counts, 'writing run records failed; kept in memory and retried');
    }
    if (timer) clearTimeout(timer);
    timer = setTimeout(() => {
      timer = undefined;
      void flush(false, true);
    }, wait);
  }

  function recovered(): void {
    logger.info(
      { failures, failingMs: Date.now() - failingSince, droppedLogLines: droppedLines },
      'writing run records again',
    );
    failures = 0;
    droppedLines = 0;
  }

  /** Takes what is to be written now out of the pending state (see flush for `force`). */
  function takeBatch(force: boolean) {
    const batch = new Map<string, Pending>();
    const held = new Map<string, Pending>();
    let holding = 0;
    const now = Date.now();
    for (const [id, p] of pending) {
      // A row written with nothing new to write (an async run waiting or running) stays as it is: it is
      // neither written nor copied, however many flushes it waits through.
      if (p.inserted && isEmpty(p.changes)) {
        held.set(id, p);
        continue;
      }
      const done = isFinalState(p.row.state) || (p.changes.state !== undefined && isFinalState(p.changes.state));
      // A row already written holds back its changes for HOLD_MS too, from the first unwritten one: an async
      // run's `running` (its start is committed by startRuns already) is then most often written with its
      // end, in one UPDATE instead of two.
      const young = p.inserted
        ? p.changedAt !== undefined && now - p.changedAt < HOLD_MS
        : now - (p.since ?? Date.parse(p.row.created_at)) < HOLD_MS;
      if (!force && !done && young) {
        held.set(id, p);
        holding += 1;
      } else batch.set(id, p);
    }
    const lines = logs;
    const deliveries = outbox;
    const stats: StatsRow[] = [];
    for (const a of dirty.values()) {
      stats.push({ run_id: a.runId, bytes: a.bytes, dropped_lines: a.droppedLines, dropped_bytes: a.droppedBytes });
    }
    dirty = new Map();
    outbox = [];
    logs = [];
    logBytes = 0;
    // Runs still in progress stay tracked (as inserted) so their next changes become UPDATEs.
    pending = held;
    for (const [id, p] of batch) {
      const done = isFinalState(p.row.state) || (p.changes.state !== undefined && isFinalState(p.changes.state));
      if (!done) pending.set(id, { row: { ...p.row, ...p.changes }, inserted: true, changes: {} });
    }
    if (holding > 0) schedule();
    return { batch, lines, deliveries, stats };
  }

  /**
   * Writes what is pending. The timer's flushes (`force` false) hold back runs that are not finished and
   * not yet written while they are younger than HOLD_MS: most runs end by then, and are written once,
   * final, instead of as an INSERT then an UPDATE. Changes to a run already written (not its end) are held
   * HOLD_MS from the first of them in the same way. Readers (the API) flush with `force`.
   *
   * The batch is taken when the write before it has ended, not when flush is called: a batch that failed
   * is back in the pending state by then, so no later write can UPDATE a run whose INSERT has not happened.
   */
  function flush(force = true, retry = false): Promise<void> {
    // While the store fails, only the back-off timer (and close) try again.
    if (failures > 0 && !retry) return writing;
    if (pending.size === 0 && logs.length === 0 && outbox.length === 0 && dirty.size === 0) return writing;
    if (timer) {
      clearTimeout(timer);
      timer = undefined;
    }
    writing = writing.then(async () => {
      if (failures > 0 && !retry) return;
      if (pending.size === 0 && logs.length === 0 && outbox.length === 0 && dirty.size === 0) return;
      const { batch, lines, deliveries, stats } = takeBatch(force);
      if (batch.size === 0 && lines.length === 0 && deliveries.length === 0 && stats.length === 0) return;
      let finished: string[];
      writingBatch = batch;
      try {
        finished = await write(batch, lines, deliveries, stats);
      } catch (err) {
        requeue(batch, lines, deliveries, stats);
        failed(err);
        return;
      } finally {
        writingBatch = undefined;
      }
      if (finished.length > 0) recorder.onFinished?.(finished);
      if (failures > 0) {
        recovered();
        // What came in while the retry ran found the back-off in force and was not scheduled.
        if (pending.size > 0 || logs.length > 0 || outbox.length > 0 || dirty.size > 0) schedule();
      }
      if (deliveries.length > 0) recorder.onOutbox?.();
    });
    return writing;
  }

  /**
   * Inserts a group of async runs and marks another group started, in one transaction; a row whose
   * idempotency key another run holds resolves to that run. On PostgreSQL both are one statement
   * (store/run-inserts.ts insertRunsAndStart; or the one of them there is), committed as it is: one round
   * trip and one commit for the group, no BEGIN and COMMIT.
   */
  async function insertGroup(group: typeof durable, starting: typeof starts): Promise<void> {
    const resolved = new Map<string, string>();
    let started = new Map<string, number>();
    const rows = group.map((g) => g.row);
    const inserted = new Set<string>();
    const owners = new Set(starting.map((s) => s.owner));
    const startedAt = new Date().toISOString();
    const writeIn = async (trx: Store) => {
      // Starts first: they never concern the rows inserted here (a run is started only once its insert
      // resolved), and a node's starts are a single statement.
      for (const by of owners) {
        const ids = starting.filter((s) => s.owner === by).map((s) => s.id);
        for (const [id, attempt] of await startRuns(trx, by, ids, startedAt)) started.set(id, attempt);
      }
      const chunk = pgStore ? Math.max(1, rows.length) : INSERT_CHUNK;
      for (let i = 0; i < rows.length; i += chunk) {
        // Per row, not per group: one clash on the idempotency key must not roll back the others.
        const { ids } = await insertRunsIgnoring(trx, rows.slice(i, i + chunk), true);
        for (const id of ids) inserted.add(id);
      }
    };
    const [by] = owners;
    if (pgStore && owners.size <= 1 && (rows.length === 0 || by === undefined)) await writeIn(store);
    else if (pgStore && by !== undefined && owners.size === 1) {
      const done = await insertRunsAndStart(store, rows, { owner: by, runIds: starting.map((s) => s.id), startedAt });
      for (const id of done.ids) inserted.add(id);
      started = done.started;
    } else await store.transaction().execute(writeIn);
    for (const row of rows) {
      if (inserted.has(row.id)) {
        resolved.set(row.id, row.id);
        continue;
      }
      if (row.idempotency_key === null) continue;
      // The run that holds the key is committed: an insert that meets a key of a transaction in progress
      // waits for it to end, and skips the row only once it committed.
      const winner = await store
        .selectFrom('runs')
        .select('id')
        .where('project_id', '=', row.project_id)
        .where('app_id', '=', row.app_id)
        .where('idempotency_key', '=', row.idempotency_key)
        .executeTakeFirst();
      if (winner) resolved.set(row.id, winner.id);
    }
    for (const s of starting) s.resolve(markStarted(s.id, started.get(s.id)));
    for (const g of group) {
      const id = resolved.get(g.row.id);
      if (id) g.resolve(id);
      else g.reject(new Error(`run ${g.row.id} was not inserted and holds no idempotency key another run has`));
    }
  }

  /**
   * Async runs' inserts go one group after another, but not behind the flushes of run changes: nothing of
   * a run is written before its insert (its changes only start once the insert resolved), and an async
   * call's 202 should wait for its own commit only. On PostgreSQL the two then use two connections.
   *
   * On SQLite a group is what arrived in one turn of the event loop (its write blocks the loop anyway). On
   * PostgreSQL a group is everything that arrived while the one before it was being written (group commit:
   * the busier the server, the larger the groups, at one round trip each), so one group at a time is in
   * flight. The starts ride along in both (startNow): every commit waits for a WAL flush, and on a busy
   * disk PostgreSQL's flushes are what a 202 waits for, so each commit fewer shortens the others' wait.
   */
  let durableWriting: Promise<void> = Promise.resolve();
  /** PostgreSQL: a group is being written (the next one is taken when it ends). */
  let durableBusy = false;

  function flushDurable(): void {
    durableScheduled = false;
    if (pgStore) {
      if (durableBusy || (durable.length === 0 && starts.length === 0)) return;
      const group = durable;
      const starting = starts;
      durable = [];
      starts = [];
      durableBusy = true;
      durableWriting = insertGroup(group, starting)
        .catch((err: unknown) => {
          for (const s of starting) s.reject(err);
          for (const g of group) g.reject(err);
        })
        .finally(() => {
          durableBusy = false;
          flushDurable();
        });
      return;
    }
    const group = durable;
    const starting = starts;
    durable = [];
    starts = [];
    durableWriting = durableWriting
      .then(() => insertGroup(group, starting))
      .catch((err: unknown) => {
        for (const s of starting) s.reject(err);
        for (const g of group) g.reject(err);
      });
  }

  /** A start committed (attempt known) or refused (undefined): its number when the run is this node's to run now. */
  function markStarted(runId: string, attempt: number | undefined): number | undefined {
    if (attempt !== undefined) startedAttempts[runId] = attempt;
    return attempt;
  }

  function scheduleDurable(): void {
    if (!durableScheduled) {
      durableScheduled = true;
      setImmediate(flushDurable);
    }
  }

  function dropLine(account: LogAccount, text: string): void {
    account.storeFailing = true;
    account.droppedLines += 1;
    account.droppedBytes += Buffer.byteLength(text);
    dirty.set(account.runId, account);
    droppedLines += 1;
    if (droppedLines === 1 || droppedLines % 10_000 === 0) {
      logger.error(
        { droppedLogLines: droppedLines, bufferedBytes: logBytes, maxBufferedLogBytes: limits.maxBufferedLogBytes },
        'run log lines dropped: the store is failing and the lines kept in memory reached their limit',
      );
    }
  }

  /** A line past the run's bounds: counted only. */
  function dropOver(account: LogAccount, text: string): void {
    account.droppedLines += 1;
    account.droppedBytes += Buffer.byteLength(text);
    dirty.set(account.runId, account);
    schedule();
  }

  /** The run ended with lines dropped: its log's last line says how many (the bounds do not apply to it). */
  function endDropped(account: LogAccount): void {
    const line = droppedMarker(
      account.droppedLines,
      account.droppedBytes,
      account.storeFailing
        ? 'the store was failing and the lines waiting in memory reached their bound'
        : `a run's log keeps at most ${limits.maxRunLogBytes} bytes and ${MAX_LINES_PER_RUN} lines`,
    );
    account.seq += 1;
    logs.push({
      run_id: account.runId,
      seq: (account.base ?? 0) + account.seq,
      at: isoTime(Date.now()),
      stream: 'system',
      line,
    });
    logBytes += line.length;
    account.bytes += Buffer.byteLength(line);
    dirty.set(account.runId, account);
  }

  const recorder: RunRecorder = {
    ...(deps.onOutbox ? { onOutbox: deps.onOutbox } : {}),
    ...(deps.onFinished ? { onFinished: deps.onFinished } : {}),
    start(row) {
      if (owner !== undefined && row.owner === null) row.owner = owner;
      pending.set(row.id, { row, inserted: false, changes: {}, since: Date.now() });
      schedule();
    },
    insertNow(row) {
      return new Promise<string>((resolve, reject) => {
        durable.push({
          row,
          // Nothing is kept of the row: later changes (update) are UPDATEs of the committed run. A gateway of
          // a cluster accepts runs it never performs; keeping each row until its end leaked them all.
          resolve,
          reject,
        });
        scheduleDurable();
      });
    },
    startNow(runId, by) {
      return new Promise<number | undefined>((resolve, reject) => {
        starts.push({ id: runId, owner: by, resolve, reject });
        scheduleDurable();
      });
    },
    finish(end) {
      if (end.attempt !== undefined) startedAttempts[end.runId] = end.attempt;
      if (end.outbox) outbox.push(end.outbox);
      recorder.update(end.runId, end.changes);
    },
    update(runId, changes) {
      const p = pending.get(runId);
      if (p) {
        if (p.inserted && p.changedAt === undefined) p.changedAt = Date.now();
        // A run not written yet is written whole, once: its changes go into the row itself.
        Object.assign(p.inserted ? p.changes : p.row, changes);
      } else
        pending.set(runId, {
          row: { id: runId } as RunRow,
          inserted: true,
          changes: { ...changes },
          changedAt: Date.now(),
        });
      if (accountRuns > 0 && changes.state !== undefined && isFinalState(changes.state)) {
        const account = accounts[runId];
        if (account !== undefined) {
          delete accounts[runId];
          accountRuns -= 1;
          if (account.droppedLines > 0) endDropped(account);
        }
      }
      schedule();
    },
    pendingRuns() {
      return pending.size;
    },
    holds(runId) {
      return pending.has(runId) || writingBatch?.has(runId) === true;
    },
    attemptStarted(runId, attempt, of) {
      if (attempt <= 1) return;
      // The earlier attempt ran here: its lines go on. Elsewhere (or before a restart): numbered after them.
      if (accounts[runId] === undefined) {
        accounts[runId] = {
          runId,
          seq: 0,
          base: (attempt - 1) * ATTEMPT_SEQ_STRIDE,
          bytes: 0,
          droppedLines: 0,
          droppedBytes: 0,
        };
        accountRuns += 1;
      }
      recorder.log(runId, 'system', `attempt ${attempt} of ${of} started`);
    },
    log(runId, stream, text) {
      let account = accounts[runId];
      if (account === undefined) {
        account = { runId, seq: 0, bytes: 0, droppedLines: 0, droppedBytes: 0 };
        accounts[runId] = account;
        accountRuns += 1;
      }
      // Once a line is dropped, so are all after it: what is kept is the log's beginning, whole.
      if (account.droppedLines > 0 || account.seq >= MAX_LINES_PER_RUN) return dropOver(account, text);
      const line = text.length > MAX_LINE ? `${text.slice(0, MAX_LINE)}… (line cut)` : text;
      const size = Buffer.byteLength(line);
      if (account.bytes + size > limits.maxRunLogBytes) return dropOver(account, text);
      if (logBytes + line.length > limits.maxBufferedLogBytes) return dropLine(account, text);
      account.seq += 1;
      account.bytes += size;
      totalLogBytes += size;
      dirty.set(runId, account);
      logs.push({ run_id: runId, seq: (account.base ?? 0) + account.seq, at: isoTime(Date.now()), stream, line });
      logBytes += line.length;
      schedule();
    },
    loggedBytes() {
      return totalLogBytes;
    },
    flush,
    async close() {
      const end = Date.now() + limits.closeRetryMs;
      // A group written on PostgreSQL starts the next one when it ends: wait for the last.
      for (let last = durableWriting; ; last = durableWriting) {
        await last;
        if (durableWriting === last) break;
      }
      await flush(true, true);
      await writing;
      while (failures > 0 && Date.now() < end) {
        await new Promise((r) => setTimeout(r, Math.min(backoffMs(), Math.max(0, end - Date.now()))));
        await flush(true, true);
        await writing;
      }
      if (timer) clearTimeout(timer);
      timer = undefined;
      if (failures > 0) {
        logger.error(
          { runs: pending.size, logLines: logs.length, webhooks: outbox.length },
          'closing with run records the store would not take: they are lost',
        );
      }
    },
  };
  return recorder;
}

/** Whether every update goes into the same statement (store/run-updates.ts updateRuns). */
function sameShape(updates: readonly RunUpdate[]): boolean {
  const first = updates[0];
  if (first === undefined) return true;
  const shape = updateShape(first);
  for (let i = 1; i < updates.length; i++) if (updateShape(updates[i]!) !== shape) return false;
  return true;
}

function isEmpty(changes: RunChanges): boolean {
  for (const _ in changes) return false;
  return true;
}
