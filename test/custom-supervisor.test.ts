/**
 * The custom-runtime supervisor, compiled, as a plain child process (no sandbox): it starts a small Node
 * HTTP server written into a temp app folder, and the tests talk to that server through the supervisor's
 * Unix socket, with node:http and with raw sockets. Every test ends every process it started.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import { Agent, type IncomingHttpHeaders, request } from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after, afterEach, before, describe, it } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { waitFor } from './helpers/ferry.js';

const SUPERVISOR = fileURLToPath(new URL('../src/runtimes/custom/supervisor.js', import.meta.url));

/**
 * The app's server, configured by APP_* variables: APP_DELAY_MS before it listens, APP_HOST to listen on,
 * APP_READY_AFTER_MS before /ready answers 200 (503 until then), APP_HEALTH_FAIL_AFTER_MS after which /health
 * answers 500, APP_CRASH_AFTER_MS after listening it exits 3, APP_MARKER written on SIGTERM, APP_IGNORE_SIGTERM.
 */
const SERVER_JS = `
import fs from 'node:fs';
import http from 'node:http';
const env = process.env;
const started = Date.now();
const since = () => Date.now() - started;
fs.writeFileSync('server.pid', String(process.pid));
const json = (res, value) => res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(value));
const server = http.createServer((req, res) => {
  const { pathname } = new URL(req.url, 'http://x');
  if (pathname === '/ready') {
    const status = since() >= Number(env.APP_READY_AFTER_MS ?? 0) ? 200 : 503;
    console.log('ready-check ' + status + ' host=' + req.headers.host);
    res.writeHead(status).end();
  } else if (pathname === '/health') {
    const failing = env.APP_HEALTH_FAIL_AFTER_MS !== undefined && since() >= Number(env.APP_HEALTH_FAIL_AFTER_MS);
    res.writeHead(failing ? 500 : 200).end();
  } else if (pathname === '/chunks') {
    res.writeHead(200, { 'content-type': 'text/plain' });
    let i = 0;
    const tick = () => {
      res.write('chunk ' + i + '\\n');
      i += 1;
      if (i < 3) setTimeout(tick, 400);
      else res.end();
    };
    tick();
  } else if (pathname === '/env') {
    json(res, Object.keys(env).filter((key) => key.startsWith('FERRY') || key === 'PORT').sort());
  } else if (pathname.startsWith('/echo')) {
    const chunks = [];
    req.on('data', (chunk) => chunks.push(chunk));
    req.on('end', () =>
      json(res, {
        method: req.method,
        url: req.url,
        headers: req.headers,
        body: Buffer.concat(chunks).toString(),
        remotePort: req.socket.remotePort,
      }),
    );
  } else {
    res.writeHead(200, { 'content-type': 'text/plain' }).end('hello ' + (env.APP_GREETING ?? 'world'));
  }
});
server.on('upgrade', (req, socket, head) => {
  socket.write('HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: echo\\r\\nConnection: Upgrade\\r\\n\\r\\n');
  if (head.length > 0) socket.write(head);
  socket.pipe(socket);
});
process.on('SIGTERM', () => {
  if (env.APP_MARKER) fs.writeFileSync(env.APP_MARKER, 'SIGTERM');
  if (env.APP_IGNORE_SIGTERM) return;
  server.close(() => process.exit(0));
  server.closeIdleConnections();
});
setTimeout(() => {
  server.listen(Number(env.PORT), env.APP_HOST ?? '127.0.0.1', () => {
    console.log('listening on ' + env.PORT);
    if (env.APP_CRASH_AFTER_MS) setTimeout(() => process.exit(3), Number(env.APP_CRASH_AFTER_MS));
  });
}, Number(env.APP_DELAY_MS ?? 0));
`;

/**
 * How long to wait for a supervisor to start, exit or answer before failing. Idle, each takes well under a
 * second; a busy 2-core machine stretches node's start-up several times. Only a hang runs into this.
 */
const PATIENCE_MS = 15_000;

interface Exit {
  code: number | null;
  signal: NodeJS.Signals | null;
}

interface Supervised {
  child: ChildProcess;
  appDir: string;
  socketPath: string;
  port: number;
  /** performance.now() when the supervisor was spawned. */
  startedAt: number;
  stdout(): string;
  stderr(): string;
  exited: Promise<Exit>;
}

interface StartOptions {
  /** Default: `[node, "server.mjs"]`. */
  entrypoint?: string | string[];
  /** Added to the supervisor's environment; undefined removes a variable. */
  env?: Record<string, string | undefined>;
  port?: number;
}

let root: string;
const started: Supervised[] = [];

before(async () => {
  root = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-supervisor-'));
});

afterEach(async () => {
  await Promise.all(started.splice(0).map(cleanUp));
});

after(async () => {
  await fs.rm(root, { recursive: true, force: true });
});

/** Kills whatever is still running: the supervisor, and the server when the supervisor did not take it along. */
async function cleanUp(run: Supervised): Promise<void> {
  if (run.child.exitCode === null && run.child.signalCode === null) run.child.kill('SIGKILL');
  const pid = await serverPid(run);
  if (pid !== undefined) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // Already gone, as it should be.
    }
  }
  await within(run.exited, PATIENCE_MS, 'the supervisor to be gone');
}

async function serverPid(run: Supervised): Promise<number | undefined> {
  try {
    return Number(await fs.readFile(path.join(run.appDir, 'server.pid'), 'utf8'));
  } catch {
    return undefined;
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

async function freePort(host = '127.0.0.1'): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, host, resolve);
  });
  const { port } = server.address() as net.AddressInfo;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

async function start(options: StartOptions = {}): Promise<Supervised> {
  const appDir = await fs.mkdtemp(path.join(root, 'app-'));
  await fs.writeFile(path.join(appDir, 'server.mjs'), SERVER_JS);
  const socketPath = path.join(appDir, 'replica.sock');
  const port = options.port ?? (await freePort());
  const env: NodeJS.ProcessEnv = {
    PATH: `${path.dirname(process.execPath)}${path.delimiter}${process.env.PATH ?? ''}`,
    FERRY_SOCKET: socketPath,
    PORT: String(port),
    FERRY_CUSTOM_ENTRYPOINT: JSON.stringify(options.entrypoint ?? [process.execPath, 'server.mjs']),
  };
  for (const [key, value] of Object.entries(options.env ?? {})) {
    if (value === undefined) delete env[key];
    else env[key] = value;
  }
  const startedAt = performance.now();
  const child = spawn(process.execPath, [SUPERVISOR], { cwd: appDir, env, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.setEncoding('utf8').on('data', (text: string) => {
    stdout += text;
  });
  child.stderr.setEncoding('utf8').on('data', (text: string) => {
    stderr += text;
  });
  // 'close' rather than 'exit': the output pipes (shared with the server) are drained by then.
  const exited = new Promise<Exit>((resolve) => {
    child.on('close', (code, signal) => resolve({ code, signal }));
  });
  const run: Supervised = {
    child,
    appDir,
    socketPath,
    port,
    startedAt,
    stdout: () => stdout,
    stderr: () => stderr,
    exited,
  };
  started.push(run);
  return run;
}

async function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

function canConnect(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect(socketPath);
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('error', () => resolve(false));
  });
}

/** Milliseconds from spawn until the socket first accepts; fails when the supervisor exits first. */
async function waitForSocket(run: Supervised, ms = PATIENCE_MS): Promise<number> {
  const deadline = performance.now() + ms;
  for (;;) {
    if (await canConnect(run.socketPath)) return performance.now() - run.startedAt;
    if (run.child.exitCode !== null || run.child.signalCode !== null) {
      throw new Error(`the supervisor exited before its socket accepted:\n${run.stderr()}`);
    }
    if (performance.now() > deadline) throw new Error(`the socket did not accept within ${ms} ms:\n${run.stderr()}`);
    await sleep(10);
  }
}

interface Answer {
  status: number;
  headers: IncomingHttpHeaders;
  body: string;
  /** When each body chunk arrived, in milliseconds since the request was sent. */
  times: number[];
  chunks: string[];
}

function call(
  socketPath: string,
  urlPath: string,
  options: { method?: string; headers?: Record<string, string>; body?: string[]; agent?: Agent } = {},
): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const sent = performance.now();
    const req = request({
      socketPath,
      path: urlPath,
      method: options.method ?? 'GET',
      headers: options.headers,
      agent: options.agent ?? false,
      timeout: PATIENCE_MS,
    });
    req.on('timeout', () => req.destroy(new Error(`no answer to ${urlPath} within ${PATIENCE_MS} ms`)));
    req.on('error', reject);
    req.on('response', (res) => {
      const chunks: string[] = [];
      const times: number[] = [];
      res.setEncoding('utf8');
      res.on('data', (chunk: string) => {
        chunks.push(chunk);
        times.push(performance.now() - sent);
      });
      res.on('error', reject);
      res.on('end', () =>
        resolve({ status: res.statusCode ?? 0, headers: res.headers, body: chunks.join(''), times, chunks }),
      );
    });
    void (async () => {
      for (const part of options.body ?? []) {
        req.write(part);
        await sleep(50);
      }
      req.end();
    })();
  });
}

/** Reads from a raw socket until `done(text so far)` holds; rejects on close or after PATIENCE_MS. */
function readUntil(socket: net.Socket, done: (text: string) => boolean): Promise<string> {
  return new Promise((resolve, reject) => {
    let text = '';
    const finish = (err?: Error) => {
      clearTimeout(timer);
      socket.off('data', onData);
      socket.off('end', onEnd);
      socket.off('error', finish);
      if (err) reject(err);
      else resolve(text);
    };
    const onData = (chunk: Buffer) => {
      text += chunk.toString('utf8');
      if (done(text)) finish();
    };
    const onEnd = () =>
      done(text) ? finish() : finish(new Error(`the connection ended after ${JSON.stringify(text)}`));
    const timer = setTimeout(() => finish(new Error(`timed out after ${JSON.stringify(text)}`)), PATIENCE_MS);
    socket.on('data', onData);
    socket.on('end', onEnd);
    socket.on('error', finish);
  });
}

/** Everything a raw socket receives until the other side ends it (at most PATIENCE_MS). */
function readToEnd(socket: net.Socket): Promise<string> {
  let text = '';
  socket.on('data', (chunk: Buffer) => {
    text += chunk.toString('utf8');
  });
  return within(
    new Promise<string>((resolve, reject) => {
      socket.once('end', () => resolve(text));
      socket.once('error', reject);
    }),
    PATIENCE_MS,
    'the connection to end',
  );
}

describe('custom runtime supervisor', () => {
  it('opens the socket only once the server listens, then forwards to it', async () => {
    const run = await start({ env: { APP_DELAY_MS: '1000' } });
    // Polled from the spawn on: the server listens 1 s after it starts, so a socket that accepted any
    // earlier (whatever the load) accepted before the server listened.
    const readyMs = await waitForSocket(run);
    assert.ok(readyMs >= 1000, `the socket accepted after ${readyMs} ms, before the server listened`);
    const answer = await call(run.socketPath, '/');
    assert.equal(answer.status, 200);
    assert.equal(answer.body, 'hello world');
    assert.match(run.stderr(), new RegExp(`\\[ferry\\] ready on port ${run.port} \\(\\d+ ms\\)\\n`));
    // The server's own output goes to the supervisor's stdout (the replica's log).
    assert.match(run.stdout(), /listening on \d+/);
  });

  it('waits for the readiness path to answer 200, with Host 127.0.0.1:PORT', async () => {
    // 2 s of 503 leaves room for the first readiness checks however slowly the server starts (idle: 100 ms).
    const run = await start({ env: { FERRY_CUSTOM_READYCHECK: '/ready', APP_READY_AFTER_MS: '2000' } });
    const readyMs = await waitForSocket(run);
    assert.ok(readyMs >= 2000, `the socket accepted after ${readyMs} ms, while /ready still answered 503`);
    const lines = run.stdout().match(/ready-check \d+ host=\S+/g) ?? [];
    assert.ok(lines.length >= 2, `expected several readiness checks, saw ${JSON.stringify(lines)}`);
    assert.equal(lines[0], `ready-check 503 host=127.0.0.1:${run.port}`);
    assert.equal(lines.at(-1), `ready-check 200 host=127.0.0.1:${run.port}`);
    assert.equal(lines.filter((line) => line.startsWith('ready-check 200')).length, 1);
  });

  it('forwards method, path, query, headers and a streamed body, and streams the response', async () => {
    const run = await start();
    await waitForSocket(run);

    const echo = await call(run.socketPath, '/echo/a%20b?x=1&y=two', {
      method: 'POST',
      headers: { 'x-custom': 'abc', 'content-type': 'text/plain' },
      body: ['first,', 'second,', 'third'],
    });
    assert.equal(echo.status, 200);
    const seen = JSON.parse(echo.body) as { method: string; url: string; headers: IncomingHttpHeaders; body: string };
    assert.equal(seen.method, 'POST');
    assert.equal(seen.url, '/echo/a%20b?x=1&y=two');
    assert.equal(seen.headers['x-custom'], 'abc');
    assert.equal(seen.headers['content-type'], 'text/plain');
    assert.equal(seen.headers['transfer-encoding'], 'chunked');
    assert.equal(seen.body, 'first,second,third');

    const chunked = await call(run.socketPath, '/chunks');
    assert.equal(chunked.body, 'chunk 0\nchunk 1\nchunk 2\n');
    assert.equal(chunked.headers['transfer-encoding'], 'chunked');
    assert.equal(chunked.chunks.length, 3, `chunks arrived together: ${JSON.stringify(chunked.chunks)}`);
    // The server writes them 400 ms apart (800 ms from first to last): buffered, they would arrive together.
    // Checking for half that spread leaves 400 ms for a test process kept off the CPU on a busy machine.
    const first = chunked.times[0]!;
    const last = chunked.times.at(-1)!;
    assert.ok(last - first >= 400, `the chunks arrived within ${last - first} ms of each other`);

    // Keep-alive passes through: two requests on one gateway connection reach the server on one connection.
    const agent = new Agent({ keepAlive: true, maxSockets: 1 });
    try {
      const one = JSON.parse((await call(run.socketPath, '/echo', { agent })).body) as { remotePort: number };
      const two = JSON.parse((await call(run.socketPath, '/echo', { agent })).body) as { remotePort: number };
      assert.equal(one.remotePort, two.remotePort);
    } finally {
      agent.destroy();
    }

    // The server sees PORT but none of Ferry's plumbing.
    assert.deepEqual(JSON.parse((await call(run.socketPath, '/env')).body), ['PORT']);
  });

  it('passes upgrades and half-closed connections through', async () => {
    const run = await start();
    await waitForSocket(run);

    const ws = net.connect(run.socketPath);
    try {
      ws.write('GET /socket HTTP/1.1\r\nHost: app\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n');
      const head = await readUntil(ws, (text) => text.includes('\r\n\r\n'));
      assert.match(head, /^HTTP\/1\.1 101 /);
      ws.write('ping');
      assert.equal(await readUntil(ws, (text) => text === 'ping'), 'ping');
      ws.write('pong');
      assert.equal(await readUntil(ws, (text) => text === 'pong'), 'pong');
    } finally {
      ws.destroy();
    }

    // The client sends its request and half-closes; the answer still comes back, then the connection ends.
    const half = net.connect({ path: run.socketPath, allowHalfOpen: true });
    try {
      half.end('GET / HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n');
      const text = await readToEnd(half);
      assert.match(text, /HTTP\/1\.1 200 OK/);
      assert.match(text, /hello world/);
    } finally {
      half.destroy();
    }
  });

  it('runs a string entrypoint through the shell', async () => {
    const run = await start({
      entrypoint: 'export APP_GREETING="from $GREETING_SOURCE"; exec node server.mjs',
      env: { GREETING_SOURCE: 'the shell' },
    });
    await waitForSocket(run);
    assert.equal((await call(run.socketPath, '/')).body, 'hello from the shell');
  });

  it('falls back to ::1 for a server listening on IPv6 only', async (t) => {
    let port: number;
    try {
      port = await freePort('::1');
    } catch {
      t.skip('no IPv6 loopback here');
      return;
    }
    const run = await start({ port, env: { APP_HOST: '::1', FERRY_CUSTOM_READYCHECK: '/ready' } });
    await waitForSocket(run);
    assert.equal((await call(run.socketPath, '/')).body, 'hello world');
  });

  it('exits with the server when it crashes after it was ready', async () => {
    const run = await start({ env: { APP_CRASH_AFTER_MS: '300' } });
    await waitForSocket(run);
    const exit = await within(run.exited, PATIENCE_MS, 'the supervisor to exit');
    assert.deepEqual(exit, { code: 3, signal: null });
    assert.match(run.stderr(), /\[ferry\] the server exited \(exit code 3\)\n/);
    assert.equal(existsSync(run.socketPath), false, 'the socket file is left behind');
  });

  it('exits non-zero when the server ends before it is ready', async () => {
    const quits = await start({ entrypoint: [process.execPath, '-e', 'process.exit(5)'] });
    assert.deepEqual(await within(quits.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 5, signal: null });
    assert.match(quits.stderr(), /\[ferry\] the server exited before it was ready \(exit code 5\)\n/);

    const clean = await start({ entrypoint: [process.execPath, '-e', ''] });
    assert.deepEqual(await within(clean.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 1, signal: null });
    assert.match(clean.stderr(), /exited before it was ready \(exit code 0\)/);

    const killed = await start({ entrypoint: [process.execPath, '-e', "process.kill(process.pid, 'SIGKILL')"] });
    assert.deepEqual(await within(killed.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 137, signal: null });
    assert.match(killed.stderr(), /exited before it was ready \(signal SIGKILL\)/);
  });

  it('exits 127 when the entrypoint cannot be started', async () => {
    const run = await start({ entrypoint: ['ferry-test-no-such-command'] });
    assert.deepEqual(await within(run.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 127, signal: null });
    assert.match(run.stderr(), /\[ferry\] could not start the entrypoint: .*ENOENT/);
  });

  it('stops the server and exits 1 after consecutive failed health checks', async () => {
    const marker = path.join(root, 'health-marker');
    const run = await start({
      env: {
        FERRY_CUSTOM_HEALTHCHECK: '/health',
        FERRY_CUSTOM_HEALTH_INTERVAL_MS: '100',
        FERRY_CUSTOM_HEALTH_FAILURES: '3',
        APP_HEALTH_FAIL_AFTER_MS: '700',
        APP_MARKER: marker,
      },
    });
    await waitForSocket(run);
    const exit = await within(run.exited, PATIENCE_MS, 'the supervisor to exit');
    const ranMs = performance.now() - run.startedAt;
    assert.deepEqual(exit, { code: 1, signal: null });
    assert.ok(ranMs >= 900, `the supervisor gave up after ${ranMs} ms, while /health still answered 200`);
    assert.match(
      run.stderr(),
      /\[ferry\] health check failed 3 times in a row \(GET \/health answered 500\); stopping so the replica is replaced\n/,
    );
    assert.equal(await fs.readFile(marker, 'utf8'), 'SIGTERM');
  });

  it('on SIGTERM stops accepting, lets open connections finish, stops the server and exits 0', async () => {
    const marker = path.join(root, 'sigterm-marker');
    const run = await start({ env: { APP_MARKER: marker } });
    await waitForSocket(run);
    const pid = await serverPid(run);
    assert.ok(pid !== undefined && isAlive(pid));

    const streaming = new Promise<{ body: string; afterSignal: boolean }>((resolve, reject) => {
      const req = request({ socketPath: run.socketPath, path: '/chunks', agent: false, timeout: PATIENCE_MS });
      req.on('timeout', () => req.destroy(new Error(`no answer within ${PATIENCE_MS} ms`)));
      req.on('error', reject);
      req.on('response', (res) => {
        let body = '';
        let signalled = false;
        res.setEncoding('utf8');
        res.on('data', (chunk: string) => {
          body += chunk;
          if (!signalled) {
            signalled = true;
            run.child.kill('SIGTERM');
            // A second SIGTERM changes nothing.
            setTimeout(() => run.child.kill('SIGTERM'), 20);
          }
        });
        res.on('error', reject);
        res.on('end', () => resolve({ body, afterSignal: signalled }));
      });
      req.end();
    });

    await waitFor(async () => existsSync(marker), PATIENCE_MS, 'the server to get SIGTERM');
    assert.equal(await canConnect(run.socketPath), false, 'the socket still accepts after SIGTERM');
    const { body } = await within(streaming, PATIENCE_MS, 'the open response to finish');
    assert.equal(body, 'chunk 0\nchunk 1\nchunk 2\n');
    assert.deepEqual(await within(run.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 0, signal: null });
    assert.equal(await fs.readFile(marker, 'utf8'), 'SIGTERM');
    assert.equal(isAlive(pid), false, 'the server outlived the supervisor');
  });

  it('exits 1 when the server is not ready within the start timeout', async () => {
    const marker = path.join(root, 'timeout-marker');
    const run = await start({
      // Long enough for the server's node to have started and installed its SIGTERM handler (which writes
      // the marker) when the timeout runs out, however slowly node starts on a busy machine: with 0.5 s a
      // loaded machine delivered the SIGTERM before the handler existed, and the marker was never written.
      env: { FERRY_CUSTOM_START_TIMEOUT_MS: '5000', APP_DELAY_MS: '60000', APP_MARKER: marker },
    });
    assert.deepEqual(await within(run.exited, PATIENCE_MS, 'the supervisor to exit'), { code: 1, signal: null });
    assert.match(
      run.stderr(),
      new RegExp(
        `\\[ferry\\] the server did not become ready within 5 s \\(connection to port ${run.port} refused\\)\\n`,
      ),
    );
    assert.equal(await fs.readFile(marker, 'utf8'), 'SIGTERM');
    assert.equal(existsSync(run.socketPath), false);
  });

  it('SIGKILLs a server that ignores SIGTERM after the start timeout', async () => {
    const run = await start({
      env: {
        // Long enough for the server to be listening (and answering 503) when it runs out, however slowly
        // node starts on a busy machine; the last readiness answer is in the message.
        FERRY_CUSTOM_START_TIMEOUT_MS: '3000',
        FERRY_CUSTOM_READYCHECK: '/ready',
        APP_READY_AFTER_MS: '60000',
        APP_IGNORE_SIGTERM: '1',
      },
    });
    assert.deepEqual(await within(run.exited, 3_000 + 3_000 + PATIENCE_MS, 'the supervisor to exit'), {
      code: 1,
      signal: null,
    });
    const ranMs = performance.now() - run.startedAt;
    // The start timeout, then the SIGKILL grace (3 s) after the SIGTERM the server ignores.
    assert.ok(ranMs >= 6_000, `the supervisor exited after ${ranMs} ms, before the SIGKILL grace`);
    assert.match(run.stderr(), /within 3 s \(GET \/ready answered 503\)/);
    const pid = await serverPid(run);
    assert.ok(pid !== undefined);
    assert.equal(isAlive(pid), false, 'the server survived');
  });

  it('exits 2 with a clear message for a bad environment', async () => {
    const cases: [Record<string, string | undefined>, RegExp][] = [
      [{ FERRY_SOCKET: undefined }, /FERRY_SOCKET must be set/],
      [{ PORT: undefined }, /PORT must be set/],
      [{ PORT: '70000' }, /PORT must be a port number from 1 to 65535, not "70000"/],
      [{ FERRY_CUSTOM_ENTRYPOINT: undefined }, /FERRY_CUSTOM_ENTRYPOINT must be set/],
      [{ FERRY_CUSTOM_ENTRYPOINT: 'node server.mjs' }, /FERRY_CUSTOM_ENTRYPOINT is not valid JSON/],
      [{ FERRY_CUSTOM_ENTRYPOINT: '[]' }, /FERRY_CUSTOM_ENTRYPOINT must be a non-empty command string/],
      [{ FERRY_CUSTOM_ENTRYPOINT: '["node", 1]' }, /FERRY_CUSTOM_ENTRYPOINT must be/],
      [{ FERRY_CUSTOM_READYCHECK: 'ready' }, /FERRY_CUSTOM_READYCHECK must be empty .* or an absolute path/],
      [
        { FERRY_CUSTOM_START_TIMEOUT_MS: '0' },
        /FERRY_CUSTOM_START_TIMEOUT_MS must be a positive whole number .*, not "0"/,
      ],
      [{ FERRY_CUSTOM_HEALTH_INTERVAL_MS: 'abc' }, /FERRY_CUSTOM_HEALTH_INTERVAL_MS must be a positive whole number/],
      [
        { FERRY_CUSTOM_HEALTH_INTERVAL_MS: '3000000000' },
        /FERRY_CUSTOM_HEALTH_INTERVAL_MS must be a positive whole number/,
      ],
      [{ FERRY_CUSTOM_HEALTH_FAILURES: '1.5' }, /FERRY_CUSTOM_HEALTH_FAILURES must be a positive whole number/],
    ];
    for (const [env, message] of cases) {
      const run = await start({ env });
      const exit = await within(run.exited, PATIENCE_MS, 'the supervisor to exit');
      assert.deepEqual(exit, { code: 2, signal: null }, `for ${JSON.stringify(env)}: ${run.stderr()}`);
      assert.match(run.stderr(), /^\[ferry\] /);
      assert.match(run.stderr(), message);
      assert.equal(await serverPid(run), undefined, 'the server was started');
    }
  });
});
