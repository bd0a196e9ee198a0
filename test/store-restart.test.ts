/**
 * Every accepted run ends, whatever fails in between (issue 30 point 5): a cluster of one gateway and two
 * workers on PostgreSQL and NATS takes 500 async calls while the store goes away for 10 s. The store is
 * reached through a TCP proxy of the test's own (never the machine's shared PostgreSQL, which other tests
 * use): the cut resets every connection and refuses new ones, as a PostgreSQL stopped with `-m immediate`
 * does, then it listens again. Callers get 503 meanwhile and send again with their Idempotency-Key; every
 * run answered 202 must reach a final state, though a claim or a start may have been committed without
 * its node hearing of it (the node's held-runs sweep lets such runs go, runs/async-worker.ts).
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { deployFiles, tempDir, waitFor } from './helpers/ferry.js';
import {
  type Accepted,
  bootstrapShared,
  createTestDatabase,
  type FleetProcess,
  type FleetSettings,
  type Slot,
  sleep,
  startFleetProcess,
  submitAsync,
  sweepStrays,
  type TestDatabase,
} from './helpers/fleet.js';
import { deleteClusterStreams, NATS_URL } from './helpers/nats.js';

const RUNS = 500;
const CONCURRENCY = 16;
const OUTAGE_MS = 10_000;
const TERMINAL = new Set(['success', 'failure', 'timeout', 'cancelled']);

/** A TCP proxy to PostgreSQL that can be cut (every connection reset, new ones refused) and restored. */
async function storeProxy(target: { host: string; port: number }) {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((client) => {
    const upstream = net.connect(target);
    sockets.add(client);
    sockets.add(upstream);
    const drop = () => {
      client.destroy();
      upstream.destroy();
      sockets.delete(client);
      sockets.delete(upstream);
    };
    client.on('error', drop).on('close', drop);
    upstream.on('error', drop).on('close', drop);
    client.pipe(upstream);
    upstream.pipe(client);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const port = (server.address() as net.AddressInfo).port;
  return {
    port,
    /** Resets every connection and stops listening. */
    async cut(): Promise<void> {
      const closed = new Promise<void>((resolve) => server.close(() => resolve()));
      for (const s of sockets) s.resetAndDestroy();
      sockets.clear();
      await closed;
    },
    /** Listens again on the same port. */
    restore(): Promise<void> {
      return new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(port, '127.0.0.1', () => {
          server.off('error', reject);
          resolve();
        });
      });
    },
    close(): Promise<void> {
      for (const s of sockets) s.destroy();
      return new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

describe('a cluster whose store goes away for 10 s under async load', { timeout: 900_000 }, () => {
  let root = '';
  let db: TestDatabase | undefined;
  let proxy: Awaited<ReturnType<typeof storeProxy>> | undefined;
  const cluster = `t_${process.pid}_${randomBytes(3).toString('hex')}`;
  const procs: FleetProcess[] = [];
  let auth: { projectId: string; token: string };
  const slots: Slot[] = [{ label: 'gateway', url: undefined }];

  before(
    async () => {
      root = await tempDir('ferry-store-restart-');
      db = await createTestDatabase('ferry_store_restart');
      const direct = new URL(db.url);
      proxy = await storeProxy({ host: direct.hostname, port: Number(direct.port || 5432) });
      const viaProxy = new URL(db.url);
      viaProxy.port = String(proxy.port);
      const settings: FleetSettings = {
        databaseUrl: viaProxy.toString(),
        keysDir: path.join(root, 'keys'),
        artifactsDir: path.join(root, 'unused-artifacts'),
        env: { FERRY_NATS_URL: NATS_URL, FERRY_CLUSTER_NAME: cluster, FERRY_LEASE_SECONDS: '4' },
      };
      auth = await bootstrapShared(path.join(root, 'boot'), db.url, settings.keysDir);
      const start = async (label: string, role: 'gateway' | 'worker') => {
        const p = await startFleetProcess(label, path.join(root, label), {
          ...settings,
          env: { ...settings.env, FERRY_ROLE: role },
        });
        procs.push(p);
        return p;
      };
      const [gateway] = await Promise.all([
        start('gateway', 'gateway'),
        start('worker-1', 'worker'),
        start('worker-2', 'worker'),
      ]);
      slots[0]!.url = gateway.url;
      await deployFiles(gateway, auth, 'work', {
        'ferry.toml':
          '[app]\nname = "work"\n[scaling]\nmax_replicas = 2\nreplica_concurrency = 16\nresponse_grace_period = 60\n',
        'main.ts':
          'export async function run({ n, ms }: { n: number; ms: number }) { await new Promise((r) => setTimeout(r, ms)); return { n }; }\n',
      });
    },
    { timeout: 180_000 },
  );

  after(
    async () => {
      // The store reachable again first, so the processes can stop cleanly.
      await proxy?.restore().catch(() => undefined);
      const results = await Promise.allSettled(procs.map((p) => p.stop(10_000)));
      const strays = root ? await sweepStrays(root) : 0;
      results.push(
        ...(await Promise.allSettled([
          proxy?.close(),
          db?.drop(),
          deleteClusterStreams(cluster),
          root ? fs.rm(root, { recursive: true, force: true }) : undefined,
        ])),
      );
      assert.equal(strays, 0, 'no process of the test may outlive it');
      for (const r of results) if (r.status === 'rejected') throw r.reason;
    },
    { timeout: 60_000 },
  );

  it('ends every run it answered 202', async () => {
    const accepted: Accepted[] = [];
    let unavailable = 0;
    let next = 0;
    const events: string[] = [];
    const outage = (async () => {
      await waitFor(async () => (accepted.length >= 150 ? true : undefined), 120_000, '150 accepted');
      events.push(`cut at ${accepted.length}`);
      await proxy!.cut();
      await sleep(OUTAGE_MS);
      await proxy!.restore();
      events.push(`restored at ${accepted.length}`);
    })();
    const clients = Array.from({ length: CONCURRENCY }, async () => {
      for (;;) {
        const n = next++;
        if (n >= RUNS) return;
        // Paced (about 40 calls a second in all) so that the outage falls in the middle of the load.
        await sleep(400);
        const a = await submitAsync(
          slots,
          0,
          {
            path: `/v4/${auth.projectId}/work/run?async=true`,
            token: auth.token,
            body: { n, ms: 20 + ((n * 37) % 200) },
            idempotencyKey: `${cluster}-${n}`,
          },
          40,
        );
        accepted.push(a);
      }
    });
    await Promise.all(clients);
    await outage;
    const ids = [...new Set(accepted.map((a) => a.runId))];
    assert.equal(ids.length, RUNS, 'one run per call');

    const client = new pg.Client({ connectionString: db!.url });
    client.on('error', () => {});
    await client.connect();
    let open: Array<{ id: string; state: string; owner: string | null; attempts: number }> = [];
    try {
      await waitFor(
        async () => {
          const r = await client.query<{ id: string; state: string; owner: string | null; attempts: number }>(
            'select id, state, owner, attempts from runs where id = any($1)',
            [ids],
          );
          open = r.rows.filter((row) => !TERMINAL.has(row.state));
          return r.rows.length === RUNS && open.length === 0 ? true : undefined;
        },
        // Generous: the held-runs sweep needs two passes (10 s apart) to let a lost claim go.
        120_000,
        'every accepted run to end',
      ).catch((err: unknown) => {
        throw new Error(
          `${(err as Error).message}: ${open.length} not final: ${JSON.stringify(open.slice(0, 10))}; ${events.join('; ')}`,
        );
      });
    } finally {
      await client.end();
    }
    unavailable = accepted.filter((a) => a.connectionFailures > 0).length;
    const said = (text: RegExp) => procs.reduce((n, p) => n + (p.output().match(text)?.length ?? 0), 0);
    console.log(
      `store cut for ${OUTAGE_MS} ms: ${RUNS} runs accepted and ended; ${events.join('; ')}; ${unavailable} calls ` +
        `failed over; held-runs sweeps that let runs go: ${said(/not in hand/g)}; ` +
        `runs kept in hand on a store error: ${said(/async run; trying again|dispatch failed; trying again/g)}`,
    );
  });
});
