/**
 * Checkpoints of the SQLite store's write-ahead log, off the server's thread.
 *
 * By default SQLite checkpoints in the connection whose commit brings the log past 1,000 pages: that commit
 * copies the log's pages into the database file and syncs both before it returns. better-sqlite3 is
 * synchronous, so the server's event loop waits with it, every route included. On a small store it is a few
 * milliseconds; on a large one, or after a retention pass deleted rows all over the file, the pages are
 * scattered and the copy and sync take longer. With SQLite's default, issue 31's bench:scale took 89 s to
 * delete 900,000 runs on SQLite; with the thread, 50 to 60 s (bench/README.md).
 *
 * Here the server's connection never checkpoints (`wal_autocheckpoint = 0`). Once the log has grown past
 * `startBytes` (the size at which SQLite's default would have checkpointed), a worker thread
 * (sqlite-checkpoint-worker.ts) with its own connection checkpoints every `intervalMs`, PASSIVE: it waits on
 * nobody and nobody waits on it. SQLite starts the log over at the next write that finds all of it copied;
 * should a steady stream of writes never leave that moment, the log is started over once it holds 64 MiB:
 * the thread asks, the server's connection is held (`hold`, given by the driver: its statements wait their
 * turn, off the event loop), the thread copies the last frames, and the hold ends (see the worker). A store
 * that never writes that much (most tests, a quiet install) never starts the thread. If the thread fails,
 * the connection checkpoints itself again as SQLite's default does, and the failure is logged. On close the
 * thread checkpoints once more and ends before the connection closes (the last connection to close then
 * removes the log, as before).
 */
import fs from 'node:fs/promises';
import { Worker } from 'node:worker_threads';
import type SqliteDatabase from 'better-sqlite3';

/** SQLite's default `wal_autocheckpoint`, restored when the thread fails. */
const SQLITE_DEFAULT_AUTOCHECKPOINT_PAGES = 1000;

export interface SqliteCheckpointerOptions {
  /** The log's size at which the thread starts (default 4 MiB: 1,000 pages of 4 KiB). */
  startBytes?: number;
  /** How often the thread starts it looks at the log's size (default 1,000 ms). */
  lookMs?: number;
  /** How often the thread checkpoints (default 200 ms). */
  intervalMs?: number;
  /** The log's frames past which the thread forces it to start over (default 16× `startBytes`, 4 KiB pages). */
  restartFrames?: number;
  /** Told of a failed checkpoint or a failed thread (the store has no logger of its own). */
  onProblem?: (message: string) => void;
  /** Told each time the log was made to start over: how long the connection was held, the log's frames. */
  onRestart?: (restart: { heldMs: number; frames: number }) => void;
}

/** Holds the server's connection (no statement runs) until the returned function is called. */
export type HoldConnection = () => Promise<() => void>;

/** Longest the connection is held for the thread (a RESTART with no reader of the server takes milliseconds). */
const HOLD_MAX_MS = 5_000;

export class SqliteCheckpointer {
  readonly #sqlite: SqliteDatabase.Database;
  readonly #file: string;
  readonly #startBytes: number;
  readonly #intervalMs: number;
  readonly #restartFrames: number;
  readonly #onProblem: (message: string) => void;
  readonly #onRestart: (restart: { heldMs: number; frames: number }) => void;
  readonly #look: NodeJS.Timeout;
  #hold: HoldConnection | undefined;
  /** Holding (or waiting to hold) the connection for the thread. */
  #holding = false;
  /** Called when the thread says it restarted the log (its frames), or ended (`'ended'`): the hold ends. */
  #restarted: ((outcome: number | 'ended') => void) | undefined;
  #worker: Worker | undefined;
  #exited: Promise<void> | undefined;
  #closing = false;
  #looking = false;

  constructor(sqlite: SqliteDatabase.Database, file: string, options: SqliteCheckpointerOptions = {}) {
    this.#sqlite = sqlite;
    this.#file = file;
    this.#startBytes = options.startBytes ?? 4 * 1024 * 1024;
    this.#intervalMs = options.intervalMs ?? 200;
    this.#restartFrames = options.restartFrames ?? (this.#startBytes * 16) / 4096;
    this.#onProblem = options.onProblem ?? (() => {});
    this.#onRestart = options.onRestart ?? (() => {});
    sqlite.pragma('wal_autocheckpoint = 0');
    this.#look = setInterval(() => void this.#lookAtLog(), options.lookMs ?? 1000);
    this.#look.unref();
  }

  /** The driver's way to hold the connection; without it the thread restarts the log without a hold. */
  holdWith(hold: HoldConnection): void {
    this.#hold = hold;
  }

  async #lookAtLog(): Promise<void> {
    if (this.#looking || this.#worker || this.#closing) return;
    this.#looking = true;
    try {
      const { size } = await fs.stat(`${this.#file}-wal`);
      if (size >= this.#startBytes && !this.#closing) this.#start();
    } catch {
      // No log yet (nothing written): look again next time.
    } finally {
      this.#looking = false;
    }
  }

  #start(): void {
    clearInterval(this.#look);
    const worker = new Worker(new URL('./sqlite-checkpoint-worker.js', import.meta.url), {
      workerData: { file: this.#file, intervalMs: this.#intervalMs, restartFrames: this.#restartFrames },
    });
    this.#worker = worker;
    worker.on('message', (message: { error?: string; restart?: number; restarted?: { frames: number } }) => {
      if (message.error) this.#onProblem(`a checkpoint of the SQLite log failed: ${message.error}`);
      if (message.restart !== undefined) void this.#holdForRestart(worker);
      if (message.restarted) this.#restarted?.(message.restarted.frames);
    });
    worker.on('error', (err: Error) => this.#fallBack(`the SQLite checkpoint thread failed: ${err.message}`));
    this.#exited = new Promise((resolve) =>
      worker.once('exit', (code) => {
        this.#fallBack(`the SQLite checkpoint thread ended (code ${code})`);
        this.#restarted?.('ended');
        resolve();
      }),
    );
  }

  /**
   * The thread asks to restart the log: hold the connection (once the statement or transaction in progress
   * is done), tell the thread, and let go when it says it is done, or ended, or after HOLD_MAX_MS.
   */
  async #holdForRestart(worker: Worker): Promise<void> {
    if (this.#holding) return;
    this.#holding = true;
    let release: (() => void) | undefined;
    let timer: NodeJS.Timeout | undefined;
    try {
      release = await this.#hold?.();
      if (this.#closing || this.#worker !== worker) return;
      const heldAt = performance.now();
      const outcome = await new Promise<number | 'ended' | 'late'>((resolve) => {
        this.#restarted = resolve;
        timer = setTimeout(() => resolve('late'), HOLD_MAX_MS);
        worker.postMessage('held');
      });
      const heldMs = performance.now() - heldAt;
      // An ended thread is reported by #fallBack; only a restart is told to onRestart.
      if (outcome === 'late') {
        this.#onProblem(`the SQLite checkpoint thread did not restart the log within ${HOLD_MAX_MS} ms`);
      } else if (outcome !== 'ended') this.#onRestart({ heldMs, frames: outcome });
    } finally {
      clearTimeout(timer);
      this.#restarted = undefined;
      this.#holding = false;
      release?.();
    }
  }

  /** The thread failed or ended before close(): the connection checkpoints as SQLite does by default. */
  #fallBack(message: string): void {
    if (this.#closing) return; // Closing (or fallen back already, when 'exit' follows 'error').
    this.#onProblem(`${message}; the server's connection checkpoints the log itself from now on`);
    this.#worker = undefined;
    this.#closing = true; // Nothing more to start; close() still waits for the thread's end.
    try {
      this.#sqlite.pragma(`wal_autocheckpoint = ${SQLITE_DEFAULT_AUTOCHECKPOINT_PAGES}`);
    } catch {
      // The connection is closed already.
    }
  }

  /** Stops looking, and ends the thread (after one last checkpoint) before the connection closes. */
  async close(): Promise<void> {
    this.#closing = true;
    clearInterval(this.#look);
    const worker = this.#worker;
    this.#worker = undefined;
    if (worker) worker.postMessage('close');
    if (!this.#exited) return;
    const timer = setTimeout(() => void worker?.terminate(), 10_000);
    try {
      await this.#exited;
    } finally {
      clearTimeout(timer);
    }
  }
}
