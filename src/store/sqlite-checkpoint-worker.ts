/**
 * The SQLite store's checkpointer, run in a worker thread (see sqlite-checkpointer.ts): its own connection
 * to the file copies the write-ahead log into the database every `intervalMs`, with a PASSIVE checkpoint,
 * which waits on no reader or writer and never makes a writer wait. The server's thread does none of it.
 *
 * A PASSIVE checkpoint copies the log but cannot start it over while writes keep coming (SQLite reuses the
 * log from its start only when a write begins with every frame copied, which a steady stream of commits
 * never leaves time for), so under a long load the log file would keep growing. Once it holds
 * `restartFrames`, the thread follows its PASSIVE checkpoint with a RESTART: that one takes the write lock,
 * copies the few frames written since the PASSIVE one, syncs, and the next write starts the log over. The
 * server's writes that meet that lock wait on a timer, off the event loop (sqlite.ts), for as long as that
 * short copy takes.
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
// thread, then gives up until the next tick.
db.pragma('busy_timeout = 50');
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
