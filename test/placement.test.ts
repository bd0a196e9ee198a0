/** Where a gateway sends a call (src/cluster/placement.ts): rendezvous order, minimal movement, spill-over. */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { createCallerTally } from '../src/cluster/caller-tally.js';
import { homeOf, isFull, placeCall, rankWorkers, withOwnCalls } from '../src/cluster/placement.js';
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

  it('keeps an app’s minimum on the first worker that runs it, else the first with room under its cap', () => {
    const app = apps[1]!;
    const [first, second, third] = rankWorkers(
      app,
      ['w-a', 'w-b', 'w-c'].map((id) => worker(id)),
    ).map((w) => w.id) as [string, string, string];
    // Nobody runs it and nobody is capped: the first in rendezvous order.
    assert.equal(homeOf(app, [worker(first), worker(second), worker(third)])?.id, first);
    // The first is at its cap with other apps (FERRY_WORKER_MAX_REPLICAS): the next with room. The regression
    // of 2026-11-26: both workers' single slots went to one worker, over its cap.
    const full = worker(first, {
      capacity: 1,
      replicas: 1,
      apps: { 'p/other': { replicas: 1, inflight: 0, capacity: 1 } },
    });
    assert.equal(homeOf(app, [full, worker(second), worker(third)])?.id, second);
    // A worker that runs the app stays its home, even full, even behind a better-ranked one with room.
    const runs = worker(third, {
      capacity: 1,
      replicas: 1,
      apps: { [app]: { replicas: 1, inflight: 0, capacity: 1 } },
    });
    assert.equal(homeOf(app, [worker(first), worker(second), runs])?.id, third);
    // Every worker full and none runs it: the first, as before (its minimum waits for room there).
    const capped = (id: string) => worker(id, { capacity: 1, replicas: 1 });
    assert.equal(homeOf(app, [capped(first), capped(second), capped(third)])?.id, first);
    assert.equal(homeOf(app, []), undefined);
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

  it("weighs an announcement with this gateway's own calls as they are now, the others' as announced", () => {
    const scaling = { max_replicas: 1, replica_concurrency: 2 };
    // Announced a moment ago: 4 calls of the app in flight, 3 of them from this gateway (g1), 1 from g2.
    const w = worker('w-a', {
      capacity: 1,
      replicas: 1,
      inflight: 4,
      apps: { 'p/a': { replicas: 1, inflight: 4, capacity: 2, by: { g1: 3, g2: 1 } } },
    });
    // g1 has only 1 call there now: 1 (g2's) + 1 (its own) = 2, full but no longer over its slots.
    const now = withOwnCalls(w, 'p/a', { nodeId: 'g1', mine: 1, mineOnWorker: 1, scaling });
    assert.equal(now.load.apps['p/a']!.inflight, 2);
    assert.equal(now.load.inflight, 2);
    // g1 has none there now: room for one more call.
    const idle = withOwnCalls(w, 'p/a', { nodeId: 'g1', mine: 0, mineOnWorker: 0, scaling });
    assert.equal(idle.load.apps['p/a']!.inflight, 1);
    assert.equal(isFull(idle, 'p/a'), false);
    // Another gateway (g3) with 2 calls there now: the announced 4 are all the others', plus its 2.
    assert.equal(
      withOwnCalls(w, 'p/a', { nodeId: 'g3', mine: 2, mineOnWorker: 2, scaling }).load.apps['p/a']!.inflight,
      6,
    );
    // Unchanged since the announcement: the announcement as it is.
    assert.equal(withOwnCalls(w, 'p/a', { nodeId: 'g1', mine: 3, mineOnWorker: 3, scaling }), w);
    // A worker not announcing the app yet: the slots it could start, and this gateway's calls on the way.
    const fresh = withOwnCalls(worker('w-b', { capacity: 1 }), 'p/a', {
      nodeId: 'g1',
      mine: 1,
      mineOnWorker: 1,
      scaling,
    });
    assert.deepEqual(fresh.load.apps['p/a'], { replicas: 0, capacity: 2, inflight: 1 });
  });

  it('counts calls per app and calling gateway while they last (what a worker announces)', () => {
    const tally = createCallerTally();
    const a = tally.enter('p/a', 'g1');
    const b = tally.enter('p/a', 'g1');
    const c = tally.enter('p/a', 'g2');
    assert.deepEqual(tally.of('p/a'), { g1: 2, g2: 1 });
    a();
    a(); // ending twice ends once
    c();
    assert.deepEqual(tally.of('p/a'), { g1: 1 });
    b();
    assert.equal(tally.of('p/a'), undefined);
  });
});
