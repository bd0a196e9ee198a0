/**
 * The custom-runtime examples (examples/custom-*), run directly as child processes the way a replica's
 * supervisor starts them (the entrypoint from their ferry.toml, cwd = the example folder, PORT set), not
 * through Ferry: their routes, streaming, graceful SIGTERM, and the WebSocket echo server's framing.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs/promises';
import http from 'node:http';
import net from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { WebSocket } from 'undici';
import { parseAppConfig } from '../src/apps/app-config.js';
import { REPO_ROOT } from './helpers/ferry.js';

const TIMEOUT = 30_000;

interface Example {
  child: ChildProcess;
  port: number;
  output: () => string;
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

/** Starts an example with its ferry.toml entrypoint (a list directly, a string with /bin/sh -c). */
async function startExample(name: string): Promise<Example> {
  const dir = path.join(REPO_ROOT, 'examples', name);
  const config = parseAppConfig(await fs.readFile(path.join(dir, 'ferry.toml'), 'utf8'));
  const entrypoint = config.runtime.custom?.entrypoint;
  assert.ok(entrypoint, `${name}/ferry.toml has [runtime.custom]`);
  const [command, ...args] = typeof entrypoint === 'string' ? ['/bin/sh', '-c', entrypoint] : entrypoint;
  const port = await freePort();
  const child = spawn(command!, args, {
    cwd: dir,
    // The replica's PATH, with this test's own node first (it may live outside /usr).
    env: { PATH: `${path.dirname(process.execPath)}:/usr/local/bin:/usr/bin:/bin`, HOME: '/tmp', PORT: String(port) },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout?.on('data', (d: Buffer) => (output += d));
  child.stderr?.on('data', (d: Buffer) => (output += d));
  const end = Date.now() + 15_000;
  for (;;) {
    if (child.exitCode !== null) assert.fail(`${name} exited early (${child.exitCode}):\n${output}`);
    if (Date.now() > end) assert.fail(`${name} did not listen on ${port}:\n${output}`);
    const ok = await get(port, '/health')
      .then((r) => r.status === 200)
      .catch(() => false);
    if (ok) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  return { child, port, output: () => output };
}

function stop(example: Example | undefined): void {
  if (example && example.child.exitCode === null && example.child.signalCode === null) example.child.kill('SIGKILL');
}

/** Sends SIGTERM and resolves with the exit code (or fails after 10 s). */
function terminate(example: Example): Promise<number | null> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no exit after SIGTERM:\n${example.output()}`)), 10_000);
    example.child.once('exit', (code) => {
      clearTimeout(timer);
      resolve(code);
    });
    example.child.kill('SIGTERM');
  });
}

interface Reply {
  status: number;
  headers: http.IncomingHttpHeaders;
  text: string;
  /** When each piece of the body arrived (ms since the request was sent), with the piece. */
  pieces: { at: number; text: string }[];
}

/**
 * One request on a fresh connection; `body` as an array is written piece by piece (chunked). `onPiece` hears
 * each piece of the answer as it arrives.
 */
function request(
  port: number,
  method: string,
  target: string,
  body?: string | string[],
  headers: Record<string, string> = {},
  onPiece?: (text: string) => void,
): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    const req = http.request(
      { host: '127.0.0.1', port, method, path: target, headers, agent: false, timeout: 10_000 },
      (res) => {
        const pieces: Reply['pieces'] = [];
        res.setEncoding('utf8');
        res.on('data', (d: string) => {
          pieces.push({ at: Date.now() - started, text: d });
          onPiece?.(d);
        });
        res.on('end', () =>
          resolve({
            status: res.statusCode ?? 0,
            headers: res.headers,
            text: pieces.map((p) => p.text).join(''),
            pieces,
          }),
        );
        res.on('error', reject);
      },
    );
    req.on('error', reject);
    req.on('timeout', () => req.destroy(new Error(`${method} ${target} timed out`)));
    if (Array.isArray(body)) {
      for (const piece of body) req.write(piece);
      req.end();
    } else {
      req.end(body);
    }
  });
}

const get = (port: number, target: string) => request(port, 'GET', target);

/** The routes both HTTP examples answer the same way. */
function describeHttpExample(name: string): void {
  describe(`examples/${name}`, { timeout: TIMEOUT }, () => {
    let example: Example | undefined;
    before(async () => {
      example = await startExample(name);
    });
    after(() => stop(example));

    it('answers the health and readiness checks', async () => {
      for (const route of ['/health', '/ready']) {
        const reply = await get(example!.port, route);
        assert.equal(reply.status, 200, route);
        assert.equal(reply.text, 'ok', route);
      }
    });

    it('answers GET / with its pid', async () => {
      const reply = await get(example!.port, '/');
      assert.equal(reply.status, 200);
      assert.match(String(reply.headers['content-type']), /^application\/json/);
      // The same pid as the process started: for the shell form, `exec` replaced the shell.
      assert.deepEqual(JSON.parse(reply.text), { hello: 'world', pid: example!.child.pid });
    });

    it('echoes a request, also one with a chunked body', async () => {
      const reply = await request(example!.port, 'POST', '/echo?x=1&y=two', 'hi', {
        'content-type': 'text/plain',
        'x-test': 'abc',
      });
      assert.equal(reply.status, 200);
      const echoed = JSON.parse(reply.text);
      assert.equal(echoed.method, 'POST');
      assert.equal(echoed.path, '/echo');
      assert.deepEqual(echoed.query, { x: '1', y: 'two' });
      assert.equal(echoed.headers['x-test'], 'abc');
      assert.equal(echoed.headers['content-type'], 'text/plain');
      assert.equal(echoed.body, 'hi');

      const chunked = await request(example!.port, 'POST', '/echo', ['héllo ', 'wörld']);
      assert.equal(chunked.status, 200);
      const streamed = JSON.parse(chunked.text);
      assert.equal(streamed.headers['transfer-encoding'], 'chunked');
      assert.equal(streamed.body, 'héllo wörld');
      assert.deepEqual(streamed.query, {});
    });

    it('streams /events progressively', async () => {
      const reply = await get(example!.port, '/events');
      assert.equal(reply.status, 200);
      assert.match(String(reply.headers['content-type']), /^text\/event-stream/);
      assert.equal(reply.text, 'data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: 5\n\n');
      const first = reply.pieces.find((p) => p.text.includes('data: 1'));
      const last = reply.pieces.find((p) => p.text.includes('data: 5'));
      assert.ok(first && last, JSON.stringify(reply.pieces));
      // Five events 200 ms apart: the first arrives about 800 ms before the last, not with it. Checking for
      // half that leaves room for a test process kept off the CPU on a busy machine.
      assert.ok(last.at - first.at >= 400, `first at ${first.at} ms, last at ${last.at} ms`);
    });

    it('answers 404 with JSON for anything else', async () => {
      for (const [method, target] of [
        ['GET', '/nope'],
        ['DELETE', '/nope'],
        ['POST', '/'],
      ] as const) {
        const reply = await request(example!.port, method, target, method === 'POST' ? 'x' : undefined);
        assert.equal(reply.status, 404, `${method} ${target}`);
        assert.equal(JSON.parse(reply.text).error, 'not found');
      }
    });

    it('exits 0 on SIGTERM, finishing a stream in flight', async () => {
      // SIGTERM once the stream is surely in flight (its first event has arrived), not after a fixed time.
      let inFlight!: () => void;
      const firstEvent = new Promise<void>((resolve) => {
        inFlight = resolve;
      });
      const events = request(example!.port, 'GET', '/events', undefined, {}, () => inFlight());
      await firstEvent;
      const code = await terminate(example!);
      assert.equal(code, 0, example!.output());
      assert.equal((await events).text.match(/data: /g)?.length, 5, 'the stream in flight was finished');
    });
  });
}

describeHttpExample('custom-node');
describeHttpExample('custom-python');

// ---- the WebSocket example ----

/** A raw client connection after a successful handshake, for what undici's client cannot send. */
async function rawWebSocket(port: number): Promise<{ socket: net.Socket; read: (n: number) => Promise<Buffer> }> {
  const socket = net.connect(port, '127.0.0.1');
  let buffer = Buffer.alloc(0);
  let wake: (() => void) | undefined;
  socket.on('data', (d: Buffer) => {
    buffer = Buffer.concat([buffer, d]);
    wake?.();
  });
  socket.on('close', () => wake?.());
  const waitFor = async (ready: () => boolean) => {
    while (!ready()) {
      if (socket.destroyed) throw new Error('connection closed');
      await new Promise<void>((r) => {
        wake = r;
      });
    }
  };
  const key = crypto.randomBytes(16).toString('base64');
  socket.write(
    `GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: ${key}\r\nSec-WebSocket-Version: 13\r\n\r\n`,
  );
  await waitFor(() => buffer.includes('\r\n\r\n'));
  const headEnd = buffer.indexOf('\r\n\r\n') + 4;
  const head = buffer.subarray(0, headEnd).toString('latin1');
  buffer = buffer.subarray(headEnd);
  assert.match(head, /^HTTP\/1\.1 101 /);
  const accept = crypto.createHash('sha1').update(`${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11`).digest('base64');
  assert.ok(head.includes(`Sec-WebSocket-Accept: ${accept}\r\n`), head);
  return {
    socket,
    async read(n) {
      await waitFor(() => buffer.length >= n);
      const out = buffer.subarray(0, n);
      buffer = buffer.subarray(n);
      return out;
    },
  };
}

/** A masked client frame. `length` overrides the header's length (to claim more than is sent). */
function clientFrame(opcode: number, payload: Buffer, fin = true, length = payload.length): Buffer {
  const mask = crypto.randomBytes(4);
  let header: Buffer;
  if (length < 126) header = Buffer.from([0, 0x80 | length]);
  else if (length < 65536) {
    header = Buffer.from([0, 0x80 | 126, 0, 0]);
    header.writeUInt16BE(length, 2);
  } else {
    header = Buffer.alloc(10);
    header[1] = 0x80 | 127;
    header.writeBigUInt64BE(BigInt(length), 2);
  }
  header[0] = (fin ? 0x80 : 0) | opcode;
  const masked = Buffer.from(payload);
  for (let i = 0; i < masked.length; i++) masked[i]! ^= mask[i & 3]!;
  return Buffer.concat([header, mask, masked]);
}

/** Reads one server frame (small ones only: 7-bit or 16-bit length). */
async function readFrame(
  read: (n: number) => Promise<Buffer>,
): Promise<{ fin: boolean; opcode: number; payload: Buffer }> {
  const head = await read(2);
  assert.equal(head[1]! & 0x80, 0, 'server frames are not masked');
  let length = head[1]! & 0x7f;
  if (length === 126) length = (await read(2)).readUInt16BE(0);
  return {
    fin: (head[0]! & 0x80) !== 0,
    opcode: head[0]! & 0x0f,
    payload: length ? await read(length) : Buffer.alloc(0),
  };
}

function nextMessage(ws: WebSocket): Promise<unknown> {
  return new Promise((resolve, reject) => {
    ws.addEventListener('message', (e) => resolve(e.data), { once: true });
    ws.addEventListener('error', () => reject(new Error('websocket error')), { once: true });
  });
}

describe('examples/custom-websocket', { timeout: TIMEOUT }, () => {
  let example: Example | undefined;
  before(async () => {
    example = await startExample('custom-websocket');
  });
  after(() => stop(example));

  it('answers the health check', async () => {
    const reply = await get(example!.port, '/health');
    assert.equal(reply.status, 200);
    assert.equal(reply.text, 'ok');
  });

  it('echoes text and a 70 000-byte binary message, then closes cleanly', async () => {
    const ws = new WebSocket(`ws://127.0.0.1:${example!.port}/`);
    ws.binaryType = 'arraybuffer';
    await new Promise<void>((resolve, reject) => {
      ws.addEventListener('open', () => resolve(), { once: true });
      ws.addEventListener('error', () => reject(new Error('could not connect')), { once: true });
    });
    let reply = nextMessage(ws);
    ws.send('hello, ferry ✓');
    assert.equal(await reply, 'hello, ferry ✓');

    const big = crypto.randomBytes(70_000);
    reply = nextMessage(ws);
    ws.send(big);
    const echoed = await reply;
    assert.ok(echoed instanceof ArrayBuffer, `binary comes back binary, got ${typeof echoed}`);
    assert.ok(Buffer.from(echoed).equals(big), 'the same bytes');

    const closed = new Promise<{ code: number; wasClean: boolean }>((resolve) =>
      ws.addEventListener('close', (e) => resolve({ code: e.code, wasClean: e.wasClean }), { once: true }),
    );
    ws.close(4000, 'bye');
    assert.deepEqual(await closed, { code: 4000, wasClean: true });
  });

  it('reassembles fragments, answers a ping between them, and echoes the close code', async () => {
    const { socket, read } = await rawWebSocket(example!.port);
    try {
      socket.write(clientFrame(0x1, Buffer.from('frag'), false));
      socket.write(clientFrame(0x9, Buffer.from('are you there?')));
      socket.write(clientFrame(0x0, Buffer.from('men'), false));
      socket.write(clientFrame(0x0, Buffer.from('ted ✓')));
      const pong = await readFrame(read);
      assert.deepEqual([pong.opcode, pong.payload.toString()], [0xa, 'are you there?']);
      const message = await readFrame(read);
      assert.deepEqual([message.fin, message.opcode, message.payload.toString()], [true, 0x1, 'fragmented ✓']);

      // A 16-bit length, binary.
      const medium = crypto.randomBytes(300);
      socket.write(clientFrame(0x2, medium));
      const binary = await readFrame(read);
      assert.equal(binary.opcode, 0x2);
      assert.ok(binary.payload.equals(medium));

      const code = Buffer.alloc(2);
      code.writeUInt16BE(1000);
      socket.write(clientFrame(0x8, Buffer.concat([code, Buffer.from('done')])));
      const close = await readFrame(read);
      assert.equal(close.opcode, 0x8);
      assert.equal(close.payload.readUInt16BE(0), 1000);
      await new Promise<void>((resolve) => (socket.destroyed ? resolve() : socket.once('close', () => resolve())));
    } finally {
      socket.destroy();
    }
  });

  it('refuses a frame over 1 MiB with close 1009, from its header', async () => {
    const { socket, read } = await rawWebSocket(example!.port);
    try {
      // Claims 2 MiB but sends a few bytes: the server must not wait for the rest.
      socket.write(clientFrame(0x2, Buffer.from('abc'), true, 2 * 1024 * 1024));
      const close = await readFrame(read);
      assert.equal(close.opcode, 0x8);
      assert.equal(close.payload.readUInt16BE(0), 1009);
    } finally {
      socket.destroy();
    }
  });

  it('refuses a handshake with another version or a bad key', async () => {
    const handshake = (headers: string) =>
      new Promise<string>((resolve, reject) => {
        const socket = net.connect(example!.port, '127.0.0.1');
        let text = '';
        socket.on('data', (d: Buffer) => (text += d.toString('latin1')));
        socket.on('close', () => resolve(text));
        socket.on('error', reject);
        socket.write(`GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n${headers}\r\n`);
      });
    const key = crypto.randomBytes(16).toString('base64');
    const version8 = await handshake(`Sec-WebSocket-Key: ${key}\r\nSec-WebSocket-Version: 8\r\n`);
    assert.match(version8, /^HTTP\/1\.1 426 /);
    assert.match(version8, /Sec-WebSocket-Version: 13\r\n/);
    assert.match(await handshake('Sec-WebSocket-Key: short\r\nSec-WebSocket-Version: 13\r\n'), /^HTTP\/1\.1 400 /);
  });

  it('says goodbye (1001) to open WebSockets and exits 0 on SIGTERM', async () => {
    const ws = new WebSocket(`ws://127.0.0.1:${example!.port}/`);
    await new Promise<void>((resolve) => ws.addEventListener('open', () => resolve(), { once: true }));
    const closed = new Promise<number>((resolve) =>
      ws.addEventListener('close', (e) => resolve(e.code), { once: true }),
    );
    const code = await terminate(example!);
    assert.equal(code, 0, example!.output());
    assert.equal(await closed, 1001);
  });
});
