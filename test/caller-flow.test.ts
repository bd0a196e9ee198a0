/**
 * Back-pressure pieces (issue 30): watchCaller on a real loopback socket (blocked while the caller does
 * not read, ready again once it does, cut after the stall limit), and a resumable stream's `blocked` and
 * `whenReady` over its readers.
 */
import assert from 'node:assert/strict';
import net from 'node:net';
import { describe, it } from 'node:test';
import { watchCaller } from '../src/http/caller-flow.js';
import { createStreamReplay, type StreamReader } from '../src/runs/stream-replay.js';

/** A connected pair on loopback: `server` writes, `client` reads only when told (paused from the start). */
async function socketPair(): Promise<{ server: net.Socket; client: net.Socket; close(): void }> {
  const listener = net.createServer();
  await new Promise<void>((r) => listener.listen(0, '127.0.0.1', r));
  const accepted = new Promise<net.Socket>((r) => listener.once('connection', r));
  const client = net.connect((listener.address() as net.AddressInfo).port, '127.0.0.1');
  client.pause();
  const server = await accepted;
  return {
    server,
    client,
    close() {
      server.destroy();
      client.destroy();
      listener.close();
    },
  };
}

/** Writes 64 KiB chunks until the socket holds more than `bytes` (bounded: at most 4096 chunks). */
function fill(socket: net.Socket, bytes: number, wrote: () => void): void {
  const chunk = Buffer.alloc(64 * 1024, 1);
  for (let i = 0; i < 4096 && socket.writableLength <= bytes; i++) {
    socket.write(chunk);
    wrote();
  }
}

describe('watchCaller', () => {
  it('is blocked while the caller does not read, and ready again once it does', async () => {
    const pair = await socketPair();
    try {
      let ready = 0;
      let stalled = 0;
      const flow = watchCaller({
        full: () => pair.server.writableLength > 256 * 1024,
        drains: [pair.server],
        stallMs: 60_000,
        onStalled: () => stalled++,
        onReady: () => ready++,
      });
      fill(pair.server, 256 * 1024, () => flow.wrote());
      assert.equal(flow.blocked, true);
      pair.client.resume();
      const began = Date.now();
      while (flow.blocked && Date.now() - began < 20_000) await new Promise((r) => setTimeout(r, 20));
      assert.equal(flow.blocked, false);
      assert.equal(ready, 1);
      assert.equal(stalled, 0);
      flow.stop();
    } finally {
      pair.close();
    }
  });

  it('cuts a caller that stays blocked for the stall limit', async () => {
    const pair = await socketPair();
    try {
      const flow = watchCaller({
        full: () => pair.server.writableLength > 256 * 1024,
        drains: [pair.server],
        stallMs: 300,
        onStalled: () => pair.server.destroy(),
      });
      fill(pair.server, 256 * 1024, () => flow.wrote());
      assert.equal(flow.blocked, true);
      const closed = await new Promise<boolean>((resolve) => {
        const timer = setTimeout(() => resolve(false), 20_000);
        pair.server.once('close', () => {
          clearTimeout(timer);
          resolve(true);
        });
      });
      assert.ok(closed, 'the stalled caller was cut');
      flow.stop();
    } finally {
      pair.close();
    }
  });
});

describe('a resumable stream under back-pressure', () => {
  it('is blocked while a reader is, and lets what waits go on once none is (or it went away)', async () => {
    const replay = createStreamReplay({ keepMs: 1000, maxBytesPerRun: 1 << 20, maxTotalBytes: 1 << 24, graceMs: 0 });
    const stream = replay.open({ runId: 'r1', projectId: 'p', appId: 'a', fn: 'f', stop: () => {} });
    const reader: StreamReader & { blocked: boolean } = { blocked: false, send() {}, end() {} };
    const other: StreamReader & { blocked: boolean } = { blocked: false, send() {}, end() {} };
    stream.attach(reader, 0);
    stream.attach(other, 0);
    assert.equal(stream.blocked, false);
    reader.blocked = true;
    assert.equal(stream.blocked, true);
    let went = 0;
    stream.whenReady(() => went++);
    await new Promise((r) => setImmediate(r));
    assert.equal(went, 0, 'waits while a reader is blocked');
    other.blocked = true;
    reader.blocked = false;
    stream.readerReady();
    assert.equal(went, 0, 'another reader is still blocked');
    stream.detach(other);
    assert.equal(went, 1, 'the blocked reader went away');
    stream.whenReady(() => went++);
    await new Promise((r) => setImmediate(r));
    assert.equal(went, 2, 'nothing blocked: goes on at once (soon after)');
    replay.close();
  });
});
