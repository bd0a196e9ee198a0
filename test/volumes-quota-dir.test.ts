/**
 * Volumes as folders bounded by the filesystem's own quota (FERRY_VOLUMES_BACKEND=quota-dir), on a real
 * filesystem loop-mounted for the test: a volume is a folder, two apps share it, a write past size_mib fails
 * inside the function for every replica together (EDQUOT on btrfs, ENOSPC on XFS) and an upload past it is
 * 413, used_bytes comes from the quota, a subvolume a function makes cannot escape the bound (btrfs), and
 * a delete removes the folder and its quota. Run on btrfs with simple quotas, and on XFS with prjquota
 * where the kernel has XFS quotas (CI's has not: that run is skipped, saying so). Without the mechanism
 * (XFS without prjquota, btrfs with quotas off or with full qgroups, a filesystem with none) volumes are
 * refused with the reason, by the API and by `ferry doctor`.
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { probeQuotaDirSupport } from '../src/volumes/quota-dirs.js';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { makeQuotaFs, type QuotaFs } from './helpers/quota-fs.js';
import { volumeApp } from './helpers/volume-app.js';

const filesystems = {
  btrfs: await makeQuotaFs('btrfs'),
  xfs: await makeQuotaFs('xfs'),
};
assert.ok(typeof filesystems.btrfs !== 'string', `btrfs with simple quotas: ${filesystems.btrfs}`);

for (const kind of ['btrfs', 'xfs'] as const) {
  const made = filesystems[kind];
  const full = kind === 'btrfs' ? 'EDQUOT' : 'ENOSPC';
  describe(`volumes as folders with ${kind} quotas`, { skip: typeof made === 'string' ? made : false }, () => {
    const qfs = made as QuotaFs;
    let server: TestServer;
    let auth: { projectId: string; token: string };
    const api = (p: string) => `${server.url}/v2/projects/${auth.projectId}${p}`;
    const call = (app: string, fn: string, body: unknown) =>
      http(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });
    const folder = (name: string) => path.join(qfs.volumesDir, auth.projectId, name);
    const rowOf = (name: string) =>
      server.services.store
        .selectFrom('volumes')
        .select(['gid', 'quota_id', 'backend'])
        .where('project_id', '=', auth.projectId)
        .where('name', '=', name)
        .executeTakeFirstOrThrow();

    before(async () => {
      server = await startServer({ volumesDir: qfs.volumesDir, volumesBackend: 'quota-dir' });
      assert.ok(server.services.volumes.support.available, server.services.volumes.support.reasons.join('; '));
      auth = await server.bootstrap(`qd-${randomBytes(4).toString('hex')}`);
    });

    after(async () => {
      await server?.close();
      await qfs.close();
    });

    it('makes a volume as a folder bounded by its quota, with used_bytes from the quota', async () => {
      const created = await http(api('/volumes'), {
        method: 'POST',
        token: auth.token,
        body: { name: 'models', size_mib: 64 },
      });
      assert.equal(created.status, 201, created.text);
      const dup = await http(api('/volumes'), {
        method: 'POST',
        token: auth.token,
        body: { name: 'models', size_mib: 64 },
      });
      assert.equal(dup.status, 409);
      const row = await rowOf('models');
      assert.equal(row.backend, 'quota-dir');
      assert.ok(Number(row.quota_id) > 0);
      const stat = await fs.stat(folder('models'));
      assert.ok(stat.isDirectory());
      assert.equal(stat.mode & 0o7777, 0o2770);
      assert.equal(stat.uid, 0);
      assert.equal(stat.gid, Number(row.gid));
      const one = await http(api('/volumes/models'), { token: auth.token });
      assert.equal(one.status, 200, one.text);
      assert.ok(one.json.used_bytes < 1024 * 1024, one.text);
      assert.ok(one.json.free_bytes > 60 * 1024 * 1024 && one.json.free_bytes <= 64 * 1024 * 1024, one.text);
    });

    it('shares one volume between replicas of two apps, the API seeing their files at once', async () => {
      await deployFiles(
        server,
        auth,
        'writer',
        volumeApp('writer', '[[volumes]]\nname = "models"\nmount = "/models"\n'),
      );
      await deployFiles(
        server,
        auth,
        'reader',
        volumeApp('reader', '[[volumes]]\nname = "models"\nmount = "/mnt/m"\n'),
      );
      const w = await call('writer', 'write', { file: '/models/a/hello.txt', text: 'written by writer' });
      assert.equal(w.status, 200, w.text);
      const r = await call('reader', 'read', { file: '/mnt/m/a/hello.txt' });
      assert.equal(r.json.result.text, 'written by writer');
      const w2 = await call('reader', 'tryWrite', { file: '/mnt/m/a/hello.txt', text: 'overwritten' });
      assert.deepEqual(w2.json.result, { ok: true });
      const viaApi = await http(api('/volumes/models/file?path=a/hello.txt'), { token: auth.token });
      assert.equal(viaApi.text, 'overwritten');
      const put = await http(api('/volumes/models/file?path=up/b.txt'), {
        method: 'PUT',
        token: auth.token,
        body: Buffer.from('b'),
      });
      assert.equal(put.status, 201, put.text);
      const w3 = await call('writer', 'tryWrite', { file: '/models/up/b.txt', text: 'replaced' });
      assert.deepEqual(w3.json.result, { ok: true });
      // The same files on the host, in the volume's folder.
      assert.equal(await fs.readFile(path.join(folder('models'), 'up/b.txt'), 'utf8'), 'replaced');
    });

    it(`stops writes at size_mib inside the function for every replica together (${full}) and through the API (413)`, async () => {
      const created = await http(api('/volumes'), {
        method: 'POST',
        token: auth.token,
        body: { name: 'small', size_mib: 32 },
      });
      assert.equal(created.status, 201, created.text);
      const mount = '[[volumes]]\nname = "small"\nmount = "/data"\n';
      await deployFiles(server, auth, 'filler', volumeApp('filler', mount));
      await deployFiles(server, auth, 'filler2', volumeApp('filler2', mount));
      const first = await call('filler', 'fill', { file: '/data/one.bin', mib: 20 });
      assert.deepEqual(first.json.result, { ok: true, written: 20 });
      // Another app's replica (another host uid) meets the same bound.
      const second = await call('filler2', 'fill', { file: '/data/two.bin', mib: 20 });
      assert.equal(second.json.result.ok, false, JSON.stringify(second.json.result));
      assert.equal(second.json.result.code, full);
      assert.ok(second.json.result.written < 13, JSON.stringify(second.json.result));
      const use = await http(api('/volumes/small'), { token: auth.token });
      assert.ok(use.json.used_bytes > 19 * 1024 * 1024, use.text);
      assert.ok(use.json.free_bytes < 13 * 1024 * 1024, use.text);
      // Declared too large: refused before anything is written.
      const declared = await http(api('/volumes/small/file?path=big.bin'), {
        method: 'PUT',
        token: auth.token,
        body: Buffer.alloc(16 * 1024 * 1024),
      });
      assert.equal(declared.status, 413, declared.text);
      assert.equal(declared.json.error.code, 'FERRY_VOLUME_FULL');
      // Without a length (chunked): the quota's error, and the partial file is gone.
      await call('filler2', 'remove', { file: '/data/two.bin' });
      const chunked = await fetch(api('/volumes/small/file?path=big.bin'), {
        method: 'PUT',
        headers: { authorization: `Bearer ${auth.token}` },
        body: new ReadableStream({
          start(controller) {
            for (let i = 0; i < 24; i++) controller.enqueue(new Uint8Array(1024 * 1024).fill(7));
            controller.close();
          },
        }),
        duplex: 'half',
      } as RequestInit);
      const body = (await chunked.json()) as { error: { code: string } };
      assert.equal(chunked.status, 413);
      assert.equal(body.error.code, 'FERRY_VOLUME_FULL');
      const listing = await http(api('/volumes/small/files'), { token: auth.token });
      assert.deepEqual(
        listing.json.entries.map((e: { name: string }) => e.name),
        ['one.bin'],
      );
    });

    if (kind === 'btrfs') {
      it('keeps a subvolume made in the volume without privilege inside its bound', async () => {
        const created = await http(api('/volumes'), {
          method: 'POST',
          token: auth.token,
          body: { name: 'nest', size_mib: 32 },
        });
        assert.equal(created.status, 201, created.text);
        // Any user who may write a folder may make a subvolume in it; under full qgroups it would be
        // unlimited. Made here by an unprivileged uid with the volume's group, as a replica is.
        const { gid } = await rowOf('nest');
        execFileSync('setpriv', [
          '--reuid=1879000123',
          '--regid=1879000123',
          `--groups=${gid}`,
          '--inh-caps=-all',
          'sh',
          '-c',
          'btrfs subvolume create "$1" && chmod 0777 "$1"',
          'sh',
          path.join(folder('nest'), 'nested'),
        ]);
        await deployFiles(server, auth, 'nester', volumeApp('nester', '[[volumes]]\nname = "nest"\nmount = "/data"\n'));
        const nested = await call('nester', 'fill', { file: '/data/nested/big.bin', mib: 40 });
        assert.equal(nested.status, 200, nested.text);
        assert.equal(nested.json.result.ok, false, JSON.stringify(nested.json.result));
        assert.equal(nested.json.result.code, 'EDQUOT');
        assert.ok(nested.json.result.written < 33, JSON.stringify(nested.json.result));
        // A delete removes the nested subvolume with the rest.
        const del = await http(api('/volumes/nest?force=true'), { method: 'DELETE', token: auth.token });
        assert.equal(del.status, 204, del.text);
        await assert.rejects(fs.stat(folder('nest')), { code: 'ENOENT' });
      });
    }

    it('shows the volumes and their use in ferry doctor', async () => {
      const home = await tempDir('ferry-home-');
      const out = await runCli(['doctor'], {
        HOME: home,
        FERRY_VOLUMES_DIR: qfs.volumesDir,
        FERRY_VOLUMES_BACKEND: 'quota-dir',
      });
      assert.match(
        out.stdout,
        kind === 'btrfs' ? /Volumes\s+available: btrfs simple quotas/ : /Volumes\s+available: XFS project quotas/,
      );
      assert.match(out.stdout, new RegExp(`${auth.projectId}/small: [0-9.]+ MiB used of 32\\.0 MiB`));
    });

    it('deletes a volume: its folder and its quota go, and the name can be used again', async () => {
      for (const app of ['filler', 'filler2']) {
        const del = await http(api(`/apps/${app}`), { method: 'DELETE', token: auth.token });
        assert.equal(del.status, 200, del.text);
      }
      const { quota_id: quotaId } = await rowOf('small');
      const deleted = await http(api('/volumes/small'), { method: 'DELETE', token: auth.token });
      assert.equal(deleted.status, 204, deleted.text);
      await assert.rejects(fs.stat(folder('small')), { code: 'ENOENT' });
      if (kind === 'btrfs') {
        const groups = execFileSync('btrfs', ['qgroup', 'show', '--raw', '-re', qfs.mount], { encoding: 'utf8' });
        assert.ok(!groups.split('\n').some((l) => l.startsWith(`1/${quotaId} `)), groups);
      } else {
        const report = execFileSync('xfs_quota', ['-x', '-c', 'report -p -N -b', qfs.mount], { encoding: 'utf8' });
        assert.ok(!new RegExp(`^#?${quotaId}\\s+\\d+\\s+\\d+\\s+[1-9]`, 'm').test(report), report);
      }
      const again = await http(api('/volumes'), {
        method: 'POST',
        token: auth.token,
        body: { name: 'small', size_mib: 32 },
      });
      assert.equal(again.status, 201, again.text);
      const fresh = await http(api('/volumes/small'), { token: auth.token });
      assert.ok(fresh.json.used_bytes < 1024 * 1024, fresh.text);
      const gone = await http(api('/volumes/small'), { method: 'DELETE', token: auth.token });
      assert.equal(gone.status, 204);
    });
  });
}

describe('the quota-dir backend without its mechanism', () => {
  const made: QuotaFs[] = [];
  after(async () => {
    for (const q of made) await q.close();
  });

  async function mountOf(kind: 'btrfs' | 'xfs', quotas: 'full' | 'off'): Promise<QuotaFs> {
    const q = await makeQuotaFs(kind, { quotas });
    assert.ok(typeof q !== 'string', String(q));
    made.push(q);
    return q;
  }

  it('refuses volumes on XFS mounted without prjquota, in the API and in ferry doctor', async () => {
    const q = await mountOf('xfs', 'off');
    const support = await probeQuotaDirSupport(q.volumesDir, true, true);
    assert.equal(support.available, false);
    assert.match(support.reasons.join('; '), /mounted without project quotas: mount it with -o prjquota/);
    const server = await startServer({ volumesDir: q.volumesDir, volumesBackend: 'quota-dir' });
    try {
      const auth = await server.bootstrap(`nq-${randomBytes(4).toString('hex')}`);
      const res = await http(`${server.url}/v2/projects/${auth.projectId}/volumes`, {
        method: 'POST',
        token: auth.token,
        body: { name: 'models', size_mib: 32 },
      });
      assert.equal(res.status, 503, res.text);
      assert.equal(res.json.error.code, 'FERRY_VOLUMES_UNAVAILABLE');
      assert.match(res.json.error.message, /prjquota/);
    } finally {
      await server.close();
    }
    const out = await runCli(['doctor'], {
      HOME: await tempDir('ferry-home-'),
      FERRY_VOLUMES_DIR: q.volumesDir,
      FERRY_VOLUMES_BACKEND: 'quota-dir',
    });
    assert.match(
      out.stdout,
      /Volumes\s+NOT AVAILABLE \(FERRY_VOLUMES_BACKEND=quota-dir; volumes are refused, never unbounded\): .*prjquota/,
    );
  });

  it('refuses btrfs with quotas off, and with full qgroups (a subvolume would escape the bound)', async () => {
    const off = await mountOf('btrfs', 'off');
    const a = await probeQuotaDirSupport(off.volumesDir, true, true);
    assert.equal(a.available, false);
    assert.match(a.reasons.join('; '), /quotas are off/);
    const fullQ = await mountOf('btrfs', 'full');
    const b = await probeQuotaDirSupport(fullQ.volumesDir, true, true);
    assert.equal(b.available, false);
    assert.match(b.reasons.join('; '), /full qgroups .*simple quotas/);
  });

  it('refuses a filesystem without folder quotas', async () => {
    const dir = path.join(await tempDir('ferry-plain-'), 'volumes');
    const support = await probeQuotaDirSupport(dir, true, true);
    assert.equal(support.available, false);
    assert.match(support.reasons.join('; '), /has no folder quota Ferry can set/);
  });
});
