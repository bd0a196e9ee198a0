/**
 * A run waiting for a replica is never left behind (issue 43 point 4), the replica pool's rules one by one:
 * a run waiting when the build is replaced goes to the new build's pool and is served by it (and is no
 * longer there once its caller goes away); a draining pool with no new pool to hand its runs to serves
 * them first, starting a replica when its own died; and the manager's tend gives a run waiting with no
 * replica coming one (a missed wake-up, which no real fault causes any more: here a start refused by
 * `mayStart` that nothing retries), or moves a draining pool's run to the app's current pool.
 *
 * Component tests: the real ReplicaPool with fake replicas (each ready a tick after it starts, its exit a
 * tick after it is stopped). The same fault end to end, with real replicas and builds, is
 * test/redeploy-backlog.test.ts.
 */
import assert from 'node:assert/strict';
import { EventEmitter } from 'node:events';
import { describe, it } from 'node:test';
import { pino } from 'pino';
import { parseAppConfig } from '../src/apps/app-config.js';
import { type PoolBuild, ReplicaPool, type Slot } from '../src/replicas/pool.js';
import type { Replica, ReplicaExit, ReplicaState } from '../src/replicas/replica.js';

class FakeReplica extends EventEmitter<{ exit: [ReplicaExit] }> {
  state: ReplicaState = 'starting';
  inflight = 0;
  lastUsed = Date.now();
  readyAt = 0;
  constructor(readonly id: string) {
    super();
  }
  waitReady(): Promise<void> {
    return new Promise((resolve) =>
      setImmediate(() => {
        this.state = 'ready';
        this.readyAt = Date.now();
        resolve();
      }),
    );
  }
  async stop(): Promise<void> {
    if (this.state === 'exited' || this.state === 'stopping') return;
    this.state = 'stopping';
    setImmediate(() => this.exit('stopped'));
  }
  exit(reason: ReplicaExit['reason']): void {
    this.state = 'exited';
    this.emit('exit', { code: reason === 'stopped' ? 0 : 1, signal: null, reason, tail: [] });
  }
}

function buildOf(buildId: string): PoolBuild {
  // The default scaling: min 0, max 2, one run per replica.
  const config = parseAppConfig('[app]\nname = "waiting"\n');
  return { projectId: 'p-0000wait', appId: 'waiting', buildId, runtime: 'node', config };
}

interface Harness {
  pool(buildId: string, options?: { mayStart?: () => boolean }): ReplicaPool;
  started: FakeReplica[];
  logs: Array<Record<string, unknown>>;
}

function harness(): Harness {
  const started: FakeReplica[] = [];
  const logs: Array<Record<string, unknown>> = [];
  const logger = pino({ level: 'info' }, { write: (line: string) => void logs.push(JSON.parse(line)) });
  return {
    started,
    logs,
    pool(buildId, options = {}) {
      return new ReplicaPool({
        build: buildOf(buildId),
        maxQueue: 10,
        startTimeoutMs: 5_000,
        logger,
        ...options,
        async startReplica() {
          const r = new FakeReplica(`${buildId}-${started.length + 1}`);
          started.push(r);
          return r as unknown as Replica;
        },
      });
    },
  };
}

const tick = () => new Promise((resolve) => setImmediate(resolve));
/** Settles fake starts and stops: a few turns of the event loop. */
async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) await tick();
}

describe('runs waiting in a replica pool', () => {
  it('a run waiting when the build is replaced is served by the new build', async () => {
    const h = harness();
    // One replica allowed for the old build (the node's cap, or the app's other replica on another worker).
    const old = h.pool('b-old', { mayStart: () => old.liveReplicas === 0 });
    const first = await old.acquire();
    let second: Slot | undefined;
    const waiting = old.acquire().then((s) => (second = s));
    await settle();
    assert.equal(old.queueDepth, 1, 'the second run waits behind the first');

    const fresh = h.pool('b-new');
    old.drain(fresh);
    assert.equal(old.queueDepth, 0, 'nothing waits in the draining pool');
    await waiting;
    assert.equal(second?.build.buildId, 'b-new', 'the new build serves the waiting run');
    assert.equal(second?.replica.id, 'b-new-2');
    assert.equal(second?.coldStart, true);

    // The old build's replica stops once its run is done (no run waits for it any more).
    first.release();
    await settle();
    assert.equal(h.started[0]?.state, 'exited');
    second?.release();
  });

  it('a handed-over run whose caller goes away leaves the new pool', async () => {
    const h = harness();
    const old = h.pool('b-old', { mayStart: () => old.liveReplicas === 0 });
    const first = await old.acquire();
    const caller = new AbortController();
    const waiting = old.acquire(caller.signal);
    await settle();
    // The new pool can start nothing yet (its node is full): the run waits there.
    let room = false;
    const fresh = h.pool('b-new', { mayStart: () => room });
    old.drain(fresh);
    assert.equal(fresh.queueDepth, 1);
    caller.abort(new Error('caller gone'));
    await assert.rejects(waiting, /caller gone/);
    assert.equal(fresh.queueDepth, 0, 'the run left the queue it was in');
    room = true;
    first.release();
    await settle();
    assert.equal(h.started.length, 1, 'no replica started for a run that is gone');
  });

  it('a draining pool with no new pool serves its waiting runs first, with a new replica when its own died', async () => {
    const h = harness();
    const pool = h.pool('b-gone', { mayStart: () => pool.liveReplicas === 0 });
    const first = await pool.acquire();
    let served: Slot | undefined;
    const waiting = pool.acquire().then((s) => (served = s));
    await settle();
    pool.drain();
    // Its run ends: the replica takes the waiting run instead of stopping.
    first.release();
    await waiting;
    assert.equal(served?.replica, first.replica);
    assert.equal(h.started[0]?.state, 'ready');

    // The replica dies with another run waiting: one is started for it.
    let third: Slot | undefined;
    const again = pool.acquire().catch((err: unknown) => err);
    assert.match(String(await again), /being replaced/, 'a draining pool takes no new runs');
    const next = h.pool('b-other', { mayStart: () => next.liveReplicas === 0 });
    const busy = await next.acquire();
    const behind = next.acquire().then((s) => (third = s));
    await settle();
    next.drain();
    h.started.at(-1)?.exit('crash');
    await behind;
    assert.equal(third?.build.buildId, 'b-other');
    assert.notEqual(third?.replica, busy.replica, 'a new replica serves it');
    served?.release();
    third?.release();
    await settle();
    assert.ok(
      h.started.every((r) => r.state === 'exited'),
      'every replica of a draining pool stops once no run waits',
    );
  });

  it('tend: a run waiting with no replica coming gets one, and a draining pool’s run goes to the current pool', async () => {
    const h = harness();
    let allowed = false;
    const pool = h.pool('b-one', { mayStart: () => allowed });
    let served: Slot | undefined;
    const waiting = pool.acquire().then((s) => (served = s));
    await settle();
    assert.equal(h.started.length, 0, 'the start was refused');
    // Room now, but nothing said so (a missed wake-up): the manager's tend finds the run.
    allowed = true;
    pool.tend();
    await waiting;
    assert.equal(served?.build.buildId, 'b-one');
    assert.ok(h.logs.some((l) => l.msg === 'runs waited with no replica starting for them; starting one'));

    // A pool drained with no successor (the manager's `stop`, as for a deleted volume), a run waiting behind
    // a busy replica; the app's pool made later takes it at the next tend.
    const stopped = h.pool('b-two', { mayStart: () => stopped.liveReplicas === 0 });
    const busy = await stopped.acquire();
    let moved: Slot | undefined;
    const behind = stopped.acquire().then((s) => (moved = s));
    await settle();
    stopped.drain();
    const current = h.pool('b-two');
    stopped.tend(current);
    await behind;
    assert.equal(moved?.replica.id.startsWith('b-two-'), true);
    assert.notEqual(moved?.replica, busy.replica, 'served by the current pool, not behind the busy replica');
    assert.equal(stopped.queueDepth, 0);
    served?.release();
    busy.release();
    moved?.release();
  });
});
