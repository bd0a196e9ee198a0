/** Tokens between the nodes of a cluster (src/cluster/cluster-auth.ts): what is accepted and what is not. */
import assert from 'node:assert/strict';
import { createHmac, randomBytes } from 'node:crypto';
import { describe, it } from 'node:test';
import { createClusterAuth } from '../src/cluster/cluster-auth.js';

const key = randomBytes(32);

function forge(secret: Uint8Array, nodeId: string, expires: number): string {
  const payload = `v1.${Buffer.from(nodeId).toString('base64url')}.${expires}`;
  return `Ferry-Cluster ${payload}.${createHmac('sha256', Buffer.from(secret)).update(payload).digest('base64url')}`;
}

describe('cluster authentication', () => {
  it('accepts a node’s own token on another node with the same key, and names the node', () => {
    const a = createClusterAuth({ key, nodeId: 'gw-1-100-aabbccdd' });
    const b = createClusterAuth({ key, nodeId: 'worker-2-200-eeff0011' });
    assert.deepEqual(b.verify(a.header()), { nodeId: 'gw-1-100-aabbccdd' });
    // Cached: the same header while it is fresh.
    assert.equal(a.header(), a.header());
  });

  it('refuses a token signed with another key', () => {
    const other = createClusterAuth({ key: randomBytes(32), nodeId: 'intruder' });
    const mine = createClusterAuth({ key, nodeId: 'worker' });
    assert.equal(mine.verify(other.header()), null);
    assert.equal(mine.verify(forge(randomBytes(32), 'intruder', Date.now() + 10_000)), null);
  });

  it('refuses expired tokens and tokens claiming to last longer than the ttl allows', () => {
    const auth = createClusterAuth({ key, nodeId: 'worker', ttlMs: 60_000 });
    assert.deepEqual(auth.verify(forge(key, 'gw', Date.now() + 30_000)), { nodeId: 'gw' });
    assert.equal(auth.verify(forge(key, 'gw', Date.now() - 120_000)), null);
    assert.equal(auth.verify(forge(key, 'gw', Date.now() + 3_600_000)), null);
  });

  it('refuses a token whose node id was changed after signing', () => {
    const auth = createClusterAuth({ key, nodeId: 'gw' });
    const parts = auth.header().split('.');
    parts[1] = Buffer.from('someone-else').toString('base64url');
    assert.equal(auth.verify(parts.join('.')), null);
  });

  it('never throws on junk, and refuses it', () => {
    const auth = createClusterAuth({ key, nodeId: 'worker' });
    const junk = [
      undefined,
      '',
      'Bearer abc',
      'Ferry-Cluster ',
      'Ferry-Cluster v1',
      'Ferry-Cluster v1...',
      'Ferry-Cluster v2.Z3c.99999999999999.AAAA',
      'Ferry-Cluster v1.Z3c.notanumber.AAAA',
      'Ferry-Cluster v1.Z3c.1.AAAA.extra',
      `Ferry-Cluster v1.${'A'.repeat(5000)}.1.AAAA`,
      'Ferry-Cluster v1.Z3c.99999999999999999999999.AAAA',
      'Ferry-Cluster v1.!!!.1.@@@',
      'x'.repeat(100_000),
    ];
    for (const value of junk) assert.equal(auth.verify(value), null, String(value).slice(0, 40));
  });

  it('checks a token once, and refuses it once it has expired even though it checked out before', () => {
    const key = randomBytes(32);
    let now = 1_000_000_000_000;
    const auth = createClusterAuth({ key, nodeId: 'wk', now: () => now });
    const token = forge(key, 'gw', now + 60_000);
    assert.deepEqual(auth.verify(token), { nodeId: 'gw' });
    now += 60_000;
    assert.deepEqual(auth.verify(token), { nodeId: 'gw' }, 'within the clock skew allowed');
    now += 31_000;
    assert.equal(auth.verify(token), null);
    assert.equal(auth.verify(token), null);
  });
});
