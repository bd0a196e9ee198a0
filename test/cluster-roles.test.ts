/**
 * Gateways and workers (issue 13, items 3 and 4): two `ferry serve --role gateway` and two `--role worker`
 * processes on one PostgreSQL database and one NATS JetStream server, each with its own data directory.
 * The README's quickstart goes through gateway A while the other calls go through gateway B: deploy
 * (built on a worker), sync, stream, async with a webhook, a custom HTTP app and a WebSocket. Then the
 * workers' internal listener refuses what is not from the cluster, and a worker killed with SIGKILL
 * during sync calls costs only the calls in flight on it (coded errors), later calls succeeding within
 * 5 seconds.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { WebSocket } from 'undici';
import { http, REPO_ROOT, tempDir, waitFor } from './helpers/ferry.js';
import {
  bootstrapShared,
  createTestDatabase,
  type FleetProcess,
  type FleetSettings,
  startFleetProcess,
  sweepStrays,
  type TestDatabase,
} from './helpers/fleet.js';
import { deleteClusterStreams, NATS_URL } from './helpers/nats.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';
import { dataLines, disconnectAfterFirstItem, endEvent, streamRequest, streamWire } from './helpers/stream.js';

async function exampleFiles(name: string): Promise<Record<string, string>> {
  const dir = path.join(REPO_ROOT, 'examples', name);
  const files: Record<string, string> = {};
  for (const entry of await fs.readdir(dir)) {
    if (entry === 'README.md') continue;
    files[entry] = await fs.readFile(path.join(dir, entry), 'utf8');
  }
  return files;
}

async function deploy(
  gateway: { url: string },
  auth: { projectId: string; token: string },
  name: string,
  files: Record<string, string>,
): Promise<{ id: string; state: string; log: string }> {
  const { zipFiles } = await import('./helpers/app-zip.js');
  const res = await http(`${gateway.url}/v2/projects/${auth.projectId}/apps/${name}/builds`, {
    method: 'POST',
    token: auth.token,
    body: await zipFiles(files),
    headers: { 'content-type': 'application/zip' },
  });
  assert.equal(res.status, 201, res.text);
  const build = await waitFor(
    async () => {
      const b = await http(`${gateway.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${res.json.id}`, {
        token: auth.token,
      });
      return ['ready', 'failed', 'cancelled'].includes(b.json.state) ? b.json : undefined;
    },
    120_000,
    `build of ${name}`,
  );
  const log = await http(`${gateway.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${res.json.id}/logs`, {
    token: auth.token,
  });
  assert.equal(build.state, 'ready', `build of ${name} ended ${build.state}: ${build.error}\n${log.text}`);
  return { ...build, log: log.text };
}

function openSocket(url: string, headers: Record<string, string>): Promise<WebSocket> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers });
    const timer = setTimeout(() => reject(new Error('WebSocket did not open within 30 s')), 30_000);
    ws.addEventListener('open', () => {
      clearTimeout(timer);
      resolve(ws);
    });
    ws.addEventListener('error', () => {
      clearTimeout(timer);
      reject(new Error('WebSocket failed to open'));
    });
  });
}

function echo(ws: WebSocket, message: string): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('no echo within 15 s')), 15_000);
    ws.addEventListener(
      'message',
      (event) => {
        clearTimeout(timer);
        resolve(event.data);
      },
      { once: true },
    );
    ws.send(message);
  });
}

describe('gateways and workers on PostgreSQL and NATS JetStream', { timeout: 600_000 }, () => {
  let root = '';
  let db: TestDatabase | undefined;
  let receiver: Receiver | undefined;
  const cluster = `t_${process.pid}_${randomBytes(3).toString('hex')}`;
  const procs: FleetProcess[] = [];
  let gatewayA: FleetProcess;
  let gatewayB: FleetProcess;
  let workers: FleetProcess[] = [];
  let auth: { projectId: string; token: string };
  let settings: FleetSettings;

  const start = (label: string, role: 'gateway' | 'worker') =>
    startFleetProcess(label, path.join(root, label), {
      ...settings,
      env: { ...settings.env, FERRY_ROLE: role },
    }).then((p) => {
      procs.push(p);
      return p;
    });

  before(
    async () => {
      root = await tempDir('ferry-roles-');
      db = await createTestDatabase('ferry_roles');
      receiver = await startReceiver();
      settings = {
        databaseUrl: db.url,
        keysDir: path.join(root, 'keys'),
        artifactsDir: path.join(root, 'unused-artifacts'),
        env: {
          FERRY_NATS_URL: NATS_URL,
          FERRY_CLUSTER_NAME: cluster,
          FERRY_LEASE_SECONDS: '4',
          FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
          // A caller that goes away frees its slot soon (the gateway keeps a streaming run for a resume).
          FERRY_STREAM_RESUME_GRACE_SECONDS: '1',
          // The product's default (test/helpers/fleet.ts turns it off): warm sandboxes on workers only.
          FERRY_WARM_POOL: '1',
        },
      };
      auth = await bootstrapShared(path.join(root, 'boot'), db.url, settings.keysDir);
      [gatewayA, gatewayB, ...workers] = await Promise.all([
        start('gateway-a', 'gateway'),
        start('gateway-b', 'gateway'),
        start('worker-1', 'worker'),
        start('worker-2', 'worker'),
      ]);
      // Both gateways see both workers before the first call.
      await waitFor(
        async () => {
          const res = await http(`${gatewayA.url}/v2/cluster`, { token: auth.token });
          const roles = (res.json?.nodes ?? []).map((n: { role: string }) => n.role).sort();
          return roles.join(',') === 'gateway,gateway,worker,worker';
        },
        30_000,
        'the cluster view to list 2 gateways and 2 workers',
      );
    },
    { timeout: 180_000 },
  );

  after(
    async () => {
      const results = await Promise.allSettled(procs.map((p) => p.stop(10_000)));
      const strays = root ? await sweepStrays(root) : 0;
      results.push(
        ...(await Promise.allSettled([
          receiver?.close(),
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

  it('runs the quickstart through gateway A and the other calls through gateway B', async () => {
    const hello = await deploy(gatewayA, auth, 'hello', await exampleFiles('hello'));
    // Built on a worker: the gateway builds nothing.
    assert.match(hello.log, /Picked up by /);
    const base = (g: FleetProcess) => `${g.url}/v4/${auth.projectId}/hello/run`;

    const sync = await http(base(gatewayB), { method: 'POST', token: auth.token, body: { name: 'cluster' } });
    assert.equal(sync.status, 200, sync.text);
    assert.deepEqual(sync.json.result, { message: 'Hello, cluster!' });

    // Stream through A: a plain function's result is its one event (its one data: line), then the end comment.
    const stream = await fetch(base(gatewayA), {
      method: 'POST',
      headers: {
        authorization: `Bearer ${auth.token}`,
        accept: 'text/event-stream',
        'content-type': 'application/json',
      },
      body: JSON.stringify({ name: 'stream' }),
    });
    assert.equal(stream.status, 200);
    const wire = await stream.text();
    assert.deepEqual(dataLines(wire), ['{"message":"Hello, stream!"}']);
    const streamId = String(stream.headers.get('x-request-id'));
    assert.equal(wire, streamWire(streamId, ['{"message":"Hello, stream!"}', endEvent(streamId)]));

    // Async through B with a webhook: accepted, run by a worker, delivered.
    const hook = `${receiver!.url}/hook`;
    const accepted = await http(`${base(gatewayB)}?async=true&webhookEndpoint=${encodeURIComponent(hook)}`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'async' },
    });
    assert.equal(accepted.status, 202, accepted.text);
    const runId = accepted.json.run_id as string;
    const delivered = await waitFor(
      async () => receiver!.requests.find((r) => r.body.toString('utf8').includes(runId)),
      60_000,
      'the async run’s webhook',
    );
    assert.match(delivered.body.toString('utf8'), /Hello, async!/);
    const run = await http(`${gatewayA.url}/v2/projects/${auth.projectId}/apps/hello/runs/${runId}`, {
      token: auth.token,
    });
    assert.equal(run.json.state, 'success');

    // The sync call's run is recorded (by the worker that ran it) and readable through the other gateway.
    const syncRun = await http(`${gatewayA.url}/v2/projects/${auth.projectId}/apps/hello/runs/${sync.json.run_id}`, {
      token: auth.token,
    });
    assert.equal(syncRun.json.state, 'success');
  });

  it('serves a custom HTTP app and a WebSocket through either gateway', async () => {
    await deploy(gatewayB, auth, 'custom-websocket', await exampleFiles('custom-websocket'));
    const health = await http(`${gatewayA.url}/v4/${auth.projectId}/custom-websocket/health`, { token: auth.token });
    assert.equal(health.status, 200, health.text);
    assert.equal(health.text, 'ok');
    const missing = await http(`${gatewayB.url}/v4/${auth.projectId}/custom-websocket/nope`, { token: auth.token });
    assert.equal(missing.status, 404);
    // A gateway serves the dashboard: the worker's relayed answers are sandboxed there too (issue 43).
    for (const res of [health, missing]) {
      assert.equal(res.headers.get('content-security-policy'), 'sandbox allow-scripts allow-forms allow-popups');
    }

    const wsUrl = `${gatewayA.url.replace('http:', 'ws:')}/v4/${auth.projectId}/custom-websocket/`;
    const ws = await openSocket(wsUrl, { authorization: `Bearer ${auth.token}` });
    assert.equal(await echo(ws, 'one'), 'one');
    assert.equal(await echo(ws, 'two'), 'two');
    ws.close();
  });

  it('streams events through a gateway as they are yielded, and a caller going away stops the run', async () => {
    await deploy(gatewayB, auth, 'streamer', {
      'ferry.toml': '[app]\nname = "streamer"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n',
      'main.ts': `
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
export async function* count({ n = 4, ms = 300 }: { n?: number; ms?: number }) {
  for (let i = 0; i < n; i++) { await sleep(ms); yield { i }; }
}
export function* words() { yield 'plain'; yield 42; }
export async function* forever() { let i = 0; for (;;) { await sleep(50); yield i++; } }
export async function hang() { await sleep(600_000); return 'never'; }
`,
    });
    const url = (g: FleetProcess, fn: string) => `${g.url}/v4/${auth.projectId}/streamer/${fn}`;
    const res = await streamRequest(url(gatewayA, 'count'), auth.token, {}, { 'accept-encoding': 'gzip' });
    assert.equal(res.status, 200);
    const arrivalOf = (needle: string) => res.arrivals.find((a) => a.text.includes(needle));
    const first = arrivalOf('data: {"i":0}');
    const last = arrivalOf('data: {"i":3}');
    const wire = res.arrivals.map((a) => a.text).join('');
    assert.ok(first && last && arrivalOf(': end {'), wire);
    // A reader of data: lines gets exactly the yielded items; the end is a comment.
    assert.deepEqual(dataLines(wire), ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}']);
    const countId = String(res.headers['x-request-id']);
    assert.equal(wire, streamWire(countId, ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}', endEvent(countId)]));
    // Named events when asked, through the other gateway too.
    const named = await streamRequest(`${url(gatewayB, 'words')}?events=true`, auth.token, {});
    const namedId = String(named.headers['x-request-id']);
    assert.equal(
      named.arrivals.map((a) => a.text).join(''),
      streamWire(namedId, ['plain', '42', endEvent(namedId)], { named: true }),
    );
    // Progressive: the first item reached the caller before the last was yielded (300 ms apart each).
    assert.ok(first.at < last.at, `first item at ${first.at} ms, last at ${last.at} ms`);

    const runId = await disconnectAfterFirstItem(url(gatewayB, 'forever'), auth.token);
    // One slot: the next call gets through only once the endless generator on the worker let go of it.
    const next = await streamRequest(url(gatewayA, 'words'), auth.token, {});
    assert.equal(next.status, 200);
    /** The run once it has ended, read through `gateway`. */
    const ended = (gateway: FleetProcess, id: string) =>
      waitFor(
        async () => {
          const r = await http(`${gateway.url}/v2/projects/${auth.projectId}/apps/streamer/runs/${id}`, {
            token: auth.token,
          });
          return r.json.state !== 'running' && r.json.state !== 'queued' ? r.json : undefined;
        },
        30_000,
        `run ${id} to end`,
      );
    const run = await ended(gatewayA, runId);
    assert.equal(run.state, 'cancelled');
    assert.equal(run.reason, 'client_disconnected');

    // The same for a plain sync call (the gateway's run endpoint fast path): the caller hangs up while the
    // function runs on the worker, and the worker's run ends and frees the one slot.
    const hung = new AbortController();
    const call = fetch(url(gatewayA, 'hang'), {
      method: 'POST',
      headers: { authorization: `Bearer ${auth.token}`, 'content-type': 'application/json' },
      body: '{}',
      signal: hung.signal,
    }).catch((err: unknown) => err);
    const running = await waitFor(
      async () => {
        const r = await http(`${gatewayA.url}/v2/projects/${auth.projectId}/apps/streamer/runs?limit=5`, {
          token: auth.token,
        });
        return (r.json.runs as Array<{ run_id: string; function: string; state: string }>).find(
          (x) => x.function === 'hang' && x.state === 'running',
        );
      },
      30_000,
      'the sync call to run on the worker',
    );
    hung.abort();
    await call;
    const after = await streamRequest(url(gatewayB, 'words'), auth.token, {});
    assert.equal(after.status, 200);
    const abandoned = await ended(gatewayB, running.run_id);
    assert.equal(abandoned.state, 'cancelled');
    assert.equal(abandoned.reason, 'client_disconnected');
  });

  it('keeps min_replicas and max_replicas for the whole cluster', async () => {
    await deploy(gatewayA, auth, 'limited', {
      'ferry.toml': '[app]\nname = "limited"\n[scaling]\nmin_replicas = 1\nmax_replicas = 1\nreplica_concurrency = 1\n',
      'main.ts': 'export async function run() { await new Promise((r) => setTimeout(r, 300)); return { ok: true }; }\n',
    });
    const replicasOfLimited = async (): Promise<number> => {
      const res = await http(`${gatewayB.url}/v2/cluster`, { token: auth.token });
      let n = 0;
      for (const node of res.json?.nodes ?? []) {
        for (const app of node.apps ?? []) {
          if (app.app_id === 'limited') n += app.replicas_ready + app.replicas_starting;
        }
      }
      return n;
    };
    // min_replicas = 1 means one replica in the cluster (on the app's home worker), not one per worker.
    await waitFor(async () => (await replicasOfLimited()) === 1, 30_000, 'the one minimum replica');
    // max_replicas = 1 bounds the cluster too: 8 calls at once through both gateways share the one replica.
    const seen: number[] = [];
    let sampling = true;
    const sampler = (async () => {
      for (let i = 0; i < 100 && sampling; i++) {
        seen.push(await replicasOfLimited());
        await new Promise((r) => setTimeout(r, 250));
      }
    })();
    const calls = await Promise.all(
      Array.from({ length: 8 }, (_, i) =>
        http(`${(i % 2 ? gatewayA : gatewayB).url}/v4/${auth.projectId}/limited/run`, {
          method: 'POST',
          token: auth.token,
          body: {},
        }),
      ),
    );
    // Two more lease renewals after the burst, so a replica started during it would be listed.
    await new Promise((r) => setTimeout(r, 3_000));
    sampling = false;
    await sampler;
    assert.deepEqual(
      calls.map((c) => c.status),
      Array(8).fill(200),
      calls.map((c) => c.text).join('\n'),
    );
    assert.ok(seen.length > 0);
    assert.ok(
      seen.every((n) => n <= 1),
      `replicas of the app in the cluster while it was called: ${seen.join(',')}`,
    );
  });

  it('refuses calls to a worker that are not authenticated as coming from the cluster', async () => {
    const worker = workers[0]!;
    const health = await http(`${worker.url}/healthz`);
    assert.equal(health.status, 200);
    for (const authorization of [undefined, `Bearer ${auth.token}`, 'Ferry-Cluster v1.forged.9999999999999.AAAA']) {
      const res = await fetch(`${worker.url}/internal/v1/invoke`, {
        method: 'POST',
        headers: authorization ? { authorization } : {},
        body: '{}\n{}',
      });
      assert.equal(res.status, 401, `authorization ${authorization}`);
      assert.equal(((await res.json()) as { error: { code: string } }).error.code, 'FERRY_CLUSTER_UNAUTHENTICATED');
    }
    // The public interface is not there at all.
    const publicRoute = await fetch(`${worker.url}/v2/cluster`, { headers: { authorization: `Bearer ${auth.token}` } });
    assert.equal(publicRoute.status, 401);
  });

  it('keeps warm sandboxes on workers only: a gateway runs no user code', async () => {
    const warm = async (url: string): Promise<number> => {
      const text = await (await fetch(`${url}/metrics`)).text();
      let n = 0;
      for (const line of text.split('\n')) {
        if (line.startsWith('ferry_warm_sandboxes{')) n += Number(line.slice(line.lastIndexOf(' ') + 1));
      }
      return n;
    };
    await waitFor(async () => (await warm(workers[0]!.url)) >= 1, 60_000, 'a warm sandbox on a worker');
    for (const gateway of [gatewayA, gatewayB]) assert.equal(await warm(gateway.url), 0, gateway.label);
  });

  it('loses only the calls in flight on a worker killed with SIGKILL; later calls succeed within 5 s', async () => {
    const url = `${gatewayB.url}/v4/${auth.projectId}/hello/run`;
    const call = async () => {
      const started = Date.now();
      const res = await http(url, { method: 'POST', token: auth.token, body: { name: 'load' } });
      return { status: res.status, code: res.json?.error?.code as string | undefined, started, at: Date.now() };
    };
    // The worker to kill is the one serving the app (its home): the cluster view lists its replicas there.
    const home = await waitFor(
      async () => {
        const res = await http(`${gatewayA.url}/v2/cluster`, { token: auth.token });
        const node = (res.json?.nodes ?? []).find((n: { role: string; apps: Array<{ app_id: string }> }) =>
          n.apps?.some((a) => a.app_id === 'hello'),
        );
        return node?.url as string | undefined;
      },
      30_000,
      'a worker with replicas of hello',
    );
    const victim = workers.find((w) => w.url === home)!;
    const survivor = workers.find((w) => w !== victim)!;
    assert.ok(victim && survivor, `the worker at ${home} is one of ours`);
    const outcomes: Array<{ status: number; code: string | undefined; started: number; at: number }> = [];
    let stop = false;
    // Paced (10 ms between a loop's calls) so the loops outlast the kill by far: bounded by `stop` and a count.
    const loops = [0, 1, 2, 3].map(async () => {
      for (let i = 0; i < 5_000 && !stop; i++) {
        outcomes.push(await call());
        await new Promise((r) => setTimeout(r, 10));
      }
    });
    await waitFor(async () => outcomes.length >= 20, 60_000, '20 calls');
    const killedAt = await victim.kill();
    workers = [survivor];
    await waitFor(async () => outcomes.some((o) => o.started > killedAt + 6_000), 60_000, 'calls after the kill');
    stop = true;
    await Promise.all(loops);
    const failures = outcomes.filter((o) => o.status !== 200);
    console.log(
      `${outcomes.length} calls: ${outcomes.length - failures.length} succeeded, ${failures.length} failed (${[
        ...new Set(failures.map((f) => f.code)),
      ].join(', ')}); the last failure started ${
        failures.length ? Math.max(...failures.map((f) => f.started)) - killedAt : '-'
      } ms after the kill`,
    );
    for (const f of failures) {
      assert.ok(
        ['FERRY_WORKER_LOST', 'FERRY_NO_WORKERS', 'FERRY_REPLICA_DIED'].includes(f.code ?? ''),
        `a failed call answered a coded error, not ${f.status} ${f.code}`,
      );
    }
    // Every call that started 5 s after the kill succeeded.
    const late = outcomes.filter((o) => o.started > killedAt + 5_000);
    assert.ok(late.length > 0);
    assert.deepEqual(
      late.filter((o) => o.status !== 200),
      [],
      'calls made more than 5 s after the kill all succeed',
    );
  });

  it('serves the app from a worker whose data directory started empty (the build comes from the object store)', async () => {
    const fresh = await start('worker-3', 'worker');
    workers.push(fresh);
    // Stop every other worker (cleanly: gateways drop it at once), so calls can only go to the fresh one.
    for (const w of workers.filter((x) => x !== fresh)) await w.stop(15_000);
    workers = [fresh];
    const res = await waitFor(
      async () => {
        const r = await http(`${gatewayA.url}/v4/${auth.projectId}/hello/run`, {
          method: 'POST',
          token: auth.token,
          body: { name: 'fresh' },
        });
        return r.status === 200 ? r : undefined;
      },
      60_000,
      'a call served by the fresh worker',
    );
    assert.deepEqual(res.json.result, { message: 'Hello, fresh!' });
    const builds = await fs.readdir(path.join(fresh.dataDir, 'builds'));
    assert.ok(builds.length >= 1, 'the fresh worker fetched the build into its own data directory');
  });
});
