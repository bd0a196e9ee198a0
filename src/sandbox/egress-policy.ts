/**
 * The egress policy of sandboxes (issue 10, item 2): which destinations a sandbox's traffic may reach
 * through the host. It is data only; veth-network.ts turns it into nftables rules enforced outside the
 * sandbox.
 *
 * Precedence, first match wins:
 *   1. FERRY_EGRESS_DENY (explicit deny)       dropped
 *   2. FERRY_EGRESS_ALLOW (explicit allow)     accepted
 *   3. the built-in deny-list (DEFAULT_DENY)   dropped
 *   4. everything else (the public internet)   accepted and masqueraded
 * The host's own addresses are never reachable whatever the lists say: traffic to them is not forwarded
 * but delivered to the host, where only DNS to Ferry's resolver is let in.
 */
import net from 'node:net';

/** Where the sandboxes' /30 links come from unless FERRY_EGRESS_POOL says otherwise. */
export const DEFAULT_EGRESS_POOL = '10.213.0.0/16';

export interface CidrList {
  /** Normalized `address/prefix` (host bits cleared), IPv4. */
  v4: string[];
  /** Normalized `address/prefix` (host bits cleared), IPv6. */
  v6: string[];
}

export interface EgressPolicy {
  allow: CidrList;
  deny: CidrList;
}

/** Never reachable from a sandbox unless FERRY_EGRESS_ALLOW lists them (the sandbox pool is added too). */
export const DEFAULT_DENY: CidrList = {
  v4: [
    '0.0.0.0/8', // "this network"
    '127.0.0.0/8', // loopback
    '10.0.0.0/8', // RFC 1918
    '172.16.0.0/12',
    '192.168.0.0/16',
    '100.64.0.0/10', // carrier-grade NAT
    '169.254.0.0/16', // link-local, cloud metadata (169.254.169.254)
    '192.0.0.0/24', // IETF protocol assignments
    '198.18.0.0/15', // benchmarking
    '224.0.0.0/4', // multicast
    '240.0.0.0/4', // reserved, broadcast
  ],
  v6: ['::1/128', '::/128', 'fe80::/10', 'fc00::/7', 'fec0::/10', 'ff00::/8'],
};

/**
 * Parses a comma-separated list of CIDRs (`10.0.0.0/8, 2001:db8::/32`); a bare address means just that
 * address. Throws an Error naming `setting` and the bad entry.
 */
export function parseCidrList(text: string | undefined, setting: string): CidrList {
  const out: CidrList = { v4: [], v6: [] };
  for (const raw of (text ?? '').split(',')) {
    const entry = raw.trim();
    if (entry === '') continue;
    out[net.isIPv6(entry.split('/')[0] ?? '') ? 'v6' : 'v4'].push(normalizeCidr(entry, setting));
  }
  return out;
}

/** `10.1.2.3/8` → `10.0.0.0/8`; throws for anything that is not an address with an optional prefix. */
export function normalizeCidr(entry: string, setting: string): string {
  const slash = entry.indexOf('/');
  const address = slash === -1 ? entry : entry.slice(0, slash);
  const version = net.isIP(address);
  const bad = () => new Error(`${setting}: "${entry}" is not a CIDR range (like 203.0.113.0/24 or 2001:db8::/32)`);
  if (version === 0) throw bad();
  const bits = version === 4 ? 32 : 128;
  const prefixText = slash === -1 ? String(bits) : entry.slice(slash + 1);
  if (!/^\d{1,3}$/.test(prefixText)) throw bad();
  const prefix = Number(prefixText);
  if (prefix > bits) throw bad();
  const value = toBigInt(address, version) & mask(prefix, bits);
  return `${fromBigInt(value, version)}/${prefix}`;
}

/** The policy from the settings' text; throws with the setting's name for a bad entry. */
export function parseEgressPolicy(allow: string, deny: string): EgressPolicy {
  return {
    allow: parseCidrList(allow, 'FERRY_EGRESS_ALLOW (--egress-allow)'),
    deny: parseCidrList(deny, 'FERRY_EGRESS_DENY (--egress-deny)'),
  };
}

/** One line for logs and `ferry doctor`. */
export function describePolicy(policy: EgressPolicy): string {
  const list = (cidrs: CidrList) => [...cidrs.v4, ...cidrs.v6].join(', ') || 'nothing';
  return `public internet allowed; loopback, host addresses, private, CGNAT, link-local/metadata and multicast ranges denied; extra allow: ${list(policy.allow)}; extra deny: ${list(policy.deny)} (deny wins over allow)`;
}

function mask(prefix: number, bits: number): bigint {
  const all = (1n << BigInt(bits)) - 1n;
  return prefix === 0 ? 0n : (all << BigInt(bits - prefix)) & all;
}

function toBigInt(address: string, version: 4 | 6 | number): bigint {
  if (version === 4) {
    return address.split('.').reduce((acc, part) => (acc << 8n) | BigInt(Number(part)), 0n);
  }
  // Expand "::" and a trailing dotted IPv4 part into eight groups.
  let text = address;
  const dotted = /(\d+\.\d+\.\d+\.\d+)$/.exec(text);
  if (dotted) {
    const v4 = toBigInt(dotted[1]!, 4);
    text = `${text.slice(0, dotted.index)}${(v4 >> 16n).toString(16)}:${(v4 & 0xffffn).toString(16)}`;
  }
  const [head = '', tail] = text.split('::');
  const headParts = head === '' ? [] : head.split(':');
  const tailParts = tail === undefined || tail === '' ? [] : tail.split(':');
  const zeros = tail === undefined ? [] : new Array<string>(8 - headParts.length - tailParts.length).fill('0');
  return [...headParts, ...zeros, ...tailParts].reduce((acc, part) => (acc << 16n) | BigInt(`0x${part}`), 0n);
}

function fromBigInt(value: bigint, version: 4 | 6 | number): string {
  if (version === 4) {
    return [24n, 16n, 8n, 0n].map((shift) => String((value >> shift) & 0xffn)).join('.');
  }
  const groups: string[] = [];
  for (let shift = 112n; shift >= 0n; shift -= 16n) groups.push(((value >> shift) & 0xffffn).toString(16));
  // Let the platform pick the canonical short form.
  return new URL(`http://[${groups.join(':')}]`).hostname.slice(1, -1);
}

/** IPv4 address ↔ number, for the sandbox pool. */
export function ipv4ToNumber(address: string): number {
  return Number(toBigInt(address, 4));
}

export function numberToIpv4(value: number): string {
  return fromBigInt(BigInt(value), 4);
}
