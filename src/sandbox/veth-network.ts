/**
 * The `veth` sandbox network (issue 10, item 2): when Ferry runs as root with iproute2, nftables and
 * nsenter, every sandbox gets a network namespace of its own with loopback and one veth link to the host:
 *
 *   sandbox: eth0 10.213.x.(4k+2)/30, default route via the host end
 *   host:    fy<slot> 10.213.x.(4k+1)/30, in this server's interface group; a DNS forwarder on :53
 *
 * There is no bridge: each link is a point-to-point pair, so sandboxes cannot reach each other. The
 * policy is enforced outside the sandbox by one nftables table per server (`inet ferry_<tag>`, the tag
 * derived from the data directory, so two servers on one machine do not clobber each other's rules):
 *   - forwarded from a sandbox link: explicit deny, explicit allow, built-in deny-list, else accepted and
 *     masqueraded (egress-policy.ts has the order); IPv6 is dropped (sandboxes have IPv4 only);
 *   - into a sandbox link: replies only;
 *   - to the host itself from a sandbox link: DNS to the forwarder on that same link only (`fib daddr .
 *     iif type local`: the address is one of the incoming link's own), never to another sandbox's
 *     forwarder, which would share that sandbox's limits (dns-forwarder.ts).
 * A refused connection is answered (TCP reset, else ICMP admin-prohibited) rather than dropped, so a
 * sandbox's client (npm, pip, a function) fails at once instead of waiting for its own timeout.
 *
 * Setting a namespace up costs two `ip -batch` processes (one in the host namespace, one in the new
 * one: `ip -batch` cannot switch namespaces between lines), and releasing it one. two namespaces are
 * kept set up ahead (spare-pool.ts), so a replica's cold start does not wait for them.
 *
 * Slots (one /30 of the pool each) are claimed machine-wide through the host link's name, `fy<slot>`:
 * the kernel refuses a second link of the same name, so two servers sharing a pool never share an
 * address; a server that finds a slot taken moves on to the next.
 */
import { createHash, randomInt } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import type { DnsForwarder } from './dns-forwarder.js';
import { DEFAULT_DENY, describePolicy, type EgressPolicy, ipv4ToNumber, numberToIpv4 } from './egress-policy.js';
import { findTool } from './find-tool.js';
import type { SandboxNetwork, SandboxNetworkLease } from './network.js';
import { type QuietResult, runQuiet, WRAPPER_ENV } from './run-quiet.js';
import { createSparePool } from './spare-pool.js';

export interface VethTools {
  ip: string;
  nft: string;
  nsenter: string;
  /** flock(1): serializes the servers of one host over their tags (withHostLock). */
  flock: string;
}

export interface VethNetworkOptions {
  tools: VethTools;
  policy: EgressPolicy;
  /** Normalized IPv4 CIDR the /30 links come from (FERRY_EGRESS_POOL), prefix /30 or shorter. */
  pool: string;
  /** Data directory: names the nftables table and the namespaces, and holds the resolv.conf files. */
  dataDir: string;
  /** Where the generated resolv.conf files go when /run/ferry-egress/<tag> cannot be made. */
  runDir: string;
  dns: DnsForwarder;
  logger: Logger;
}

const NETNS_DIR = '/run/netns';
const RESOLV_ROOT = '/run/ferry-egress';
/** In /run/ferry-egress/<tag>/: the pid and start time of the server that owns the tag's namespaces. */
const OWNER_FILE = 'owner';
/** /run/ferry-egress/.lock: held while a server claims its tag or sweeps dead servers' (withHostLock). */
const LOCK_FILE = '.lock';
/** How long a server waits for another to finish claiming or sweeping. */
const LOCK_WAIT_S = 120;

const TOOL_TIMEOUT_MS = 15_000;
const SLOT_ATTEMPTS = 32;

/**
 * Whether this machine can give sandboxes the veth network: root, and `ip`, `nft` and `nsenter` found.
 * Returns the tools, or the reasons it cannot.
 */
export function findVethTools(): { tools: VethTools } | { reasons: string[] } {
  const reasons: string[] = [];
  if (typeof process.getuid !== 'function' || process.getuid() !== 0) reasons.push('Ferry does not run as root');
  const find = (name: string, pkg: string) => findTool(name, pkg, reasons);
  const tools = {
    ip: find('ip', 'iproute2'),
    nft: find('nft', 'nftables'),
    nsenter: find('nsenter', 'util-linux'),
    flock: find('flock', 'util-linux'),
  };
  return reasons.length > 0 ? { reasons } : { tools };
}

/** Sets up the host side (forwarding, the nftables table) and returns the provider. Throws when it cannot. */
export async function createVethNetwork(options: VethNetworkOptions): Promise<SandboxNetwork> {
  const { tools, policy, dns, logger } = options;
  const [poolBase, poolPrefix] = parsePool(options.pool);
  const slots = 2 ** (32 - poolPrefix) / 4;
  const tag = createHash('sha256').update(path.resolve(options.dataDir)).digest('hex').slice(0, 8);
  const table = `ferry_${tag}`;
  // Interface groups are 32-bit; this server's links share one, which the rules match on.
  const group = (Number.parseInt(tag.slice(0, 7), 16) | 0x10000000) >>> 0;
  const nsPrefix = `ferry-${tag}-`;
  const clash = hostAddressIn(poolBase, poolPrefix);
  if (clash) {
    throw new Error(`the sandbox pool ${options.pool} (FERRY_EGRESS_POOL) holds the host's own address ${clash}`);
  }
  // Outside the data directory: the path shows in the sandbox's own command line (bwrap's argv).
  let resolvDir = path.join(RESOLV_ROOT, tag);
  // The claim of this tag (its folder made anew with this process as owner, a killed predecessor's
  // namespaces removed) and the sweep of dead servers' tags happen under one host-wide lock, so another
  // server's sweep never reads a killed predecessor's owner file and then removes what this one has just
  // set up (its folder, its nftables table, its namespaces: the egress rules of its sandboxes).
  try {
    await withHostLock(tools.flock, async () => {
      try {
        await fs.rm(resolvDir, { recursive: true, force: true });
        await fs.mkdir(resolvDir, { recursive: true, mode: 0o755 });
      } catch {
        resolvDir = path.join(options.runDir, 'resolv');
        await fs.mkdir(resolvDir, { recursive: true, mode: 0o755 });
      }
      await removeStaleNamespaces(tools.ip, nsPrefix);
      await removeDeadServers(tools, tag);
      await writeOwner(resolvDir).catch(() => {});
    });
    await fs.writeFile('/proc/sys/net/ipv4/ip_forward', '1');
    const ruleset = nftRuleset(table, group, options.pool, policy);
    const loaded = await runTool(
      tools.nft,
      ['-f', '-'],
      `add table inet ${table}\ndelete table inet ${table}\n${ruleset}`,
    );
    if (loaded.code !== 0) throw new Error(`nft could not load the egress rules: ${loaded.stderr.trim()}`);
  } catch (err) {
    await fs.rm(resolvDir, { recursive: true, force: true });
    throw err;
  }

  const used = new Set<number>();
  const active = new Set<SandboxNetworkLease>();
  let cursor = randomInt(slots);
  let closed = false;
  let dnsWarned = false;

  async function setUp(slot: number): Promise<'taken' | { host: string; sandbox: string }> {
    const base = poolBase + slot * 4;
    const host = numberToIpv4(base + 1);
    const sandbox = numberToIpv4(base + 2);
    const link = linkName(slot);
    const ns = `${nsPrefix}${slot}`;
    const outer = await runTool(
      tools.ip,
      ['-batch', '-'],
      [
        `netns add ${ns}`,
        `link add ${link} group ${group} type veth peer name eth0 netns ${ns}`,
        `link set ${link} addrgenmode none`,
        `addr add ${host}/30 dev ${link}`,
        `link set ${link} up`,
      ].join('\n'),
    );
    if (outer.code !== 0) {
      const failedLine = Number(/Command failed -:(\d+)/.exec(outer.stderr)?.[1] ?? 0);
      // Line 2 failing means the link (the slot) is someone else's: leave it alone.
      await runTool(
        tools.ip,
        ['-force', '-batch', '-'],
        `${failedLine === 2 ? '' : `link del ${link}\n`}netns del ${ns}`,
      );
      if (failedLine === 2 && /exists/i.test(outer.stderr)) return 'taken';
      throw new Error(`ip could not set up a sandbox network: ${outer.stderr.trim()}`);
    }
    const inner = await runTool(
      tools.ip,
      ['-n', ns, '-batch', '-'],
      [
        'link set lo up',
        'link set eth0 addrgenmode none',
        `addr add ${sandbox}/30 dev eth0`,
        'link set eth0 up',
        `route add default via ${host}`,
      ].join('\n'),
    );
    if (inner.code !== 0) {
      await runTool(tools.ip, ['-force', '-batch', '-'], `link del ${link}\nnetns del ${ns}`);
      throw new Error(`ip could not set up a sandbox network: ${inner.stderr.trim()}`);
    }
    return { host, sandbox };
  }

  // Namespaces set up ahead, so a cold start finds one ready instead of waiting for `ip` twice.
  const spares = createSparePool(() => createLease(), logger);

  async function acquire(id: string): Promise<SandboxNetworkLease> {
    if (closed) throw new Error('the sandbox network is closed');
    if (!/^[A-Za-z0-9_-]{1,100}$/.test(id)) throw new Error(`Invalid sandbox id ${JSON.stringify(id)}`);
    return (await spares.take()) ?? createLease();
  }

  async function createLease(): Promise<SandboxNetworkLease> {
    for (let attempt = 0; attempt < SLOT_ATTEMPTS; attempt++) {
      const slot = nextSlot();
      used.add(slot);
      let addresses: Awaited<ReturnType<typeof setUp>>;
      try {
        addresses = await setUp(slot);
      } catch (err) {
        used.delete(slot);
        throw err;
      }
      if (addresses === 'taken') continue; // stays in `used` while this server runs: another server has it
      const link = linkName(slot);
      const ns = `${nsPrefix}${slot}`;
      let resolver: { close(): Promise<void> } | null = null;
      const resolvConf = path.join(resolvDir, `${slot}.conf`);
      try {
        resolver = await dns.listen(addresses.host).catch((err: NodeJS.ErrnoException) => {
          // Another DNS server listening on every address (dnsmasq on 0.0.0.0:53) holds the port; it
          // then answers the sandbox itself, which is the best there is. Said once, not per sandbox.
          if (!dnsWarned) {
            dnsWarned = true;
            logger.warn(
              { err },
              `Ferry's resolver for sandboxes cannot listen on port 53 of the links (${err.code ?? err.message}): sandboxes ask whatever DNS server holds it`,
            );
          }
          return null;
        });
        await fs.writeFile(
          resolvConf,
          `# Ferry's resolver, on the host end of this sandbox's link\nnameserver ${addresses.host}\noptions timeout:2 attempts:2\n`,
          { mode: 0o644 },
        );
      } catch (err) {
        await resolver?.close();
        await runTool(tools.ip, ['-force', '-batch', '-'], `link del ${link}\nnetns del ${ns}`);
        used.delete(slot);
        throw err;
      }
      let released: Promise<void> | undefined;
      const lease: SandboxNetworkLease = {
        netnsPath: path.join(NETNS_DIR, ns),
        resolvConf,
        release() {
          released ??= (async () => {
            active.delete(lease);
            await resolver?.close();
            // Deleting the host end takes the sandbox end with it, at once (the namespace may linger
            // in the kernel until its last process is gone).
            const result = await runTool(tools.ip, ['-force', '-batch', '-'], `link del ${link}\nnetns del ${ns}`);
            if (result.code !== 0)
              logger.warn({ netns: ns, stderr: result.stderr.trim() }, 'removing a sandbox network failed');
            await fs.rm(resolvConf, { force: true });
            used.delete(slot);
          })();
          return released;
        },
      };
      active.add(lease);
      return lease;
    }
    throw new Error(
      `no free address in the sandbox pool ${options.pool} (FERRY_EGRESS_POOL) after ${SLOT_ATTEMPTS} tries`,
    );
  }

  function nextSlot(): number {
    for (let i = 0; i < slots; i++) {
      const slot = (cursor + i) % slots;
      if (!used.has(slot)) {
        cursor = (slot + 1) % slots;
        return slot;
      }
    }
    throw new Error(`every address of the sandbox pool ${options.pool} (FERRY_EGRESS_POOL) is in use`);
  }

  spares.fill();
  return {
    mode: 'veth',
    describe: () =>
      `veth: each sandbox has its own network namespace with egress through the host (pool ${options.pool}, nftables table inet ${table}, DNS forwarded to ${dns.upstreams.map((u) => `${u.host}:${u.port}`).join(', ') || 'NO NAMESPACE SERVER'}); ${describePolicy(policy)}`,
    acquire,
    async close() {
      closed = true;
      await spares.close();
      await Promise.all([...active].map((lease) => lease.release()));
      await fs.rm(resolvDir, { recursive: true, force: true });
      const result = await runTool(tools.nft, ['delete', 'table', 'inet', table], '');
      if (result.code !== 0) logger.warn({ table, stderr: result.stderr.trim() }, 'removing the egress rules failed');
    },
  };
}

/** `fy` and the slot in base 36: at most 7 characters, well within the 15 an interface name may have. */
function linkName(slot: number): string {
  return `fy${slot.toString(36)}`;
}

function parsePool(pool: string): [base: number, prefix: number] {
  const [address = '', prefixText = ''] = pool.split('/');
  const prefix = Number(prefixText);
  if (!Number.isInteger(prefix) || prefix < 8 || prefix > 30) {
    throw new Error(`FERRY_EGRESS_POOL: "${pool}" must be an IPv4 range from /8 to /30`);
  }
  return [ipv4ToNumber(address), prefix];
}

/** The nftables table of one server; `group` is the interface group of its sandbox links. */
export function nftRuleset(table: string, group: number, pool: string, policy: EgressPolicy): string {
  const set = (name: string, cidrs: string[]) =>
    `  set ${name} { type ipv4_addr; flags interval; auto-merge;${cidrs.length > 0 ? ` elements = { ${cidrs.join(', ')} }` : ''} }`;
  return `table inet ${table} {
${set('deny', policy.deny.v4)}
${set('allow', policy.allow.v4)}
${set('blocked', DEFAULT_DENY.v4)}
  chain forward {
    type filter hook forward priority filter; policy accept;
    iifgroup ${group} jump egress
    oifgroup ${group} ct state established,related accept
    oifgroup ${group} drop
  }
  chain egress {
    meta nfproto != ipv4 drop
    ip daddr ${pool} jump refuse
    ip daddr @deny jump refuse
    ip daddr @allow accept
    ip daddr @blocked jump refuse
    fib daddr type { local, broadcast, multicast } jump refuse
    accept
  }
  chain refuse {
    meta l4proto tcp reject with tcp reset
    reject with icmpx type admin-prohibited
  }
  chain input {
    type filter hook input priority filter; policy accept;
    iifgroup ${group} jump to_host
  }
  chain to_host {
    ct state established,related accept
    meta nfproto ipv4 fib daddr . iif type local udp dport 53 accept
    meta nfproto ipv4 fib daddr . iif type local tcp dport 53 accept
    jump refuse
  }
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr ${pool} oifgroup != ${group} masquerade
  }
}
`;
}

/** A host address inside the pool, other than the sandbox links' own (`fy*`, this or another server's). */
function hostAddressIn(base: number, prefix: number): string | undefined {
  const mask = prefix === 0 ? 0 : (~0 << (32 - prefix)) >>> 0;
  for (const [name, addresses] of Object.entries(os.networkInterfaces())) {
    if (name.startsWith('fy')) continue;
    for (const entry of addresses ?? []) {
      if (entry.family === 'IPv4' && (ipv4ToNumber(entry.address) & mask) >>> 0 === base) return entry.address;
    }
  }
  return undefined;
}

/**
 * Runs `work` holding an exclusive flock(2) on /run/ferry-egress/.lock. The lock is taken by flock(1) on
 * a descriptor this process opened and passed to it: a flock belongs to the open file, so it stays held
 * after flock(1) exits, until this process closes the file, or dies (the kernel then releases it: a
 * killed server never leaves it held). Without /run/ferry-egress (not root), `work` runs unlocked.
 */
async function withHostLock<T>(flock: string, work: () => Promise<T>): Promise<T> {
  let handle: fs.FileHandle;
  try {
    await fs.mkdir(RESOLV_ROOT, { recursive: true, mode: 0o755 });
    handle = await fs.open(path.join(RESOLV_ROOT, LOCK_FILE), 'a', 0o600);
  } catch {
    return work();
  }
  try {
    const locked = await runQuiet(
      flock,
      ['--exclusive', '--timeout', String(LOCK_WAIT_S), '3'],
      (LOCK_WAIT_S + 10) * 1000,
      WRAPPER_ENV,
      undefined,
      [handle.fd],
    );
    if (locked.code !== 0) {
      const why = locked.error ?? (locked.stderr.trim() || `flock exited with ${locked.code}`);
      throw new Error(
        `could not lock ${path.join(RESOLV_ROOT, LOCK_FILE)} within ${LOCK_WAIT_S} s (another Ferry server holds it?): ${why}`,
      );
    }
    return await work();
  } finally {
    await handle.close();
  }
}

/**
 * What a server killed hard (SIGKILL, a crash) left behind: its namespaces, its nftables table and its
 * folder under /run/ferry-egress, found through the owner file of every other tag whose process is gone.
 * A server restarted on the same data directory cleans its own tag anyway (removeStaleNamespaces). Called
 * under withHostLock, as every claim of a tag is: an owner read here is not replaced meanwhile.
 */
async function removeDeadServers(tools: VethTools, ownTag: string): Promise<void> {
  const tags = await fs.readdir(RESOLV_ROOT).catch(() => [] as string[]);
  for (const tag of tags) {
    if (tag === ownTag || !/^[0-9a-f]{8}$/.test(tag)) continue;
    const owner = await fs.readFile(path.join(RESOLV_ROOT, tag, OWNER_FILE), 'utf8').catch(() => null);
    // No owner, or not one this code writes: a server still setting up, or not one of ours. Never taken
    // for a dead one: that removed a live server's namespaces and resolv.conf folder mid-build.
    const match = owner === null ? null : /^([1-9][0-9]*) (\S+)$/.exec(owner);
    if (!match) continue;
    if ((await processIdentity(Number(match[1]))) === owner) continue;
    await removeStaleNamespaces(tools.ip, `ferry-${tag}-`);
    await runTool(tools.nft, ['delete', 'table', 'inet', `ferry_${tag}`], '');
    await fs.rm(path.join(RESOLV_ROOT, tag), { recursive: true, force: true });
  }
}

/**
 * Writes this process's identity to `<dir>/owner` whole or not at all (a file renamed into place): a
 * server starting at the same moment reads either no owner or all of it, never an empty file.
 */
async function writeOwner(dir: string): Promise<void> {
  const temporary = path.join(dir, `.${OWNER_FILE}-${process.pid}`);
  await fs.writeFile(temporary, await processIdentity(process.pid));
  await fs.rename(temporary, path.join(dir, OWNER_FILE));
}

/** `<pid> <start time>`: tells a live owner from a new process that got the same pid. */
async function processIdentity(pid: number): Promise<string> {
  const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return `${pid} ${fields[19] ?? 'gone'}`;
}

async function removeStaleNamespaces(ip: string, prefix: string): Promise<void> {
  const names = await fs.readdir(NETNS_DIR).catch(() => [] as string[]);
  const stale = names.filter((name) => name.startsWith(prefix));
  if (stale.length === 0) return;
  // Deleting a namespace deletes its end of the veth pair, and with it the host end.
  await runTool(ip, ['-force', '-batch', '-'], stale.map((name) => `netns del ${name}`).join('\n'));
}

/** Runs `ip`, `nft` and the like with a script on stdin; never throws (runQuiet). */
function runTool(file: string, args: string[], input: string): Promise<QuietResult> {
  return runQuiet(file, args, TOOL_TIMEOUT_MS, WRAPPER_ENV, input);
}
