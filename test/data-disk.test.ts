/**
 * A data folder that is the root of a filesystem of its own (issue 43, point 3): the usual production
 * layout, a dedicated disk mounted at the data folder, played by a tmpfs mounted there. No folder outside
 * the data folder is then on its filesystem, so build views, build steps' stages and image unpacking use
 * `<data>/staging` (src/sandbox/views.ts): builds work, replicas run, and a sandbox's mountinfo still does
 * not name the data folder's host path. Runs as root (mounting, and the sandboxes' own uids).
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { makeBaseImage, requireImageTools, startRegistry, type TestRegistry } from './helpers/registry.js';

describe('a data folder that is the root of its own filesystem', () => {
  let root: string;
  let data: string;
  let server: TestServer | undefined;
  let auth: { projectId: string; token: string };
  let registry: TestRegistry | undefined;
  let base: string;

  before(async () => {
    await requireImageTools();
    root = await tempDir('ferry-data-disk-');
    // As /var/lib is: the sandboxes' uids may pass through on their way to what is bound.
    await fs.chmod(root, 0o711);
    data = path.join(root, 'data');
    await fs.mkdir(data);
    const mounted = spawnSync('mount', ['-t', 'tmpfs', '-o', 'size=256m', 'tmpfs', data], { encoding: 'utf8' });
    assert.equal(mounted.status, 0, `mount -t tmpfs failed: ${mounted.stderr}`);
    const image = await makeBaseImage(path.join(root, 'image'), { files: { 'etc/os-release': 'ID=ferry-disk-image' } });
    registry = await startRegistry();
    await registry.push(image, 'ferry-test/disk:1');
    base = `${registry.host}/ferry-test/disk:1`;
    server = await startServer({ dataDir: data, env: { FERRY_INSECURE_REGISTRIES: registry.host } });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
    await registry?.stop();
    for (let i = 0; i < 20 && spawnSync('umount', [data]).status !== 0; i++)
      await new Promise((r) => setTimeout(r, 250));
    if (spawnSync('mountpoint', ['-q', data]).status === 0) spawnSync('umount', ['-l', data]);
    await fs.rm(root, { recursive: true, force: true });
  });

  it('builds and runs an app, and the replica’s mountinfo does not name the data folder', async () => {
    const body =
      "import { readFileSync } from 'node:fs';\nexport function run() { return { mountinfo: readFileSync('/proc/self/mountinfo', 'utf8') }; }\n";
    await deployFiles(server!, auth, 'probe', { 'ferry.toml': '[app]\nname = "probe"\n', 'main.ts': body });
    const res = await http(`${server!.url}/v4/${auth.projectId}/probe/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    const mountinfo = String(res.json.result.mountinfo);
    assert.ok(!mountinfo.includes(root), `the sandbox's mountinfo names the data folder:\n${mountinfo}`);
    // The cost, as documented: the bind's source is shown relative to the data folder's filesystem.
    assert.match(mountinfo, / \/staging\/ferry-view-[^ ]+ \/app /, mountinfo);
    const stat = await fs.stat(data);
    assert.equal(stat.mode & 0o777, 0o711, 'the data folder is searchable by the sandboxes, not listable');
    for (const name of ['keys', 'builds', 'tmp', 'cache', 'artifacts']) {
      assert.equal((await fs.stat(path.join(data, name))).mode & 0o777, 0o700, `${name}/ stays 0700`);
    }
    assert.equal((await fs.stat(path.join(data, 'ferry.db'))).mode & 0o077, 0, 'ferry.db is for root alone');
  });

  it('unpacks a base image and builds its run steps there, and runs a function on it', async () => {
    await deployFiles(
      server!,
      auth,
      'on-image',
      {
        'ferry.toml': `[app]\nname = "on-image"\n\n[image]\nbase = "${base}"\nrun = ["echo made-by-a-step > /made"]\n`,
        'main.ts':
          "import fs from 'node:fs';\nexport function run() { return { os: fs.readFileSync('/etc/os-release', 'utf8'), made: fs.readFileSync('/made', 'utf8') }; }\n",
      },
      { timeoutMs: 120_000 },
    );
    const res = await http(`${server!.url}/v4/${auth.projectId}/on-image/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { os: 'ID=ferry-disk-image', made: 'made-by-a-step\n' });
  });

  it('ferry doctor says which staging folder sandboxes are given their folders from', async () => {
    const doctor = await runCli(['doctor'], { FERRY_DATA_DIR: data });
    assert.equal(doctor.code, 0, doctor.stderr);
    assert.match(doctor.stdout, new RegExp(`Staging folder +${data}/staging \\(inside the data folder`));
    const json = JSON.parse((await runCli(['doctor', '--json'], { FERRY_DATA_DIR: data })).stdout);
    assert.deepEqual(json.staging, { dir: path.join(data, 'staging'), inside_data_folder: true });
    // A data folder beside others on its filesystem stages outside it, as before.
    const plain = await tempDir('ferry-data-plain-');
    try {
      const outside = JSON.parse((await runCli(['doctor', '--json'], { FERRY_DATA_DIR: plain })).stdout);
      assert.equal(outside.staging.inside_data_folder, false);
    } finally {
      await fs.rm(plain, { recursive: true, force: true });
    }
  });
});
