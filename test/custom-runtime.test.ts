/**
 * The custom runtime through the real run endpoint, against real sandboxed replicas running the user's own
 * server: every method and path forwarded (less Ferry's parameters and headers), SSE streamed through,
 * async and webhooks with a real receiver, readiness gating, crash restarts, health checks, and several
 * replicas on one port. Apps are the shipped examples plus small servers written here.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import http from 'node:http';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { detectSandbox } from '../src/sandbox/launch.js';
import { http as call, deployFiles, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

/** The files of an example folder, as deployFiles takes them. */
async function exampleFiles(name: string): Promise<Record<string, string>> {
  const dir = path.join(REPO_ROOT, 'examples', name);
  const files: Record<string, string> = {};
  for (const entry of await fs.readdir(dir)) files[entry] = await fs.readFile(path.join(dir, entry), 'utf8');
  return files;
}

/** A custom app: ferry.toml plus a server.js. */
function customApp(name: string, server: string, custom = '', extra = ''): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "${name}"\nruntime = "custom"\n\n[runtime.custom]\nentrypoint = ["node", "server.mjs"]\nport = 8080\n${custom}\n${extra}`,
    'server.mjs': server,
  };
}

/** GETs with node:http and records when each chunk arrives. */
function timedGet(
  url: string,
  token: string,
): Promise<{ status: number; arrivals: Array<{ at: number; text: string }> }> {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    const req = http.get(url, { headers: { authorization: `Bearer ${token}`, accept: 'text/event-stream' } }, (res) => {
      const arrivals: Array<{ at: number; text: string }> = [];
      res.on('data', (chunk: Buffer) => arrivals.push({ at: Date.now() - started, text: chunk.toString('utf8') }));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, arrivals }));
      res.on('error', reject);
    });
    req.on('error', reject);
    req.setTimeout(20_000, () => req.destroy(new Error('timed out')));
  });
}

describe('custom runtime', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  const url = (app: string, rest: string) => `${server.url}/v4/${auth.projectId}/${app}${rest}`;
  const appLog = async (app: string): Promise<Array<{ stream: string; line: string; replica: string }>> =>
    (await call(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/logs`, { token: auth.token })).json.lines;
  const record = async (app: string, runId: string) =>
    (await call(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}`, { token: auth.token })).json;

  before(async () => {
    receiver = await startReceiver();
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'custom-node', await exampleFiles('custom-node'));
  });

  after(async () => {
    await server?.close();
    await receiver?.close();
  });

  it('forwards every method, the path after the app name, the query less Ferry parameters, and the headers', async () => {
    const res = await call(url('custom-node', '/echo/../echo?x=1&async=false&y=two%20words'), {
      method: 'POST',
      token: auth.token,
      body: Buffer.from('hello body'),
      headers: { 'content-type': 'text/plain', 'x-custom': 'kept', 'x-webhook-secret': 'not for the app' },
    });
    assert.equal(res.status, 200, res.text);
    const runId = res.headers.get('x-request-id');
    assert.ok(runId);
    assert.equal(res.json.method, 'POST');
    assert.equal(res.json.path, '/echo');
    assert.deepEqual(res.json.query, { x: '1', y: 'two words' });
    assert.equal(res.json.body, 'hello body');
    assert.equal(res.json.headers['x-custom'], 'kept');
    assert.equal(res.json.headers.authorization, undefined, 'the token never reaches the app');
    assert.equal(res.json.headers['x-webhook-secret'], undefined);
    assert.equal(res.json.headers['x-request-id'], runId);
    assert.equal(res.json.headers['x-forwarded-prefix'], `/v4/${auth.projectId}/custom-node`);

    for (const method of ['PUT', 'DELETE', 'PATCH']) {
      const other = await call(url('custom-node', '/echo?q=1'), { method, token: auth.token, body: Buffer.from('x') });
      assert.equal(other.status, 200, `${method}: ${other.text}`);
      assert.equal(other.json.method, method);
    }
    const root = await call(url('custom-node', ''), { token: auth.token });
    assert.equal(root.status, 200, root.text);
    assert.equal(root.json.hello, 'world');
    const missing = await call(url('custom-node', '/nope/deeper'), { token: auth.token });
    assert.equal(missing.status, 404, 'the server answers its own 404, as it is');
    assert.equal(missing.headers.get('x-request-id') !== null, true);

    const run = await waitFor(async () => {
      const r = await record('custom-node', runId);
      return r.state === 'success' ? r : undefined;
    });
    assert.equal(run.function, 'POST /echo');
    assert.equal(run.status_code, 200);
  });

  it('refuses calls without a valid token, like any run call', async () => {
    const none = await call(url('custom-node', '/echo'));
    assert.equal(none.status, 401);
    const bad = await call(url('custom-node', '/echo'), { token: 'nope' });
    assert.equal(bad.status, 401);
  });

  it('streams server-sent events through as the server writes them', async () => {
    const res = await timedGet(url('custom-node', '/events'), auth.token);
    assert.equal(res.status, 200);
    const text = res.arrivals.map((a) => a.text).join('');
    assert.equal((text.match(/data: \d/g) ?? []).length, 5);
    const first = res.arrivals.find((a) => a.text.includes('data: 1'))!;
    const last = res.arrivals.find((a) => a.text.includes('data: 5'))!;
    // Five events 200 ms apart: buffered, they would all arrive together at the end. Checking for half the
    // 800 ms spread leaves room for a test process kept off the CPU on a busy machine.
    assert.ok(last.at - first.at >= 400, `events arrived ${first.at} ms and ${last.at} ms after the request`);
  });

  it('runs ?async=true and webhookEndpoint calls, forwarding the server response body in the payload', async () => {
    const hook = encodeURIComponent(`${receiver.url}/custom-async`);
    const accepted = await call(url('custom-node', `/echo?async=true&webhookEndpoint=${hook}&k=v`), {
      method: 'POST',
      token: auth.token,
      body: { n: 42 },
      headers: { 'x-webhook-secret': 'whsec-custom' },
    });
    assert.equal(accepted.status, 202, accepted.text);
    const runId = accepted.json.run_id;
    const got = await waitFor(async () => receiver.requests.find((r) => r.path === '/custom-async'), 20_000, 'webhook');
    const payload = JSON.parse(got.body.toString('utf8'));
    assert.equal(payload.run_id, runId);
    assert.equal(payload.status_code, 200);
    assert.equal(payload.result.method, 'POST');
    assert.equal(payload.result.path, '/echo');
    assert.deepEqual(payload.result.query, { k: 'v' });
    assert.equal(payload.result.body, '{"n":42}');
    assert.ok(got.headers['x-service-webhook-signature'], 'signed with the given secret');

    // Sync with a webhook: the caller gets the response; the receiver gets it inside the payload.
    const sync = await call(
      url('custom-node', `?webhookEndpoint=${encodeURIComponent(`${receiver.url}/custom-sync`)}`),
      {
        token: auth.token,
      },
    );
    assert.equal(sync.status, 200);
    const hooked = await waitFor(
      async () => receiver.requests.find((r) => r.path === '/custom-sync'),
      20_000,
      'webhook',
    );
    const body = JSON.parse(hooked.body.toString('utf8'));
    assert.equal(body.run_id, sync.headers.get('x-request-id'));
    assert.equal(body.result.hello, 'world');
  });

  it('runs the Python example the same way, async and webhook included', async () => {
    await deployFiles(server, auth, 'custom-python', await exampleFiles('custom-python'));
    const res = await call(url('custom-python', '/echo?x=1'), {
      method: 'POST',
      token: auth.token,
      body: Buffer.from('from python'),
    });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.body, 'from python');
    assert.deepEqual(res.json.query, { x: '1' });
    const events = await timedGet(url('custom-python', '/events'), auth.token);
    assert.equal(
      (
        events.arrivals
          .map((a) => a.text)
          .join('')
          .match(/data: \d/g) ?? []
      ).length,
      5,
    );

    const hook = encodeURIComponent(`${receiver.url}/py-async`);
    const accepted = await call(url('custom-python', `/echo?async=true&webhookEndpoint=${hook}`), {
      method: 'POST',
      token: auth.token,
      body: Buffer.from('later'),
    });
    assert.equal(accepted.status, 202);
    const got = await waitFor(async () => receiver.requests.find((r) => r.path === '/py-async'), 20_000, 'webhook');
    const payload = JSON.parse(got.body.toString('utf8'));
    assert.equal(payload.run_id, accepted.json.run_id);
    assert.equal(payload.result.body, 'later');
  });

  it('sends no request to a replica before its readiness check passes', async () => {
    const server1 = `
import http from 'node:http';
const started = Date.now();
let early = 0;
http.createServer((req, res) => {
  const ready = Date.now() - started > 1000;
  if (req.url === '/ready') { res.writeHead(ready ? 200 : 503); res.end(); return; }
  if (!ready) early += 1;
  res.setHeader('content-type', 'application/json');
  res.end(JSON.stringify({ early, sinceStart: Date.now() - started }));
}).listen(Number(process.env.PORT));
`;
    await deployFiles(server, auth, 'slow-ready', customApp('slow-ready', server1, 'readycheck_endpoint = "/ready"'));
    const started = Date.now();
    const res = await call(url('slow-ready', '/work'), { token: auth.token });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.early, 0, 'no request reached the server before it was ready');
    assert.ok(res.json.sinceStart >= 1000, `served ${res.json.sinceStart} ms after the server started`);
    assert.ok(Date.now() - started >= 1000);
  });

  it('restarts a crashed server (with its output in the app log) and a failing health check', async () => {
    const crashy = `
import http from 'node:http';
let sick = false;
const ID = Math.random().toString(36).slice(2);
http.createServer((req, res) => {
  if (req.url === '/crash') { console.error('about to crash: goodbye'); process.exit(3); }
  if (req.url === '/sick') { sick = true; res.end('ok'); return; }
  if (req.url === '/health') { res.writeHead(sick ? 500 : 200); res.end(); return; }
  res.end(ID);
}).listen(Number(process.env.PORT), () => console.log('crashy up'));
`;
    await deployFiles(
      server,
      auth,
      'crashy',
      customApp(
        'crashy',
        crashy,
        'healthcheck_endpoint = "/health"\nhealthcheck_interval = 1',
        '[scaling]\nmin_replicas = 1\nmax_replicas = 1',
      ),
    );
    const first = await call(url('crashy', '/pid'), { token: auth.token });
    assert.equal(first.status, 200, first.text);
    const crashed = await call(url('crashy', '/crash'), { token: auth.token });
    assert.equal(crashed.status, 502, 'the call the server died on answers 502');
    // min_replicas = 1: a new replica comes back by itself, after the back-off.
    const second = await waitFor(
      async () => {
        const r = await call(url('crashy', '/pid'), { token: auth.token });
        return r.status === 200 ? r : undefined;
      },
      15_000,
      'a restarted replica',
    );
    assert.notEqual(second.text, first.text, 'a new server process answers');
    const log = await appLog('crashy');
    assert.ok(
      log.some((l) => l.stream === 'stderr' && l.line.includes('about to crash: goodbye')),
      'the crash output',
    );
    assert.ok(
      log.some((l) => l.stream === 'system' && /exited unexpectedly .*exit code 3/.test(l.line)),
      JSON.stringify(log.filter((l) => l.stream === 'system')),
    );

    // A failing health check (interval 1 s, 3 failures) replaces the replica too.
    assert.equal((await call(url('crashy', '/sick'), { token: auth.token })).status, 200);
    const third = await waitFor(
      async () => {
        const r = await call(url('crashy', '/pid'), { token: auth.token });
        return r.status === 200 && r.text !== second.text ? r : undefined;
      },
      20_000,
      'a replica replacing the unhealthy one',
    );
    assert.ok(third);
    assert.ok((await appLog('crashy')).some((l) => l.line.includes('health check failed 3 times')));
  });

  it('runs two replicas of one app on the same port at once', async (t) => {
    const caps = await detectSandbox();
    if (!caps.bwrap) return t.skip('needs the sandbox: without it, each replica gets a port of its own');
    const slow = `
import http from 'node:http';
http.createServer((req, res) => {
  setTimeout(() => res.end(JSON.stringify({ pid: process.pid, port: process.env.PORT })), 3000);
}).listen(Number(process.env.PORT), '127.0.0.1');
`;
    await deployFiles(
      server,
      auth,
      'two-replicas',
      customApp('two-replicas', slow, '', '[scaling]\nmax_replicas = 2\nreplica_concurrency = 1'),
    );
    // Each answer takes 3 s, so the second replica is ready before the first is free again, however slowly
    // replicas start on a busy machine; with a quicker answer, both calls could end up on the first replica.
    const [a, b] = await Promise.all([
      call(url('two-replicas', '/'), { token: auth.token }),
      call(url('two-replicas', '/'), { token: auth.token }),
    ]);
    assert.equal(a.status, 200, a.text);
    assert.equal(b.status, 200, b.text);
    assert.equal(a.json.port, '8080');
    assert.equal(b.json.port, '8080');
    const replicas = new Set((await appLog('two-replicas')).map((l) => l.replica));
    assert.equal(replicas.size, 2, 'two replicas served the two calls');
  });

  it('answers FERRY_CORTEX_CALL for other methods and paths of a cortex app', async () => {
    await deployFiles(server, auth, 'fn', {
      'ferry.toml': '[app]\nname = "fn"\n',
      'main.ts': 'export function run() { return 1; }\n',
    });
    const get = await call(url('fn', '/run'), { token: auth.token });
    assert.equal(get.status, 405);
    assert.equal(get.json.error.code, 'FERRY_CORTEX_CALL');
    assert.equal(get.headers.get('allow'), 'POST');
    const deep = await call(url('fn', '/run/deeper'), { method: 'POST', token: auth.token, body: {} });
    assert.equal(deep.status, 405);
    const ok = await call(url('fn', '/run'), { method: 'POST', token: auth.token, body: {} });
    assert.equal(ok.status, 200);
  });
});
