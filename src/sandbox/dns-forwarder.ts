/**
 * The DNS resolver sandboxes use: it listens on port 53 (UDP and TCP) of the host end of a sandbox's
 * veth link and forwards each query, unchanged, to the host's own nameservers. The sandbox cannot reach
 * those nameservers itself (they are usually on loopback or the private network, both denied), so this
 * is its only way to resolve names; the answers are the host's.
 *
 * It forwards opaque messages and parses nothing but the length: a query is 12 to 4096 bytes over UDP,
 * and each listener keeps at most MAX_PENDING UDP queries and MAX_TCP connections in flight, so a
 * sandbox cannot turn it into a flood of the upstream.
 */
import dgram from 'node:dgram';
import fs from 'node:fs';
import net from 'node:net';

export interface Nameserver {
  host: string;
  port: number;
}

export interface DnsForwarder {
  readonly upstreams: readonly Nameserver[];
  /** Starts answering on `address`:53 (UDP and TCP) until the returned close() is called. */
  listen(address: string): Promise<{ close(): Promise<void> }>;
}

const QUERY_TIMEOUT_MS = 5_000;
const TCP_IDLE_MS = 10_000;
const MAX_PENDING = 64;
const MAX_TCP = 16;
const MIN_MESSAGE = 12;
const MAX_UDP_MESSAGE = 4096;

/**
 * Parses `FERRY_EGRESS_DNS`: comma-separated nameservers, `address` or `address:port` (`[v6]:port`).
 * Empty means the `nameserver` lines of /etc/resolv.conf. Throws with a clear message for a bad entry.
 */
export function parseNameservers(text: string | undefined, resolvConf = '/etc/resolv.conf'): Nameserver[] {
  const entries = (text ?? '')
    .split(',')
    .map((entry) => entry.trim())
    .filter(Boolean);
  if (entries.length === 0) {
    const content = fs.existsSync(resolvConf) ? fs.readFileSync(resolvConf, 'utf8') : '';
    return [...content.matchAll(/^\s*nameserver\s+(\S+)/gm)]
      .map((match) => match[1]!.replace(/%.*$/, ''))
      .filter((host) => net.isIP(host) !== 0)
      .map((host) => ({ host, port: 53 }));
  }
  return entries.map((entry) => {
    const match = /^\[([^\]]+)\](?::(\d+))?$/.exec(entry) ?? /^([^:]+)(?::(\d+))?$/.exec(entry);
    const host = match?.[1] ?? entry;
    const port = match?.[2] === undefined ? 53 : Number(match[2]);
    if (net.isIP(host) === 0 || !Number.isInteger(port) || port < 1 || port > 65535) {
      throw new Error(`FERRY_EGRESS_DNS: "${entry}" is not a nameserver address (like 192.0.2.53 or 192.0.2.53:5353)`);
    }
    return { host, port };
  });
}

export function createDnsForwarder(upstreams: readonly Nameserver[]): DnsForwarder {
  let next = 0;
  const pick = (): Nameserver | undefined => {
    const server = upstreams[next % Math.max(1, upstreams.length)];
    next++;
    return server;
  };

  async function listen(address: string): Promise<{ close(): Promise<void> }> {
    const udp = dgram.createSocket({ type: net.isIPv6(address) ? 'udp6' : 'udp4' });
    let pending = 0;
    const outgoing = new Set<dgram.Socket>();
    udp.on('error', () => {});
    udp.on('message', (query, client) => {
      const upstream = pick();
      if (!upstream || query.length < MIN_MESSAGE || query.length > MAX_UDP_MESSAGE || pending >= MAX_PENDING) return;
      pending++;
      const out = dgram.createSocket(net.isIPv6(upstream.host) ? 'udp6' : 'udp4');
      outgoing.add(out);
      const done = () => {
        if (!outgoing.delete(out)) return;
        pending--;
        clearTimeout(timer);
        out.close();
      };
      const timer = setTimeout(done, QUERY_TIMEOUT_MS);
      out.on('error', done);
      out.on('message', (answer, from) => {
        if (from.address !== upstream.host || from.port !== upstream.port) return;
        udp.send(answer, client.port, client.address, () => {});
        done();
      });
      out.send(query, upstream.port, upstream.host, (err) => {
        if (err) done();
      });
    });
    await new Promise<void>((resolve, reject) => {
      udp.once('error', reject);
      udp.bind({ address, port: 53, exclusive: true }, () => {
        udp.off('error', reject);
        resolve();
      });
    });

    const sockets = new Set<net.Socket>();
    const tcp = net.createServer({ pauseOnConnect: true }, (client) => {
      const upstream = pick();
      if (!upstream || sockets.size >= MAX_TCP) {
        client.destroy();
        return;
      }
      const server = net.connect({ host: upstream.host, port: upstream.port });
      for (const socket of [client, server]) {
        sockets.add(socket);
        socket.setTimeout(TCP_IDLE_MS, () => socket.destroy());
        socket.on('error', () => {});
        socket.on('close', () => {
          sockets.delete(socket);
          client.destroy();
          server.destroy();
        });
      }
      client.pipe(server);
      server.pipe(client);
      client.resume();
    });
    try {
      await new Promise<void>((resolve, reject) => {
        tcp.once('error', reject);
        tcp.listen({ host: address, port: 53, exclusive: true }, () => {
          tcp.off('error', reject);
          resolve();
        });
      });
    } catch (err) {
      udp.close();
      throw err;
    }

    return {
      async close() {
        for (const out of outgoing) out.close();
        outgoing.clear();
        for (const socket of sockets) socket.destroy();
        await Promise.all([
          new Promise<void>((resolve) => udp.close(() => resolve())),
          new Promise<void>((resolve) => tcp.close(() => resolve())),
        ]);
      },
    };
  }

  return { upstreams, listen };
}
