/**
 * Which registries Ferry's own pulls may connect to. The `[image].base` reference is user input, so a
 * pull is an outgoing request the user aims: without a guard, `base = "127.0.0.1:2375/x"` or a registry
 * whose token realm or blob redirect points at 169.254.169.254 would make the server call its own
 * network (SSRF). The rules are the webhooks' (`webhooks/address-guard.ts`): every connection, the
 * first and every redirect's and token realm's, resolves the name, refuses it when any address is
 * loopback, private, link-local or otherwise internal, and connects to the checked address (no DNS
 * rebinding window).
 *
 * The operator opens exceptions two ways:
 * - `FERRY_INSECURE_REGISTRIES`: comma-separated `host:port` (a local registry, a test's). Such a
 *   registry is reached over plain HTTP and is exempt from the address guard, for exactly that host and
 *   port; a redirect elsewhere is guarded again.
 * - `FERRY_REGISTRY_ALLOW`: CIDR ranges (as `FERRY_WEBHOOK_ALLOW`) a registry may be in although they are
 *   internal, for an HTTPS registry on the private network.
 */
import { Agent, buildConnector } from 'undici';
import { type AllowList, BlockedAddressError, parseAllowList, resolveSafeAddress } from '../webhooks/address-guard.js';

export { BlockedAddressError };

/** The registries reached over plain HTTP without the address guard, as `host:port`, lower-cased. */
export type InsecureRegistries = ReadonlySet<string>;

/**
 * Parses `FERRY_INSECURE_REGISTRIES`: comma-separated `host:port` (the port is required, so the entry
 * names one listener, not every service of a host). Throws an Error naming the bad entry.
 */
export function parseInsecureRegistries(text: string | undefined): InsecureRegistries {
  const set = new Set<string>();
  for (const raw of (text ?? '').split(',')) {
    const entry = raw.trim().toLowerCase();
    if (entry === '') continue;
    const match = entry.match(/^(\[[0-9a-f:.]+\]|[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?):([0-9]{1,5})$/);
    if (!match || Number(match[2]) < 1 || Number(match[2]) > 65535) {
      throw new Error(`"${raw.trim()}" is not host:port (like 127.0.0.1:5000 or registry.local:5000)`);
    }
    set.add(entry);
  }
  return set;
}

export interface RegistryAccess {
  insecure: InsecureRegistries;
  allow: AllowList;
}

/** The access rules from the two settings (validated at start by config.ts, so this does not throw then). */
export function registryAccess(insecureRegistries: string, registryAllow: string): RegistryAccess {
  return { insecure: parseInsecureRegistries(insecureRegistries), allow: parseAllowList(registryAllow) };
}

/** `host:port` of a URL's origin, with the scheme's default port filled in, lower-cased. */
export function originKey(url: URL): string {
  const port = url.port || (url.protocol === 'http:' ? '80' : '443');
  return `${url.hostname.toLowerCase()}:${port}`;
}

/** Whether a registry (`host[:port]` as in a reference) is listed as insecure: plain HTTP, unguarded. */
export function isInsecure(registry: string, access: RegistryAccess): boolean {
  return access.insecure.has(registry.toLowerCase());
}

type LookupAll = (hostname: string) => Promise<Array<{ address: string; family: number }>>;

/**
 * An undici Agent for pulls: a connection to a listed insecure `host:port` goes straight there; any other
 * goes through the address guard (resolve, check every address, connect to the checked one).
 */
export function createRegistryAgent(
  access: RegistryAccess,
  options: { connectTimeoutMs: number; lookup?: LookupAll },
): Agent {
  const base = buildConnector({ timeout: options.connectTimeoutMs });
  const connect: buildConnector.connector = (opts, callback) => {
    const defaultPort = opts.protocol === 'http:' ? '80' : '443';
    const host = opts.hostname.toLowerCase();
    const bracketed = host.includes(':') && !host.startsWith('[') ? `[${host}]` : host;
    if (opts.protocol === 'http:' && access.insecure.has(`${bracketed}:${opts.port || defaultPort}`)) {
      base(opts, callback);
      return;
    }
    resolveSafeAddress(opts.hostname, access.allow, options.lookup).then(
      ({ address }) => base({ ...opts, hostname: address }, callback),
      (err: unknown) => callback(err instanceof Error ? err : new Error(String(err)), null),
    );
  };
  return new Agent({ connect, keepAliveTimeout: 4_000, pipelining: 1 });
}
