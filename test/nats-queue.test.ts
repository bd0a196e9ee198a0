/**
 * The async run queue on NATS JetStream (issue 13, item 1): with `--nats-url`, accepted async runs are
 * published to the cluster's runs stream after their insert and fetched, claimed and run by the nodes.
 *
 * Real PostgreSQL and NATS JetStream: the shared NATS on 127.0.0.1:4222 where NATS stays up, and a
 * nats-server of the test's own (random loopback port, its own store folder) where the test stops it.
 * A fresh database and cluster name per test; the cluster's streams are deleted at the end.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { createTestDatabase, type TestDatabase } from './helpers/fleet.js';
import { deleteClusterStreams, NATS_URL, ownNats } from './helpers/nats.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const TERMINAL = ['success', 'failure', 'timeout', 'cancelled'];
const freshCluster = () => `t_${process.pid}_${randomBytes(4).toString('hex')}`;

/** Deletes every stream of a cluster (runs stream, artifacts and nodes buckets) from the NATS at `url`. */
const deleteCluster = (url: string, cluster: string) => deleteClusterStreams(cluster, url);

const SLOW_APP = (name: string, concurrency = 4) => ({
  'ferry.toml': `[app]\nname = "${name}"\n[scaling]\nmin_replicas = 1\nmax_replicas = 1\nreplica_concurrency = ${concurrency}\nresponse_grace_period = 60\n`,
  'main.ts': `export async function run({ ms = 5 }: { ms?: number }) { await new Promise((r) => setTimeout(r, ms)); return { done: true }; }\n`,
});

async function callAsync(
  server: { url: string },
  auth: { projectId: string; token: string },
  app: string,
  body: unknown,
  webhook?: string,
): Promise<string> {
  const query = webhook ? `async=true&webhookEndpoint=${encodeURIComponent(webhook)}` : 'async=true';
  const res = await http(`${server.url}/v4/${auth.projectId}/${app}/run?${query}`, {
    method: 'POST',
    token: auth.token,
    body,
  });
  assert.equal(res.status, 202, res.text);
  return res.json.run_id as string;
}

/** The run rows of these ids, once every one is terminal. */
async function allTerminal(server: TestServer, ids: string[], ms = 90_000) {
  return waitFor(
    async () => {
      const rows = await server.services.store
        .selectFrom('runs')
        .select(['id', 'project_id', 'state', 'attempts', 'owner', 'started_at', 'finished_at', 'publishes'])
        .where('id', 'in', ids)
        .execute();
      return rows.length === ids.length && rows.every((r) => TERMINAL.includes(r.state)) ? rows : undefined;
    },
    ms,
    `${ids.length} runs terminal`,
  );
}

describe('the async queue on JetStream', () => {
  const cleanups: Array<() => Promise<unknown>> = [];
  after(async () => {
    for (const c of cleanups.reverse()) await c().catch(() => undefined);
  });

  async function cluster(natsUrl: string): Promise<{ db: TestDatabase; name: string; keysDir: string }> {
    const db = await createTestDatabase();
    const name = freshCluster();
    cleanups.push(() => db.drop());
    cleanups.push(() => deleteCluster(natsUrl, name));
    return { db, name, keysDir: await tempDir('ferry-keys-') };
  }

  async function server(c: { db: TestDatabase; name: string; keysDir: string }, natsUrl: string) {
    const s = await startServer({
      databaseUrl: c.db.url,
      keysDir: c.keysDir,
      natsUrl,
      clusterName: c.name,
      env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' },
    });
    cleanups.push(() => s.close());
    return s;
  }

  it('runs every accepted run once, through the stream, on two nodes', async () => {
    const c = await cluster(NATS_URL);
    const a = await server(c, NATS_URL);
    const b = await server(c, NATS_URL);
    const auth = await a.bootstrap('queue');
    await deployFiles(a, auth, 'work', SLOW_APP('work'));
    const receiver: Receiver = await startReceiver();
    cleanups.push(() => receiver.close());
    const ids: string[] = [];
    for (let i = 0; i < 120; i++)
      ids.push(await callAsync(i % 2 ? a : b, auth, 'work', { ms: 5 }, `${receiver.url}/hook`));
    const rows = await allTerminal(a, ids);
    assert.ok(
      rows.every((r) => r.state === 'success'),
      JSON.stringify(rows.filter((r) => r.state !== 'success')),
    );
    assert.ok(
      rows.every((r) => r.attempts === 1),
      'each run started exactly once',
    );
    await receiver.waitForRequests(ids.length, 60_000);
    const hooked = new Map<string, number>();
    for (const r of receiver.requests) {
      const id = JSON.parse(r.body.toString()).run_id as string;
      hooked.set(id, (hooked.get(id) ?? 0) + 1);
    }
    for (const id of ids) assert.equal(hooked.get(id), 1, `one webhook for ${id}`);
    // They went through JetStream: the nodes published them at acceptance and fetched them from the stream.
    const metric = async (s: TestServer, name: string) => {
      const text = await (await fetch(`${s.url}/metrics`)).text();
      return text
        .split('\n')
        .filter((l) => l.startsWith(name))
        .reduce((sum, l) => sum + Number(l.split(' ').pop()), 0);
    };
    const published =
      (await metric(a, 'ferry_async_published_total')) + (await metric(b, 'ferry_async_published_total'));
    const claimed =
      (await metric(a, 'ferry_async_fetched_total{outcome="claimed"')) +
      (await metric(b, 'ferry_async_fetched_total{outcome="claimed"'));
    assert.ok(published >= ids.length, `published ${published}`);
    assert.equal(claimed, ids.length, 'every run claimed from a fetched message, once');
    // Each run's steps through the queue were timed (ferry_async_stage_seconds): its publish at acceptance,
    // its claim and its start once each, and its message's ack once its end was committed.
    const stage = async (name: string, part: 'count' | 'sum') => {
      let sum = 0;
      for (const s of [a, b]) {
        const text = await (await fetch(`${s.url}/metrics`)).text();
        for (const l of text.split('\n'))
          if (l.startsWith(`ferry_async_stage_seconds_${part}{`) && l.includes(`stage="${name}"`))
            sum += Number(l.split(' ').pop());
      }
      return sum;
    };
    const publishedAtAccept =
      (await metric(a, 'ferry_async_published_total{via="accept"')) +
      (await metric(b, 'ferry_async_published_total{via="accept"'));
    assert.ok(publishedAtAccept > 0, 'runs published at acceptance');
    assert.equal(await stage('publish', 'count'), publishedAtAccept, 'each publish at acceptance timed');
    assert.equal(await stage('claim', 'count'), ids.length, 'each claim timed once');
    assert.equal(await stage('start', 'count'), ids.length, 'each start timed once');
    await waitFor(async () => (await stage('ack', 'count')) === ids.length, 10_000, 'each ack timed once');
    for (const name of ['publish', 'claim', 'start', 'ack']) {
      const [sum, count] = [await stage(name, 'sum'), await stage(name, 'count')];
      assert.ok(sum >= 0 && sum / count < 60, `${name}: ${sum} s over ${count} runs`);
    }
  });

  it('starts with NATS down, accepts async calls, and runs them once NATS is up', async () => {
    const nats = await ownNats();
    cleanups.push(() => nats.destroy());
    const c = await cluster(NATS_URL);
    // NATS is not running: the server starts anyway.
    const s = await server(c, nats.url);
    const auth = await s.bootstrap('down');
    // Deploying needs the object store: refused with its coded error while NATS is down...
    await assert.rejects(deployFiles(s, auth, 'work', SLOW_APP('work')), /FERRY_ARTIFACTS_UNAVAILABLE/);
    // ...and accepted once it is up (the server connects by itself, within a second or so).
    await nats.start();
    await waitFor(
      () =>
        deployFiles(s, auth, 'work', SLOW_APP('work')).then(
          () => true,
          (err: Error) => {
            if (!/FERRY_ARTIFACTS_UNAVAILABLE/.test(err.message)) throw err;
            return false;
          },
        ),
      30_000,
      'a deploy once NATS is up',
    );
    // Warm the app (its replica is up), then cut NATS.
    await allTerminal(s, [await callAsync(s, auth, 'work', { ms: 1 })]);
    await nats.stop();
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) ids.push(await callAsync(s, auth, 'work', { ms: 1 }));
    // Stored, answered 202, and not run while NATS is down.
    const queued = await s.services.store.selectFrom('runs').select(['state']).where('id', 'in', ids).execute();
    assert.deepEqual(
      queued.map((r) => r.state),
      ids.map(() => 'queued'),
    );
    await nats.start();
    const rows = await allTerminal(s, ids);
    assert.ok(rows.every((r) => r.state === 'success' && r.attempts === 1));
    // The relay published them (their publish at acceptance never reached NATS).
    assert.ok(rows.every((r) => r.publishes >= 1));
    cleanups.push(() => deleteCluster(nats.url, c.name));
  });

  it('loses nothing when NATS restarts during async load', async () => {
    const nats = await ownNats();
    cleanups.push(() => nats.destroy());
    await nats.start();
    const c = await cluster(nats.url);
    const a = await server(c, nats.url);
    const b = await server(c, nats.url);
    const auth = await a.bootstrap('restart');
    await deployFiles(a, auth, 'work', SLOW_APP('work'));
    const ids: string[] = [];
    for (let i = 0; i < 60; i++) ids.push(await callAsync(i % 2 ? a : b, auth, 'work', { ms: 20 }));
    await nats.stop();
    for (let i = 0; i < 30; i++) ids.push(await callAsync(i % 2 ? a : b, auth, 'work', { ms: 20 }));
    await nats.start();
    for (let i = 0; i < 30; i++) ids.push(await callAsync(i % 2 ? a : b, auth, 'work', { ms: 20 }));
    const rows = await allTerminal(a, ids, 120_000);
    // A run that was running when NATS went away keeps running (the store decides, not the message).
    assert.ok(
      rows.every((r) => r.state === 'success' && r.attempts === 1),
      JSON.stringify(rows.filter((r) => r.state !== 'success' || r.attempts !== 1)),
    );
  });

  it("one project's backlog does not hold up another project's runs", async () => {
    const c = await cluster(NATS_URL);
    const s = await server(c, NATS_URL);
    const busy = await s.bootstrap('busy');
    const other = await s.bootstrap('other');
    // One run at a time for the busy project: its backlog takes 24 × 1 s at least, so the other project's
    // runs have 12 s to finish before half of it is done, however slow the machine is at accepting calls
    // and starting replicas (with 80 × 100 ms the window was 4 s, and a loaded 2-core machine missed it).
    await deployFiles(s, busy, 'slow', SLOW_APP('slow', 1));
    await deployFiles(s, other, 'quick', SLOW_APP('quick', 1));
    const backlog: string[] = [];
    for (let i = 0; i < 24; i++) backlog.push(await callAsync(s, busy, 'slow', { ms: 1000 }));
    const quick: string[] = [];
    for (let i = 0; i < 5; i++) quick.push(await callAsync(s, other, 'quick', { ms: 1 }));
    const quickRows = await allTerminal(s, quick);
    assert.ok(quickRows.every((r) => r.state === 'success'));
    const lastQuick =
      quickRows
        .map((r) => r.finished_at ?? '')
        .sort()
        .at(-1) ?? '';
    const busyDone = await s.services.store
      .selectFrom('runs')
      .select('id')
      .where('id', 'in', backlog)
      .where('state', 'in', TERMINAL as Array<'success'>)
      .where('finished_at', '<=', lastQuick)
      .execute();
    assert.ok(
      busyDone.length < backlog.length / 2,
      `the other project's runs finished while the busy one had ${backlog.length - busyDone.length} left`,
    );
    await allTerminal(s, backlog, 120_000);
  });
});
