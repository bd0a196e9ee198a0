/**
 * The SQLite store's checkpointer, run in a worker thread (see sqlite-checkpointer.ts): its own connection
 * to the file copies the write-ahead log into the database every `intervalMs`, with a PASSIVE checkpoint,
 * which waits on no reader or writer and never makes a writer wait. The server's thread does none of it.
 *
 * SQLite starts the log over when a write begins with every frame of it copied. Between commits that come
 * a few milliseconds apart, a PASSIVE checkpoint usually finishes in such a gap; under a steady stream of
 * commits (a retention pass beside the intake) it never does, and the log file would keep growing. So once
 * the log holds `restartFrames`, the thread asks the server's thread to hold its connection (`'restart'`).
 * Holding it, no statement of the server runs; the thread is told (`'held'`), copies the few frames written
 * since its last checkpoint with a RESTART, which then has no reader or writer of the server to wait for,
 * and says so (`{ restarted }`); the server lets its statements go, and its next write starts the log over.
 * (A RESTART without the hold, as before, held SQLite's write lock for 80 to 120 ms under that load while it
 * waited for the server's readers: every 202 meanwhile waited as long; bench/README.md.) Just before
 * asking, the thread copies what it can without the hold (up to RESTART_PRECOPIES PASSIVE checkpoints in a
 * row, while each still finds over RESTART_DELTA_FRAMES new frames), so that little is left to copy.
 *
 * Messages to the parent: `{ error }` when a checkpoint fails (the parent logs it; the next tick tries
 * again); `{ restart: frames }` to ask for the hold; `{ restarted: { frames } }` once done under it. On
 * `'close'` it checkpoints once more, closes its connection and lets the thread end.
 */
import { parentPort, workerData } from 'node:worker_threads';
import SqliteDatabase from 'better-sqlite3';

interface CheckpointWorkerData {
  file: string;
  intervalMs: number;
  restartFrames: number;
}

interface CheckpointResult {
  busy: number;
  log: number;
  checkpointed: number;
}

/** Frames a checkpoint may leave for the one under the hold; more, and another PASSIVE goes first. */
const RESTART_DELTA_FRAMES = 256;
/** PASSIVE checkpoints at most in a row before asking for the hold. */
const RESTART_PRECOPIES = 3;

const port = parentPort;
if (!port) throw new Error('sqlite-checkpoint-worker runs in a worker thread');
const { file, intervalMs, restartFrames } = workerData as CheckpointWorkerData;
const db = new SqliteDatabase(file, { fileMustExist: true });
// A PASSIVE checkpoint never waits; a RESTART waits this long for the write lock and for readers (of
// another process: the server's are held meanwhile), in this thread.
db.pragma('busy_timeout = 10');
let lastError = '';
/** When the thread asked the server to hold its connection, and was not told yet that it does (else 0). */
let askedAt = 0;
/** Past this without an answer, the thread asks again (the server may have been closing, or busy). */
const ASK_AGAIN_MS = 10_000;
/**
 * The log's frames when the thread last had it restarted: SQLite starts it over at the next write, so until
 * then the log still shows them, and a quiet server is not held again for a log that has not grown.
 */
let restartedAt = -1;

function passive(): CheckpointResult | undefined {
  return (db.pragma('wal_checkpoint(PASSIVE)') as CheckpointResult[])[0];
}

function failed(err: unknown): void {
  // Said once per distinct failure, not at every tick.
  const message = err instanceof Error ? err.message : String(err);
  if (message !== lastError) port?.postMessage({ error: message });
  lastError = message;
}

function checkpoint(): void {
  try {
    let result = passive();
    // While an answer is awaited, the ticks still copy (what is left for the hold shrinks), but do not ask.
    const awaiting = askedAt !== 0 && performance.now() - askedAt < ASK_AGAIN_MS;
    if (!awaiting && result && result.log >= restartFrames && result.log !== restartedAt) {
      for (let i = 1; i < RESTART_PRECOPIES; i++) {
        const before = result.log;
        const next = passive();
        if (!next) break;
        result = next;
        if (next.log - before <= RESTART_DELTA_FRAMES) break;
      }
      askedAt = performance.now();
      port?.postMessage({ restart: result.log });
    }
    lastError = '';
  } catch (err) {
    failed(err);
  }
}

/** The server holds its connection: copy the rest and leave the log for its next write to start over. */
function restart(): void {
  let frames = 0;
  try {
    const [result] = db.pragma('wal_checkpoint(RESTART)') as CheckpointResult[];
    frames = result?.log ?? 0;
    if (result && result.busy === 0) restartedAt = frames;
    lastError = '';
  } catch (err) {
    failed(err);
  } finally {
    askedAt = 0;
    port?.postMessage({ restarted: { frames } });
  }
}

const timer = setInterval(checkpoint, intervalMs);
port.on('message', (message) => {
  if (message === 'held') {
    restart();
    return;
  }
  if (message !== 'close') return;
  clearInterval(timer);
  try {
    passive();
  } catch (err) {
    failed(err);
  }
  db.close();
  port.close();
});
