/**
 * Calls between the nodes of a cluster (a gateway to a worker's internal listener) carry a token signed
 * with the cluster key, `cluster.key` in the shared keys directory (made at first start, like jwt.key):
 *
 *   authorization: Ferry-Cluster v1.<node id, base64url>.<expiry, ms since the epoch>.<HMAC-SHA256, base64url>
 *
 * The HMAC covers `v1.<node id>.<expiry>`. A token is good until its expiry (a minute after it is made; a
 * node makes a new one every half of that) and is a bearer token until then: run the internal network
 * privately (or with TLS, `https://` advertise URLs), as the keys directory is the cluster's only secret.
 * Clocks may differ by up to CLOCK_SKEW_MS; a token claiming to last longer than the ttl plus that is
 * refused, so a stolen key's tokens cannot be minted for a far future.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';

export const CLUSTER_KEY_FILE = 'cluster.key';
const SCHEME = 'Ferry-Cluster ';
const VERSION = 'v1';
const CLOCK_SKEW_MS = 30_000;
/** A header longer than this is not one of ours (node ids are short). */
const MAX_HEADER = 1024;
/** Verified tokens kept (a few per node of the cluster); past this the cache starts afresh. */
const VERIFIED_KEEP = 1024;

export interface ClusterAuth {
  /** The value for an `authorization` header on a call to another node (cached, renewed internally). */
  header(): string;
  /** The calling node's id when `header` is a valid cluster token; null otherwise. Never throws. */
  verify(header: string | undefined): { nodeId: string } | null;
}

export function createClusterAuth(options: {
  key: Uint8Array;
  nodeId: string;
  ttlMs?: number;
  /** The clock (tests). */
  now?: () => number;
}): ClusterAuth {
  const clock = options.now ?? Date.now;
  const ttlMs = options.ttlMs ?? 60_000;
  const key = Buffer.from(options.key);
  const sign = (payload: string) => createHmac('sha256', key).update(payload).digest();
  let cached: { value: string; renewAt: number } | undefined;
  const verified = new Map<string, { nodeId: string; expires: number }>();

  return {
    header() {
      const now = clock();
      if (cached && now < cached.renewAt) return cached.value;
      const expires = now + ttlMs;
      const payload = `${VERSION}.${Buffer.from(options.nodeId).toString('base64url')}.${expires}`;
      const value = `${SCHEME}${payload}.${sign(payload).toString('base64url')}`;
      cached = { value, renewAt: now + ttlMs / 2 };
      return value;
    },
    verify(header) {
      if (typeof header !== 'string') return null;
      // A node sends the same token for half a minute: one HMAC per token, not per call. Only tokens that
      // checked out are kept (at most VERIFIED_KEEP), each until its own expiry.
      const known = verified.get(header);
      if (known) {
        if (known.expires >= clock() - CLOCK_SKEW_MS) return { nodeId: known.nodeId };
        verified.delete(header);
        return null;
      }
      const result = check(header);
      if (result) {
        if (verified.size >= VERIFIED_KEEP) verified.clear();
        verified.set(header, result);
        return { nodeId: result.nodeId };
      }
      return null;
    },
  };

  function check(header: string): { nodeId: string; expires: number } | null {
    if (header.length > MAX_HEADER || !header.startsWith(SCHEME)) return null;
    const parts = header.slice(SCHEME.length).split('.');
    if (parts.length !== 4) return null;
    const [version, node, expiresText, mac] = parts as [string, string, string, string];
    if (version !== VERSION || !/^\d{1,16}$/.test(expiresText) || !/^[A-Za-z0-9_-]{1,200}$/.test(node)) return null;
    const expected = sign(`${version}.${node}.${expiresText}`);
    let given: Buffer;
    try {
      given = Buffer.from(mac, 'base64url');
    } catch {
      return null;
    }
    if (given.length !== expected.length || !timingSafeEqual(given, expected)) return null;
    const expires = Number(expiresText);
    const now = clock();
    if (expires < now - CLOCK_SKEW_MS || expires > now + ttlMs + CLOCK_SKEW_MS) return null;
    const nodeId = Buffer.from(node, 'base64url').toString('utf8');
    return nodeId ? { nodeId, expires } : null;
  }
}
