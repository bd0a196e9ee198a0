/**
 * Images in a cluster (issue 26, point 4): an app whose image was built by one worker (a `run` step on a
 * base from a registry on loopback) is served by a worker that started later with an empty data directory,
 * after the builder is gone and the registry is stopped: the image reached it through the cluster's image
 * shelf (the JetStream object store's `<cluster>_images` bucket), by digest, verified, and unpacked there.
 * No registry has a built image, so the shelf is the only way it can have come. Deployed through one
 * gateway, called through the other.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startCluster, type TestCluster } from './helpers/cluster.js';
import { http, tempDir, waitFor } from './helpers/ferry.js';
import { makeBaseImage, requireImageTools, startRegistry, type TestRegistry } from './helpers/registry.js';

describe('images in a cluster', () => {
  let registry: TestRegistry;
  let cluster: TestCluster;
  let work: string;
  let base: string;

  before(async () => {
    await requireImageTools();
    work = await tempDir('ferry-cluster-images-');
    const image = await makeBaseImage(path.join(work, 'image'), { files: { 'etc/os-release': 'ID=cluster-image' } });
    registry = await startRegistry();
    await registry.push(image, 'ferry-test/cluster:1');
    base = `${registry.host}/ferry-test/cluster:1`;
    cluster = await startCluster({
      gateways: 2,
      workers: 1,
      env: { FERRY_INSECURE_REGISTRIES: registry.host },
    });
  });

  after(async () => {
    await cluster?.close();
    await registry?.stop();
    await fs.rm(work, { recursive: true, force: true });
  });

  it('a worker that never saw the image fetches it from the image shelf and serves the app', async () => {
    const [viaA, viaB] = cluster.gateways;
    assert.ok(viaA && viaB);
    const { projectId, token } = cluster.auth;
    await cluster.deploy(
      'imaged',
      {
        'ferry.toml': `[app]\nname = "imaged"\n\n[image]\nbase = "${base}"\nrun = ["mkdir -p /opt/made && echo made-on-the-builder > /opt/made/marker"]\n`,
        'main.ts': `import fs from 'node:fs';
export function run() {
  return { marker: fs.readFileSync('/opt/made/marker', 'utf8').trim(), os: fs.readFileSync('/etc/os-release', 'utf8') };
}
`,
      },
      viaA,
    );
    const call = (gateway: { url: string }) =>
      http(`${gateway.url}/v4/${projectId}/imaged/run`, { method: 'POST', token, body: {} });
    const first = await call(viaA);
    assert.equal(first.status, 200, first.text);
    assert.deepEqual(first.json.result, { marker: 'made-on-the-builder', os: 'ID=cluster-image' });

    // Nothing but the shelf can give the image now: the registry is gone, and so is the worker that built it.
    await registry.stop();
    const builder = cluster.workers[0]!;
    const fresh = await cluster.start('worker-fresh', 'worker');
    const unpacked = path.join(fresh.dataDir, 'images', 'unpacked');
    assert.deepEqual(
      (await fs.readdir(unpacked).catch(() => [])).filter((n) => /^[a-f0-9]{64}$/.test(n)),
      [],
      'the new worker starts without the image',
    );
    await builder.stop();
    const served = await waitFor(
      async () => {
        const res = await call(viaB);
        return res.status === 200 ? res : undefined;
      },
      60_000,
      `the app served by the new worker (${fresh.output().slice(-2000)})`,
    );
    assert.deepEqual(served.json.result, { marker: 'made-on-the-builder', os: 'ID=cluster-image' });
    const builds = await http(`${viaB.url}/v2/projects/${projectId}/apps/imaged/builds`, { token });
    const digest = builds.json.builds[0].image.digest as string;
    assert.ok(
      (await fs.readdir(unpacked)).includes(digest.slice('sha256:'.length)),
      'the new worker unpacked the built image',
    );
  });
});
