/**
 * Issue 43, point 8: a tenant's app never answers with the dashboard's origin. On the port that serves the
 * dashboard every response of a custom app's server is sandboxed (`Content-Security-Policy: sandbox ...`
 * without `allow-same-origin`) whatever its status, and `Service-Worker-Allowed` never reaches a caller;
 * with FERRY_RUN_PORT the run endpoint is also served alone on a second listener, where the app answers
 * as it is, and the addresses Ferry tells (the project's `run_url`, `ferry deploy`, `ferry apps list`,
 * `ferry serve`'s log) follow it. Real servers, real sandboxed replicas, the real CLI. The browser side of
 * the same attack is test/dashboard-origin.test.ts.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { WebSocket } from 'undici';
import { resolveServerConfig } from '../src/config.js';
import {
  http as call,
  deployFiles,
  REPO_ROOT,
  runCli,
  spawnServe,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';

const THIEF = path.join(REPO_ROOT, 'test', 'fixtures', 'security', 'origin-thief');
/** Scripts, forms and popups, in an opaque origin: never `allow-same-origin`. */
const SANDBOX = 'sandbox allow-scripts allow-forms allow-popups';

async function folderFiles(dir: string): Promise<Record<string, string>> {
  const files: Record<string, string> = {};
  for (const entry of await fs.readdir(dir)) files[entry] = await fs.readFile(path.join(dir, entry), 'utf8');
  return files;
}

/** Opens a WebSocket, sends one message and resolves with the echo. */
function wsEcho(url: string, token: string, message: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers: { authorization: `Bearer ${token}` } });
    const timer = setTimeout(() => {
      ws.close();
      reject(new Error(`no echo from ${url} within 30 s`));
    }, 30_000);
    ws.addEventListener('open', () => ws.send(message));
    ws.addEventListener('message', (event) => {
      clearTimeout(timer);
      ws.close();
      resolve(String(event.data));
    });
    ws.addEventListener('error', () => {
      clearTimeout(timer);
      reject(new Error(`WebSocket to ${url} failed`));
    });
  });
}

describe("a custom app on the dashboard's port", () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const url = (rest: string) => `${server.url}/v4/${auth.projectId}/evil${rest}`;

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'evil', await folderFiles(THIEF));
  });
  after(() => server?.close());

  it('answers every status sandboxed, without Service-Worker-Allowed', async () => {
    for (const [rest, method, status] of [
      ['/', 'GET', 200],
      ['/', 'HEAD', 200],
      ['/sw.js', 'GET', 200],
      ['/steal?t=x', 'GET', 204],
      ['/missing', 'GET', 404],
      ['/boom', 'GET', 500],
      ['/missing', 'POST', 404],
    ] as const) {
      const res = await call(url(rest), { method });
      const what = `${method} ${rest}`;
      assert.equal(res.status, status, what);
      assert.equal(res.headers.get('content-security-policy'), SANDBOX, what);
      assert.equal(res.headers.get('service-worker-allowed'), null, what);
      assert.ok(res.headers.get('x-request-id'), what);
    }
    // The body is the app's, untouched.
    const page = await call(url('/'));
    assert.match(page.text, /sessionStorage\.getItem\('ferry\.token'\)/);
    assert.equal(page.headers.get('content-type'), 'text/html; charset=utf-8');
  });

  it("keeps the app's own policy beside the sandbox (a browser enforces both)", async () => {
    const res = await call(url('/own-policy'));
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('content-security-policy'), `img-src 'self', ${SANDBOX}`);
    assert.equal(res.headers.get('service-worker-allowed'), null);
  });

  it('tells no run address apart from its own on a single port', async () => {
    const project = await server.inject(`/v2/projects/${auth.projectId}`, { token: auth.token });
    assert.equal(project.status, 200);
    assert.equal(project.json.run_url, null);
    assert.equal(server.runUrl, undefined);
  });
});

describe('the run listener (FERRY_RUN_PORT)', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let runUrl: string;
  let cliEnv: NodeJS.ProcessEnv;

  before(async () => {
    server = await startServer({ runPort: 0 });
    assert.ok(server.runUrl);
    runUrl = server.runUrl;
    auth = await server.bootstrap();
    cliEnv = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: server.url,
      FERRY_TOKEN: auth.token,
      FERRY_PROJECT: auth.projectId,
    };
  });
  after(() => server?.close());

  it('is the run address the API tells, and the one `ferry deploy` prints', async () => {
    assert.notEqual(new URL(runUrl).port, new URL(server.url).port);
    const project = await call(`${server.url}/v2/projects/${auth.projectId}`, { token: auth.token });
    assert.equal(project.status, 200);
    // The caller's own host name, on the run port.
    assert.equal(project.json.run_url, runUrl);

    const deployed = await runCli(['deploy', THIEF, '--json'], cliEnv);
    assert.equal(deployed.code, 0, `${deployed.stdout}\n${deployed.stderr}`);
    const out = JSON.parse(deployed.stdout) as { run_url: string; status: string };
    assert.equal(out.status, 'ready');
    assert.equal(out.run_url, `${runUrl}/v4/${auth.projectId}/evil/`);
  });

  it("derives the address from the caller's host name, or the listen address for one it cannot use", async () => {
    const port = new URL(runUrl).port;
    const ask = async (host: string) =>
      (await server.inject(`/v2/projects/${auth.projectId}`, { token: auth.token, headers: { host } })).json.run_url;
    assert.equal(await ask('ferry.example.com:8443'), `http://ferry.example.com:${port}`);
    assert.equal(await ask('[::1]:8000'), `http://[::1]:${port}`);
    assert.equal(await ask('evil.example/path?x'), `http://127.0.0.1:${port}`);
    assert.equal(await ask('a b'), `http://127.0.0.1:${port}`);
  });

  it('serves the app as it answers there, and only the run endpoint and /healthz', async () => {
    const app = `${runUrl}/v4/${auth.projectId}/evil`;
    const res = await call(`${app}/own-policy`);
    assert.equal(res.status, 200, res.text);
    // Its own origin: the app's policy alone; still no scope above the app for a service worker.
    assert.equal(res.headers.get('content-security-policy'), "img-src 'self'");
    assert.equal(res.headers.get('service-worker-allowed'), null);
    const missing = await call(`${app}/missing`);
    assert.equal(missing.status, 404);
    assert.equal(missing.headers.get('content-security-policy'), null);

    assert.equal((await call(`${runUrl}/healthz`)).status, 200);
    for (const rest of [
      '/',
      '/dashboard/',
      '/dashboard/app.js',
      `/v2/projects/${auth.projectId}`,
      '/v2/openapi.json',
      '/metrics',
    ]) {
      const other = await call(`${runUrl}${rest}`, { token: auth.token });
      assert.equal(other.status, 404, rest);
      assert.equal(other.json?.error?.code, 'FERRY_ROUTE_NOT_FOUND', rest);
    }

    // The main port still serves the run endpoint, sandboxed: a single-port client keeps working.
    const main = await call(`${server.url}/v4/${auth.projectId}/evil/own-policy`);
    assert.equal(main.status, 200);
    assert.equal(main.headers.get('content-security-policy'), `img-src 'self', ${SANDBOX}`);
    assert.equal((await call(`${server.url}/`)).status, 200, 'the dashboard stays on the main port');
  });

  it('runs functions there too, and `ferry apps list` shows that address', async () => {
    const example = path.join(REPO_ROOT, 'examples', 'hello');
    await deployFiles(server, auth, 'hello', await folderFiles(example));
    const res = await call(`${runUrl}/v4/${auth.projectId}/hello/run`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'run port' },
    });
    assert.equal(res.status, 200, res.text);
    assert.ok(res.json.run_id);
    const listed = await runCli(['apps', 'list'], cliEnv);
    assert.equal(listed.code, 0, listed.stderr);
    assert.ok(listed.stdout.includes(`${runUrl}/v4/${auth.projectId}/hello/run`), listed.stdout);
  });

  it('carries WebSockets on both ports', async () => {
    await deployFiles(
      server,
      auth,
      'custom-websocket',
      await folderFiles(path.join(REPO_ROOT, 'examples', 'custom-websocket')),
    );
    for (const base of [runUrl, server.url]) {
      const ws = `${base.replace('http:', 'ws:')}/v4/${auth.projectId}/custom-websocket/`;
      assert.equal(await wsEcho(ws, auth.token, `through ${base}`), `through ${base}`);
    }
  });
});

describe('run address settings', () => {
  it('tells FERRY_RUN_URL as written, without a trailing slash, whatever the caller', async () => {
    // A proxy in front maps the run address to this one port: no second listener.
    const server = await startServer({ env: { FERRY_RUN_URL: 'https://run.example.com/ferry/' } });
    try {
      const auth = await server.bootstrap();
      for (const host of ['127.0.0.1:8000', 'ferry.example.com']) {
        const project = await server.inject(`/v2/projects/${auth.projectId}`, { token: auth.token, headers: { host } });
        assert.equal(project.json.run_url, 'https://run.example.com/ferry', host);
      }
    } finally {
      await server.close();
    }
  });

  it('refuses what cannot work, naming the setting', () => {
    const refused = (env: NodeJS.ProcessEnv, flags = {}) => assert.throws(() => resolveServerConfig(flags, env));
    refused({ FERRY_RUN_PORT: '8000' });
    refused({ FERRY_RUN_PORT: '70000' });
    refused({ FERRY_RUN_PORT: 'x' });
    refused({ FERRY_RUN_URL: 'ftp://run.example.com' });
    refused({ FERRY_RUN_URL: 'https://user:pw@run.example.com' });
    refused({ FERRY_RUN_URL: 'https://run.example.com/?q=1' });
    assert.throws(() => resolveServerConfig({ port: 9000, runPort: 9000 }, {}), /FERRY_RUN_PORT must differ/);
    assert.throws(
      () =>
        resolveServerConfig(
          { role: 'worker', databaseUrl: 'postgres://h/db', natsUrl: 'nats://h:4222', runPort: 9001 },
          {},
        ),
      /not workers/,
    );
  });
});

describe('ferry serve --run-port', () => {
  it('listens on the run port too, says where, and serves only the run endpoint there', async () => {
    const serve = await spawnServe(await tempDir(), { FERRY_RUN_PORT: '0' });
    try {
      const run = await waitFor(
        async () => /"runAddress":"(http:\/\/[^"]+)"/.exec(serve.output())?.[1],
        30_000,
        'the run endpoint line',
      );
      assert.notEqual(run, serve.url);
      assert.match(serve.output(), /Run endpoint \(apps\): http:\/\/[^ ]+\/v4\//);
      assert.equal((await call(`${run}/healthz`)).status, 200);
      assert.equal((await call(`${run}/`)).status, 404);
      assert.equal((await call(`${serve.url}/`)).status, 200);
    } finally {
      await serve.stop();
    }
  });
});
