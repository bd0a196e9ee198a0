/**
 * An "outside" network for egress tests: a network namespace the test makes itself, joined to the host by
 * one veth pair with a /30 from 10.214.0.0/16 (unique per run), so a sandbox's traffic to it really leaves
 * the host's namespace through Ferry's nftables rules. Never a real outside address. Needs root, ip and
 * nsenter (scripts/setup-system.sh --runtime installs them).
 */
import { type ChildProcess, spawn, spawnSync } from 'node:child_process';
import { randomInt } from 'node:crypto';
import net from 'node:net';
import readline from 'node:readline';

export interface OutsideNetwork {
  /** The namespace's name (`ip netns`). */
  name: string;
  /** The /30, for FERRY_EGRESS_ALLOW. */
  cidr: string;
  /** The host's end of the link. */
  hostAddress: string;
  /** The outside namespace's address, where its servers listen. */
  address: string;
  /**
   * Runs `command` inside the namespace (as root, with the test's environment) and resolves once it
   * printed a line containing `ready`; every line it prints goes to `lines`.
   */
  start(command: string[]): Promise<{ child: ChildProcess; lines: string[] }>;
  close(): Promise<void>;
}

function ip(args: string[], input?: string): { code: number | null; stderr: string } {
  const result = spawnSync('ip', args, { input: input ?? '', encoding: 'utf8', timeout: 15_000 });
  return { code: result.status, stderr: result.stderr ?? String(result.error ?? '') };
}

/**
 * Makes the namespace and its link; retries another /30 when the random pick is taken. `prefix` starts
 * the namespace's name (`<prefix>-<tag>`), `ferry-test-out` unless given.
 */
export async function createOutsideNetwork(options: { prefix?: string } = {}): Promise<OutsideNetwork> {
  for (let attempt = 0; attempt < 20; attempt++) {
    const n = randomInt(256);
    const block = randomInt(64) * 4;
    const tag = `${n.toString(16).padStart(2, '0')}${block.toString(16).padStart(2, '0')}`;
    const name = `${options.prefix ?? 'ferry-test-out'}-${tag}`;
    const link = `fto${tag}`;
    const base = `10.214.${n}.`;
    const hostAddress = `${base}${block + 1}`;
    const address = `${base}${block + 2}`;
    const routes = spawnSync('ip', ['-4', 'route', 'show', 'to', 'match', address], { encoding: 'utf8' }).stdout ?? '';
    if (routes.includes('10.214.')) continue; // another run's block
    const made = ip(
      ['-batch', '-'],
      [
        `netns add ${name}`,
        `link add ${link} type veth peer name eth0 netns ${name}`,
        `addr add ${hostAddress}/30 dev ${link}`,
        `link set ${link} up`,
      ].join('\n'),
    );
    if (made.code !== 0) {
      ip(['-force', '-batch', '-'], `netns del ${name}`);
      if (/exists/i.test(made.stderr)) continue;
      throw new Error(`could not make the outside namespace: ${made.stderr}`);
    }
    const inner = ip(
      ['-n', name, '-batch', '-'],
      [
        'link set lo up',
        `addr add ${address}/30 dev eth0`,
        // No IPv6 link-local address: its duplicate address detection ends a second or two after the link
        // comes up, and Chromium (the dashboard test runs it in this namespace) takes that address change
        // for a network change and aborts its requests (ERR_NETWORK_CHANGED, seen on CI).
        'link set dev eth0 addrgenmode none',
        'link set eth0 up',
        `route add default via ${hostAddress}`,
      ].join('\n'),
    );
    if (inner.code !== 0) {
      ip(['-force', '-batch', '-'], `link del ${link}\nnetns del ${name}`);
      throw new Error(`could not set up the outside namespace: ${inner.stderr}`);
    }
    const children: ChildProcess[] = [];
    return {
      name,
      cidr: `${base}${block}/30`,
      hostAddress,
      address,
      start(command) {
        const child = spawn('ip', ['netns', 'exec', name, ...command], { stdio: ['ignore', 'pipe', 'pipe'] });
        children.push(child);
        const lines: string[] = [];
        return new Promise((resolve, reject) => {
          const timer = setTimeout(() => reject(new Error(`${command.join(' ')} did not get ready`)), 20_000);
          readline.createInterface({ input: child.stdout! }).on('line', (line) => {
            lines.push(line);
            if (line.includes('ready')) {
              clearTimeout(timer);
              resolve({ child, lines });
            }
          });
          child.stderr!.on('data', (chunk: Buffer) => lines.push(chunk.toString('utf8')));
          child.once('exit', (code) => {
            clearTimeout(timer);
            reject(new Error(`${command.join(' ')} exited (${code}): ${lines.join('\n')}`));
          });
        });
      },
      async close() {
        for (const child of children) {
          if (child.exitCode === null && child.signalCode === null) {
            const exited = new Promise((resolve) => child.once('exit', resolve));
            child.kill('SIGKILL');
            await exited;
          }
        }
        ip(['-force', '-batch', '-'], `link del ${link}\nnetns del ${name}`);
      },
    };
  }
  throw new Error('no free 10.214.x.y/30 for the outside namespace after 20 tries');
}

/** The host's IPv4 addresses (every `ip -4 addr` entry). */
export function hostIpv4Addresses(): string[] {
  const out = spawnSync('ip', ['-4', '-o', 'addr', 'show'], { encoding: 'utf8' }).stdout ?? '';
  return [...out.matchAll(/\binet (\d+\.\d+\.\d+\.\d+)\//g)].map((match) => match[1]!);
}

/** Where a fixture function is asked to connect, and what it saw. */
export interface Target {
  host: string;
  port: number;
}
export interface Outcome extends Target {
  ok: boolean;
  connected: boolean;
  echoed?: string;
  error?: string;
}

/** A TCP echo server on every host address (0.0.0.0), as a careless host service would listen. */
export async function startHostListener(): Promise<{ port: number; close(): Promise<void> }> {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((socket) => {
    sockets.add(socket);
    socket.on('error', () => {});
    socket.on('close', () => sockets.delete(socket));
    socket.pipe(socket);
  });
  await new Promise<void>((resolve) => server.listen(0, '0.0.0.0', resolve));
  return {
    port: (server.address() as net.AddressInfo).port,
    close: () => {
      for (const socket of sockets) socket.destroy();
      return new Promise((resolve) => server.close(() => resolve()));
    },
  };
}

/**
 * A TCP forwarder on `host` (a port of its own) to `127.0.0.1:targetPort`: makes a server that listens on
 * loopback reachable from a namespace the test made (its link's host address).
 */
export async function forwardTcp(host: string, targetPort: number): Promise<{ port: number; close(): Promise<void> }> {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((inbound) => {
    const outbound = net.connect(targetPort, '127.0.0.1');
    for (const s of [inbound, outbound]) {
      sockets.add(s);
      s.on('error', () => {
        inbound.destroy();
        outbound.destroy();
      });
      s.on('close', () => sockets.delete(s));
    }
    inbound.pipe(outbound).pipe(inbound);
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, host, () => resolve());
  });
  return {
    port: (server.address() as net.AddressInfo).port,
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}
