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
import type { Store } from '../store/index.js';
import type { RunsTable } from '../store/schema.js';

export type RunRow = RunsTable;

/** A new run record, state `queued`: what the caller knows at acceptance; the rest starts empty. */
export function newRunRow(fields: {
  id: string;
  build: { projectId: string; appId: string; buildId: string };
  fn: string;
  mode: RunRow['mode'];
  input: string | null;
  webhookUrl?: string | undefined;
  webhookSecret?: string | undefined;
  idempotencyKey?: string | undefined;
  httpRequest?: string | undefined;
  createdAt?: number;
}): RunRow {
  return {
    id: fields.id,
    project_id: fields.build.projectId,
    app_id: fields.build.appId,
    build_id: fields.build.buildId,
    function_name: fields.fn,
    mode: fields.mode,
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
    created_at: new Date(fields.createdAt ?? Date.now()).toISOString(),
    started_at: null,
    finished_at: null,
    run_time_ms: null,
  };
}
export type RunChanges = Partial<Omit<RunRow, 'id'>>;

interface Pending {
  row: RunRow;
  /** True once the row exists in the store; later changes are UPDATEs. */
  inserted: boolean;
  changes: RunChanges;
}

/** A webhook delivery to write in the same transaction as the run's final state (invariant 2). */
export interface OutboxEntry {
  runId: string;
  url: string;
  payload: string;
}

export interface RunRecorder {
  /** Records a new run (written at the next flush). */
  start(row: RunRow): void;
  /**
   * Inserts a run and resolves once it is committed (async runs: nothing is acknowledged before it is
   * durable). Concurrent calls share one transaction (group commit).
   */
  insertNow(row: RunRow): Promise<void>;
  update(runId: string, changes: RunChanges): void;
  /** Records the run's final state and its webhook delivery together, in one transaction. */
  finish(runId: string, changes: RunChanges, outbox?: OutboxEntry): void;
  /** Called after each flush that wrote outbox entries (wakes the webhook deliverer). */
  onOutbox?: () => void;
  /** Appends a log line of the run. */
  log(runId: string, stream: 'stdout' | 'stderr' | 'system', line: string): void;
  /** Writes everything pending; resolves when it is committed. */
  flush(force?: boolean): Promise<void>;
  close(): Promise<void>;
}

const MAX_LINE = 16_384;
const MAX_LINES_PER_RUN = 10_000;
const INSERT_CHUNK = 400;
/** How long a run in progress may stay unwritten (see flush). */
const HOLD_MS = 250;

export function createRunRecorder(deps: { store: Store; logger: Logger; flushEveryMs?: number }): RunRecorder {
  const { store, logger } = deps;
  const every = deps.flushEveryMs ?? 5;
  let pending = new Map<string, Pending>();
  let logs: Array<{ run_id: string; seq: number; at: string; stream: string; line: string }> = [];
  let outbox: OutboxEntry[] = [];
  let durable: Array<{ row: RunRow; resolve(): void; reject(err: unknown): void }> = [];
  let durableScheduled = false;
  const seqs = new Map<string, number>();
  let timer: NodeJS.Timeout | undefined;
  let writing: Promise<void> = Promise.resolve();

  function schedule(): void {
    if (!timer) timer = setTimeout(() => void flush(false), every);
  }

  async function write(batch: Map<string, Pending>, lines: typeof logs, deliveries: OutboxEntry[]): Promise<void> {
    const inserts: RunRow[] = [];
    const updates: Array<[string, RunChanges]> = [];
    for (const [id, p] of batch) {
      if (!p.inserted) inserts.push({ ...p.row, ...p.changes });
      else if (Object.keys(p.changes).length > 0) updates.push([id, p.changes]);
    }
    await store.transaction().execute(async (trx) => {
      for (let i = 0; i < inserts.length; i += INSERT_CHUNK) {
        await trx
          .insertInto('runs')
          .values(inserts.slice(i, i + INSERT_CHUNK))
          .execute();
      }
      for (const [id, changes] of updates) await trx.updateTable('runs').set(changes).where('id', '=', id).execute();
      for (let i = 0; i < lines.length; i += INSERT_CHUNK) {
        await trx
          .insertInto('run_log_lines')
          .values(lines.slice(i, i + INSERT_CHUNK))
          .execute();
      }
      if (deliveries.length > 0) {
        const now = new Date().toISOString();
        const rows = deliveries.map((d) => ({
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
            .execute();
        }
      }
    });
  }

  /**
   * Writes what is pending. The timer's flushes (`force` false) hold back runs that are not finished and
   * not yet written while they are younger than HOLD_MS: most runs end by then, and are written once,
   * final, instead of as an INSERT then an UPDATE. Readers (the API) flush with `force`.
   */
  function flush(force = true): Promise<void> {
    if (timer) {
      clearTimeout(timer);
      timer = undefined;
    }
    if (pending.size === 0 && logs.length === 0 && outbox.length === 0) return writing;
    const batch = new Map<string, Pending>();
    const held = new Map<string, Pending>();
    const now = Date.now();
    for (const [id, p] of pending) {
      const done = isFinal(p.row.state) || (p.changes.state !== undefined && isFinal(p.changes.state));
      if (!force && !done && !p.inserted && now - Date.parse(p.row.created_at) < HOLD_MS) held.set(id, p);
      else batch.set(id, p);
    }
    const lines = logs;
    const deliveries = outbox;
    outbox = [];
    // Runs still in progress stay tracked (as inserted) so their next changes become UPDATEs.
    pending = held;
    for (const [id, p] of batch) {
      const done = isFinal(p.row.state) || (p.changes.state !== undefined && isFinal(p.changes.state));
      if (!done) pending.set(id, { row: { ...p.row, ...p.changes }, inserted: true, changes: {} });
    }
    if (held.size > 0) schedule();
    logs = [];
    writing = writing
      .then(() => write(batch, lines, deliveries))
      .then(() => {
        if (deliveries.length > 0) recorder.onOutbox?.();
      })
      .catch((err: unknown) => logger.error({ err, runs: batch.size }, 'writing run records failed'));
    return writing;
  }

  function flushDurable(): void {
    durableScheduled = false;
    const group = durable;
    durable = [];
    writing = writing
      .then(async () => {
        await store.transaction().execute(async (trx) => {
          const rows = group.map((g) => g.row);
          for (let i = 0; i < rows.length; i += INSERT_CHUNK) {
            await trx
              .insertInto('runs')
              .values(rows.slice(i, i + INSERT_CHUNK))
              .execute();
          }
        });
        for (const g of group) g.resolve();
      })
      .catch((err: unknown) => {
        for (const g of group) g.reject(err);
      });
  }

  const recorder: RunRecorder = {
    start(row) {
      pending.set(row.id, { row, inserted: false, changes: {} });
      schedule();
    },
    insertNow(row) {
      return new Promise<void>((resolve, reject) => {
        durable.push({
          row,
          resolve: () => {
            // Later changes to the run are UPDATEs of the committed row.
            if (!pending.has(row.id)) pending.set(row.id, { row, inserted: true, changes: {} });
            resolve();
          },
          reject,
        });
        if (!durableScheduled) {
          durableScheduled = true;
          setImmediate(flushDurable);
        }
      });
    },
    finish(runId, changes, entry) {
      if (entry) outbox.push(entry);
      recorder.update(runId, changes);
    },
    update(runId, changes) {
      const p = pending.get(runId);
      if (p) Object.assign(p.changes, changes);
      else pending.set(runId, { row: { id: runId } as RunRow, inserted: true, changes: { ...changes } });
      if (changes.state !== undefined && isFinal(changes.state)) seqs.delete(runId);
      schedule();
    },
    log(runId, stream, text) {
      const seq = (seqs.get(runId) ?? 0) + 1;
      if (seq > MAX_LINES_PER_RUN) return;
      seqs.set(runId, seq);
      const line =
        seq === MAX_LINES_PER_RUN
          ? `(log cut: a run keeps at most ${MAX_LINES_PER_RUN} lines)`
          : text.length > MAX_LINE
            ? `${text.slice(0, MAX_LINE)}… (line cut)`
            : text;
      logs.push({ run_id: runId, seq, at: new Date().toISOString(), stream, line });
      schedule();
    },
    flush,
    async close() {
      await flush();
      await writing;
    },
  };
  return recorder;
}

function isFinal(state: string): boolean {
  return state === 'success' || state === 'failure' || state === 'timeout' || state === 'cancelled';
}
