/**
 * Cluster-wide views (issue 13, item 5) on the `nodes` table every process keeps a leased row in:
 * `GET /v2/cluster` (auth, the node's info, live and expired nodes apart, apps of the caller's project
 * only), the `node` and `role` labels of `/metrics`, `ferry cluster` and `ferry doctor` as child processes;
 * and on PostgreSQL two servers in this process that each list both, with load figures that follow runs in
 * flight, and a server that closes leaving the live list.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { ClusterView } from '../src/cli/cluster.js';
import {
  deployFiles,
  http,
  REPO_ROOT,
  runCli,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';
import { createTestDatabase, type TestDatabase } from './helpers/store.js';

const VERSION = (JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'package.json'), 'utf8')) as { version: string })
  .version;

async function cluster(server: TestServer, token: string): Promise<ClusterView> {
  const res = await http(`${server.url}/v2/cluster`, { token });
  assert.equal(res.status, 200, res.text);
  return res.json as ClusterView;
}

const SLEEPY = {
  'ferry.toml': '[app]\nname = "sleepy"\n\n[scaling]\nmin_replicas = 0\nmax_replicas = 2\nreplica_concurrency = 4\n',
  'main.ts': `export async function run({ ms = 0 }: { ms?: number } = {}) {
  await new Promise((resolve) => setTimeout(resolve, ms));
  return { slept: ms };
}
`,
};

describe('GET /v2/cluster on one server', { timeout: 180_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let other: { projectId: string; token: string };

  before(async () => {
    // A lease of an hour: no renewal and no sweep during the test, so a row written by hand stays as it is.
    server = await startServer({ leaseMs: 3_600_000 });
    auth = await server.bootstrap();
    other = await server.bootstrap('elsewhere');
  });
  after(() => server?.close());

  it('answers coded errors without a manage token of some project', async () => {
    const none = await http(`${server.url}/v2/cluster`);
    assert.equal(none.status, 401);
    assert.equal(none.json.error.code, 'FERRY_UNAUTHENTICATED');
    const bad = await http(`${server.url}/v2/cluster`, { token: 'not-a-jwt' });
    assert.equal(bad.status, 401);
    assert.equal(bad.json.error.code, 'FERRY_TOKEN_INVALID');
    const made = await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'runner', scopes: ['run'] },
    });
    assert.equal(made.status, 201, made.text);
    const runOnly = await http(`${server.url}/v2/cluster`, { token: made.json.token });
    assert.equal(runOnly.status, 403);
    assert.equal(runOnly.json.error.code, 'FERRY_MISSING_SCOPE');
    const revoked = await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts/${made.json.id}`, {
      method: 'DELETE',
      token: auth.token,
    });
    assert.equal(revoked.status, 200, revoked.text);
    const afterRevoke = await http(`${server.url}/v2/cluster`, { token: made.json.token });
    assert.equal(afterRevoke.status, 401);
    assert.equal(afterRevoke.json.error.code, 'FERRY_TOKEN_REVOKED');
  });

  it('lists this server as the one live node, with its info', async () => {
    // The address is written once the server listens (a moment after listen() resolves).
    const view = await waitFor(
      async () => {
        const v = await cluster(server, auth.token);
        return v.nodes[0]?.url ? v : undefined;
      },
      10_000,
      'the listen address in the node info',
    );
    assert.equal(view.node, server.services.node.id);
    assert.equal(view.nodes.length, 1, JSON.stringify(view));
    assert.deepEqual(view.expired, []);
    const [node] = view.nodes;
    assert.ok(node);
    assert.equal(node.id, server.services.node.id);
    assert.equal(node.hostname, os.hostname());
    assert.equal(node.pid, process.pid);
    assert.equal(node.version, VERSION);
    assert.equal(node.role, 'all');
    assert.equal(node.url, server.url);
    assert.deepEqual(node.load, {
      runs_in_flight: 0,
      runs_queued: 0,
      async_backlog: 0,
      replicas_starting: 0,
      replicas_ready: 0,
    });
    assert.deepEqual(node.apps, []);
    assert.ok(Date.parse(node.lease_until) > Date.now() + 3_000_000, node.lease_until);
    assert.ok(Date.parse(node.started_at) <= Date.now());
    assert.equal('data_dir' in node, false, 'no file system path of the server in the answer');
    // Any project's manage token reads the same cluster.
    const seen = await cluster(server, other.token);
    assert.deepEqual(
      seen.nodes.map((n) => n.id),
      [node.id],
    );
  });

  it('lists a node whose lease ran out apart, tolerating the info of an older Ferry', async () => {
    const past = new Date(Date.now() - 60_000).toISOString();
    await server.services.store
      .insertInto('nodes')
      .values({
        id: 'old-host-4242-abcd',
        started_at: new Date(Date.now() - 3_600_000).toISOString(),
        lease_until: past,
        info: JSON.stringify({ hostname: 'old-host', pid: 4242, data_dir: '/srv/ferry' }),
      })
      .execute();
    try {
      const view = await cluster(server, auth.token);
      assert.deepEqual(
        view.nodes.map((n) => n.id),
        [server.services.node.id],
      );
      assert.deepEqual(view.expired, [
        {
          id: 'old-host-4242-abcd',
          started_at: view.expired[0]?.started_at,
          lease_until: past,
          hostname: 'old-host',
          pid: 4242,
          version: null,
          role: null,
          url: null,
          load: null,
          apps: [],
        },
      ]);
    } finally {
      await server.services.store.deleteFrom('nodes').where('id', '=', 'old-host-4242-abcd').execute();
    }
  });

  it('labels every /metrics sample with the node and its role', async () => {
    const text = (await http(`${server.url}/metrics`)).text;
    const samples = text.split('\n').filter((line) => line !== '' && !line.startsWith('#'));
    assert.ok(samples.length > 20, `${samples.length} samples`);
    const labels = `node="${server.services.node.id}",role="all"`;
    const unlabelled = samples.filter((line) => !line.includes(labels));
    assert.deepEqual(unlabelled, [], 'samples without the node and role labels');
    assert.match(text, new RegExp(`^ferry_http_requests_total\\{[^}]*${labels}\\} \\d+`, 'm'));
    assert.match(text, new RegExp(`^ferry_process_cpu_user_seconds_total\\{${labels}\\} `, 'm'));
  });

  it('ferry cluster prints the nodes as a table, and as JSON with --json', async () => {
    const env = { HOME: await tempDir('ferry-home-'), FERRY_URL: server.url, FERRY_TOKEN: auth.token };
    const json = await runCli(['cluster', '--json'], env);
    assert.equal(json.code, 0, json.stderr);
    const view = JSON.parse(json.stdout) as ClusterView;
    assert.deepEqual(
      view.nodes.map((n) => [n.id, n.url, n.version]),
      [[server.services.node.id, server.url, VERSION]],
    );
    const table = await runCli(['cluster'], env);
    assert.equal(table.code, 0, table.stderr);
    const lines = table.stdout.trimEnd().split('\n');
    assert.match(lines[0] ?? '', /^1 node live/);
    assert.match(
      lines[1] ?? '',
      /^\s+NODE\s+ROLE\s+VERSION\s+URL\s+RUNS\s+QUEUED\s+BACKLOG\s+REPLICAS\s+APPS\s+LEASE UNTIL$/,
    );
    const row = lines[2] ?? '';
    assert.ok(row.startsWith(`*  ${server.services.node.id}  all`), row);
    assert.ok(row.includes(` ${VERSION} `) && row.includes(` ${server.url} `), row);
    assert.equal(lines.length, 3, table.stdout);

    const refused = await runCli(['cluster'], { ...env, FERRY_TOKEN: 'not-a-jwt' });
    assert.equal(refused.code, 1);
    assert.match(refused.stderr, /FERRY_TOKEN_INVALID/);
  });

  it('ferry doctor prints the cluster when it reaches the server, and why not when it does not', async () => {
    const env = { HOME: await tempDir('ferry-home-'), FERRY_URL: server.url, FERRY_TOKEN: auth.token };
    const json = await runCli(['doctor', '--json'], env);
    assert.equal(json.code, 0, json.stderr);
    const report = JSON.parse(json.stdout) as { cluster: ClusterView | null; cluster_problem: string | null };
    assert.equal(report.cluster_problem, null);
    assert.deepEqual(
      report.cluster?.nodes.map((n) => n.id),
      [server.services.node.id],
    );
    const text = await runCli(['doctor'], env);
    assert.equal(text.code, 0, text.stderr);
    assert.ok(text.stdout.includes(`Cluster (as ${server.url} sees it):\n  1 node live`), text.stdout);
    assert.ok(text.stdout.includes(`*  ${server.services.node.id}  all`), text.stdout);

    // Nothing listens on port 1: the doctor still reports, and says why there is no cluster.
    const away = await runCli(['doctor', '--json'], { ...env, FERRY_URL: 'http://127.0.0.1:1' });
    assert.equal(away.code, 0, away.stderr);
    const awayReport = JSON.parse(away.stdout) as { cluster: unknown; cluster_problem: string };
    assert.equal(awayReport.cluster, null);
    assert.match(awayReport.cluster_problem, /cannot reach Ferry \(connection refused\)/);
    const noToken = await runCli(['doctor'], { HOME: env.HOME, FERRY_URL: server.url });
    assert.equal(noToken.code, 0, noToken.stderr);
    assert.match(noToken.stdout, /not shown: no token configured/);
  });
});

describe('GET /v2/cluster on PostgreSQL with two servers', { timeout: 300_000 }, () => {
  let db: TestDatabase;
  let a: TestServer;
  let b: TestServer | undefined;
  let auth: { projectId: string; token: string };
  let other: { projectId: string; token: string };

  before(async () => {
    db = await createTestDatabase();
    const shared = {
      databaseUrl: db.url,
      keysDir: await tempDir('ferry-keys-'),
      artifactsDir: await tempDir('ferry-artifacts-'),
      // Renewals (with the info) every second, so the load figures follow quickly.
      leaseMs: 3000,
    };
    a = await startServer(shared);
    b = await startServer(shared);
    auth = await a.bootstrap();
    other = await a.bootstrap('elsewhere');
    await deployFiles(a, auth, 'sleepy', SLEEPY);
  });
  after(async () => {
    await b?.close();
    await a?.close();
    await db?.drop();
  });

  const byId = (view: ClusterView, id: string) => view.nodes.find((n) => n.id === id);

  it('lists both servers from either one, each with its own address', async () => {
    const ids = [a.services.node.id, b!.services.node.id];
    for (const server of [a, b!]) {
      const view = await waitFor(
        async () => {
          const v = await cluster(server, auth.token);
          return v.nodes.length === 2 && v.nodes.every((n) => n.url) ? v : undefined;
        },
        15_000,
        `both nodes with their address, seen from ${server.url}`,
      );
      assert.equal(view.node, server.services.node.id);
      assert.deepEqual(view.nodes.map((n) => n.id).sort(), [...ids].sort());
      assert.equal(byId(view, a.services.node.id)?.url, a.url);
      assert.equal(byId(view, b!.services.node.id)?.url, b!.url);
      for (const node of view.nodes) {
        assert.equal(node.version, VERSION);
        assert.equal(node.role, 'all');
        assert.equal(node.pid, process.pid);
      }
    }
  });

  it('shows load figures that move while runs are in flight on each server, and back to zero after', async () => {
    const call = (server: TestServer, query = '') =>
      http(`${server.url}/v4/${auth.projectId}/sleepy/run${query}`, {
        method: 'POST',
        token: auth.token,
        body: { ms: 6000 },
      });
    // Sync calls held open on each server, and async runs accepted by A (held by A: it has room).
    const calls = [call(a), call(a), call(b!), call(b!)];
    const accepted = await Promise.all([call(a, '?async=true'), call(a, '?async=true')]);
    for (const res of accepted) assert.equal(res.status, 202, res.text);

    const busy = await waitFor(
      async () => {
        const v = await cluster(b!, auth.token);
        const [na, nb] = [byId(v, a.services.node.id), byId(v, b!.services.node.id)];
        const ok =
          (na?.load?.runs_in_flight ?? 0) >= 1 &&
          (nb?.load?.runs_in_flight ?? 0) >= 1 &&
          (na?.load?.async_backlog ?? 0) >= 1 &&
          (na?.apps.some((app) => app.app_id === 'sleepy' && app.replicas_ready >= 1) ?? false) &&
          (nb?.apps.some((app) => app.app_id === 'sleepy' && app.replicas_ready >= 1) ?? false);
        return ok ? v : undefined;
      },
      30_000,
      'runs in flight on both nodes, as B sees them',
    );
    const busyA = byId(busy, a.services.node.id)!;
    assert.ok((busyA.load?.replicas_ready ?? 0) + (busyA.load?.replicas_starting ?? 0) >= 1, JSON.stringify(busyA));
    // Another project's token sees the same load, but not this project's apps.
    const seen = await cluster(a, other.token);
    assert.equal(seen.nodes.length, 2);
    for (const node of seen.nodes) assert.deepEqual(node.apps, []);

    for (const res of await Promise.all(calls)) assert.equal(res.status, 200, res.text);
    await waitFor(
      async () => {
        const v = await cluster(a, auth.token);
        return (
          v.nodes.length === 2 &&
          v.nodes.every((n) => n.load?.runs_in_flight === 0 && n.load.async_backlog === 0 && n.load.runs_queued === 0)
        );
      },
      60_000,
      'no run in flight on either node',
    );
  });

  it('no longer lists a server as live once it closed, and forgets it after the sweep', async () => {
    const gone = b!.services.node.id;
    await b!.close();
    b = undefined;
    const view = await cluster(a, auth.token);
    assert.deepEqual(
      view.nodes.map((n) => n.id),
      [a.services.node.id],
    );
    // Either still listed as expired (its lease ended at close), or already removed by A's recovery.
    assert.ok(
      view.expired.every((n) => n.id === gone && Date.parse(n.lease_until) === 0),
      JSON.stringify(view),
    );
    await waitFor(
      async () => {
        const v = await cluster(a, auth.token);
        return v.expired.length === 0 && v.nodes.length === 1;
      },
      15_000,
      'the closed node removed by the sweep',
    );
  });
});
