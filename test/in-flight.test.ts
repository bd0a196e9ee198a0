/** The registry of runs in progress a cancel looks in (src/runs/in-flight.ts). */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { InFlightRuns } from '../src/runs/in-flight.js';

describe('InFlightRuns', () => {
  it('finds a run by id while it is in progress, and not after', () => {
    const runs = new InFlightRuns<string>();
    const a = runs.add('run-a', 'cancel a');
    const b = runs.add('run-b', 'cancel b');
    assert.equal(runs.find('run-a'), 'cancel a');
    assert.equal(runs.find('run-b'), 'cancel b');
    assert.equal(runs.find('run-c'), undefined);
    assert.equal(runs.size, 2);
    runs.remove(a);
    assert.equal(runs.find('run-a'), undefined);
    assert.equal(runs.find('run-b'), 'cancel b');
    runs.remove(b);
    assert.equal(runs.size, 0);
    assert.equal(runs.find('run-b'), undefined);
  });

  it('finds ids equal in content, not only the same string', () => {
    const runs = new InFlightRuns<number>();
    runs.add(['run', '42'].join('-'), 42);
    assert.equal(runs.find(`run-${40 + 2}`), 42);
  });

  it('reuses the slots of runs that ended: its arrays stay as large as the most runs in progress at once', () => {
    const runs = new InFlightRuns<number>();
    const slots = new Set<number>();
    for (let i = 0; i < 10_000; i++) {
      const first = runs.add(`r${i}`, i);
      const second = runs.add(`s${i}`, i);
      slots.add(first).add(second);
      runs.remove(first);
      runs.remove(second);
    }
    assert.deepEqual([...slots].sort(), [0, 1]);
    assert.equal(runs.size, 0);
  });

  it('finds the latest of one id added twice, and the other once that one is removed', () => {
    const runs = new InFlightRuns<string>();
    const filler = runs.add('x', 'x');
    const older = runs.add('same', 'older');
    runs.remove(filler);
    // The newer one takes the lower, freed slot: the latest is told by when it was added, not where.
    const newer = runs.add('same', 'newer');
    assert.ok(newer < older);
    assert.equal(runs.find('same'), 'newer');
    runs.remove(newer);
    assert.equal(runs.find('same'), 'older');
    runs.remove(older);
    assert.equal(runs.find('same'), undefined);
  });
});
