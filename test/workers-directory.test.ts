/**
 * Workers announcing themselves and the directory gateways keep (src/cluster/workers.ts), on real NATS:
 * the machine's JetStream server, and one of the test's own that it restarts.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, describe, it } from 'node:test';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import pino from 'pino';
import {
  createWorkerAnnouncer,
  createWorkerDirectory,
  type WorkerAnnouncement,
  type WorkerAnnouncer,
  type WorkerDirectory,
} from '../src/cluster/workers.js';
import { waitFor } from './helpers/ferry.js';
import { deleteClusterStreams, NATS_URL, ownNats } from './helpers/nats.js';

const logger = pino({ level: 'silent' });
const cluster = `t_${process.pid}_${randomBytes(3).toString('hex')}`;

function describeWorker(id: string, inflight = () => 0): () => Omit<WorkerAnnouncement, 'at'> {
  return () => ({
    id,
    url: 'http://127.0.0.1:9999',
    role: 'worker',
    version: 'test',
    startedAt: new Date().toISOString(),
    load: { capacity: 0, inflight: inflight(), replicas: 0, apps: {} },
  });
}

async function conn(url: string): Promise<NatsConnection> {
  return connect({ servers: url, maxReconnectAttempts: -1, reconnectTimeWait: 200, timeout: 5_000 });
}

describe('worker announcements and the directory', { timeout: 120_000 }, () => {
  const closers: Array<() => Promise<unknown>> = [];
  after(
    async () => {
      // Each step bounded: a connection to a stopped server must not hold the run up.
      const bounded = (p: Promise<unknown>) =>
        Promise.race([p.catch(() => undefined), new Promise((r) => setTimeout(r, 10_000).unref())]);
      for (const close of closers.reverse()) await bounded(close());
      await deleteClusterStreams(cluster);
    },
    { timeout: 120_000 },
  );

  it('lists an announcing worker, drops one that closes at once and one that goes silent within 5 s', async () => {
    const nc = await conn(NATS_URL);
    closers.push(() => nc.close());
    const nats = { ready: async () => nc };
    const bucket = `${cluster}_nodes`;
    const directory: WorkerDirectory = createWorkerDirectory({ nats, bucket, logger });
    closers.push(() => directory.close());
    await directory.start();
    let load = 0;
    const a: WorkerAnnouncer = createWorkerAnnouncer({
      nats,
      bucket,
      logger,
      describe: describeWorker('worker-a', () => load),
      everyMs: 200,
    });
    const b = createWorkerAnnouncer({ nats, bucket, logger, describe: describeWorker('worker-b'), everyMs: 200 });
    closers.push(
      () => a.close(),
      () => b.close(),
    );
    await a.start();
    await b.start();
    await waitFor(async () => directory.live().length === 2, 10_000, 'both workers live');
    // Load follows announcements.
    load = 7;
    a.announceNow();
    await waitFor(async () => directory.get('worker-a')?.load.inflight === 7, 10_000, 'the new load');

    // A clean close deletes the key: gone well before the staleness limit.
    const closedAt = Date.now();
    await b.close();
    await waitFor(async () => !directory.live().some((w) => w.id === 'worker-b'), 2_500, 'b gone after close');
    assert.ok(Date.now() - closedAt < 2_500);

    // markDown leaves a worker out until it announces again after the mark.
    directory.markDown('worker-a', 300);
    assert.deepEqual(
      directory.live().map((w) => w.id),
      [],
    );
    await waitFor(async () => directory.live().some((w) => w.id === 'worker-a'), 5_000, 'a back after markDown');

    // A worker that stops announcing without a word (as when SIGKILLed) is out within 5 s.
    const ncA = await conn(NATS_URL);
    closers.push(() => ncA.close());
    const c = createWorkerAnnouncer({
      nats: { ready: async () => ncA },
      bucket,
      logger,
      describe: describeWorker('worker-c'),
      everyMs: 200,
    });
    await c.start();
    await waitFor(async () => directory.live().some((w) => w.id === 'worker-c'), 10_000, 'c live');
    // Cut c off as a dead machine would be: its connection closes without deleting its key.
    await ncA.close();
    const cutAt = Date.now();
    await waitFor(async () => !directory.live().some((w) => w.id === 'worker-c'), 10_000, 'c gone after going silent');
    const gone = Date.now() - cutAt;
    assert.ok(gone <= 5_000, `a silent worker left the directory after ${gone} ms (limit 5 s)`);
  });

  it('keeps working across a NATS restart, and starts while NATS is down', async () => {
    const server = await ownNats();
    closers.push(() => server.destroy());
    // NATS is down: announcer and directory start anyway and wait.
    let nc: NatsConnection | undefined;
    // Connects once NATS is there (as cluster/nats.ts does for Ferry): tries for at most a minute in all.
    const until = Date.now() + 60_000;
    let connecting: Promise<NatsConnection> | undefined;
    const ready = () => {
      connecting ??= (async () => {
        while (Date.now() < until) {
          try {
            nc = await connect({
              servers: server.url,
              maxReconnectAttempts: -1,
              reconnectTimeWait: 200,
              timeout: 2_000,
            });
            return nc;
          } catch {
            await new Promise((r) => setTimeout(r, 200));
          }
        }
        throw new Error('NATS never came');
      })();
      return connecting;
    };
    closers.push(async () => nc?.close());
    const bucket = `${cluster}_own`;
    const directory = createWorkerDirectory({ nats: { ready }, bucket, logger });
    const announcer = createWorkerAnnouncer({
      nats: { ready },
      bucket,
      logger,
      describe: describeWorker('worker-r'),
      everyMs: 200,
    });
    closers.push(
      () => announcer.close(),
      () => directory.close(),
    );
    const t0 = Date.now();
    await Promise.all([directory.start(), announcer.start()]);
    assert.ok(Date.now() - t0 < 10_000, 'start does not wait for NATS');
    assert.deepEqual(directory.live(), []);
    await server.start();
    await waitFor(async () => directory.live().some((w) => w.id === 'worker-r'), 20_000, 'live once NATS is up');

    await server.stop();
    // Down: no announcements arrive, and nothing else either: silence is the directory's, not the worker's,
    // so the worker last seen alive stays (issue 30, point 6) past the staleness limit.
    await new Promise((r) => setTimeout(r, 5_000));
    assert.deepEqual(
      directory.live().map((w) => w.id),
      ['worker-r'],
      'held while NATS is down',
    );
    // Its own failure (a call that could not connect) still takes it out.
    directory.markDown('worker-r', 100);
    assert.deepEqual(directory.live(), []);
    await server.start();
    await waitFor(async () => directory.live().some((w) => w.id === 'worker-r'), 30_000, 'live again after restart');
  });

  it('holds the workers last seen alive while NATS is frozen; a silent one leaves once it works again', async () => {
    const server = await ownNats();
    closers.push(() => server.destroy());
    await server.start();
    const conns: NatsConnection[] = [];
    closers.push(async () => {
      server.thaw();
      await Promise.all(conns.map((c) => c.close().catch(() => undefined)));
    });
    const own = async () => {
      const c = await conn(server.url);
      conns.push(c);
      return { ready: async () => c };
    };
    const bucket = `${cluster}_frozen`;
    const directory = createWorkerDirectory({ nats: await own(), bucket, logger });
    closers.push(() => directory.close());
    await directory.start();
    let bSilent = false;
    const a = createWorkerAnnouncer({ nats: await own(), bucket, logger, describe: describeWorker('worker-a') });
    const describeB = describeWorker('worker-b');
    const b = createWorkerAnnouncer({
      nats: await own(),
      bucket,
      logger,
      describe: () => {
        if (bSilent) throw new Error('worker-b is gone');
        return describeB();
      },
    });
    closers.push(
      () => a.close(),
      () => b.close(),
    );
    await a.start();
    await b.start();
    const ids = () =>
      directory
        .live()
        .map((w) => w.id)
        .sort();
    await waitFor(async () => ids().length === 2, 10_000, 'both workers live');

    server.freeze();
    const frozenAt = Date.now();
    // b stops announcing during the freeze; nobody can tell until NATS works again.
    bSilent = true;
    // Checked every 100 ms for 6 s (twice the staleness limit): nothing leaves.
    while (Date.now() - frozenAt < 6_000) {
      assert.deepEqual(ids(), ['worker-a', 'worker-b'], `at ${Date.now() - frozenAt} ms into the freeze`);
      await new Promise((r) => setTimeout(r, 100));
    }
    server.thaw();
    const thawedAt = Date.now();
    // a announces again and stays; b, silent, leaves within the staleness limit of the directory working again.
    await waitFor(async () => ids().join() === 'worker-a', 10_000, 'b gone after the freeze');
    const gone = Date.now() - thawedAt;
    assert.ok(gone <= 6_000, `the silent worker left ${gone} ms after the freeze (limit 6 s)`);
    for (let i = 0; i < 10; i++) {
      assert.deepEqual(ids(), ['worker-a'], 'a stays live after the freeze');
      await new Promise((r) => setTimeout(r, 100));
    }
  });
});
