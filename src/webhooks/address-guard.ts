/**
 * Keeps webhook deliveries away from Ferry's own network (SSRF): a caller picks the webhook URL, so
 * without this guard any run call could make the server POST to its loopback admin ports, the cloud
 * metadata service at 169.254.169.254, or hosts on the private network.
 *
 * The check happens at connect time, on the addresses the name resolves to right then, and the socket
 * is opened to the checked address itself. Checking the URL earlier and connecting later would let a
 * name that resolves to a public address at check time and to 127.0.0.1 at connect time (DNS
 * rebinding) through. Every resolved address must pass, not just one, so an answer that mixes public and
 * internal addresses is refused whole.
 *
 * `FERRY_WEBHOOK_ALLOW` (comma-separated CIDRs) opens listed ranges, e.g. loopback for tests or a
 * receiver on the private network.
 */
import dns from 'node:dns';
import net from 'node:net';
import { Agent, buildConnector } from 'undici';
import { PermanentDeliveryError } from './retry-policy.js';

type Family = 'ipv4' | 'ipv6';

const BLOCKED_RANGES: ReadonlyArray<readonly [label: string, family: Family, cidrs: readonly string[]]> = [
  ['unspecified', 'ipv4', ['0.0.0.0/8']],
  ['unspecified', 'ipv6', ['::/128']],
  ['loopback', 'ipv4', ['127.0.0.0/8']],
  ['loopback', 'ipv6', ['::1/128']],
  ['cloud metadata', 'ipv4', ['169.254.169.254/32']],
  ['cloud metadata', 'ipv6', ['fd00:ec2::254/128']],
  ['private', 'ipv4', ['10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16']],
  ['carrier-grade NAT', 'ipv4', ['100.64.0.0/10']],
  ['link-local', 'ipv4', ['169.254.0.0/16']],
  ['link-local', 'ipv6', ['fe80::/10']],
  ['site-local', 'ipv6', ['fec0::/10']],
  ['unique-local', 'ipv6', ['fc00::/7']],
  ['multicast', 'ipv4', ['224.0.0.0/4']],
  ['multicast', 'ipv6', ['ff00::/8']],
  ['broadcast', 'ipv4', ['255.255.255.255/32']],
  ['reserved', 'ipv4', ['240.0.0.0/4', '192.0.0.0/24', '198.18.0.0/15']],
  ['documentation', 'ipv4', ['192.0.2.0/24', '198.51.100.0/24', '203.0.113.0/24']],
  ['documentation', 'ipv6', ['2001:db8::/32']],
  ['discard', 'ipv6', ['100::/64']],
  ['local-use NAT64', 'ipv6', ['64:ff9b:1::/48']],
];

function listOf(family: Family, cidrs: readonly string[]): net.BlockList {
  const list = new net.BlockList();
  for (const cidr of cidrs) {
    const [address = '', prefix = ''] = cidr.split('/');
    list.addSubnet(address, Number(prefix), family);
  }
  return list;
}

// One BlockList per label, so a refusal can say which kind of range the address is in.
const BLOCKED = BLOCKED_RANGES.map(([label, family, cidrs]) => ({ label, list: listOf(family, cidrs) }));

/** The ranges `FERRY_WEBHOOK_ALLOW` opens. */
export interface AllowList {
  /** The ranges as given, normalized to `address/prefix`. */
  readonly ranges: readonly string[];
  readonly list: net.BlockList;
}

/**
 * Parses `FERRY_WEBHOOK_ALLOW`: comma-separated CIDRs (`127.0.0.0/8,::1/128`); a bare address means
 * just that address. Throws an Error naming the bad entry.
 */
export function parseAllowList(text: string | undefined): AllowList {
  const list = new net.BlockList();
  const ranges: string[] = [];
  for (const raw of (text ?? '').split(',')) {
    const entry = raw.trim();
    if (entry === '') continue;
    const slash = entry.indexOf('/');
    const address = slash === -1 ? entry : entry.slice(0, slash);
    const version = net.isIP(address);
    if (version === 0) {
      throw new Error(`"${entry}" is not a CIDR range (like 10.0.0.0/8 or fd00::/8)`);
    }
    const max = version === 4 ? 32 : 128;
    const prefixText = slash === -1 ? String(max) : entry.slice(slash + 1);
    const prefix = Number(prefixText);
    if (!/^\d{1,3}$/.test(prefixText) || prefix > max) {
      throw new Error(`"${entry}" has a bad prefix length; IPv${version} allows 0 to ${max}`);
    }
    list.addSubnet(address, prefix, version === 4 ? 'ipv4' : 'ipv6');
    ranges.push(`${address}/${prefix}`);
  }
  return { ranges, list };
}

/** The 16 bytes of an IPv6 address (zone index dropped), or undefined when it is not one. */
function ipv6Bytes(text: string): Uint8Array | undefined {
  let address = text.split('%')[0] ?? '';
  if (!net.isIPv6(address)) return undefined;
  const lastColon = address.lastIndexOf(':');
  const last = address.slice(lastColon + 1);
  if (last.includes('.')) {
    // A trailing dotted IPv4 (`::ffff:1.2.3.4`) is the last two groups.
    const [a = 0, b = 0, c = 0, d = 0] = last.split('.').map(Number);
    address = `${address.slice(0, lastColon + 1)}${((a << 8) | b).toString(16)}:${((c << 8) | d).toString(16)}`;
  }
  const halves = address.split('::');
  const head = (halves[0] ?? '').split(':').filter((g) => g !== '');
  const rest = (halves[1] ?? '').split(':').filter((g) => g !== '');
  const groups =
    halves.length > 1 ? [...head, ...Array<string>(8 - head.length - rest.length).fill('0'), ...rest] : head;
  const words = groups.map((g) => Number.parseInt(g, 16));
  if (words.length !== 8 || words.some((w) => !Number.isInteger(w) || w < 0 || w > 0xffff)) return undefined;
  const bytes = new Uint8Array(16);
  words.forEach((w, i) => {
    bytes[2 * i] = w >> 8;
    bytes[2 * i + 1] = w & 0xff;
  });
  return bytes;
}

const v4 = (b: Uint8Array, at: number) => `${b[at]}.${b[at + 1]}.${b[at + 2]}.${b[at + 3]}`;
const zero = (b: Uint8Array, from: number, to: number) => b.subarray(from, to).every((x) => x === 0);

/**
 * The IPv4 address an IPv6 address stands for, when it is one of the forms that reach an IPv4 host:
 * IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d), NAT64 (64:ff9b::a.b.c.d) and 6to4
 * (2002:aabb:ccdd::). Such an address is judged by that IPv4 address.
 */
export function embeddedIpv4(address: string): string | undefined {
  const b = ipv6Bytes(address);
  if (!b) return undefined;
  if (zero(b, 0, 10) && b[10] === 0xff && b[11] === 0xff) return v4(b, 12);
  if (zero(b, 0, 12) && !zero(b, 12, 15)) return v4(b, 12); // ::a.b.c.d, but not :: or ::1
  if (b[0] === 0x00 && b[1] === 0x64 && b[2] === 0xff && b[3] === 0x9b && zero(b, 4, 12)) return v4(b, 12);
  if (b[0] === 0x20 && b[1] === 0x02) return v4(b, 2);
  return undefined;
}

/** Why the address must not be contacted (the range's kind), or undefined when it may be. */
export function blockedReason(address: string, allow: AllowList): string | undefined {
  const family: Family = net.isIPv6(address) ? 'ipv6' : 'ipv4';
  const bare = address.split('%')[0] ?? address;
  const inner = family === 'ipv6' ? embeddedIpv4(bare) : undefined;
  if (allow.list.check(bare, family) || (inner !== undefined && allow.list.check(inner, 'ipv4'))) return undefined;
  for (const { label, list } of BLOCKED) {
    if (list.check(bare, family)) return label;
    if (inner !== undefined && list.check(inner, 'ipv4')) return `${label}, as ${inner}`;
  }
  return undefined;
}

/** The attempt's target is in a blocked range: a permanent failure, never retried. */
export class BlockedAddressError extends PermanentDeliveryError {
  override readonly name = 'BlockedAddressError';
  readonly code = 'FERRY_WEBHOOK_ADDRESS_BLOCKED';
  constructor(
    readonly address: string,
    readonly reason: string,
  ) {
    super(`address ${address} is in a blocked range (${reason}); allow it with FERRY_WEBHOOK_ALLOW`);
  }
}

type LookupAll = (hostname: string) => Promise<Array<{ address: string; family: number }>>;

const systemLookup: LookupAll = (hostname) => dns.promises.lookup(hostname, { all: true, verbatim: true });

/**
 * Resolves `hostname` and returns the address to connect to; throws BlockedAddressError when any of
 * the addresses is in a blocked range, and the resolver's error (a network error) when it fails.
 */
export async function resolveSafeAddress(
  hostname: string,
  allow: AllowList,
  lookup: LookupAll = systemLookup,
): Promise<{ address: string; family: 4 | 6 }> {
  const host = hostname.startsWith('[') && hostname.endsWith(']') ? hostname.slice(1, -1) : hostname;
  const literal = net.isIP(host);
  const addresses = literal !== 0 ? [{ address: host, family: literal }] : await lookup(host);
  if (addresses.length === 0) throw Object.assign(new Error(`${host} has no addresses`), { code: 'ENOTFOUND' });
  for (const { address } of addresses) {
    const reason = blockedReason(address, allow);
    if (reason !== undefined) throw new BlockedAddressError(address, reason);
  }
  const first = addresses[0]!;
  return { address: first.address, family: first.family === 6 ? 6 : 4 };
}

export interface GuardedAgentOptions {
  allow: AllowList;
  /** Connect timeout; the whole attempt has its own timeout on top. */
  connectTimeoutMs: number;
  /** For tests: the resolver to use instead of the system's. */
  lookup?: LookupAll;
}

/**
 * An undici Agent whose every new connection goes through the guard: resolve, check every address,
 * connect to the checked address. TLS still verifies the certificate against the URL's host name
 * (undici derives the SNI server name from the Host, not from the address connected to).
 */
export function createGuardedAgent(options: GuardedAgentOptions): Agent {
  const base = buildConnector({ timeout: options.connectTimeoutMs });
  const connect: buildConnector.connector = (opts, callback) => {
    resolveSafeAddress(opts.hostname, options.allow, options.lookup).then(
      ({ address }) => base({ ...opts, hostname: address }, callback),
      (err: unknown) => callback(err instanceof Error ? err : new Error(String(err)), null),
    );
  };
  return new Agent({
    connect,
    // Keep-alive matters for throughput: most deliveries of a burst go to the same few receivers.
    keepAliveTimeout: 4_000,
    keepAliveMaxTimeout: 30_000,
    pipelining: 1,
  });
}
