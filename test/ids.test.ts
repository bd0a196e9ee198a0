/** Identifiers and timestamps (src/ids.ts): the run path's cached ISO formatter writes what Date writes. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { isoTime, uuidv7 } from '../src/ids.js';

describe('ids', () => {
  it('isoTime writes exactly what Date.prototype.toISOString writes', () => {
    const samples = [
      0,
      1,
      9,
      10,
      99,
      100,
      999,
      1000,
      1001,
      Date.now(),
      253_402_300_799_999,
      253_402_300_800_000,
      -1,
      1.5,
    ];
    // Runs of consecutive milliseconds across second, minute and day boundaries, and random times.
    for (const start of [59_990, 86_399_990, Date.UTC(2026, 10, 25, 23, 59, 59, 990)]) {
      for (let i = 0; i < 30; i++) samples.push(start + i);
    }
    for (let i = 0; i < 2000; i++) samples.push(Math.floor(Math.random() * 4_102_444_800_000));
    for (const ms of samples) assert.equal(isoTime(ms), new Date(ms).toISOString(), String(ms));
  });

  it('uuidv7 ids are unique and sorted by creation within a process', () => {
    const ids = Array.from({ length: 5000 }, () => uuidv7());
    assert.equal(new Set(ids).size, ids.length);
    assert.deepEqual([...ids].sort(), ids);
  });
});
