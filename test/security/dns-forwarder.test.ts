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

const LISTEN = '127.53.0.1';

/** Answers each query with the query itself followed by "answer" (UDP) or framed the same way (TCP). */
async function startUpstream(): Promise<{ port: number; queries: Buffer[]; close(): Promise<void> }> {
  const queries: Buffer[] = [];
  const udp = dgram.createSocket('udp4');
  udp.on('message', (query, client) => {
    queries.push(query);
    udp.send(Buffer.concat([query, Buffer.from('answer')]), client.port, client.address);
  });
  await new Promise<void>((resolve) => udp.bind(0, '127.0.0.1', resolve));
  const port = udp.address().port;
  const tcp = net.createServer((socket) => {
    socket.once('data', (framed: Buffer) => {
      const query = framed.subarray(2);
      queries.push(query);
      const reply = Buffer.concat([query, Buffer.from('answer')]);
      const length = Buffer.alloc(2);
      length.writeUInt16BE(reply.length);
      socket.end(Buffer.concat([length, reply]));
    });
  });
  await new Promise<void>((resolve) => tcp.listen(port, '127.0.0.1', resolve));
  return {
    port,
    queries,
    close: async () => {
      udp.close();
      await new Promise((resolve) => tcp.close(resolve));
    },
  };
}

function udpQuery(message: Buffer, timeoutMs = 3000): Promise<Buffer | null> {
  return new Promise((resolve) => {
    const socket = dgram.createSocket('udp4');
    const timer = setTimeout(() => {
      socket.close();
      resolve(null);
    }, timeoutMs);
    socket.on('message', (reply) => {
      clearTimeout(timer);
      socket.close();
      resolve(reply);
    });
    socket.send(message, 53, LISTEN);
  });
}

function tcpQuery(message: Buffer): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: LISTEN, port: 53 });
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
