/**
 * WebSockets to custom apps through the real run endpoint, with a real WebSocket client (undici's) against
 * the shipped echo example in a sandboxed replica: echo both ways, the two ways to authenticate, the
 * refusals (no token, webhookEndpoint, async, a cortex app), the idle timeout, and that scale-down leaves
 * an open socket alone.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import http from 'node:http';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { WebSocket } from 'undici';
import { http as call, deployFiles, REPO_ROOT, startServer, type TestServer } from './helpers/ferry.js';

/** Opens a WebSocket and resolves once it is open (rejects on an error or close first). */
function open(url: string, headers?: Record<string, string>): Promise<WebSocket> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, headers ? { headers } : undefined);
    const timer = setTimeout(() => reject(new Error('WebSocket did not open within 15 s')), 15_000);
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

/** Sends a message and resolves with the next one received. */
function echo(ws: WebSocket, message: string | Uint8Array): Promise<string | ArrayBuffer> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('no echo within 15 s')), 15_000);
    ws.addEventListener(
      'message',
      (event) => {
        clearTimeout(timer);
        resolve(event.data as string | ArrayBuffer);
      },
      { once: true },
    );
    ws.send(message);
  });
}

function closed(ws: WebSocket, ms: number): Promise<{ code: number; at: number }> {
  const started = Date.now();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`not closed within ${ms} ms`)), ms);
    ws.addEventListener('close', (event) => {
      clearTimeout(timer);
      resolve({ code: event.code, at: Date.now() - started });
    });
  });
}

/** A raw upgrade request, for the refusals: resolves with the HTTP status and body the server answered. */
function rawUpgrade(
  url: string,
  headers: Record<string, string> = {},
): Promise<{ status: number; body: string; requestId?: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(url, {
      headers: {
        connection: 'Upgrade',
        upgrade: 'websocket',
        'sec-websocket-version': '13',
        'sec-websocket-key': Buffer.from('0123456789abcdef').toString('base64'),
        ...headers,
      },
    });
    req.on('upgrade', (res, socket) => {
      socket.destroy();
      resolve({ status: res.statusCode ?? 0, body: '' });
    });
    req.on('response', (res) => {
      let body = '';
      res.on('data', (c: Buffer) => {
        body += c.toString('utf8');
      });
      res.on('end', () =>
        resolve({ status: res.statusCode ?? 0, body, requestId: res.headers['x-request-id'] as string | undefined }),
      );
    });
    req.on('error', reject);
    req.setTimeout(15_000, () => req.destroy(new Error('timed out')));
    req.end();
  });
}

describe('websockets', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const wsUrl = (app: string, rest = '/') => `${server.url.replace('http:', 'ws:')}/v4/${auth.projectId}/${app}${rest}`;

  before(async () => {
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    const dir = path.join(REPO_ROOT, 'examples', 'custom-websocket');
    const files: Record<string, string> = {};
    for (const entry of await fs.readdir(dir)) files[entry] = await fs.readFile(path.join(dir, entry), 'utf8');
    await deployFiles(server, auth, 'custom-websocket', files);
    // The same server with a one-second idle timeout and a cooldown of zero.
    files['ferry.toml'] = files['ferry.toml']!.replace('name = "custom-websocket"', 'name = "ws-idle"')
      .replace(/websocket_idle_timeout = \d+/, 'websocket_idle_timeout = 2')
      .replace('[scaling]', '[scaling]\ncooldown = 0');
    await deployFiles(server, auth, 'ws-idle', files);
  });

  after(async () => {
    await server?.close();
  });

  it('echoes text and binary messages both ways, with a Bearer header', async () => {
    const ws = await open(wsUrl('custom-websocket'), { authorization: `Bearer ${auth.token}` });
    ws.binaryType = 'arraybuffer';
    assert.equal(await echo(ws, 'hello through Ferry'), 'hello through Ferry');
    const big = new Uint8Array(70_000).map((_, i) => i % 251);
    const back = await echo(ws, big);
    assert.ok(back instanceof ArrayBuffer);
    assert.deepEqual(new Uint8Array(back), big);
    const done = closed(ws, 15_000);
    ws.close(1000, 'bye');
    assert.equal((await done).code, 1000);
  });

  it('takes the token as ?access_token= for browsers', async () => {
    const ws = await open(wsUrl('custom-websocket', `/?access_token=${encodeURIComponent(auth.token)}`));
    assert.equal(await echo(ws, 'browser'), 'browser');
    ws.close();
  });

  it('refuses an upgrade without a valid token, with webhookEndpoint or async, and to a cortex app', async () => {
    const httpUrl = (app: string, rest = '/') => `${server.url}/v4/${auth.projectId}/${app}${rest}`;
    const none = await rawUpgrade(httpUrl('custom-websocket'));
    assert.equal(none.status, 401);
    assert.equal(JSON.parse(none.body).error.code, 'FERRY_UNAUTHENTICATED');
    const bad = await rawUpgrade(httpUrl('custom-websocket', '/?access_token=nope'));
    assert.equal(bad.status, 401);

    const bearer = { authorization: `Bearer ${auth.token}` };
    const hook = await rawUpgrade(
      httpUrl('custom-websocket', `/?webhookEndpoint=${encodeURIComponent('http://127.0.0.1:9/x')}`),
      bearer,
    );
    assert.equal(hook.status, 400);
    const hookError = JSON.parse(hook.body);
    assert.equal(hookError.error.code, 'FERRY_WEBSOCKET_WEBHOOK');
    assert.match(hookError.error.message, /HTTP requests only/);
    // Refused before any run existed: the request has its id, and no run is named (issue 43).
    assert.equal(hookError.run_id, undefined);
    assert.match(hook.requestId ?? '', /^[0-9a-f-]{36}$/);

    const asyncCall = await rawUpgrade(httpUrl('custom-websocket', '/?async=true'), bearer);
    assert.equal(asyncCall.status, 400);
    assert.equal(JSON.parse(asyncCall.body).error.code, 'FERRY_WEBSOCKET_ASYNC');

    await deployFiles(server, auth, 'plain-fn', {
      'ferry.toml': '[app]\nname = "plain-fn"\n',
      'main.ts': 'export function run() { return 1; }\n',
    });
    const cortex = await rawUpgrade(httpUrl('plain-fn'), bearer);
    assert.equal(cortex.status, 400);
    assert.equal(JSON.parse(cortex.body).error.code, 'FERRY_WEBSOCKET_NOT_CUSTOM');

    // A WebSocket client sees the refusal as a failed open.
    await assert.rejects(open(wsUrl('custom-websocket')));
  });

  it('keeps a live socket through scale-down, and closes one silent past websocket_idle_timeout', async () => {
    const ws = await open(wsUrl('ws-idle'), { authorization: `Bearer ${auth.token}` });
    // Idle, it closes about 5 s after opening; the bound only keeps a socket that is never closed from hanging.
    const done = closed(ws, 30_000);
    // cooldown = 0 and the reaper runs every second: an idle replica would stop now. Talking every 0.25 s
    // for 3 s (past the 2 s idle timeout too) keeps the socket and its replica; the short pauses leave a
    // busy machine 1.75 s of lateness per message before the idle timeout could strike.
    for (let i = 0; i < 12; i++) {
      assert.equal(await echo(ws, `ping ${i}`), `ping ${i}`);
      await new Promise((r) => setTimeout(r, 250));
    }
    // Then silence: Ferry closes it after the idle timeout. The last echo came back at least 11 pauses
    // (2.75 s) after opening, so a close that waited for 2 s of silence comes at 4.75 s or later.
    const { at } = await done;
    assert.ok(at >= 2750 + 1500, `closed ${at} ms after opening, expected after the 2 s of silence`);
    const runs = await call(`${server.url}/v2/projects/${auth.projectId}/apps/ws-idle/runs`, { token: auth.token });
    const run = runs.json.runs[0];
    assert.equal(run.function, 'WEBSOCKET /');
    assert.equal(run.status_code, 101);
  });
});
