/**
 * Day-two operations in a cluster (issue 14): two gateways and two workers on PostgreSQL and NATS
 * JetStream. Each change is made through gateway B and seen through gateway A (or on the workers): roll
 * back under load with no failed call, scale min_replicas up with no build, cancel a run that runs on a
 * worker, wait for a run that ends on a worker, delete the app (calls through A refused within seconds, the
 * workers' replicas stop); and retention, run by the workers, deleting an app's oldest build.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, waitFor } from './helpers/ferry.js';

function version(v: number): Record<string, string> {
  return {
    'ferry.toml': '[app]\nname = "ops"\n\n[scaling]\nmax_replicas = 2\nreplica_concurrency = 4\ncooldown = 600\n',
    'main.ts': `export async function run({ ms = 0 }: { ms?: number } = {}, { signal }: { signal: AbortSignal }) {
  await new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(timer); reject(signal.reason); });
  });
  return { version: ${v} };
}
`,
  };
}

describe('day-two operations in a cluster', { timeout: 600_000 }, () => {
  let cluster: TestCluster;
  let a: { url: string };
  let b: { url: string };
  const builds: string[] = [];
  const app = (g: { url: string }) => `${g.url}/v2/projects/${cluster.auth.projectId}/apps/ops`;
  const call = (g: { url: string }, body: unknown = {}, query = '') =>
    http(`${g.url}/v4/${cluster.auth.projectId}/ops/run${query}`, { method: 'POST', token: cluster.auth.token, body });

  before(
    async () => {
      // Retention every 5 s, keeping 2 ready builds per app (the active one always).
      cluster = await startCluster({
        gateways: 2,
        workers: 2,
        env: { FERRY_KEEP_BUILDS: '2', FERRY_RETENTION_INTERVAL_SECONDS: '5' },
      });
      a = cluster.gateways[0]!;
      b = cluster.gateways[1]!;
      for (const v of [1, 2]) builds.push((await cluster.deploy('ops', version(v), a)).id);
    },
    { timeout: 300_000 },
  );

  after(() => cluster?.close(), { timeout: 120_000 });

  it('rolls back through gateway B while gateway A serves calls, with no failed call', async () => {
    assert.deepEqual((await call(a)).json.result, { version: 2 });
    const seen: number[] = [];
    const failures: string[] = [];
    let stop = false;
    const loop = (async () => {
      const end = Date.now() + 90_000;
      for (let i = 0; i < 3000 && !stop && Date.now() < end; i++) {
        const res = await call(a);
        if (res.status !== 200) failures.push(`${res.status} ${res.text}`);
        else seen.push(res.json.result.version);
      }
    })();
    await waitFor(async () => seen.length >= 5, 60_000, 'calls before the rollback');
    const res = await http(`${app(b)}/builds/${builds[0]}/activate`, { method: 'POST', token: cluster.auth.token });
    assert.equal(res.status, 200, res.text);
    // Within a second or so every node runs the old build; generous bounds for a loaded machine.
    await waitFor(
      async () => seen.slice(-5).length === 5 && seen.slice(-5).every((v) => v === 1),
      60_000,
      'version 1 through A',
    );
    stop = true;
    await loop;
    assert.deepEqual(failures, []);
    assert.equal((await http(app(a), { token: cluster.auth.token })).json.active_build_id, builds[0]);
  });

  it('scales min_replicas up through gateway B: a worker starts replicas without a build', async () => {
    const res = await http(app(b), {
      method: 'PATCH',
      token: cluster.auth.token,
      body: { scaling: { min_replicas: 2 } },
    });
    assert.equal(res.status, 200, res.text);
    await waitFor(
      async () => {
        const view = (await http(`${a.url}/v2/cluster`, { token: cluster.auth.token })).json;
        const ready = (view.nodes ?? [])
          .flatMap((n: { apps?: Array<{ app_id: string; replicas_ready: number }> }) => n.apps ?? [])
          .filter((x: { app_id: string }) => x.app_id === 'ops')
          .reduce((n: number, x: { replicas_ready: number }) => n + x.replicas_ready, 0);
        return ready >= 2;
      },
      90_000,
      'two ready replicas of ops in the cluster view',
    );
  });

  it('cancels through gateway B a run accepted by gateway A and running on a worker', async () => {
    const accepted = await call(a, { ms: 120_000 }, '?async=true');
    assert.equal(accepted.status, 202, accepted.text);
    const id = accepted.json.run_id as string;
    await waitFor(
      async () => (await http(`${app(b)}/runs/${id}`, { token: cluster.auth.token })).json.state === 'running',
      60_000,
      'the run to start on a worker',
    );
    const res = await http(`${app(b)}/runs/${id}/cancel`, { method: 'POST', token: cluster.auth.token });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'cancelled');
    assert.equal(res.json.error.code, 'FERRY_RUN_CANCELLED');
  });

  it('waits through gateway B for a run accepted by gateway A, answered when it ends', async () => {
    const accepted = await call(a, { ms: 1500 }, '?async=true');
    assert.equal(accepted.status, 202, accepted.text);
    const started = Date.now();
    const res = await http(`${app(b)}/runs/${accepted.json.run_id}?wait=60`, { token: cluster.auth.token });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'success');
    assert.ok(Date.now() - started < 40_000, 'answered at the end of the run, not at the end of the wait');
  });

  it('deletes the app through gateway B: gateway A refuses its calls, the workers stop its replicas and remove its builds', async () => {
    const ids = (await http(`${app(a)}/builds`, { token: cluster.auth.token })).json.builds.map(
      (x: { id: string }) => x.id,
    ) as string[];
    assert.ok(ids.length >= 2);
    const res = await http(app(b), { method: 'DELETE', token: cluster.auth.token });
    assert.equal(res.status, 200, res.text);
    await waitFor(async () => (await call(a)).status === 404, 10_000, 'calls through A to be refused');
    assert.equal((await call(a)).json.error.code, 'FERRY_APP_NOT_FOUND');
    await waitFor(
      async () => {
        const view = (await http(`${a.url}/v2/cluster`, { token: cluster.auth.token })).json;
        return (view.nodes ?? []).every((n: { apps?: Array<{ app_id: string }> }) =>
          (n.apps ?? []).every((x) => x.app_id !== 'ops'),
        );
      },
      60_000,
      'no replica of ops left in the cluster',
    );
    // No worker keeps a copy of its builds (folder or download marker) once its replicas have stopped.
    const leftovers = async () => {
      const found: string[] = [];
      for (const w of cluster.workers) {
        const names = await fs.readdir(path.join(w.dataDir, 'builds')).catch(() => [] as string[]);
        for (const n of names) if (ids.some((id) => n.startsWith(id))) found.push(`${w.label}/${n}`);
      }
      return found;
    };
    await waitFor(async () => (await leftovers()).length === 0, 60_000, 'the workers to remove its builds').catch(
      async (err: Error) => {
        throw new Error(`${err.message}: ${(await leftovers()).join(', ')}`);
      },
    );
  });

  it("lets the workers' retention delete the oldest build beyond FERRY_KEEP_BUILDS, never the active one", async () => {
    const kept: string[] = [];
    for (const v of [1, 2, 3])
      kept.push(
        (
          await cluster.deploy(
            'kept',
            { ...version(v), 'ferry.toml': version(v)['ferry.toml']!.replace('"ops"', '"kept"') },
            b,
          )
        ).id,
      );
    const base = `${a.url}/v2/projects/${cluster.auth.projectId}/apps/kept`;
    await waitFor(
      async () => (await http(`${base}/builds/${kept[0]}`, { token: cluster.auth.token })).status === 404,
      60_000,
      'retention to delete the oldest build',
    );
    const list = (await http(`${base}/builds`, { token: cluster.auth.token })).json.builds;
    assert.deepEqual(
      list.map((x: { id: string; active: boolean }) => [x.id, x.active]),
      [
        [kept[2], true],
        [kept[1], false],
      ],
    );
    const res = await http(`${a.url}/v4/${cluster.auth.projectId}/kept/run`, {
      method: 'POST',
      token: cluster.auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { version: 3 });
  });
});
