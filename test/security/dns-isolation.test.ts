/**
 * Issue 30, point 9: one tenant must not be able to block another's DNS. Two real sandboxes (bubblewrap
 * started with nsenter inside two namespaces of the veth network, src/sandbox/veth-network.ts, the way
 * replicas start) and Ferry's DNS forwarder, whose upstream is a stub on this host's loopback that
 * answers every query after 20 ms (like a recursive resolver; nothing leaves the machine).
 *
 *   - sandbox A reaches its own forwarder (UDP and TCP) but not B's, although B's forwarder listens on
 *     an address of the same pool (the old rules accepted DNS to any address of the pool);
 *   - A sends 20,000 UDP queries to B's forwarder address and 20,000 to its own, and holds 8 idle TCP
 *     connections to each, while B asks its own forwarder 50 UDP and 5 TCP queries: B gets at least 45
 *     UDP answers and every TCP one (before: 2 to 9 of 50 answers here, and TCP queries reset);
 *   - A cannot send from B's address (IP_FREEBIND binds it, sending fails), which the forwarder's limits
 *     per source address rely on.
 *
 * Needs root, bubblewrap, iproute2, nftables and nsenter (scripts/setup-system.sh --runtime); CI runs as root.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import readline from 'node:readline';
import { after, before, describe, it } from 'node:test';
import { pino } from 'pino';
import { createDnsForwarder } from '../../src/sandbox/dns-forwarder.js';
import { DEFAULT_EGRESS_POOL, parseEgressPolicy } from '../../src/sandbox/egress-policy.js';
import type { SandboxNetwork, SandboxNetworkLease } from '../../src/sandbox/network.js';
import { createVethNetwork, findVethTools } from '../../src/sandbox/veth-network.js';
import { startUdpAndTcp } from '../helpers/dns-upstream.js';
import { REPO_ROOT, tempDir } from '../helpers/ferry.js';

const CLIENT = path.join(REPO_ROOT, 'test/fixtures/security/dns-client.mjs');
const UPSTREAM_DELAY_MS = 20;
const TIMEOUT = 180_000;

/** Answers every query (UDP, and TCP frames) with the query marked as a response, after `delayMs`. */
async function startStubResolver(delayMs: number): Promise<{ port: number; count(): number; close(): Promise<void> }> {
  let queries = 0;
  const answer = (message: Buffer) => {
    const reply = Buffer.from(message);
    reply.writeUInt16BE(0x8180, 2); // response, recursion desired and available, no error
    return reply;
  };
  const stub = await startUdpAndTcp(
    (udp, message, client) => {
      queries++;
      setTimeout(() => udp.send(answer(message), client.port, client.address, () => {}), delayMs);
    },
    (socket) => {
      let buffered = Buffer.alloc(0);
      socket.on('data', (chunk: Buffer) => {
        buffered = Buffer.concat([buffered, chunk]);
        while (buffered.length >= 2 && buffered.length >= 2 + buffered.readUInt16BE(0)) {
          const message = buffered.subarray(2, 2 + buffered.readUInt16BE(0));
          buffered = buffered.subarray(2 + message.length);
          queries++;
          const reply = answer(message);
          const length = Buffer.alloc(2);
          length.writeUInt16BE(reply.length);
          setTimeout(() => socket.write(Buffer.concat([length, reply])), delayMs);
        }
      });
    },
  );
  return { port: stub.port, count: () => queries, close: stub.close };
}

/** The host end of a lease's link: the nameserver its resolv.conf names. */
async function forwarderOf(lease: SandboxNetworkLease): Promise<string> {
  const text = await fs.readFile(lease.resolvConf!, 'utf8');
  const address = /^nameserver (\S+)$/m.exec(text)?.[1];
  assert.ok(address && net.isIPv4(address), text);
  return address;
}

interface Sandboxed {
  lines: Array<Record<string, unknown>>;
  /** Resolves once a line matching `test` was printed. */
  line(test: (line: Record<string, unknown>) => boolean): Promise<Record<string, unknown>>;
  exited: Promise<number | null>;
  kill(): void;
}

/** /bin, /lib, /lib64 and /sbin as the host has them: symbolic links into /usr, or folders. */
async function systemLinkArgs(): Promise<string[]> {
  const args: string[] = [];
  for (const dir of ['/bin', '/lib', '/lib64', '/sbin']) {
    const stat = await fs.lstat(dir).catch(() => null);
    if (stat?.isSymbolicLink()) args.push('--symlink', await fs.readlink(dir), dir);
    else if (stat?.isDirectory()) args.push('--ro-bind', dir, dir);
  }
  return args;
}

/**
 * Tries to send a UDP query to `target`:53 from `source`, an address not the sandbox's own: IP_FREEBIND
 * lets any process bind a foreign address, no capability needed. Prints `{"sent":true}` or the error.
 */
const SPOOF = `
import json, socket, sys
source, target = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND
s.bind((source, 0))
query = bytes.fromhex('f1000100000100000000000007' + b'example'.hex() + '04' + b'test'.hex() + '0000010001')
try:
    s.sendto(query, (target, 53))
    print(json.dumps({"sent": True}))
except OSError as err:
    print(json.dumps({"sent": False, "error": str(err)}))
`;

/** The DNS client (test/fixtures/security/dns-client.mjs) in a sandbox of `lease`. */
function runClient(lease: SandboxNetworkLease, command: object, systemLinks: string[]): Sandboxed {
  return runSandboxed(lease, [process.execPath, '/dns-client.mjs', JSON.stringify(command)], systemLinks);
}

/**
 * Runs `argv` in a sandbox of `lease`: nsenter into its namespace, then bubblewrap with every other
 * namespace new, the network shared, uid 65534, every capability dropped (as replicas run). Each line it
 * prints on stdout is JSON.
 */
function runSandboxed(lease: SandboxNetworkLease, argv: string[], systemLinks: string[]): Sandboxed {
  const child = spawn(
    'nsenter',
    [
      `--net=${lease.netnsPath}`,
      '--',
      'bwrap',
      '--unshare-all',
      '--share-net',
      '--unshare-user',
      '--uid',
      '65534',
      '--gid',
      '65534',
      '--die-with-parent',
      '--new-session',
      '--cap-drop',
      'ALL',
      '--ro-bind',
      '/usr',
      '/usr',
      ...systemLinks,
      '--ro-bind',
      '/etc',
      '/etc',
      '--ro-bind',
      CLIENT,
      '/dns-client.mjs',
      '--proc',
      '/proc',
      '--dev',
      '/dev',
      '--tmpfs',
      '/tmp',
      '--',
      ...argv,
    ],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  const lines: Array<Record<string, unknown>> = [];
  let stderr = '';
  child.stderr!.setEncoding('utf8').on('data', (chunk: string) => {
    if (stderr.length < 4000) stderr += chunk;
  });
  const waiters: Array<{
    test: (line: Record<string, unknown>) => boolean;
    resolve: (line: Record<string, unknown>) => void;
  }> = [];
  readline.createInterface({ input: child.stdout! }).on('line', (text) => {
    const line = JSON.parse(text) as Record<string, unknown>;
    lines.push(line);
    for (const waiter of waiters.splice(0)) {
      if (waiter.test(line)) waiter.resolve(line);
      else waiters.push(waiter);
    }
  });
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  return {
    lines,
    line(test) {
      const found = lines.find(test);
      if (found) return Promise.resolve(found);
      return new Promise((resolve, reject) => {
        waiters.push({ test, resolve });
        void exited.then((code) =>
          reject(new Error(`the sandboxed client exited (${code}) first: ${stderr.trim()} ${JSON.stringify(lines)}`)),
        );
      });
    },
    exited,
    kill: () => child.kill('SIGKILL'),
  };
}

describe('DNS between sandboxes (veth network)', { timeout: TIMEOUT }, () => {
  let upstream: Awaited<ReturnType<typeof startStubResolver>>;
  let network: SandboxNetwork;
  let dataDir: string;
  let a: SandboxNetworkLease;
  let b: SandboxNetworkLease;
  let aForwarder: string;
  let bForwarder: string;
  let links: string[];

  before(async () => {
    links = await systemLinkArgs();
    const found = findVethTools();
    assert.ok('tools' in found, `the veth network is required: ${'reasons' in found ? found.reasons.join('; ') : ''}`);
    upstream = await startStubResolver(UPSTREAM_DELAY_MS);
    dataDir = await tempDir('ferry-dns-isolation-');
    network = await createVethNetwork({
      tools: found.tools,
      policy: parseEgressPolicy('', ''),
      pool: DEFAULT_EGRESS_POOL,
      dataDir,
      runDir: path.join(dataDir, 'run'),
      dns: createDnsForwarder([{ host: '127.0.0.1', port: upstream.port }]),
      logger: pino({ level: 'silent' }),
    });
    a = await network.acquire('dns-a');
    b = await network.acquire('dns-b');
    aForwarder = await forwarderOf(a);
    bForwarder = await forwarderOf(b);
    assert.notEqual(aForwarder, bForwarder);
  });

  after(async () => {
    await network?.close();
    await upstream?.close();
    if (dataDir) await fs.rm(dataDir, { recursive: true, force: true });
  });

  it("a sandbox reaches its own forwarder, and not another sandbox's", async () => {
    const probe = runClient(a, { mode: 'probe', targets: [aForwarder, bForwarder], timeoutMs: 4000 }, links);
    assert.equal(await probe.exited, 0, JSON.stringify(probe.lines));
    const own = probe.lines.find((line) => line.host === aForwarder);
    const other = probe.lines.find((line) => line.host === bForwarder);
    assert.deepEqual(own, { host: aForwarder, udp: true, tcp: 'answered' }, 'its own forwarder answers');
    assert.equal(other?.udp, false, `a UDP query to the other sandbox's forwarder: ${JSON.stringify(other)}`);
    assert.notEqual(other?.tcp, 'answered', `a TCP query to the other sandbox's forwarder: ${JSON.stringify(other)}`);
  });

  it("a flood from one sandbox leaves another's DNS answering", async () => {
    const flood = runClient(
      a,
      {
        mode: 'flood',
        targets: [bForwarder, aForwarder],
        udp: 20_000,
        tcp: 8,
        holdMs: 60_000,
      },
      links,
    );
    try {
      await flood.line((line) => line.started === true);
      const victim = runClient(
        b,
        {
          mode: 'victim',
          target: bForwarder,
          udp: 50,
          tcp: 5,
          spacingMs: 20,
          timeoutMs: 5000,
        },
        links,
      );
      assert.equal(await victim.exited, 0, JSON.stringify(victim.lines));
      const outcome = victim.lines[0] as { udpAnswered: number; tcp: string[] };
      const floodState = JSON.stringify(flood.lines);
      assert.ok(
        outcome.udpAnswered >= 45,
        `UDP answers to B during A's flood: ${JSON.stringify(outcome)} (A: ${floodState})`,
      );
      assert.deepEqual(outcome.tcp, ['answered', 'answered', 'answered', 'answered', 'answered'], floodState);
      // The flood did run meanwhile (not only after): it had started, and its UDP part is bounded.
      assert.ok(flood.lines.some((line) => line.started === true));
    } finally {
      flood.kill();
      await flood.exited;
    }
  });

  it("a sandbox cannot send from another sandbox's address (the resolver's limits are per source address)", async () => {
    // B's own address is the other end of its /30: one above its link's host end.
    const parts = bForwarder.split('.').map(Number);
    const bAddress = [...parts.slice(0, 3), parts[3]! + 1].join('.');
    const spoof = runSandboxed(a, ['/usr/bin/python3', '-c', SPOOF, bAddress, aForwarder], links);
    assert.equal(await spoof.exited, 0, JSON.stringify(spoof.lines));
    assert.equal(spoof.lines[0]?.sent, false, JSON.stringify(spoof.lines));
  });
});
