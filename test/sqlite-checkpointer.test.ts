/**
 * The SQLite store's log is checkpointed by a thread of its own, not by the server's commits
 * (store/sqlite-checkpointer.ts, issue 31): the server's connection never checkpoints, the thread starts
 * only once the log has grown past its threshold, keeps the log from growing without bound while writes go
 * on, and ends before the connection closes, with every row in the database file.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { describe, it } from 'node:test';
import SqliteDatabase from 'better-sqlite3';
import { sql } from 'kysely';
import { openSqliteStore } from '../src/store/index.js';
import { tempDir, waitFor } from './helpers/ferry.js';

const ROW_BYTES = 4000;

/** The rows of `filler` in the database file, read by a connection of its own once the store is closed. */
function rowsInFile(file: string): number {
  const reopened = new SqliteDatabase(file, { readonly: true });
  try {
    return (reopened.prepare('select count(*) as count from filler').get() as { count: number }).count;
  } finally {
    reopened.close();
  }
}

describe('the SQLite checkpoint thread', () => {
  it('starts past the threshold, keeps the log bounded under writes, and leaves every row in the file', async () => {
    const dataDir = await tempDir();
    const file = path.join(dataDir, 'ferry.db');
    const problems: string[] = [];
    const db = await openSqliteStore({
      dataDir,
      checkpointInThread: {
        startBytes: 2 * 1024 * 1024,
        restartFrames: (8 * 1024 * 1024) / 4096,
        lookMs: 50,
        intervalMs: 50,
        onProblem: (message) => problems.push(message),
      },
    });
    const wal = () => fs.statSync(`${file}-wal`).size;
    let written = 0;
    try {
      const { rows } = await sql<{ wal_autocheckpoint: number }>`pragma wal_autocheckpoint`.execute(db);
      assert.equal(rows[0]?.wal_autocheckpoint, 0, "the server's connection never checkpoints");
      await sql`create table filler (n integer primary key, body blob not null)`.execute(db);
      const insert = async (rows: number) => {
        await db.transaction().execute(async (tx) => {
          for (let i = 0; i < rows; i++) {
            written += 1;
            await sql`insert into filler (n, body) values (${written}, randomblob(${ROW_BYTES}))`.execute(tx);
          }
        });
      };
      // Below the threshold nothing checkpoints: the log only grows.
      await insert(100);
      const before = wal();
      await new Promise((resolve) => setTimeout(resolve, 200));
      await insert(10);
      assert.ok(wal() > before, `the log grew from ${before} bytes, below the threshold`);
      // Past it, the thread starts and copies the log into the database file, while the server's
      // connection stays open and checkpoints nothing itself.
      await insert(600);
      const inFile = written * ROW_BYTES;
      await waitFor(async () => fs.statSync(file).size >= inFile, 60_000, 'the rows copied into the database file');
      // And the log stops growing: 48 MB more is written in 240 commits, with a turn of the event loop between
      // them, and the log stays far below that (the thread starts it over once it holds 8 MiB, if SQLite
      // did not already).
      let largest = 0;
      for (let i = 0; i < 240; i++) {
        await insert(50);
        largest = Math.max(largest, wal());
        await new Promise((resolve) => setTimeout(resolve, 5));
      }
      assert.ok(largest < 24 * 1024 * 1024, `the log grew to ${largest} bytes while 48 MB was written`);
      await waitFor(
        async () => fs.statSync(file).size >= written * ROW_BYTES,
        60_000,
        'every row in the database file',
      );
    } finally {
      await db.destroy();
    }
    assert.deepEqual(problems, []);
    assert.equal(fs.existsSync(`${file}-wal`), false, 'the last connection to close removed the log');
    assert.equal(rowsInFile(file), written);
  });

  it('starts the log over under a steady stream of writes by holding the connection between statements', async () => {
    const dataDir = await tempDir();
    const file = path.join(dataDir, 'ferry.db');
    const problems: string[] = [];
    const restarts: Array<{ heldMs: number; frames: number }> = [];
    const db = await openSqliteStore({
      dataDir,
      checkpointInThread: {
        startBytes: 256 * 1024,
        restartFrames: 64,
        lookMs: 20,
        intervalMs: 20,
        onProblem: (message) => problems.push(message),
        onRestart: (restart) => restarts.push(restart),
      },
    });
    // The WAL header's checkpoint sequence number (bytes 12-15): SQLite adds one each time the log starts over.
    const sequence = () => {
      const fd = fs.openSync(`${file}-wal`, 'r');
      try {
        const header = Buffer.alloc(16);
        fs.readSync(fd, header, 0, 16, 0);
        return header.readUInt32BE(12);
      } finally {
        fs.closeSync(fd);
      }
    };
    let written = 0;
    try {
      await sql`create table filler (n integer primary key, body blob not null)`.execute(db);
      const insert = (rows: number) =>
        db.transaction().execute(async (tx) => {
          for (let i = 0; i < rows; i++) {
            written += 1;
            await sql`insert into filler (n, body) values (${written}, randomblob(${ROW_BYTES}))`.execute(tx);
          }
        });
      await insert(100);
      const first = sequence();
      // Commits one after the other, one turn of the event loop between them (where the thread's message is
      // heard): the thread's PASSIVE checkpoints rarely find the log all copied when a write begins, so it
      // asks for the hold, and gets it between two transactions (the connection's lock is first come, first
      // served). At most 5,000 transactions, 60 s.
      const end = Date.now() + 60_000;
      for (let i = 0; i < 5000 && restarts.length < 2 && Date.now() < end; i++) {
        await insert(10);
        await new Promise((resolve) => setImmediate(resolve));
      }
      assert.ok(restarts.length >= 2, `the thread had the log started over ${restarts.length} times`);
      // (A restart's frames are the log's when the hold came: fewer than 64 when SQLite started it over
      // itself meanwhile, at a write that found it all copied. Nothing to assert on them.)
      // The next write starts the log over; this one leaves it past 64 frames, to be restarted once more.
      await insert(100);
      assert.ok(sequence() > first, 'the log was started over');
      // A quiet store is not held again for a log that has not grown: once the writes stop, the thread asks
      // once (for the frames of the last write), then no more.
      await new Promise((resolve) => setTimeout(resolve, 2000));
      const quiet = restarts.length;
      await new Promise((resolve) => setTimeout(resolve, 1000));
      assert.equal(restarts.length, quiet, 'no hold while nothing is written');
    } finally {
      await db.destroy();
    }
    assert.deepEqual(problems, []);
    assert.equal(rowsInFile(file), written);
  });

  it('is not started by a store that was not asked for it, which checkpoints as SQLite does', async () => {
    const dataDir = await tempDir();
    const db = await openSqliteStore({ dataDir });
    try {
      const { rows } = await sql<{ wal_autocheckpoint: number }>`pragma wal_autocheckpoint`.execute(db);
      assert.equal(rows[0]?.wal_autocheckpoint, 1000);
    } finally {
      await db.destroy();
    }
  });
});
