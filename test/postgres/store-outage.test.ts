/**
 * A PostgreSQL store that goes away, for real: the server reaches its database through a TCP proxy run
 * here, and the test stops the proxy (closing every connection and refusing new ones) and starts it again
 * on the same port. While the database cannot be reached, management calls answer 503
 * FERRY_STORE_UNAVAILABLE with Retry-After (never a 500) and /healthz answers 503 with reason "store";
 * once it is back, the same calls work. Also: a query in flight when its backend is terminated (57P01),
 * a `ferry serve` process that must live through such cuts, and one pointed at a port where nothing
 * listens. PostgreSQL only: on SQLite the file is always
 * there.
 */
import assert from 'node:assert/strict';
import net from 'node:net';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import { isStoreUnavailable } from '../../src/store/index.js';
import {
  deployFiles,
  http,
  runCli,
  spawnServe,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from '../helpers/ferry.js';
import { createTestDatabase, pgAdminUrl, type TestDatabase, withAdminClient } from '../helpers/store.js';

/** A TCP proxy on 127.0.0.1 to `target` that can be cut (every connection closed, new ones refused). */
interface Proxy {
  port: number;
  /** Connections it has accepted so far. */
  accepted(): number;
  cut(): Promise<void>;
  resume(): Promise<void>;
  close(): Promise<void>;
}

async function startProxy(target: { host: string; port: number }): Promise<Proxy> {
  const sockets = new Set<net.Socket>();
  let accepted = 0;
  const track = (s: net.Socket) => {
    sockets.add(s);
    s.on('close', () => sockets.delete(s));
    s.on('error', () => s.destroy());
  };
  const server = net.createServer((client) => {
    accepted += 1;
    const upstream = net.connect(target);
    track(client);
    track(upstream);
    client.pipe(upstream);
    upstream.pipe(client);
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
  });
  const listen = (port: number) =>
    new Promise<number>((resolve, reject) => {
      server.once('error', reject);
      server.listen(port, '127.0.0.1', () => {
        server.off('error', reject);
        resolve((server.address() as net.AddressInfo).port);
      });
    });
  const stop = async () => {
    const closed = new Promise<void>((resolve) => server.close(() => resolve()));
    for (const s of sockets) s.destroy();
    await closed;
  };
  const port = await listen(0);
  return {
    port,
    accepted: () => accepted,
    cut: stop,
    resume: async () => {
      await listen(port);
    },
    close: () => (server.listening ? stop() : Promise.resolve()),
  };
}

/** Asks `server` to upgrade `path` to a WebSocket and returns the whole answer (it closes after a refusal). */
function upgradeStatus(url: string, pathname: string, token: string): Promise<string> {
  const { port } = new URL(url);
  return new Promise((resolve, reject) => {
    const socket = net.connect(Number(port), '127.0.0.1');
    let text = '';
    socket.setEncoding('utf8');
    socket.on('data', (chunk: string) => {
      text += chunk;
    });
    socket.on('error', reject);
    socket.on('close', () => resolve(text));
    socket.setTimeout(30_000, () => socket.destroy());
    socket.write(
      `GET ${pathname} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n` +
        `Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer ${token}\r\n\r\n`,
    );
  });
}

describe('PostgreSQL store outages', () => {
  let database: TestDatabase;
  let proxy: Proxy;
  let server: TestServer;
  let auth: { projectId: string; token: string };

  before(async () => {
    database = await createTestDatabase();
    const direct = new URL(database.url);
    proxy = await startProxy({ host: direct.hostname, port: Number(direct.port || 5432) });
    const viaProxy = new URL(database.url);
    viaProxy.hostname = '127.0.0.1';
    viaProxy.port = String(proxy.port);
    server = await startServer({ databaseUrl: viaProxy.toString() });
    auth = await server.bootstrap();
  });
  after(async () => {
    await server?.close();
    await proxy?.close();
    await database?.drop();
  });

  const listApps = () => http(`${server.url}/v2/projects/${auth.projectId}/apps`, { token: auth.token });
  const createAccount = (name: string) =>
    http(`${server.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name, scopes: ['run'] },
    });

  it('answers 503 FERRY_STORE_UNAVAILABLE with Retry-After while the database is gone, and works again after', async () => {
    assert.equal((await listApps()).status, 200);
    assert.equal((await http(`${server.url}/healthz`)).status, 200);
    assert.ok(proxy.accepted() > 0, 'the server reaches its database through the proxy');

    await proxy.cut();
    for (const res of [await listApps(), await createAccount('during-outage')]) {
      assert.equal(res.status, 503, res.text);
      assert.equal(res.json.error.code, 'FERRY_STORE_UNAVAILABLE');
      assert.equal(res.json.error.message, 'The database cannot be reached; retry later');
      assert.equal(res.headers.get('retry-after'), '5');
      assert.ok(!res.text.includes('ECONNREFUSED') && !res.text.includes('127.0.0.1'), 'the body says no more');
    }
    const health = await http(`${server.url}/healthz`);
    assert.equal(health.status, 503);
    assert.deepEqual(health.json, { status: 'unavailable', reason: 'store' });

    await proxy.resume();
    // The pool opens new connections on demand: the first call after the return already works.
    const listed = await listApps();
    assert.equal(listed.status, 200, listed.text);
    assert.equal((await createAccount('after-outage')).status, 201);
    assert.equal((await http(`${server.url}/healthz`)).status, 200);
    // The call made during the outage stored nothing.
    const accounts = await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts`, { token: auth.token });
    const names = accounts.json.service_accounts.map((a: { name: string }) => a.name);
    assert.ok(names.includes('after-outage') && !names.includes('during-outage'), JSON.stringify(names));
  });

  it("answers a custom app's calls and WebSocket upgrades during the outage with 503, never a 500", {
    timeout: 120_000,
  }, async () => {
    await deployFiles(server, auth, 'outage-custom', {
      'ferry.toml':
        '[app]\nname = "outage-custom"\nruntime = "custom"\n[runtime.custom]\nentrypoint = ["node", "server.mjs"]\nport = 8080\nhealthcheck_endpoint = "/health"\nreadycheck_endpoint = "/ready"\n',
      'server.mjs':
        "import http from 'node:http';\nhttp.createServer((req, res) => res.end('ok')).listen(Number(process.env.PORT));\n",
    });
    const call = () => http(`${server.url}/v4/${auth.projectId}/outage-custom/hello`, { token: auth.token });
    assert.equal((await call()).status, 200);
    await proxy.cut();
    try {
      const statuses: string[] = [];
      for (let i = 0; i < 5; i++) {
        const res = await call();
        statuses.push(`${res.status} ${res.json?.error?.code ?? ''}`.trim());
        // A call answered by the app is fine (nothing of the store was needed); an error must be the store's.
        if (res.status !== 200) {
          assert.equal(res.status, 503, res.text);
          assert.equal(res.json.error.code, 'FERRY_STORE_UNAVAILABLE', res.text);
          assert.equal(res.headers.get('retry-after'), '5');
        }
      }
      assert.ok(statuses.length === 5, statuses.join(', '));
      // A WebSocket upgrade whose app must be looked up in the store (one never called before): the
      // refusal written on the raw socket is the store's 503 too (it was a 500).
      const head = await upgradeStatus(server.url, `/v4/${auth.projectId}/not-cached-app/ws`, auth.token);
      assert.match(head, /^HTTP\/1\.1 503 /, head);
      assert.match(head, /FERRY_STORE_UNAVAILABLE/, head);
      assert.match(head, /retry-after: 5/i, head);
    } finally {
      await proxy.resume();
    }
    assert.equal((await call()).status, 200);
  });

  it('keeps answering 503, not 500, through repeated cuts while calls are in flight', async () => {
    const statuses = new Map<number, number>();
    for (let round = 0; round < 5; round++) {
      const calls = Array.from({ length: 10 }, () => listApps());
      await proxy.cut();
      const during = Array.from({ length: 5 }, () => listApps());
      for (const res of await Promise.all([...calls, ...during])) {
        statuses.set(res.status, (statuses.get(res.status) ?? 0) + 1);
        if (res.status !== 200) {
          assert.equal(res.status, 503, res.text);
          assert.equal(res.json.error.code, 'FERRY_STORE_UNAVAILABLE');
        }
      }
      await proxy.resume();
      await waitFor(async () => (await listApps()).status === 200, 10_000, 'the store to answer again');
    }
    assert.ok((statuses.get(503) ?? 0) >= 25, `every call made during a cut got 503: ${JSON.stringify([...statuses])}`);
  });

  it('reports a query whose backend is terminated (57P01) as the store being unavailable', async () => {
    const name = new URL(database.url).pathname.slice(1);
    const sleeping = sql`select pg_sleep(30)`.execute(server.services.store);
    const failed = sleeping.then(
      () => undefined,
      (err: unknown) => err,
    );
    await waitFor(
      async () =>
        withAdminClient(async (client) => {
          const res = await client.query(
            "select pg_terminate_backend(pid) as done from pg_stat_activity where datname = $1 and query like 'select pg_sleep%'",
            [name],
          );
          return res.rows.some((r: { done: boolean }) => r.done);
        }),
      10_000,
      'the sleeping backend to be terminated',
    );
    const err = (await failed) as { cause?: { code?: string } } | undefined;
    assert.ok(err, 'the query failed');
    assert.ok(isStoreUnavailable(err), String(err));
    assert.equal(err.cause?.code, '57P01');
    assert.equal((await listApps()).status, 200, 'the next call gets a new connection');
  });

  it('keeps a `ferry serve` process alive through an outage with work in flight', async () => {
    // node-postgres emits `error` on a connection that drops while checked out of the pool; without a
    // listener that would end the process. A separate database and proxy, so the server above is not involved.
    const own = await createTestDatabase();
    const direct = new URL(own.url);
    const ownProxy = await startProxy({ host: direct.hostname, port: Number(direct.port || 5432) });
    const viaProxy = new URL(own.url);
    viaProxy.port = String(ownProxy.port);
    const dataDir = await tempDir();
    const env = { FERRY_DATABASE_URL: viaProxy.toString() };
    const serve = await spawnServe(dataDir, env);
    try {
      const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], {
        FERRY_DATABASE_URL: own.url,
      });
      assert.equal(boot.code, 0, boot.stderr);
      const { project_id: projectId, token } = JSON.parse(boot.stdout);
      const list = () => http(`${serve.url}/v2/projects/${projectId}/service-accounts`, { token });
      assert.equal((await list()).status, 200);
      for (let round = 0; round < 3; round++) {
        const inFlight = Array.from({ length: 20 }, () => list());
        await ownProxy.cut();
        const statuses = (await Promise.all(inFlight)).map((r) => r.status);
        assert.ok(
          statuses.every((s) => s === 200 || s === 503),
          `only 200 or 503: ${statuses.join(' ')}`,
        );
        const during = await list();
        assert.equal(during.status, 503, during.text);
        assert.equal(serve.child.exitCode, null, `ferry serve is still running:\n${serve.output()}`);
        await ownProxy.resume();
        await waitFor(async () => (await list()).status === 200, 10_000, 'the store to answer again');
      }
      assert.equal(serve.child.exitCode, null, 'ferry serve is still running');
      assert.equal(serve.child.signalCode, null);
    } finally {
      await serve.stop();
      await ownProxy.close();
      await own.drop();
    }
  });

  it('does not start `ferry serve` on a database where nothing listens, and says why', async () => {
    const closed = await startProxy({ host: '127.0.0.1', port: 1 });
    const port = closed.port;
    await closed.close();
    const url = new URL(pgAdminUrl());
    url.port = String(port);
    url.password = 'not-shown';
    const res = await runCli(['serve', '--port', '0', '--data-dir', await tempDir()], {
      FERRY_DATABASE_URL: url.toString(),
    });
    assert.equal(res.code, 1, res.stdout + res.stderr);
    assert.match(
      res.stderr,
      new RegExp(
        `^ferry: Cannot reach the PostgreSQL store at postgres://postgres:\\*\\*\\*@127\\.0\\.0\\.1:${port}/postgres: connect ECONNREFUSED`,
      ),
    );
    assert.ok(!res.stderr.includes('not-shown'), 'the password is not printed');
  });
});
