/**
 * Volumes (issue 27) on one server with real parts: filesystem images on loop devices, bubblewrap replicas
 * writing and reading, the size limit hit from inside a function (ENOSPC) and through the API (413), two
 * apps of one project sharing a volume, another project refused, read-only mounts, a deploy naming a
 * volume the project lacks, delete refused while mounted, and space freed by a delete. Every loop device
 * attached is detached by `close()` (checked at the end).
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { MOUNT_ROOT, probeVolumeSupport } from '../src/volumes/images.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { volumeApp } from './helpers/volume-app.js';

const support = await probeVolumeSupport(true);
assert.ok(
  support.available,
  `volumes unavailable here (scripts/setup-system.sh installs what they need): ${support.reasons.join('; ')}`,
);

function losetupLines(pattern: string): string[] {
  const out = execFileSync('losetup', ['-a'], { encoding: 'utf8' });
  return out.split('\n').filter((l) => l.includes(pattern));
}

describe('volumes', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let other: { projectId: string; token: string };
  const api = (p: string) => `${server.url}/v2/projects/${auth.projectId}${p}`;
  const call = (app: string, fn: string, body: unknown) =>
    http(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap(`vol-${randomBytes(4).toString('hex')}`);
    other = await server.bootstrap(`other-${randomBytes(4).toString('hex')}`);
  });

  after(async () => {
    await server?.close();
    // Everything this server attached is detached: no loop device names its data directory.
    assert.deepEqual(losetupLines(server.dataDir), []);
  });

  it('creates, lists and shows a volume; refuses a duplicate, a bad name and sizes past the settings', async () => {
    const created = await http(api('/volumes'), {
      method: 'POST',
      token: auth.token,
      body: { name: 'models', size_mib: 64 },
    });
    assert.equal(created.status, 201, created.text);
    assert.equal(created.json.name, 'models');
    assert.equal(created.json.size_mib, 64);
    const dup = await http(api('/volumes'), {
      method: 'POST',
      token: auth.token,
      body: { name: 'models', size_mib: 64 },
    });
    assert.equal(dup.status, 409);
    assert.equal(dup.json.error.code, 'FERRY_VOLUME_EXISTS');
    const bad = await http(api('/volumes'), {
      method: 'POST',
      token: auth.token,
      body: { name: 'Bad_Name', size_mib: 64 },
    });
    assert.equal(bad.status, 400);
    const huge = await http(api('/volumes'), {
      method: 'POST',
      token: auth.token,
      body: { name: 'huge', size_mib: server.services.config.volumeMaxMiB + 1 },
    });
    assert.equal(huge.status, 400);
    assert.equal(huge.json.error.code, 'FERRY_VOLUME_TOO_LARGE');
    const list = await http(api('/volumes'), { token: auth.token });
    assert.deepEqual(
      list.json.volumes.map((v: { name: string }) => v.name),
      ['models'],
    );
    const one = await http(api('/volumes/models'), { token: auth.token });
    assert.equal(one.status, 200);
    assert.ok(one.json.used_bytes >= 0 && one.json.free_bytes > 40 * 1024 * 1024, one.text);
    assert.deepEqual(one.json.mounted_by, []);
  });

  it('uploads, lists, downloads and deletes files through the API', async () => {
    const data = randomBytes(300_000);
    const put = await http(api('/volumes/models/file?path=weights/a.bin'), {
      method: 'PUT',
      token: auth.token,
      body: data,
      headers: { 'content-type': 'application/octet-stream' },
    });
    assert.equal(put.status, 201, put.text);
    assert.deepEqual(put.json, { path: '/weights/a.bin', bytes: data.length });
    const root = await http(api('/volumes/models/files?path=/'), { token: auth.token });
    assert.deepEqual(
      root.json.entries.map((e: { name: string; type: string }) => [e.name, e.type]),
      [['weights', 'folder']],
    );
    const folder = await http(api('/volumes/models/files?path=weights'), { token: auth.token });
    assert.equal(folder.json.entries[0].size, data.length);
    const res = await fetch(api('/volumes/models/file?path=weights/a.bin'), {
      headers: { authorization: `Bearer ${auth.token}` },
    });
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('content-length'), String(data.length));
    assert.ok(Buffer.from(await res.arrayBuffer()).equals(data));
    const missing = await http(api('/volumes/models/file?path=weights/none.bin'), { token: auth.token });
    assert.equal(missing.status, 404);
    assert.equal(missing.json.error.code, 'FERRY_VOLUME_FILE_NOT_FOUND');
    const dotdot = await http(api('/volumes/models/file?path=weights/../../x'), { token: auth.token });
    assert.equal(dotdot.status, 400);
    assert.equal(dotdot.json.error.code, 'FERRY_VOLUME_PATH_INVALID');
    const notEmpty = await http(api('/volumes/models/file?path=weights'), { method: 'DELETE', token: auth.token });
    assert.equal(notEmpty.status, 409);
    const put2 = await http(api('/volumes/models/file?path=weights/b.bin'), {
      method: 'PUT',
      token: auth.token,
      body: Buffer.from('b'),
    });
    assert.equal(put2.status, 201);
    const gone = await http(api('/volumes/models/file?path=weights/b.bin'), { method: 'DELETE', token: auth.token });
    assert.equal(gone.status, 204);
  });

  it('refuses a deploy mounting a volume the project does not have, naming it', async () => {
    const { zipFiles } = await import('./helpers/app-zip.js');
    const zip = await zipFiles(volumeApp('lost', '[[volumes]]\nname = "nope"\nmount = "/data"\n'));
    const res = await http(api('/apps/lost/builds'), {
      method: 'POST',
      token: auth.token,
      body: zip,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.code, 'FERRY_BUILD_VOLUME_MISSING');
    assert.match(res.json.error.message, /"nope"/);
    const badMount = await zipFiles(volumeApp('lost', '[[volumes]]\nname = "models"\nmount = "/tmp/x"\n'));
    const res2 = await http(api('/apps/lost/builds'), {
      method: 'POST',
      token: auth.token,
      body: badMount,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res2.status, 400);
    assert.equal(res2.json.error.code, 'FERRY_CONFIG_INVALID');
    assert.match(res2.json.error.message, /volumes\.0\.mount/);
  });

  it('shares one volume between replicas of two apps, the API seeing their files at once', async () => {
    await deployFiles(server, auth, 'writer', volumeApp('writer', '[[volumes]]\nname = "models"\nmount = "/models"\n'));
    await deployFiles(
      server,
      auth,
      'reader',
      volumeApp('reader', '[[volumes]]\nname = "models"\nmount = "/mnt/shared"\nread_only = false\n'),
    );
    const w = await call('writer', 'write', { file: '/models/from-writer/hello.txt', text: 'written by writer' });
    assert.equal(w.status, 200, w.text);
    const r = await call('reader', 'read', { file: '/mnt/shared/from-writer/hello.txt' });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.result.text, 'written by writer');
    // The other app (another host uid) may replace and remove what the first one made.
    const w2 = await call('reader', 'tryWrite', { file: '/mnt/shared/from-writer/hello.txt', text: 'overwritten' });
    assert.deepEqual(w2.json.result, { ok: true });
    const viaApi = await http(api('/volumes/models/file?path=from-writer/hello.txt'), { token: auth.token });
    assert.equal(viaApi.text, 'overwritten');
    // A file the API uploaded is writable by a replica too.
    const w3 = await call('writer', 'tryWrite', { file: '/models/weights/a.bin', text: 'replaced' });
    assert.deepEqual(w3.json.result, { ok: true });
    const one = await http(api('/volumes/models'), { token: auth.token });
    assert.deepEqual(one.json.mounted_by.sort(), ['reader', 'writer']);
  });

  it('runs examples/volume-model, which loads its model from a volume', async () => {
    const dir = path.join(REPO_ROOT, 'examples', 'volume-model');
    const model = await fs.readFile(path.join(dir, 'model.json'));
    const put = await http(api('/volumes/models/file?path=tiny/model.json'), {
      method: 'PUT',
      token: auth.token,
      body: model,
    });
    assert.equal(put.status, 201, put.text);
    const files: Record<string, string> = {};
    for (const f of ['ferry.toml', 'main.ts']) files[f] = await fs.readFile(path.join(dir, f), 'utf8');
    await deployFiles(server, auth, 'volume-model', files);
    const res = await call('volume-model', 'run', { x: [1, 2, 3] });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { model: 'tiny-linear', y: 4.75 });
  });

  it('refuses writes on a read-only mount', async () => {
    await deployFiles(
      server,
      auth,
      'ro',
      volumeApp('ro', '[[volumes]]\nname = "models"\nmount = "/models"\nread_only = true\n'),
    );
    const r = await call('ro', 'read', { file: '/models/from-writer/hello.txt' });
    assert.equal(r.json.result.text, 'overwritten');
    const w = await call('ro', 'tryWrite', { file: '/models/ro.txt', text: 'x' });
    assert.deepEqual(w.json.result, { ok: false, code: 'EROFS' });
  });

  it('stops writes at size_mib inside the function (ENOSPC, every replica together) and through the API (413)', async () => {
    const created = await http(api('/volumes'), {
      method: 'POST',
      token: auth.token,
      body: { name: 'small', size_mib: 32 },
    });
    assert.equal(created.status, 201);
    await deployFiles(server, auth, 'filler', volumeApp('filler', '[[volumes]]\nname = "small"\nmount = "/data"\n'));
    const first = await call('filler', 'fill', { file: '/data/one.bin', mib: 20 });
    assert.deepEqual(first.json.result, { ok: true, written: 20 });
    const second = await call('filler', 'fill', { file: '/data/two.bin', mib: 20 });
    assert.equal(second.json.result.ok, false);
    assert.equal(second.json.result.code, 'ENOSPC');
    assert.ok(second.json.result.written < 12, JSON.stringify(second.json.result));
    // Declared too large: refused before anything is written.
    const declared = await http(api('/volumes/small/file?path=big.bin'), {
      method: 'PUT',
      token: auth.token,
      body: Buffer.alloc(16 * 1024 * 1024),
    });
    assert.equal(declared.status, 413);
    assert.equal(declared.json.error.code, 'FERRY_VOLUME_FULL');
    // Answered before its body was read: the rest is read and dropped and the connection kept, so a caller
    // still sending reads this answer (test/bad-input.test.ts shows it on a raw connection).
    assert.notEqual(declared.headers.get('connection'), 'close');
    // Without a length (chunked): the filesystem's ENOSPC, and the partial file is gone.
    await call('filler', 'remove', { file: '/data/two.bin' });
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
    // Refused midway, its body torn down with the failed write: that connection closes after the answer.
    assert.equal(chunked.headers.get('connection'), 'close');
    const listing = await http(api('/volumes/small/files'), { token: auth.token });
    assert.deepEqual(
      listing.json.entries.map((e: { name: string }) => e.name),
      ['one.bin'],
    );
  });

  it('never reaches another project’s volume by name', async () => {
    const theirs = await http(`${server.url}/v2/projects/${other.projectId}/volumes/models`, { token: other.token });
    assert.equal(theirs.status, 404);
    assert.equal(theirs.json.error.code, 'FERRY_VOLUME_NOT_FOUND');
    const files = await http(`${server.url}/v2/projects/${other.projectId}/volumes/models/files`, {
      token: other.token,
    });
    assert.equal(files.status, 404);
    // Their token on this project's path: refused by the project check.
    const cross = await http(api('/volumes/models/files'), { token: other.token });
    assert.equal(cross.status, 403);
    // A deploy of theirs naming this project's volume fails as a volume they lack.
    const { zipFiles } = await import('./helpers/app-zip.js');
    const zip = await zipFiles(volumeApp('thief', '[[volumes]]\nname = "models"\nmount = "/models"\n'));
    const res = await http(`${server.url}/v2/projects/${other.projectId}/apps/thief/builds`, {
      method: 'POST',
      token: other.token,
      body: zip,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.json.error.code, 'FERRY_BUILD_VOLUME_MISSING');
  });

  it('refuses to delete a mounted volume without force; an app delete keeps volumes; a delete frees the space', async () => {
    const refused = await http(api('/volumes/small'), { method: 'DELETE', token: auth.token });
    assert.equal(refused.status, 409);
    assert.equal(refused.json.error.code, 'FERRY_VOLUME_IN_USE');
    assert.match(refused.json.error.message, /filler/);
    const delApp = await http(api('/apps/filler'), { method: 'DELETE', token: auth.token });
    assert.equal(delApp.status, 200, delApp.text);
    const still = await http(api('/volumes/small'), { token: auth.token });
    assert.equal(still.status, 200);
    assert.ok(still.json.used_bytes > 19 * 1024 * 1024);
    const image = `${server.services.config.volumesDir}/${auth.projectId}/small.img`;
    const allocated = (await fs.stat(image)).blocks * 512;
    assert.ok(allocated > 19 * 1024 * 1024, `image allocates ${allocated}`);
    const deleted = await http(api('/volumes/small'), { method: 'DELETE', token: auth.token });
    assert.equal(deleted.status, 204, deleted.text);
    await assert.rejects(fs.stat(image), { code: 'ENOENT' });
    // The loop device lets go once the last mount of it is gone: the deleted app's replicas stop on their own
    // time (after their runs, within the grace period), and their mount namespaces hold it until then.
    await waitFor(async () => losetupLines(image).length === 0, 60_000, `the loop device of ${image} detached`);
    const gone = await http(api('/volumes/small'), { token: auth.token });
    assert.equal(gone.status, 404);
  });

  it('deletes a mounted volume with force=true, stopping the replicas that mount it', async () => {
    // A replica of writer runs, binding the volume.
    const before = await call('writer', 'write', { file: '/models/last.txt', text: 'before the delete' });
    assert.equal(before.status, 200, before.text);
    const writerReplicas = () =>
      server.services.replicas
        .pools()
        .filter((p) => p.build.projectId === auth.projectId && p.build.appId === 'writer')
        .reduce((n, p) => n + p.liveReplicas, 0);
    assert.ok(writerReplicas() > 0);
    const forced = await http(api('/volumes/models?force=true'), { method: 'DELETE', token: auth.token });
    assert.equal(forced.status, 204, forced.text);
    // Its replicas stop (the defence off, they go on writing into the detached filesystem).
    await waitFor(async () => writerReplicas() === 0, 30_000, 'the writer replicas stopped after the forced delete');
    // The next call starts no replica on a volume that is gone: it fails, naming the volume.
    const after = await call('writer', 'write', { file: '/models/last.txt', text: 'after the delete' });
    assert.notEqual(after.status, 200, after.text);
    assert.match(after.text, /models/);
    const list = await http(api('/volumes'), { token: auth.token });
    assert.deepEqual(list.json.volumes, []);
    void MOUNT_ROOT;
  });
});
