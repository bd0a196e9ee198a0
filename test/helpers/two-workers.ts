/**
 * Two apps mounting one volume, each kept on its own worker of a test cluster whose workers take one
 * replica each (FERRY_WORKER_MAX_REPLICAS=1): the set-up of the tests that prove replicas on two workers use
 * one volume at once (test/cluster-volumes.test.ts on btrfs, test/volumes-gluster.test.ts on GlusterFS).
 */
import assert from 'node:assert/strict';
import type { TestCluster } from './cluster.js';
import { http, waitFor } from './ferry.js';
import { volumeApp } from './volume-app.js';

/** An app of `name` writing and reading under /data; one replica, kept (min_replicas) on the worker it starts on. */
export function sharedApp(name: string): Record<string, string> {
  return volumeApp(
    name,
    '[scaling]\nmin_replicas = 1\nmax_replicas = 1\n\n[[volumes]]\nname = "data"\nmount = "/data"\n',
  );
}

/** The worker URL running replicas of each app, from the cluster view. */
export async function homes(cluster: TestCluster): Promise<Map<string, string>> {
  const res = await http(`${cluster.gateways[0]!.url}/v2/cluster`, { token: cluster.auth.token });
  const out = new Map<string, string>();
  for (const node of res.json?.nodes ?? []) {
    for (const a of (node.apps ?? []) as Array<{ app_id: string }>) out.set(a.app_id, node.url);
  }
  return out;
}

/** A call of `fn` of `app` through the first gateway. */
export function callApp(cluster: TestCluster, app: string, fn: string, body: unknown) {
  const { projectId, token } = cluster.auth;
  return http(`${cluster.gateways[0]!.url}/v4/${projectId}/${app}/${fn}`, { method: 'POST', token, body });
}

/**
 * Deploys `left` and `right` (sharedApp, volume `data`) and waits until each has its replica, on different
 * workers; returns where each runs.
 */
export async function placeOnTwoWorkers(cluster: TestCluster): Promise<Map<string, string>> {
  await cluster.deploy('left', sharedApp('left'));
  await waitFor(async () => (await homes(cluster)).has('left'), 60_000, 'the replica of left');
  await cluster.deploy('right', sharedApp('right'));
  // Its home may be the worker that is full: a call starts its replica on the worker with room.
  const started = await callApp(cluster, 'right', 'write', { file: '/data/right-started.txt', text: 'x' });
  assert.equal(started.status, 200, started.text);
  const placed = await waitFor(
    async () => {
      const h = await homes(cluster);
      return h.has('left') && h.has('right') ? h : undefined;
    },
    60_000,
    'a replica of each app',
  );
  assert.notEqual(placed.get('left'), placed.get('right'), 'the two apps run on different workers');
  return placed;
}

/** Both replicas ran all along, each on the worker it was placed on. */
export async function assertStillPlaced(cluster: TestCluster, placed: Map<string, string>): Promise<void> {
  const still = await homes(cluster);
  assert.equal(still.get('left'), placed.get('left'));
  assert.equal(still.get('right'), placed.get('right'));
}

/**
 * One bound for both workers' replicas together: `left` writes 20 MiB into the 32 MiB volume, then `right`
 * tries 20 more, which a quota stops with EDQUOT inside the function. Returns how many MiB `right` wrote.
 */
export async function fillFromBothWorkers(cluster: TestCluster): Promise<number> {
  const first = await callApp(cluster, 'left', 'fill', { file: '/data/one.bin', mib: 20 });
  assert.deepEqual(first.json.result, { ok: true, written: 20 });
  const second = await callApp(cluster, 'right', 'fill', { file: '/data/two.bin', mib: 20 });
  assert.equal(second.json.result.ok, false, JSON.stringify(second.json.result));
  assert.equal(second.json.result.code, 'EDQUOT');
  assert.ok(second.json.result.written < 20, JSON.stringify(second.json.result));
  return second.json.result.written;
}
