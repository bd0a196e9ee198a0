/**
 * Volumes in a cluster (issue 27, point 4): a gateway and two workers on one machine sharing one
 * FERRY_VOLUMES_DIR (what an NFS or CephFS mount at the same path gives several machines). A file written
 * by a replica on one worker is read by a replica on the other; `ferry doctor` finds every live node's
 * marker in the shared folder, and warns when pointed at a folder that is not the shared one. With
 * FERRY_VOLUMES_BACKEND=quota-dir (folders on btrfs with simple quotas), replicas on both workers use one
 * volume at the same time, which an image (one machine's at a time) cannot give several machines.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, runCli, tempDir, waitFor } from './helpers/ferry.js';
import { makeQuotaFs, type QuotaFs } from './helpers/quota-fs.js';
import { assertStillPlaced, callApp, fillFromBothWorkers, placeOnTwoWorkers } from './helpers/two-workers.js';

const APP = {
  'ferry.toml':
    '[app]\nname = "shared"\n\n[scaling]\nmax_replicas = 1\n\n[[volumes]]\nname = "data"\nmount = "/data"\n',
  'main.mjs': `
import fs from 'node:fs';
export function write({ text }) { fs.writeFileSync('/data/note.txt', text); return { ok: true }; }
export function read() { return { text: fs.readFileSync('/data/note.txt', 'utf8') }; }
`,
};

describe('volumes in a cluster', () => {
  let cluster: TestCluster;
  let shared: string;

  before(async () => {
    const root = await tempDir('ferry-shared-volumes-');
    shared = path.join(root, 'volumes');
    cluster = await startCluster({ gateways: 1, workers: 2, env: { FERRY_VOLUMES_DIR: shared } });
  });

  after(async () => {
    await cluster?.close();
    const loops = execFileSync('losetup', ['-a'], { encoding: 'utf8' });
    assert.ok(!loops.includes(shared), loops);
  });

  /** The worker whose replicas serve the app now, from the cluster view. */
  async function home(): Promise<string> {
    const gateway = cluster.gateways[0]!;
    return waitFor(
      async () => {
        const res = await http(`${gateway.url}/v2/cluster`, { token: cluster.auth.token });
        const node = (res.json?.nodes ?? []).find((n: { apps?: Array<{ app_id: string }> }) =>
          n.apps?.some((a) => a.app_id === 'shared'),
        );
        return node?.url as string | undefined;
      },
      30_000,
      'a worker with replicas of the app',
    );
  }

  it('a file written by a replica on one worker is read by a replica on the other', async () => {
    const gateway = cluster.gateways[0]!;
    const { projectId, token } = cluster.auth;
    const created = await http(`${gateway.url}/v2/projects/${projectId}/volumes`, {
      method: 'POST',
      token,
      body: { name: 'data', size_mib: 32 },
    });
    assert.equal(created.status, 201, created.text);
    await cluster.deploy('shared', APP);
    const call = (fn: string, body: unknown = {}) =>
      http(`${gateway.url}/v4/${projectId}/shared/${fn}`, { method: 'POST', token, body });
    const wrote = await call('write', { text: 'from the first worker' });
    assert.equal(wrote.status, 200, wrote.text);
    const first = await home();
    const writer = cluster.workers.find((w) => w.url === first)!;
    const reader = cluster.workers.find((w) => w !== writer)!;
    assert.ok(writer && reader);
    // The writer's worker goes away: the app's next replica starts on the other worker.
    await writer.stop();
    const read = await waitFor(
      async () => {
        const res = await call('read');
        return res.status === 200 ? res : undefined;
      },
      60_000,
      'a read on the other worker',
    );
    assert.equal(read.json.result.text, 'from the first worker');
    assert.equal(await home(), reader.url);
    // The API on the gateway sees the same file.
    const viaApi = await http(`${gateway.url}/v2/projects/${projectId}/volumes/data/file?path=note.txt`, { token });
    assert.equal(viaApi.text, 'from the first worker');
  });

  it('ferry doctor finds every live node’s marker in the shared folder, and warns elsewhere', async () => {
    const gateway = cluster.gateways[0]!;
    const env = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: gateway.url,
      FERRY_TOKEN: cluster.auth.token,
      FERRY_PROJECT: cluster.auth.projectId,
    };
    const good = await runCli(['doctor', '--json'], { ...env, FERRY_VOLUMES_DIR: shared });
    const report = JSON.parse(good.stdout);
    assert.equal(report.volumes.available, true);
    assert.deepEqual(report.volumes.not_shared_with, []);
    assert.deepEqual(
      report.volumes.volumes.map((v: { name: string }) => v.name),
      ['data'],
    );
    const elsewhere = await tempDir('ferry-not-shared-');
    const bad = await runCli(['doctor'], { ...env, FERRY_VOLUMES_DIR: elsewhere });
    assert.match(bad.stdout, /is not the folder node\(s\) .+ use: their markers are not in it/);
  });
});

describe('quota-dir volumes in a cluster: replicas on two workers at once', () => {
  let cluster: TestCluster;
  let qfs: QuotaFs;

  before(async () => {
    const made = await makeQuotaFs('btrfs');
    assert.ok(typeof made !== 'string', String(made));
    qfs = made;
    // One replica per worker: the second app cannot start on the worker running the first one's.
    cluster = await startCluster({
      gateways: 1,
      workers: 2,
      env: { FERRY_VOLUMES_DIR: qfs.volumesDir, FERRY_VOLUMES_BACKEND: 'quota-dir', FERRY_WORKER_MAX_REPLICAS: '1' },
    });
  });

  after(async () => {
    await cluster?.close();
    await qfs?.close();
  });

  it('a file written by a replica on one worker is read by a replica on the other while both run', async () => {
    const gateway = cluster.gateways[0]!;
    const { projectId, token } = cluster.auth;
    const created = await http(`${gateway.url}/v2/projects/${projectId}/volumes`, {
      method: 'POST',
      token,
      body: { name: 'data', size_mib: 32 },
    });
    assert.equal(created.status, 201, created.text);
    const call = (app: string, fn: string, body: unknown) => callApp(cluster, app, fn, body);
    const placed = await placeOnTwoWorkers(cluster);
    const wrote = await call('left', 'write', { file: '/data/from-left.txt', text: 'written on the first worker' });
    assert.equal(wrote.status, 200, wrote.text);
    const read = await call('right', 'read', { file: '/data/from-left.txt' });
    assert.equal(read.status, 200, read.text);
    assert.equal(read.json.result.text, 'written on the first worker');
    const back = await call('right', 'write', { file: '/data/from-right.txt', text: 'and back' });
    assert.equal(back.status, 200, back.text);
    const readBack = await call('left', 'read', { file: '/data/from-right.txt' });
    assert.equal(readBack.json.result.text, 'and back');
    // Both replicas ran all along, each on its own worker.
    await assertStillPlaced(cluster, placed);
    // One bound for both workers' replicas together.
    await fillFromBothWorkers(cluster);
    const viaApi = await http(`${gateway.url}/v2/projects/${projectId}/volumes/data`, { token });
    assert.ok(viaApi.json.used_bytes > 19 * 1024 * 1024, viaApi.text);
  });
});
