/**
 * Issue 30, point 6: sync calls while NATS is frozen. A gateway and two workers on a fresh PostgreSQL
 * database and a nats-server of the test's own (never the machine's shared one), which is SIGSTOPped for
 * 20 s: the workers cannot announce themselves, but they are healthy and reachable over HTTP, so the
 * gateway keeps routing sync calls to them (src/cluster/workers.ts holds the workers it last saw alive
 * while the directory is silent). After SIGCONT the directory works again and so do async calls.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, waitFor } from './helpers/ferry.js';
import { sleep } from './helpers/fleet.js';
import { type OwnNats, ownNats } from './helpers/nats.js';

const FREEZE_MS = 20_000;

describe('sync calls while NATS is frozen', { timeout: 300_000 }, () => {
  let nats: OwnNats | undefined;
  let cluster: TestCluster | undefined;

  before(
    async () => {
      nats = await ownNats();
      await nats.start();
      cluster = await startCluster({ gateways: 1, workers: 2, env: { FERRY_NATS_URL: nats.url } });
      await cluster.deploy('echo', {
        'ferry.toml': '[app]\nname = "echo"\n[scaling]\nmax_replicas = 2\nreplica_concurrency = 8\n',
        'main.ts': 'export function run({ n }: { n: number }) { return { n }; }\n',
      });
    },
    { timeout: 180_000 },
  );

  after(
    async () => {
      nats?.thaw();
      const results = await Promise.allSettled([cluster?.close()]);
      await nats?.destroy();
      for (const r of results) if (r.status === 'rejected') throw r.reason;
    },
    { timeout: 60_000 },
  );

  it('answers every sync call 200 during a 20 s freeze, and recovers after it', async () => {
    const c = cluster!;
    const gateway = c.gateways[0]!;
    const url = `${gateway.url}/v4/${c.auth.projectId}/echo/run`;
    const call = async (n: number) => {
      const res = await http(url, { method: 'POST', token: c.auth.token, body: { n } });
      return { status: res.status, code: res.json?.error?.code as string | undefined, n: res.json?.result?.n };
    };
    // Warm: the build is on its worker and the replica started before NATS freezes.
    await waitFor(async () => (await call(0)).status === 200, 60_000, 'a first sync call answered 200');

    nats!.freeze();
    const frozenAt = Date.now();
    const failures: string[] = [];
    let calls = 0;
    // Bounded in time (the freeze) and in count.
    while (Date.now() - frozenAt < FREEZE_MS && calls < 2_000) {
      calls++;
      const r = await call(calls);
      if (r.status !== 200 || r.n !== calls) {
        failures.push(`${Date.now() - frozenAt} ms: ${r.status} ${r.code ?? ''}`);
        if (failures.length >= 20) break;
      }
      await sleep(100);
    }
    const frozenFor = Date.now() - frozenAt;
    nats!.thaw();
    assert.deepEqual(failures, [], `sync calls failed while NATS was frozen (${calls} calls in ${frozenFor} ms)`);
    assert.ok(frozenFor >= FREEZE_MS, `the freeze lasted ${frozenFor} ms`);
    assert.ok(calls >= 20, `only ${calls} calls in the freeze`);

    // After: sync calls still answer, and the directory and NATS work again (an async call runs to success).
    for (let i = 0; i < 20; i++) {
      const r = await call(10_000 + i);
      assert.equal(r.status, 200, `after the freeze, call ${i}: ${r.status} ${r.code ?? ''}`);
      await sleep(100);
    }
    const accepted = await http(`${url}?async=true`, { method: 'POST', token: c.auth.token, body: { n: 7 } });
    assert.equal(accepted.status, 202, accepted.text);
    const runId = accepted.json.run_id as string;
    const run = await waitFor(
      async () => {
        const r = await http(`${gateway.url}/v2/projects/${c.auth.projectId}/apps/echo/runs/${runId}`, {
          token: c.auth.token,
        });
        return r.json?.state === 'success' ? r.json : undefined;
      },
      60_000,
      'the async call after the freeze to succeed',
    );
    assert.deepEqual(run.result, { n: 7 });
    const view = await http(`${gateway.url}/v2/cluster`, { token: c.auth.token });
    assert.equal(
      (view.json?.nodes ?? []).filter((n: { role: string }) => n.role === 'worker').length,
      2,
      'both workers listed after the freeze',
    );
  });
});
