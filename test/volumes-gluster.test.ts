/**
 * Volumes shared by several machines (issue 27, point 4) on a real distributed filesystem: a GlusterFS
 * volume with directory quotas, mounted twice through FUSE on this machine as two machines would mount it
 * (test/helpers/gluster.ts). A gateway and the first worker use one mount as FERRY_VOLUMES_DIR, the second
 * worker the other (FERRY_VOLUMES_BACKEND=quota-dir): replicas on both workers write and read one volume at
 * the same time, a write past size_mib fails inside the function on either worker (EDQUOT) and an upload
 * past it is 413, `ferry doctor` through the other mount finds every node's marker and the volume's use, a
 * delete removes the folder and its quota, and a GlusterFS volume with lazy quota checks, or mounted without
 * ACLs, is refused with the reason.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { probeQuotaDirSupport } from '../src/volumes/quota-dirs.js';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, runCli, tempDir, waitFor } from './helpers/ferry.js';
import { type GlusterVolume, makeGlusterVolume } from './helpers/gluster.js';
import { assertStillPlaced, callApp, fillFromBothWorkers, placeOnTwoWorkers } from './helpers/two-workers.js';

const made = await makeGlusterVolume();
assert.ok(typeof made !== 'string', `a GlusterFS volume: ${made}`);
const volume = made as GlusterVolume;
const dirs = volume.mounts.map((m) => path.join(m, 'volumes')) as [string, string];

describe('volumes on GlusterFS, shared by workers on two mounts', () => {
  let cluster: TestCluster;
  const api = (p: string) => `${cluster.gateways[0]!.url}/v2/projects/${cluster.auth.projectId}${p}`;
  const call = (app: string, fn: string, body: unknown) => callApp(cluster, app, fn, body);

  before(async () => {
    // One replica per worker: the second app cannot start on the worker running the first one's.
    cluster = await startCluster({
      gateways: 1,
      workers: 2,
      env: { FERRY_VOLUMES_BACKEND: 'quota-dir', FERRY_WORKER_MAX_REPLICAS: '1' },
      envOf: (label) => ({ FERRY_VOLUMES_DIR: label === 'worker-2' ? dirs[1] : dirs[0] }),
    });
  });

  after(async () => {
    await cluster?.close();
    await volume.close();
  });

  it('replicas on two workers, on two mounts, use one volume at once, bounded together', async () => {
    const token = cluster.auth.token;
    const created = await http(api('/volumes'), { method: 'POST', token, body: { name: 'data', size_mib: 32 } });
    assert.equal(created.status, 201, created.text);
    // The folder and its quota, seen through the other mount.
    const folderB = path.join(dirs[1], cluster.auth.projectId, 'data');
    assert.equal((await fs.stat(folderB)).mode & 0o7777, 0o2770);
    assert.equal((await fs.statfs(folderB)).blocks * (await fs.statfs(folderB)).bsize, 32 * 1024 * 1024);

    const placed = await placeOnTwoWorkers(cluster);

    const wrote = await call('left', 'write', { file: '/data/from-left.txt', text: 'written on one worker' });
    assert.equal(wrote.status, 200, wrote.text);
    const read = await call('right', 'read', { file: '/data/from-left.txt' });
    assert.equal(read.status, 200, read.text);
    assert.equal(read.json.result.text, 'written on one worker');
    const back = await call('right', 'tryWrite', { file: '/data/from-left.txt', text: 'overwritten on the other' });
    assert.deepEqual(back.json.result, { ok: true });
    const readBack = await call('left', 'read', { file: '/data/from-left.txt' });
    assert.equal(readBack.json.result.text, 'overwritten on the other');
    // The API (the gateway, on the first mount) and the second mount on the host see the same file.
    const viaApi = await http(api('/volumes/data/file?path=from-left.txt'), { token });
    assert.equal(viaApi.text, 'overwritten on the other');
    assert.equal(await fs.readFile(path.join(folderB, 'from-left.txt'), 'utf8'), 'overwritten on the other');
    await assertStillPlaced(cluster, placed);

    // One bound for both workers' replicas together: EDQUOT inside the function.
    await fillFromBothWorkers(cluster);
    // What the volume holds: 12 MiB were left, and GlusterFS lets through what its client's write-behind
    // had taken when the limit was reached (0 to 2.4 MiB here; with performance.write-behind off, 0.1).
    const sizes = await Promise.all(['one.bin', 'two.bin'].map((f) => fs.stat(path.join(folderB, f))));
    const held = sizes.reduce((sum, st) => sum + st.size, 0);
    assert.ok(held <= 36 * 1024 * 1024, `${held} bytes in a 32 MiB volume`);
    const use = await http(api('/volumes/data'), { token });
    assert.ok(use.json.used_bytes > 19 * 1024 * 1024, use.text);
    assert.ok(use.json.free_bytes < 13 * 1024 * 1024, use.text);
    // Through the API: refused before anything is written.
    const upload = await http(api('/volumes/data/file?path=big.bin'), {
      method: 'PUT',
      token,
      body: Buffer.alloc(16 * 1024 * 1024),
    });
    assert.equal(upload.status, 413, upload.text);
    assert.equal(upload.json.error.code, 'FERRY_VOLUME_FULL');
  });

  it('ferry doctor through the other mount finds every node’s marker and the volume’s use', async () => {
    const env = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: cluster.gateways[0]!.url,
      FERRY_TOKEN: cluster.auth.token,
      FERRY_PROJECT: cluster.auth.projectId,
      FERRY_VOLUMES_BACKEND: 'quota-dir',
    };
    const json = await runCli(['doctor', '--json'], { ...env, FERRY_VOLUMES_DIR: dirs[1] });
    const report = JSON.parse(json.stdout);
    assert.equal(report.volumes.available, true, json.stdout);
    assert.deepEqual(report.volumes.not_shared_with, []);
    const text = await runCli(['doctor'], { ...env, FERRY_VOLUMES_DIR: dirs[1] });
    assert.match(text.stdout, /Volumes\s+available: GlusterFS directory quotas on volume ferryt/);
    assert.match(text.stdout, new RegExp(`${cluster.auth.projectId}/data: [0-9.]+ MiB used of 32\\.0 MiB`));
  });

  it('deletes the volume: its folder and its quota go', async () => {
    const token = cluster.auth.token;
    for (const app of ['left', 'right']) {
      const del = await http(api(`/apps/${app}`), { method: 'DELETE', token });
      assert.equal(del.status, 200, del.text);
    }
    const deleted = await http(api('/volumes/data'), { method: 'DELETE', token });
    assert.equal(deleted.status, 204, deleted.text);
    const gone = (dir: string) =>
      fs.stat(path.join(dir, cluster.auth.projectId, 'data')).then(
        () => false,
        () => true,
      );
    // Through the gateway's mount at once; through the other within its FUSE entry timeout (1 s).
    assert.ok(await gone(dirs[0]), 'gone through the mount that deleted it');
    await waitFor(async () => (await gone(dirs[1])) || undefined, 10_000, 'the delete through the other mount');
    const list = spawnSync('gluster', ['--mode=script', 'volume', 'quota', volume.name, 'list'], { encoding: 'utf8' });
    assert.doesNotMatch(list.stdout, new RegExp(`${cluster.auth.projectId}/data`), list.stdout);
  });

  it('refuses a GlusterFS volume whose quotas are checked lazily, or mounted without ACLs', async () => {
    const set = (option: string, value: string) =>
      spawnSync('gluster', ['--mode=script', 'volume', 'quota', volume.name, option, value], { encoding: 'utf8' });
    assert.equal(set('hard-timeout', '5').status, 0);
    try {
      const lax = await probeQuotaDirSupport(dirs[1], true, false);
      assert.equal(lax.available, false);
      assert.match(lax.reasons.join('; '), /checks its quotas lazily \(hard-timeout not 0\).*hard-timeout 0/);
    } finally {
      assert.equal(set('hard-timeout', '0').status, 0);
    }
    const strict = await probeQuotaDirSupport(dirs[1], true, false);
    assert.ok(strict.available, strict.reasons.join('; '));
    // A third mount without -o acl: the group's default ACL cannot be set, so apps could not share files.
    const bare = await tempDir('ferry-gluster-bare-');
    const source = `${os.hostname()}:/${volume.name}`;
    const mounted = spawnSync('mount', ['-t', 'glusterfs', source, bare], { encoding: 'utf8' });
    assert.equal(mounted.status, 0, mounted.stderr);
    try {
      const noAcl = await probeQuotaDirSupport(path.join(bare, 'volumes'), true, false);
      assert.equal(noAcl.available, false);
      assert.match(noAcl.reasons.join('; '), /without ACLs .*mount it with -o acl/);
    } finally {
      spawnSync('umount', [bare]);
      await fs.rm(bare, { recursive: true, force: true });
    }
  });
});
