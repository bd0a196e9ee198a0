/**
 * Kill tests of a cluster (issue 13): two gateways and two workers on one PostgreSQL database and a NATS
 * JetStream server of the test's own. 500 async runs with webhooks go in through both gateways while a
 * worker is SIGKILLed (and comes back), then a gateway is SIGKILLed (the other keeps serving, and a call
 * whose 202 was lost with it is sent again with its Idempotency-Key), then NATS is restarted. Nothing
 * accepted is lost: every run ends in a final state and its webhook arrives at least once.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { deployFiles, http, tempDir, waitFor } from './helpers/ferry.js';
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
import { deleteClusterStreams, type OwnNats, ownNats } from './helpers/nats.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const RUNS = 500;
const CONCURRENCY = 16;
const TERMINAL = new Set(['success', 'failure', 'timeout', 'cancelled']);

describe('a cluster losing a worker, a gateway and NATS under async load', { timeout: 900_000 }, () => {
  let root = '';
  let db: TestDatabase | undefined;
  let nats: OwnNats | undefined;
  let receiver: Receiver | undefined;
  const cluster = `t_${process.pid}_${randomBytes(3).toString('hex')}`;
  const procs: FleetProcess[] = [];
  let settings: FleetSettings;
  let auth: { projectId: string; token: string };
  const slots: Slot[] = [
    { label: 'gateway-a', url: undefined },
    { label: 'gateway-b', url: undefined },
  ];
  const running = new Map<string, FleetProcess>();

  async function start(label: string, role: 'gateway' | 'worker'): Promise<FleetProcess> {
    const proc = await startFleetProcess(label, path.join(root, label), {
      ...settings,
      env: { ...settings.env, FERRY_ROLE: role },
    });
    procs.push(proc);
    running.set(label, proc);
    const slot = slots.find((s) => s.label === label);
    if (slot) slot.url = proc.url;
    return proc;
  }

  async function kill(label: string): Promise<number> {
    const slot = slots.find((s) => s.label === label);
    if (slot) slot.url = undefined;
    const at = await running.get(label)!.kill();
    running.delete(label);
    return at;
  }

  before(
    async () => {
      root = await tempDir('ferry-cluster-kill-');
      db = await createTestDatabase('ferry_cluster_kill');
      nats = await ownNats();
      await nats.start();
      receiver = await startReceiver();
      settings = {
        databaseUrl: db.url,
        keysDir: path.join(root, 'keys'),
        artifactsDir: path.join(root, 'unused-artifacts'),
        env: {
          FERRY_NATS_URL: nats.url,
          FERRY_CLUSTER_NAME: cluster,
          FERRY_LEASE_SECONDS: '3',
          FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
        },
      };
      auth = await bootstrapShared(path.join(root, 'boot'), db.url, settings.keysDir);
      await Promise.all([
        start('gateway-a', 'gateway'),
        start('gateway-b', 'gateway'),
        start('worker-1', 'worker'),
        start('worker-2', 'worker'),
      ]);
      await deployFiles({ url: slots[1]!.url! }, auth, 'work', {
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
      const results = await Promise.allSettled([...running.values()].map((p) => p.stop(10_000)));
      const strays = root ? await sweepStrays(root) : 0;
      results.push(
        ...(await Promise.allSettled([
          receiver?.close(),
          db?.drop(),
          nats ? deleteClusterStreams(cluster, nats.url).finally(() => nats?.destroy()) : undefined,
          root ? fs.rm(root, { recursive: true, force: true }) : undefined,
        ])),
      );
      assert.equal(strays, 0, 'no process of the test may outlive it');
      for (const r of results) if (r.status === 'rejected') throw r.reason;
    },
    { timeout: 60_000 },
  );

  it('ends every accepted run and delivers every webhook', async () => {
    const hook = `${receiver!.url}/hook`;
    const accepted: Accepted[] = [];
    const events: string[] = [];
    let next = 0;
    const chaos = (async () => {
      await waitFor(async () => accepted.length >= 100, 120_000, '100 accepted');
      events.push(`kill worker-1 at ${accepted.length}`);
      await kill('worker-1');
      await sleep(2_000);
      await start('worker-1', 'worker');
      events.push('worker-1 back');
      await waitFor(async () => accepted.length >= 250, 120_000, '250 accepted');
      events.push(`kill gateway-a at ${accepted.length}`);
      await kill('gateway-a');
      // The other gateway keeps serving sync calls meanwhile.
      const sync = await http(`${slots[1]!.url}/v4/${auth.projectId}/work/run`, {
        method: 'POST',
        token: auth.token,
        body: { n: -1, ms: 1 },
      });
      assert.equal(sync.status, 200, sync.text);
      await sleep(2_000);
      await start('gateway-a', 'gateway');
      events.push('gateway-a back');
      await waitFor(async () => accepted.length >= 380, 120_000, '380 accepted');
      events.push(`stop NATS at ${accepted.length}`);
      await nats!.stop();
      await sleep(2_000);
      await nats!.start();
      events.push('NATS back');
    })();
    const clients = Array.from({ length: CONCURRENCY }, async () => {
      for (;;) {
        const n = next++;
        if (n >= RUNS) return;
        // Paced (about 20 calls a second in all) so that the load spans every fault below.
        await sleep(800);
        accepted.push(
          await submitAsync(
            slots,
            n % 2,
            {
              path: `/v4/${auth.projectId}/work/run?async=true&webhookEndpoint=${encodeURIComponent(hook)}`,
              token: auth.token,
              body: { n, ms: 20 + ((n * 37) % 60) },
              idempotencyKey: `${cluster}-${n}`,
            },
            40,
          ),
        );
      }
    });
    await Promise.all(clients);
    await chaos;
    const ids = new Set(accepted.map((a) => a.runId));
    assert.equal(ids.size, RUNS, 'one run per call (a call sent twice answered the same run)');

    // Every accepted run ends in a final state.
    const client = new pg.Client({ connectionString: db!.url });
    await client.connect();
    let rows: Array<{
      id: string;
      state: string;
      reason: string | null;
      error_code: string | null;
      error_message: string | null;
    }> = [];
    try {
      await waitFor(
        async () => {
          const result = await client.query<(typeof rows)[number]>(
            'SELECT id, state, reason, error_code, error_message FROM runs WHERE id = ANY($1)',
            [[...ids]],
          );
          rows = result.rows;
          return rows.length === RUNS && rows.every((r) => TERMINAL.has(r.state));
        },
        240_000,
        'every accepted run to end',
      ).catch((err: unknown) => {
        const open = rows.filter((r) => !TERMINAL.has(r.state));
        throw new Error(
          `${(err as Error).message}: ${rows.length} runs found, ${open.length} not final (${open
            .slice(0, 5)
            .map((r) => `${r.id} ${r.state}`)
            .join(', ')}); ${events.join('; ')}`,
        );
      });
    } finally {
      await client.end();
    }
    // Per outcome: how many runs, and the first of them (its error tells why, should the outcome be wrong).
    const byState = new Map<string, { count: number; first: (typeof rows)[number] }>();
    for (const r of rows) {
      const key = r.state === 'success' ? 'success' : `${r.state}/${r.reason}`;
      const seen = byState.get(key);
      if (seen) seen.count += 1;
      else byState.set(key, { count: 1, first: r });
    }
    // A run cut by the worker's death ends `interrupted`; nothing else may fail.
    for (const [key, { count, first }] of byState) {
      assert.ok(
        key === 'success' || key === 'failure/interrupted',
        `${count} runs ended ${key} (for example ${first.id}: ${first.error_code} ${first.error_message}); ${events.join('; ')}`,
      );
    }

    // Every run's webhook arrives at least once.
    const delivered = new Set<string>();
    await waitFor(
      async () => {
        for (const r of receiver!.requests) {
          const match = /"run_id":"([^"]+)"/.exec(r.body.toString('utf8'));
          if (match?.[1]) delivered.add(match[1]);
        }
        return [...ids].every((id) => delivered.has(id));
      },
      240_000,
      'every webhook',
    ).catch((err: unknown) => {
      const missing = [...ids].filter((id) => !delivered.has(id));
      throw new Error(`${(err as Error).message}: ${missing.length} missing, e.g. ${missing.slice(0, 3).join(', ')}`);
    });
    const failedOver = accepted.filter((a) => a.connectionFailures > 0).length;
    console.log(
      `${RUNS} runs accepted (${failedOver} sent again after a connection failure): ${[...byState]
        .map(([k, v]) => `${v.count} ${k}`)
        .join(', ')}; webhooks for all ${delivered.size} runs (${receiver!.requests.length} deliveries); ${events.join(
        '; ',
      )}`,
    );
  });
});
