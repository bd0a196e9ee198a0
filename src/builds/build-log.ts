/**
 * Build logs: lines appended in order to the store, readable from any sequence number, and followable
 * while the build runs. Followers poll the store (so a follower on another gateway works the same) and are
 * woken early by an in-process signal when a line is written here.
 */
import { EventEmitter } from 'node:events';
import type { Store } from '../store/index.js';

export interface LogLine {
  seq: number;
  at: string;
  line: string;
}

export interface BuildLog {
  /**
   * Appends a line; writes are ordered per build. Long lines are cut at 8 KiB. Past the build's byte bound
   * (FERRY_BUILD_LOG_BYTES) lines are counted, not stored, but those given with `always` (Ferry's own
   * notes: the build's outcome).
   */
  append(buildId: string, line: string, always?: boolean): void;
  /**
   * Resolves when every line appended so far for the build is in the store; first writes how many lines
   * the bound dropped, if any.
   */
  flush(buildId: string): Promise<void>;
  read(buildId: string, afterSeq: number, limit?: number): Promise<LogLine[]>;
  /** Waits until a line is appended for the build here (or it ended: `ended`), or `ms` passes. */
  waitForLines(buildId: string, ms: number, signal?: AbortSignal): Promise<void>;
  /**
   * The build's final state is in the store: followers here look again now (its last line was written
   * before the state, so without this they would wait out their poll to see the end).
   */
  ended(buildId: string): void;
}

const MAX_LINE = 8192;
/** Lines one INSERT writes at most (4 columns each: far below SQLite's and PostgreSQL's parameter limits). */
const MAX_LINES_PER_WRITE = 500;
/** UTF-8 bytes of lines stored per build by default (FERRY_BUILD_LOG_BYTES). */
export const DEFAULT_BUILD_LOG_BYTES = 4 * 1024 * 1024;

interface BuildLogState {
  seq: number;
  chain: Promise<void>;
  /** Lines appended and not yet given to a write: the next write takes them all, in one statement. */
  queued: string[];
  /** Bytes of the lines appended (and stored) by this process for the build. */
  bytes: number;
  droppedLines: number;
  droppedBytes: number;
}

export function createBuildLog(deps: { store: Store; maxBytes?: number }): BuildLog {
  const { store } = deps;
  const maxBytes = deps.maxBytes ?? DEFAULT_BUILD_LOG_BYTES;
  const wake = new EventEmitter();
  wake.setMaxListeners(0);
  const pending = new Map<string, BuildLogState>();

  async function nextSeq(buildId: string): Promise<number> {
    const row = await store
      .selectFrom('build_log_lines')
      .select((eb) => eb.fn.max('seq').as('max'))
      .where('build_id', '=', buildId)
      .executeTakeFirst();
    return Number(row?.max ?? 0);
  }

  /**
   * Queues a line; lines appended while a write is under way go together in the next one (one multi-row
   * INSERT, one commit), in order.
   */
  function appendLine(buildId: string, s: BuildLogState, line: string): void {
    s.queued.push(line);
    if (s.queued.length > 1) return; // a write is already chained for the queue
    s.chain = s.chain
      .then(async () => {
        // A rebuilt build (after a restart) continues its log rather than clashing with old lines.
        if (s.seq < 0) s.seq = await nextSeq(buildId);
        const lines = s.queued.splice(0, MAX_LINES_PER_WRITE);
        const at = new Date().toISOString();
        const rows = lines.map((text) => ({ build_id: buildId, seq: ++s.seq, at, line: text }));
        if (s.queued.length > 0) {
          // More than one write's worth: the rest go in the writes chained after this one.
          const rest = s.queued.splice(0);
          for (const text of rest) appendLine(buildId, s, text);
        }
        await store.insertInto('build_log_lines').values(rows).execute();
        wake.emit(buildId);
      })
      .catch(() => {
        // A log line that cannot be written must not fail the build; the store error surfaces elsewhere.
      });
  }

  return {
    append(buildId, text, always = false) {
      const line = text.length > MAX_LINE ? `${text.slice(0, MAX_LINE)}… (line cut)` : text;
      let state = pending.get(buildId);
      if (!state) {
        state = { seq: -1, chain: Promise.resolve(), queued: [], bytes: 0, droppedLines: 0, droppedBytes: 0 };
        pending.set(buildId, state);
      }
      const size = Buffer.byteLength(line);
      // Once a line is dropped, so are the tools' lines after it: what is kept is the log's beginning.
      if (!always && (state.droppedLines > 0 || state.bytes + size > maxBytes)) {
        if (state.droppedLines === 0) {
          appendLine(
            buildId,
            state,
            `… the build log keeps at most ${maxBytes} bytes: the build's further output is dropped (counted at its end)`,
          );
        }
        state.droppedLines += 1;
        state.droppedBytes += Buffer.byteLength(text);
        return;
      }
      state.bytes += size;
      appendLine(buildId, state, line);
    },
    async flush(buildId) {
      const state = pending.get(buildId);
      if (!state) return;
      if (state.droppedLines > 0) {
        appendLine(
          buildId,
          state,
          `… ${state.droppedLines} line${state.droppedLines === 1 ? '' : 's'} (${state.droppedBytes} bytes) of build output dropped`,
        );
        state.droppedLines = 0;
        state.droppedBytes = 0;
      }
      // Until the chain stops growing: a write that found more queued than it takes chains another.
      let chain: Promise<void>;
      do {
        chain = state.chain;
        await chain;
      } while (state.chain !== chain);
      pending.delete(buildId); // nothing appended meanwhile: forget the counter
    },
    async read(buildId, afterSeq, limit = 10_000) {
      return store
        .selectFrom('build_log_lines')
        .select(['seq', 'at', 'line'])
        .where('build_id', '=', buildId)
        .where('seq', '>', afterSeq)
        .orderBy('seq')
        .limit(limit)
        .execute();
    },
    ended(buildId) {
      wake.emit(buildId);
    },
    waitForLines(buildId, ms, signal) {
      return new Promise((resolve) => {
        const done = () => {
          clearTimeout(timer);
          wake.off(buildId, done);
          signal?.removeEventListener('abort', done);
          resolve();
        };
        const timer = setTimeout(done, ms);
        wake.on(buildId, done);
        signal?.addEventListener('abort', done, { once: true });
      });
    },
  };
}
