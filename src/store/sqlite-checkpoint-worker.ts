/**
 * The SQLite store's checkpointer, run in a worker thread (see sqlite-checkpointer.ts): its own connection
 * to the file copies the write-ahead log into the database every `intervalMs`, with a PASSIVE checkpoint,
 * which waits on no reader or writer and never makes a writer wait. The server's thread does none of it.
 *
 * SQLite starts the log over when a write begins with every frame of it copied. Between commits that come
 * a few milliseconds apart, a PASSIVE checkpoint usually finishes in such a gap; under a steady stream of
 * commits it may never, and the log file would keep growing. So once the log holds `restartFrames`, the
 * thread follows its PASSIVE checkpoint with a RESTART: that one takes the write lock, copies the few frames
 * written since, syncs, and the next write starts the log over. It waits at most 10 ms for the lock and for
 * readers (in this thread; then it tries again at the next tick), and the server's writes that meet its lock
 * wait on a timer, off the event loop (sqlite.ts).
 *
 * Messages to the parent: `{ error }` when a checkpoint fails (the parent logs it; the next tick tries
 * again). On `'close'` it checkpoints once more, closes its connection and lets the thread end.
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

const port = parentPort;
if (!port) throw new Error('sqlite-checkpoint-worker runs in a worker thread');
const { file, intervalMs, restartFrames } = workerData as CheckpointWorkerData;
const db = new SqliteDatabase(file, { fileMustExist: true });
// A PASSIVE checkpoint never waits; a RESTART waits this long for the write lock and the readers, in this
// thread, then gives up until the next tick (while it waits for readers it holds the write lock).
db.pragma('busy_timeout = 10');
let lastError = '';

function checkpoint(): void {
  try {
    const [passive] = db.pragma('wal_checkpoint(PASSIVE)') as CheckpointResult[];
    if (passive && passive.log >= restartFrames) {
      db.pragma('wal_checkpoint(RESTART)');
    }
    lastError = '';
  } catch (err) {
    // Said once per distinct failure, not at every tick.
    const message = err instanceof Error ? err.message : String(err);
    if (message !== lastError) port?.postMessage({ error: message });
    lastError = message;
  }
}

const timer = setInterval(checkpoint, intervalMs);
port.on('message', (message) => {
  if (message !== 'close') return;
  clearInterval(timer);
  checkpoint();
  db.close();
  port.close();
});
