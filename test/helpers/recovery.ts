/**
 * Recovery in tests (cluster/recovery.ts): a live node's lease to judge others by, and a server taking
 * over a build another let go of.
 */
import assert from 'node:assert/strict';
import type { NodeLease } from '../../src/cluster/node.js';
import type { TestServer } from './ferry.js';

/** A live node's lease, steady long enough to judge the others by theirs (nothing renews it). */
export function judgingLease(id: string): NodeLease {
  return {
    id,
    ttlMs: 4000,
    start: async () => {},
    close: async () => {},
    canJudge: () => true,
    refresh: async () => {},
  };
}

/**
 * `to` takes over build `buildId`, let go of by a server whose lease ended, and holds it after this.
 * `to`'s own periodic sweep, and the claim that follows it, may get there first: the calls here make sure
 * one of each has run since, and the assertion is on where the build went, not on which call moved it.
 */
export async function takeOverBuild(to: TestServer, buildId: string): Promise<void> {
  await to.services.recovery.sweep();
  await to.services.pipeline.recover();
  const taken = await to.services.store
    .selectFrom('builds')
    .select('owner')
    .where('id', '=', buildId)
    .executeTakeFirstOrThrow();
  assert.equal(taken.owner, to.services.node.id, 'the build is held by the server that took it over');
}
