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
export type RunChanges = Partial<Omit<RunRow, 'id'>>;

interface Pending {
  row: RunRow;
  /** True once the row exists in the store; later changes are UPDATEs. */
  inserted: boolean;
  changes: RunChanges;
}

export interface RunRecorder {
  /** Records a new run (written at the next flush). */
  start(row: RunRow): void;
  /** Inserts a run now and resolves when it is committed. */
  insertNow(row: RunRow): Promise<void>;
  update(runId: string, changes: RunChanges): void;
  /** Appends a log line of the run. */
  log(runId: string, stream: 'stdout' | 'stderr' | 'system', line: string): void;
  /** Writes everything pending; resolves when it is committed. */
  flush(): Promise<void>;
  close(): Promise<void>;
}

const MAX_LINE = 16_384;
const MAX_LINES_PER_RUN = 10_000;
const INSERT_CHUNK = 400;

export function createRunRecorder(deps: { store: Store; logger: Logger; flushEveryMs?: number }): RunRecorder {
  const { store, logger } = deps;
  const every = deps.flushEveryMs ?? 5;
  let pending = new Map<string, Pending>();
  let logs: Array<{ run_id: string; seq: number; at: string; stream: string; line: string }> = [];
  const seqs = new Map<string, number>();
  let timer: NodeJS.Timeout | undefined;
  let writing: Promise<void> = Promise.resolve();

  function schedule(): void {
    if (!timer) timer = setTimeout(() => void flush(), every);
  }

  async function write(batch: Map<string, Pending>, lines: typeof logs): Promise<void> {
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
    });
  }

  function flush(): Promise<void> {
    if (timer) {
      clearTimeout(timer);
      timer = undefined;
    }
    if (pending.size === 0 && logs.length === 0) return writing;
    const batch = pending;
    const lines = logs;
    // Runs still in progress stay tracked (as inserted) so their next changes become UPDATEs.
    pending = new Map();
    for (const [id, p] of batch) {
      const done = isFinal(p.row.state) || (p.changes.state !== undefined && isFinal(p.changes.state));
      if (!done) pending.set(id, { row: { ...p.row, ...p.changes }, inserted: true, changes: {} });
    }
    logs = [];
    writing = writing
      .then(() => write(batch, lines))
      .catch((err: unknown) => logger.error({ err, runs: batch.size }, 'writing run records failed'));
    return writing;
  }

  return {
    start(row) {
      pending.set(row.id, { row, inserted: false, changes: {} });
      schedule();
    },
    async insertNow(row) {
      await writing;
      await store.insertInto('runs').values(row).execute();
      pending.set(row.id, { row, inserted: true, changes: {} });
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
}

function isFinal(state: string): boolean {
  return state === 'success' || state === 'failure' || state === 'timeout' || state === 'cancelled';
}
