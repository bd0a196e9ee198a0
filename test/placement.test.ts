/** Where a gateway sends a call (src/cluster/placement.ts): rendezvous order, minimal movement, spill-over. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { isFull, placeCall, rankWorkers } from '../src/cluster/placement.js';
import type { WorkerAnnouncement, WorkerLoad } from '../src/cluster/workers.js';

function worker(id: string, load: Partial<WorkerLoad> = {}): WorkerAnnouncement {
  return {
    id,
    url: `http://127.0.0.1:${9000 + id.length}`,
    role: 'worker',
    version: 'test',
    startedAt: '',
    at: 0,
    load: { capacity: 0, inflight: 0, replicas: 0, apps: {}, ...load },
  };
}

const apps = Array.from({ length: 2000 }, (_, i) => `p-${(i * 7919).toString(16).padStart(8, '0')}/app-${i}`);

describe('placement', () => {
  it('orders workers the same way whatever order they are listed in', () => {
    const ws = ['w-a', 'w-b', 'w-c', 'w-d'].map((id) => worker(id));
    for (const app of apps.slice(0, 200)) {
      const one = rankWorkers(app, ws).map((w) => w.id);
      const two = rankWorkers(app, [...ws].reverse()).map((w) => w.id);
      assert.deepEqual(one, two);
    }
  });

  it('spreads apps over workers, and moves only the apps of a worker that leaves', () => {
    const ws = ['w-a', 'w-b', 'w-c', 'w-d'].map((id) => worker(id));
    const home = new Map(apps.map((app) => [app, rankWorkers(app, ws)[0]!.id]));
    const counts = new Map<string, number>();
    for (const id of home.values()) counts.set(id, (counts.get(id) ?? 0) + 1);
    // 2,000 apps over 4 workers: each gets a fair share (500 expected; a generous band).
    for (const w of ws) assert.ok((counts.get(w.id) ?? 0) > 350 && (counts.get(w.id) ?? 0) < 650, `${w.id}`);

    const without = ws.filter((w) => w.id !== 'w-c');
    let moved = 0;
    for (const app of apps) {
      const before = home.get(app)!;
      const after = rankWorkers(app, without)[0]!.id;
      if (before !== 'w-c') assert.equal(after, before, 'an app whose home stayed does not move');
      else moved += 1;
    }
    assert.equal(moved, counts.get('w-c'));
  });

  it('moves a worker without room for the app behind those with room, keeping rendezvous order otherwise', () => {
    const app = apps[0]!;
    const order = rankWorkers(
      app,
      ['w-a', 'w-b', 'w-c'].map((id) => worker(id)),
    ).map((w) => w.id);
    const [first, second, third] = order as [string, string, string];
    const ws = [
      worker(first, { apps: { [app]: { replicas: 1, inflight: 4, capacity: 4 } } }),
      worker(second),
      worker(third, { capacity: 2, replicas: 2 }),
    ];
    assert.equal(isFull(ws[0]!, app), true);
    assert.equal(isFull(ws[1]!, app), false);
    assert.equal(isFull(ws[2]!, app), true, 'at its cap of replicas, with none of this app');
    assert.deepEqual(
      placeCall(app, ws).map((w) => w.id),
      [second, first, third],
    );
    // The home with a free slot stays first.
    ws[0] = worker(first, { apps: { [app]: { replicas: 1, inflight: 3, capacity: 4 } } });
    assert.deepEqual(
      placeCall(app, ws).map((w) => w.id),
      [first, second, third],
    );
    assert.deepEqual(
      placeCall(app, ws, { exclude: new Set([first]) }).map((w) => w.id),
      [second, third],
    );
    assert.deepEqual(placeCall(app, []), []);
    // Every worker full: the least loaded for its slots first, so waiting calls spread.
    const busy = [
      worker(first, { apps: { [app]: { replicas: 1, inflight: 12, capacity: 4 } } }),
      worker(second, { apps: { [app]: { replicas: 1, inflight: 5, capacity: 4 } } }),
      worker(third, { apps: { [app]: { replicas: 1, inflight: 4, capacity: 4 } } }),
    ];
    assert.deepEqual(
      placeCall(app, busy).map((w) => w.id),
      [third, second, first],
    );
  });

  it('sends calls to the workers running the app once they run max_replicas of it together', () => {
    const app = apps[1]!;
    const [first, second, third] = rankWorkers(
      app,
      ['w-a', 'w-b', 'w-c'].map((id) => worker(id)),
    ).map((w) => w.id) as [string, string, string];
    // The third in order runs the app's only replica (max_replicas 1), busy: the others could start one,
    // but the cluster may not; the call queues where the replica is.
    const ws = [
      worker(first),
      worker(second),
      worker(third, { apps: { [app]: { replicas: 1, inflight: 1, capacity: 1 } } }),
    ];
    assert.deepEqual(
      placeCall(app, ws).map((w) => w.id),
      [first, second, third],
    );
    assert.deepEqual(
      placeCall(app, ws, { maxReplicas: 1 }).map((w) => w.id),
      [third, first, second],
    );
    assert.deepEqual(
      placeCall(app, ws, { maxReplicas: 2 }).map((w) => w.id),
      [first, second, third],
    );
  });
});
