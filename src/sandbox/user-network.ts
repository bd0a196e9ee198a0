/**
 * The `user` sandbox network (issue 10, item 2) for a Ferry that does not run as root: every sandbox gets
 * a network namespace of its own, owned by a user namespace of its own, with egress through slirp4netns
 * (Debian `slirp4netns`), a user-mode TCP/IP stack that opens the sandbox's connections from the host as
 * Ferry's user:
 *
 *   holder:      `unshare --user --map-root-user --net` running `cat` on a pipe from Ferry (it exits
 *                when the pipe closes, so a killed Ferry leaves nothing behind);
 *   egress:      `slirp4netns --configure --disable-host-loopback` attached to the holder: tap0
 *                10.0.2.100/24, gateway 10.0.2.2 (refused: no host loopback), DNS at 10.0.2.3 (the
 *                namespace's nftables redirect it to the host's nameserver, pickUpstream);
 *   the policy:  one nftables table loaded by the namespace's root (nsenter into the holder's user and
 *                network namespaces) before the sandbox starts. The sandbox joins the two namespaces the
 *                same way, but bwrap then makes a user namespace of its own inside with every capability
 *                dropped, so the sandbox holds no capability over the holder's namespace and cannot
 *                touch the rules or the link (test/security/egress-rootless.test.ts tries).
 *
 * The rules, first match wins: loopback inside the namespace, DNS to slirp4netns's forwarder, the rest of
 * the slirp4netns network (the gateway is the host), FERRY_EGRESS_DENY, the host's own addresses,
 * FERRY_EGRESS_ALLOW, the built-in deny-list (egress-policy.ts), else accepted. IPv6 is refused
 * (slirp4netns runs IPv4 only). Refused connections are answered (TCP reset, else ICMP
 * admin-prohibited) so a client fails at once.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import type { Readable, Writable } from 'node:stream';
import type { Logger } from 'pino';
import type { Nameserver } from './dns-forwarder.js';
import { DEFAULT_DENY, describePolicy, type EgressPolicy } from './egress-policy.js';
import { findTool } from './find-tool.js';
import type { SandboxNetwork, SandboxNetworkLease } from './network.js';
import { type QuietResult, runQuiet, WRAPPER_ENV } from './run-quiet.js';
import { createSparePool } from './spare-pool.js';

export interface UserNetTools {
  unshare: string;
  nsenter: string;
  nft: string;
  slirp4netns: string;
}

export interface UserNetworkOptions {
  tools: UserNetTools;
  policy: EgressPolicy;
  /** The host's nameservers (FERRY_EGRESS_DNS, else /etc/resolv.conf): the first IPv4 one off loopback is used. */
  nameservers: readonly Nameserver[];
  /** Holds the one resolv.conf every sandbox gets (outside the data directory's secrets). */
  runDir: string;
  logger: Logger;
}

/** slirp4netns's fixed layout for its default network (10.0.2.0/24). */
const SLIRP_NETWORK = '10.0.2.0/24';
const SLIRP_DNS = '10.0.2.3';

const SETUP_TIMEOUT_MS = 15_000;

interface Spare {
  lease: SandboxNetworkLease;
  /** The host addresses its rules deny, joined. */
  hostAddresses: string;
}

/**
 * Whether this machine can give sandboxes the user network: `unshare`, `nsenter`, `nft` and `slirp4netns`
 * found. (Unprivileged user namespaces are proven by the first sandbox; the setup fails loudly if not.)
 */
export function findUserNetTools(): { tools: UserNetTools } | { reasons: string[] } {
  const reasons: string[] = [];
  const find = (name: string, pkg: string) => findTool(name, pkg, reasons);
  const tools = {
    unshare: find('unshare', 'util-linux'),
    nsenter: find('nsenter', 'util-linux'),
    nft: find('nft', 'nftables'),
    slirp4netns: find('slirp4netns', 'slirp4netns'),
  };
  return reasons.length > 0 ? { reasons } : { tools };
}

/**
 * The nameserver sandboxes' DNS goes to: the first IPv4 one not on loopback (a loopback one, such as
 * systemd-resolved's stub, is out of reach of slirp4netns with host loopback disabled), or null to leave
 * it to slirp4netns's own forwarder, which asks the first nameserver of the host's /etc/resolv.conf.
 */
export function pickUpstream(nameservers: readonly Nameserver[]): Nameserver | null {
  return nameservers.find((server) => net.isIPv4(server.host) && !server.host.startsWith('127.')) ?? null;
}

/**
 * The nftables table loaded inside one sandbox's namespace. With an `upstream`, DNS to slirp4netns's
 * address is redirected to it (the namespace's own DNAT), and only that address and port are let through
 * for DNS, whatever the deny-lists say: the sandbox resolves names as the host does.
 */
export function userNftRuleset(policy: EgressPolicy, hostAddresses: string[], upstream: Nameserver | null): string {
  const set = (name: string, cidrs: string[]) =>
    `  set ${name} {\n    type ipv4_addr; flags interval; auto-merge;${cidrs.length > 0 ? `\n    elements = { ${cidrs.join(', ')} }` : ''}\n  }`;
  return `table inet ferry {
${set('deny', policy.deny.v4)}
${set('host', hostAddresses)}
${set('allow', policy.allow.v4)}
${set('blocked', DEFAULT_DENY.v4)}
${
  upstream
    ? `  chain dns {
    type nat hook output priority -100; policy accept;
    ip daddr ${SLIRP_DNS} udp dport 53 dnat ip to ${upstream.host}:${upstream.port}
    ip daddr ${SLIRP_DNS} tcp dport 53 dnat ip to ${upstream.host}:${upstream.port}
  }
`
    : ''
}  chain output {
    type filter hook output priority filter; policy accept;
    oif lo accept
    meta nfproto != ipv4 jump refuse
${
  upstream
    ? `    ip daddr ${upstream.host} udp dport ${upstream.port} accept
    ip daddr ${upstream.host} tcp dport ${upstream.port} accept
`
    : `    ip daddr ${SLIRP_DNS} udp dport 53 accept
    ip daddr ${SLIRP_DNS} tcp dport 53 accept
`
}    ip daddr ${SLIRP_NETWORK} jump refuse
    ip daddr @deny jump refuse
    ip daddr @host jump refuse
    ip daddr @allow accept
    ip daddr @blocked jump refuse
    accept
  }
  chain refuse {
    meta l4proto tcp reject with tcp reset
    reject with icmpx type admin-prohibited
  }
}
`;
}

/** The host's IPv4 addresses now (every interface), as /32s. */
function hostIpv4Addresses(): string[] {
  const out = new Set<string>();
  for (const entries of Object.values(os.networkInterfaces())) {
    for (const entry of entries ?? []) if (entry.family === 'IPv4') out.add(`${entry.address}/32`);
  }
  return [...out];
}

export async function createUserNetwork(options: UserNetworkOptions): Promise<SandboxNetwork> {
  const { tools, policy, logger } = options;
  const upstream = pickUpstream(options.nameservers);
  await fs.mkdir(options.runDir, { recursive: true, mode: 0o755 });
  const resolvConf = path.join(options.runDir, 'resolv.conf');
  await fs.writeFile(
    resolvConf,
    `# DNS in this sandbox's own network (slirp4netns's address, redirected to the host's nameserver)\nnameserver ${SLIRP_DNS}\noptions timeout:2 attempts:2\n`,
    { mode: 0o644 },
  );
  const active = new Set<SandboxNetworkLease>();
  let closed = false;

  // Namespaces set up ahead, so a cold start does not wait for unshare, nft and slirp4netns.
  const spares = createSparePool(() => createLease(), logger);

  async function acquire(id: string): Promise<SandboxNetworkLease> {
    if (closed) throw new Error('the sandbox network is closed');
    if (!/^[A-Za-z0-9_-]{1,100}$/.test(id)) throw new Error(`Invalid sandbox id ${JSON.stringify(id)}`);
    const ready = await spares.take();
    // The host's addresses are in the rules: a spare made before they changed is not used.
    if (ready && ready.hostAddresses === hostIpv4Addresses().join(',')) return ready.lease;
    await ready?.lease.release();
    return (await createLease()).lease;
  }

  async function createLease(): Promise<Spare> {
    const hostAddresses = hostIpv4Addresses();
    const children: ChildProcess[] = [];
    const stop = async () => {
      await Promise.all(children.map(stopChild));
    };
    try {
      // `cat` on a pipe: the namespace lives exactly as long as Ferry keeps the pipe open.
      const holder = spawn(
        tools.unshare,
        ['--user', '--map-root-user', '--net', '--', 'sh', '-c', 'echo ready; exec cat >/dev/null'],
        { env: WRAPPER_ENV, stdio: ['pipe', 'pipe', 'pipe'] },
      );
      children.push(holder);
      await waitForLine(holder, holder.stdout!, 'the namespace holder');
      const pid = holder.pid!;
      const userns = `/proc/${pid}/ns/user`;
      const netns = `/proc/${pid}/ns/net`;
      const join = [`--user=${userns}`, `--net=${netns}`, '--preserve-credentials', '--'];

      // The policy first: the namespace has no link out until slirp4netns adds one.
      const loaded = await runTool(
        tools.nsenter,
        [...join, tools.nft, '-f', '-'],
        userNftRuleset(policy, hostAddresses, upstream),
      );
      if (loaded.code !== 0) throw new Error(`nft could not load the egress rules: ${loaded.stderr.trim()}`);

      // fd 3: closing it (Ferry exiting, or release()) ends slirp4netns; fd 4: it writes there when ready.
      const slirp = spawn(
        tools.slirp4netns,
        [
          '--configure',
          '--mtu=65520',
          '--disable-host-loopback',
          '--enable-sandbox',
          '--exit-fd=3',
          '--ready-fd=4',
          `--userns-path=${userns}`,
          String(pid),
          'tap0',
        ],
        { env: WRAPPER_ENV, stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'] },
      );
      children.push(slirp);
      await waitForLine(slirp, slirp.stdio[4] as Readable, 'slirp4netns', true);

      let released: Promise<void> | undefined;
      const lease: SandboxNetworkLease = {
        netnsPath: netns,
        usernsPath: userns,
        resolvConf,
        release() {
          released ??= (async () => {
            active.delete(lease);
            await stop();
          })();
          return released;
        },
      };
      active.add(lease);
      return { lease, hostAddresses: hostAddresses.join(',') };
    } catch (err) {
      await stop();
      throw err;
    }
  }

  // The first one now, so a machine where this cannot work (user namespaces off, nft refused in them)
  // makes createUserNetwork throw and the server fall back to loopback only, saying so, at start.
  spares.add(await createLease());
  spares.fill();
  return {
    mode: 'user',
    describe: () =>
      `user: each sandbox has its own user and network namespace with egress through slirp4netns (Ferry is not root; policy in nftables inside the namespace, out of the sandbox's reach; host addresses denied; DNS to ${upstream ? `${upstream.host}:${upstream.port}` : "slirp4netns's forwarder (the host's /etc/resolv.conf)"}); ${describePolicy(policy)}`,
    acquire,
    async close() {
      closed = true;
      await spares.close();
      await Promise.all([...active].map((lease) => lease.release()));
      await fs.rm(resolvConf, { force: true }).catch((err: unknown) => logger.debug({ err }, 'resolv.conf'));
    },
  };
}

/**
 * Resolves at the first line (or, with `anyData`, the first byte) `stream` gives; rejects with the
 * child's stderr if it exits first or takes longer than SETUP_TIMEOUT_MS.
 */
function waitForLine(child: ChildProcess, stream: Readable, what: string, anyData = false): Promise<void> {
  return new Promise((resolve, reject) => {
    let stderr = '';
    let seen = '';
    child.stderr?.setEncoding('utf8').on('data', (chunk: string) => {
      if (stderr.length < 4000) stderr += chunk;
    });
    const finish = (err?: Error) => {
      clearTimeout(timer);
      stream.off('data', onData);
      child.off('exit', onExit);
      child.off('error', onError);
      if (err) reject(err);
      else resolve();
    };
    const onData = (chunk: Buffer) => {
      seen += chunk.toString('utf8');
      if (anyData || seen.includes('\n')) finish();
    };
    const onExit = (code: number | null) => finish(new Error(`${what} exited (${code}): ${stderr.trim()}`));
    const onError = (err: Error) => finish(new Error(`${what} could not start: ${err.message}`));
    const timer = setTimeout(
      () => finish(new Error(`${what} was not ready after ${SETUP_TIMEOUT_MS} ms: ${stderr.trim()}`)),
      SETUP_TIMEOUT_MS,
    );
    stream.on('data', onData);
    child.once('exit', onExit);
    child.once('error', onError);
  });
}

async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((resolve) => child.once('exit', resolve));
  for (const stream of [child.stdin, ...child.stdio.slice(3)] as Array<Writable | Readable | null>) {
    stream?.destroy();
  }
  child.kill('SIGKILL');
  await exited;
}

/** Runs `ip`, `nft` and the like with a script on stdin; never throws (runQuiet). */
function runTool(file: string, args: string[], input: string): Promise<QuietResult> {
  return runQuiet(file, args, SETUP_TIMEOUT_MS, WRAPPER_ENV, input);
}
