/**
 * A worker frozen past its lease comes back (issue 30 point 4), with real processes: a cluster of one
 * gateway and two workers on PostgreSQL and NATS; async runs with webhooks are running on a worker when
 * its serve process is stopped (SIGSTOP). Its lease runs out, the other worker's recovery ends its running
 * runs `failure`, reason `interrupted`, and their webhooks are delivered; meanwhile the frozen worker's
 * replicas finish the runs. After SIGCONT the worker reads their results: it must write none of them. Every
 * run recovery settled keeps that end, no webhook contradicts the first, and the worker counts what it
 * discarded in `ferry_late_results_discarded_total`.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, waitFor } from './helpers/ferry.js';
import type { FleetProcess } from './helpers/fleet.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const RUNS = 40;
const RUN_MS = 9000;
const TERMINAL = ['success', 'failure', 'timeout', 'cancelled'];

interface Row {
  id: string;
  state: string;
  reason: string | null;
  owner: string | null;
  result: string | null;
  finished_at: string | null;
  status_code: number | null;
}

describe('a worker frozen past its lease', { timeout: 300_000 }, () => {
  let cluster: TestCluster | undefined;
  let receiver: Receiver | undefined;
  let client: pg.Client | undefined;
  let frozen: FleetProcess | undefined;

  before(
    async () => {
      receiver = await startReceiver();
      cluster = await startCluster({ gateways: 1, workers: 2 });
      client = new pg.Client({ connectionString: cluster.db.url });
      client.on('error', () => {});
      await client.connect();
      await cluster.deploy('work', {
        'ferry.toml':
          '[app]\nname = "work"\n[scaling]\nmax_replicas = 2\nreplica_concurrency = 16\nresponse_grace_period = 120\n',
        'main.ts':
          'export async function run({ n, ms }: { n: number; ms: number }) { await new Promise((r) => setTimeout(r, ms)); return { n }; }\n',
      });
    },
    { timeout: 180_000 },
  );

  after(
    async () => {
      // Never leave a stopped process behind, whatever failed.
      if (frozen) {
        try {
          process.kill(frozen.pid, 'SIGCONT');
        } catch {}
      }
      await client?.end().catch(() => undefined);
      await receiver?.close();
      await cluster?.close();
    },
    { timeout: 60_000 },
  );

  it('writes none of the results of the runs recovery settled', async () => {
    const c = cluster!;
    const db = client!;
    const gateway = c.gateways[0]!;
    const hook = `${receiver!.url}/hook`;
    const ids: string[] = [];
    for (let n = 0; n < RUNS; n++) {
      const res = await http(
        `${gateway.url}/v4/${c.auth.projectId}/work/run?async=true&webhookEndpoint=${encodeURIComponent(hook)}`,
        {
          method: 'POST',
          token: c.auth.token,
          body: { n, ms: RUN_MS },
        },
      );
      assert.equal(res.status, 202, res.text);
      ids.push(res.json.run_id as string);
    }
    // The worker running the most runs is frozen while they run.
    const owner = await waitFor(
      async () => {
        const r = await db.query<{ owner: string; n: string }>(
          "select owner, count(*) as n from runs where state = 'running' and owner is not null group by owner order by n desc limit 1",
        );
        const top = r.rows[0];
        return top && Number(top.n) >= 5 ? top.owner : undefined;
      },
      60_000,
      'a worker running at least 5 runs',
    );
    const nodes = await db.query<{ id: string; info: string }>('select id, info from nodes');
    const urlOf = new Map(nodes.rows.map((r) => [r.id, (JSON.parse(r.info) as { url?: string }).url]));
    frozen = c.workers.find((w) => w.url === urlOf.get(owner));
    assert.ok(frozen, `the owner ${owner} is one of the workers`);
    process.kill(frozen.pid, 'SIGSTOP');
    const frozenAt = Date.now();

    // Its lease runs out; the other worker's recovery ends its running runs and their webhooks go out.
    const settled = await waitFor(
      async () => {
        const r = await db.query<Row>(
          "select id, state, reason, owner, result, finished_at, status_code from runs where owner = $1 and reason = 'interrupted'",
          [owner],
        );
        const left = await db.query("select 1 from runs where owner = $1 and state = 'running'", [owner]);
        return r.rows.length > 0 && left.rows.length === 0 ? r.rows : undefined;
      },
      60_000,
      'recovery to end the frozen worker’s running runs',
    ).catch(async (err: Error) => {
      const states = await db.query(
        'select state, reason, count(*) as n from runs where owner = $1 group by state, reason',
        [owner],
      );
      const leases = await db.query('select id, lease_until from nodes');
      throw new Error(
        `${err.message}: runs of ${owner}: ${JSON.stringify(states.rows)}; nodes: ${JSON.stringify(leases.rows)}; ` +
          `at ${new Date().toISOString()}; other worker: ${c.workers
            .find((w) => w !== frozen)
            ?.output()
            .split('\n')
            .filter((l) => /recover|lease|took over|sweep/i.test(l))
            .slice(-10)
            .join('\n')}`,
      );
    });
    const settledIds = new Set(settled.map((r) => r.id));
    const bodiesOf = (id: string) =>
      receiver!.requests
        .map((q) => JSON.parse(q.body.toString('utf8')) as { run_id: string; status_code: number; error?: unknown })
        .filter((b) => b.run_id === id);
    await waitFor(
      async () => (settled.every((r) => bodiesOf(r.id).length > 0) ? true : undefined),
      60_000,
      'the interrupted runs’ webhooks',
    );
    // The replicas finish the runs meanwhile (they are not stopped): wait past their end, then thaw.
    const wait = Math.max(0, frozenAt + RUN_MS + 1000 - Date.now());
    await new Promise((r) => setTimeout(r, wait));
    process.kill(frozen.pid, 'SIGCONT');
    const thawedAt = Date.now();
    const thawed = frozen;
    frozen = undefined;

    // Every run ends (the rest on either worker), and the thawed worker says what it discarded.
    const unended = async () =>
      (
        await db.query<{ id: string; state: string; owner: string | null; attempts: number }>(
          'select id, state, owner, attempts from runs where id = any($1) and state <> all($2)',
          [ids, TERMINAL],
        )
      ).rows;
    await waitFor(async () => ((await unended()).length === 0 ? true : undefined), 120_000, 'every run to end').catch(
      async (err: Error) => {
        throw new Error(`${err.message}: ${JSON.stringify(await unended())}`);
      },
    );
    const counted = async () => {
      const text = await (await fetch(`${thawed.url}/metrics`)).text();
      const m = /^ferry_late_results_discarded_total\{[^}]*\} (\d+)/m.exec(text);
      return Number(m?.[1] ?? 0);
    };
    const before = new Map(settled.map((r) => [r.id, r]));
    const readSettled = async () =>
      (
        await db.query<Row>(
          'select id, state, reason, owner, result, finished_at, status_code from runs where id = any($1)',
          [[...settledIds]],
        )
      ).rows;
    // The thawed worker's late results are in: counted as discarded, or (were they not fenced) written.
    await waitFor(
      async () =>
        (await counted()) > 0 || (await readSettled()).some((r) => r.state !== before.get(r.id)?.state)
          ? true
          : undefined,
      30_000,
      'the thawed worker to discard (or write) its late results',
    ).catch(() => undefined);
    // Time for any late write or webhook to land before the verdict.
    await new Promise((r) => setTimeout(r, 3000));
    for (const row of await readSettled())
      assert.deepEqual(row, before.get(row.id), `run ${row.id} was rewritten after it settled`);
    for (const id of settledIds) {
      const bodies = bodiesOf(id);
      const codes = new Set(bodies.map((b) => b.status_code));
      assert.deepEqual([...codes], [502], `run ${id}: webhooks ${JSON.stringify(bodies)}`);
    }
    const discarded = await counted();
    assert.ok(discarded >= 1, `ferry_late_results_discarded_total ${discarded}`);
    console.log(
      `frozen ${Math.round((thawedAt - frozenAt) / 1000)} s: ${settled.length} runs ended interrupted by recovery, ` +
        `unchanged after SIGCONT; ferry_late_results_discarded_total ${discarded}`,
    );
    // The thawed worker says so in its log too.
    assert.match(thawed.output(), /run changes discarded/);
  });
});
