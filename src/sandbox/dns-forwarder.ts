/**
 * The DNS resolver sandboxes use: it listens on port 53 (UDP and TCP) of the host end of a sandbox's
 * veth link and forwards each query, unchanged, to the host's own nameservers. The sandbox cannot reach
 * those nameservers itself (they are usually on loopback or the private network, both denied), so this
 * is its only way to resolve names; the answers are the host's.
 *
 * It forwards opaque messages and parses nothing but the length: a query is 12 to 4096 bytes over UDP.
 * Limits are per source address, that is per sandbox, whichever listener it asks (DnsForwarderLimits):
 * UDP queries by a token bucket and a cap on those waiting, TCP connections by a cap per source (a new
 * one closes the source's oldest) and an idle timeout. So one sandbox flooding the forwarder, or holding
 * idle connections, spends its own share only: it cannot starve another sandbox nor turn the forwarder
 * into a flood of the upstream. (The nftables rules of veth-network.ts let a sandbox ask only the
 * listener on its own link anyway.)
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

/**
 * What one source address (one sandbox) may use of the forwarder, whichever of its listeners it asks.
 * The defaults are far above what resolving names needs, and low enough that a source flooding the
 * forwarder leaves the upstream and the other sources their share.
 */
export interface DnsForwarderLimits {
  /** UDP queries per second a source may send, sustained; more are dropped unanswered. */
  udpPerSecond: number;
  /** UDP queries a source may send at once after a quiet spell (the token bucket's size). */
  udpBurst: number;
  /** UDP queries of one source waiting for the upstream. */
  udpPendingPerSource: number;
  /** TCP connections one source may hold: a new one beyond it closes that source's oldest. */
  tcpPerSource: number;
  /** A TCP connection with nothing sent either way for this long is closed. */
  tcpIdleMs: number;
  /** How long a UDP query waits for the upstream's answer. */
  queryTimeoutMs: number;
  /** For the whole forwarder (every listener): UDP queries waiting, and TCP connections (a bound on sockets). */
  udpPendingTotal: number;
  tcpTotal: number;
}

export const DEFAULT_DNS_LIMITS: DnsForwarderLimits = {
  udpPerSecond: 100,
  udpBurst: 200,
  udpPendingPerSource: 32,
  tcpPerSource: 4,
  tcpIdleMs: 10_000,
  queryTimeoutMs: 5_000,
  udpPendingTotal: 4096,
  tcpTotal: 1024,
};

const MIN_MESSAGE = 12;
const MAX_UDP_MESSAGE = 4096;
/** Sources remembered at most; past it, those with nothing in flight and a full bucket are forgotten. */
const MAX_SOURCES = 1024;

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

interface Source {
  /** UDP tokens left, refilled at udpPerSecond up to udpBurst. */
  tokens: number;
  refilledAt: number;
  udpPending: number;
  /** Open TCP connections, oldest first (each closes both its sockets). */
  tcp: Array<() => void>;
}

export function createDnsForwarder(
  upstreams: readonly Nameserver[],
  overrides: Partial<DnsForwarderLimits> = {},
): DnsForwarder {
  const limits = { ...DEFAULT_DNS_LIMITS, ...overrides };
  let next = 0;
  const pick = (): Nameserver | undefined => {
    const server = upstreams[next % Math.max(1, upstreams.length)];
    next++;
    return server;
  };
  // Per source address, across every listener: a sandbox asking another's listener (which the nftables
  // rules refuse anyway) still spends its own share.
  const sources = new Map<string, Source>();
  let udpPendingTotal = 0;
  let tcpTotal = 0;

  function source(address: string): Source {
    let entry = sources.get(address);
    if (!entry) {
      if (sources.size >= MAX_SOURCES) forgetQuietSources();
      entry = { tokens: limits.udpBurst, refilledAt: performance.now(), udpPending: 0, tcp: [] };
      sources.set(address, entry);
    }
    return entry;
  }

  function forgetQuietSources(): void {
    const now = performance.now();
    for (const [address, entry] of sources) {
      const full = entry.tokens + ((now - entry.refilledAt) / 1000) * limits.udpPerSecond >= limits.udpBurst;
      if (full && entry.udpPending === 0 && entry.tcp.length === 0) sources.delete(address);
    }
  }

  /** Whether `entry` may send one more UDP query now (and takes its token). */
  function takeUdpToken(entry: Source): boolean {
    const now = performance.now();
    entry.tokens = Math.min(limits.udpBurst, entry.tokens + ((now - entry.refilledAt) / 1000) * limits.udpPerSecond);
    entry.refilledAt = now;
    if (entry.tokens < 1) return false;
    entry.tokens -= 1;
    return true;
  }

  async function listen(address: string): Promise<{ close(): Promise<void> }> {
    const udp = dgram.createSocket({ type: net.isIPv6(address) ? 'udp6' : 'udp4' });
    /** The queries waiting for the upstream, each as the function that ends it. */
    const outgoing = new Set<() => void>();
    udp.on('error', () => {});
    udp.on('message', (query, client) => {
      if (query.length < MIN_MESSAGE || query.length > MAX_UDP_MESSAGE || upstreams.length === 0) return;
      const from = source(client.address);
      if (from.udpPending >= limits.udpPendingPerSource || udpPendingTotal >= limits.udpPendingTotal) return;
      if (!takeUdpToken(from)) return;
      const upstream = pick()!;
      from.udpPending++;
      udpPendingTotal++;
      const out = dgram.createSocket(net.isIPv6(upstream.host) ? 'udp6' : 'udp4');
      const done = () => {
        if (!outgoing.delete(done)) return;
        from.udpPending--;
        udpPendingTotal--;
        clearTimeout(timer);
        out.close();
      };
      outgoing.add(done);
      const timer = setTimeout(done, limits.queryTimeoutMs);
      out.on('error', done);
      out.on('message', (answer, sender) => {
        if (sender.address !== upstream.host || sender.port !== upstream.port) return;
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

    const connections = new Set<() => void>();
    const tcp = net.createServer({ pauseOnConnect: true }, (client) => {
      const upstream = pick();
      const from = client.remoteAddress === undefined ? undefined : source(client.remoteAddress);
      if (!upstream || !from || tcpTotal >= limits.tcpTotal) {
        client.destroy();
        return;
      }
      // A source at its limit loses its oldest connection, not the new one: idle connections it keeps
      // open cost it its own slots and nobody else's.
      while (from.tcp.length >= limits.tcpPerSource) from.tcp[0]!();
      const server = net.connect({ host: upstream.host, port: upstream.port });
      let closed = false;
      const close = () => {
        if (closed) return;
        closed = true;
        tcpTotal--;
        connections.delete(close);
        const index = from.tcp.indexOf(close);
        if (index !== -1) from.tcp.splice(index, 1);
        client.destroy();
        server.destroy();
      };
      tcpTotal++;
      connections.add(close);
      from.tcp.push(close);
      for (const socket of [client, server]) {
        // Each exchange reads and writes both sockets, so either one idle means the connection is.
        socket.setTimeout(limits.tcpIdleMs, close);
        socket.on('error', () => {});
        socket.on('close', close);
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
        for (const done of [...outgoing]) done();
        for (const close of [...connections]) close();
        await Promise.all([
          new Promise<void>((resolve) => udp.close(() => resolve())),
          new Promise<void>((resolve) => tcp.close(() => resolve())),
        ]);
      },
    };
  }

  return { upstreams, listen };
}
