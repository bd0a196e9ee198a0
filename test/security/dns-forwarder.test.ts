/**
 * The sandboxes' DNS forwarder (src/sandbox/dns-forwarder.ts) on real sockets: it relays UDP queries and
 * TCP streams unchanged to the upstream and back, ignores messages too short to be DNS, and stops
 * answering once closed. The upstream is a tiny responder on loopback that echoes the query's id with a
 * marker, so the test sees the exact bytes that came back. Port 53 needs root (CI runs as root).
 */
import assert from 'node:assert/strict';
import dgram from 'node:dgram';
import net from 'node:net';
import { after, before, describe, it } from 'node:test';
import { createDnsForwarder, parseNameservers } from '../../src/sandbox/dns-forwarder.js';
import { startUdpAndTcp } from '../helpers/dns-upstream.js';

const LISTEN = '127.53.0.1';

/**
 * Answers each query with the query itself followed by "answer" (UDP) or framed the same way (TCP),
 * after `delayMs` (a recursive resolver takes some time).
 */
async function startUpstream(delayMs = 0): Promise<{ port: number; queries: Buffer[]; close(): Promise<void> }> {
  const queries: Buffer[] = [];
  const stub = await startUdpAndTcp(
    (udp, query, client) => {
      queries.push(query);
      const reply = Buffer.concat([query, Buffer.from('answer')]);
      setTimeout(() => udp.send(reply, client.port, client.address, () => {}), delayMs);
    },
    (socket) => {
      socket.once('data', (framed: Buffer) => {
        const query = framed.subarray(2);
        queries.push(query);
        const reply = Buffer.concat([query, Buffer.from('answer')]);
        const length = Buffer.alloc(2);
        length.writeUInt16BE(reply.length);
        setTimeout(() => socket.end(Buffer.concat([length, reply])), delayMs);
      });
    },
  );
  return { port: stub.port, queries, close: stub.close };
}

function udpQuery(message: Buffer, timeoutMs = 3000, to = LISTEN, from?: string): Promise<Buffer | null> {
  return new Promise((resolve) => {
    const socket = dgram.createSocket('udp4');
    if (from) socket.bind(0, from);
    const timer = setTimeout(() => {
      socket.close();
      resolve(null);
    }, timeoutMs);
    socket.on('message', (reply) => {
      clearTimeout(timer);
      socket.close();
      resolve(reply);
    });
    socket.send(message, 53, to, () => {});
  });
}

function tcpQuery(message: Buffer, to = LISTEN, from?: string): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: to, port: 53, localAddress: from });
    const chunks: Buffer[] = [];
    const length = Buffer.alloc(2);
    length.writeUInt16BE(message.length);
    socket.on('connect', () => socket.write(Buffer.concat([length, message])));
    socket.on('data', (chunk: Buffer) => chunks.push(chunk));
    socket.on('end', () => resolve(Buffer.concat(chunks).subarray(2)));
    socket.on('error', reject);
    socket.setTimeout(5000, () => socket.destroy(new Error('timed out')));
  });
}

describe('DNS forwarder', () => {
  let upstream: Awaited<ReturnType<typeof startUpstream>>;
  let listener: { close(): Promise<void> };
  const query = Buffer.from('0123456789ab-question', 'latin1');

  before(async () => {
    upstream = await startUpstream();
    listener = await createDnsForwarder([{ host: '127.0.0.1', port: upstream.port }]).listen(LISTEN);
  });

  after(async () => {
    await listener?.close();
    await upstream?.close();
  });

  it('relays a UDP query and its answer unchanged', async () => {
    const reply = await udpQuery(query);
    assert.equal(reply?.toString('latin1'), '0123456789ab-questionanswer');
    assert.ok(upstream.queries.some((q) => q.equals(query)));
  });

  it('relays a TCP query and its answer unchanged', async () => {
    const reply = await tcpQuery(query);
    assert.equal(reply.toString('latin1'), '0123456789ab-questionanswer');
  });

  it('ignores a message too short to be a DNS query', async () => {
    const before = upstream.queries.length;
    assert.equal(await udpQuery(Buffer.from('short'), 1000), null);
    assert.equal(upstream.queries.length, before, 'nothing reached the upstream');
  });

  it('reads nameservers from the setting, else from resolv.conf', () => {
    assert.deepEqual(parseNameservers('192.0.2.53, [2001:db8::53]:5353'), [
      { host: '192.0.2.53', port: 53 },
      { host: '2001:db8::53', port: 5353 },
    ]);
    assert.throws(() => parseNameservers('192.0.2.53:99999'), /FERRY_EGRESS_DNS/);
    for (const server of parseNameservers('')) assert.notEqual(net.isIP(server.host), 0);
  });
});

/**
 * Issue 30, point 9: limits per source address, so one sandbox cannot starve another even when both ask
 * the same listener (the nftables rules keep them to their own listeners anyway; test/security/
 * dns-isolation.test.ts). The sources are two loopback addresses; the upstream answers after 200 ms (a slow
 * resolver). Before, the limits were per listener: 64 UDP queries waiting and 16 sockets (8 connections)
 * in all. The flood is 2,000 queries a second, which the forwarder's process drains even on a busy machine:
 * a flood faster than the process can read overflows the socket's kernel buffer, which a listener shared
 * by two sources cannot share fairly; that is why each sandbox has a listener of its own.
 */
describe('DNS forwarder: one source cannot starve another', () => {
  const shared = '127.53.1.1';
  const flooder = '127.53.1.2';
  const victim = '127.53.1.3';
  let upstream: Awaited<ReturnType<typeof startUpstream>>;
  let listener: { close(): Promise<void> };

  before(async () => {
    upstream = await startUpstream(200);
    listener = await createDnsForwarder([{ host: '127.0.0.1', port: upstream.port }], { tcpIdleMs: 5000 }).listen(
      shared,
    );
  });

  after(async () => {
    await listener?.close();
    await upstream?.close();
  });

  it('a flood of UDP queries from one source leaves another its answers', async () => {
    const socket = dgram.createSocket('udp4');
    socket.on('error', () => {});
    await new Promise<void>((resolve) => socket.bind(0, flooder, resolve));
    const message = Buffer.from('0123456789ab-flood', 'latin1');
    let flooding = true;
    const flood = (async () => {
      // 20 every 10 ms, 5,000 in all: at least 2.5 s, longer than the victim's queries take.
      for (let sent = 0; sent < 5000 && flooding; sent += 20) {
        for (let i = 0; i < 20; i++) socket.send(message, 53, shared, () => {});
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
    })();
    try {
      await new Promise((resolve) => setTimeout(resolve, 100));
      const answers: Array<Promise<Buffer | null>> = [];
      for (let i = 0; i < 50; i++) {
        answers.push(udpQuery(Buffer.from(`0123456789ab-victim-${i}`, 'latin1'), 5000, shared, victim));
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      const answered = (await Promise.all(answers)).filter((reply) => reply?.toString('latin1').endsWith('answer'));
      assert.ok(answered.length >= 45, `answers to the other source during the flood: ${answered.length} of 50`);
    } finally {
      flooding = false;
      await flood;
      socket.close();
    }
  });

  it('idle TCP connections of one source neither block another nor pile up', async () => {
    const idle: net.Socket[] = [];
    const closed: boolean[] = [];
    try {
      for (let i = 0; i < 8; i++) {
        const socket = net.connect({ host: shared, port: 53, localAddress: flooder });
        socket.on('error', () => {});
        const index = i;
        closed.push(false);
        socket.on('close', () => {
          closed[index] = true;
        });
        await new Promise<void>((resolve, reject) => {
          socket.once('connect', resolve);
          socket.once('error', reject);
        });
        idle.push(socket);
      }
      const query = Buffer.from('0123456789ab-tcp-victim', 'latin1');
      for (let i = 0; i < 3; i++) {
        const reply = await tcpQuery(query, shared, victim);
        assert.equal(reply.toString('latin1'), '0123456789ab-tcp-victimanswer');
      }
      // The flooder's own newest connection works: the oldest ones made room (4 per source).
      const reply = await tcpQuery(Buffer.from('0123456789ab-tcp-flooder', 'latin1'), shared, flooder);
      assert.equal(reply.toString('latin1'), '0123456789ab-tcp-flooderanswer');
      for (let i = 0; i < 50 && closed.filter(Boolean).length < 5; i++) {
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      assert.deepEqual(closed.slice(0, 5), [true, true, true, true, true], 'the oldest connections were closed');
    } finally {
      for (const socket of idle) socket.destroy();
    }
  });
});
