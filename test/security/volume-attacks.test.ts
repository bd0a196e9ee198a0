/**
 * Issue 27, point 3: the API reads and writes volume files as root on the host, in a folder a function
 * fills as it likes. Each attack is planted by a function in its sandbox (or, where a sandbox cannot make
 * the thing at all, by root on the host, as the strongest attacker), then the API is asked to follow it.
 * Every attack is also tried with its defence switched off (`VOLUME_DEFENCES`, the same code path) and
 * seen to work: the test detects the hole it guards (but the recursive delete's race, see there). Run
 * against both backends: ext4 images (`image`), and folders with btrfs simple quotas (`quota-dir`).
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { volumePaths } from '../../src/volumes/images.js';
import { VOLUME_DEFENCES } from '../../src/volumes/volume-files.js';
import { deployFiles, http, startServer, type TestServer, tempDir } from '../helpers/ferry.js';
import { makeQuotaFs, type QuotaFs } from '../helpers/quota-fs.js';

/** Runs `fn` with one defence off, restoring it whatever happens. */
async function withoutDefence<T>(name: keyof typeof VOLUME_DEFENCES, fn: () => Promise<T>): Promise<T> {
  VOLUME_DEFENCES[name] = false;
  try {
    return await fn();
  } finally {
    VOLUME_DEFENCES[name] = true;
  }
}

const PLANT_APP = `
import fs from 'node:fs';
import { execFileSync } from 'node:child_process';
export function plant({ kind, file, target }) {
  fs.rmSync(file, { force: true, recursive: true });
  if (kind === 'symlink') fs.symlinkSync(target, file);
  else if (kind === 'fifo') execFileSync('mkfifo', [file]);
  else if (kind === 'hardlink') {
    try { fs.linkSync(target, file); } catch (err) { return { ok: false, code: err.code }; }
  } else if (kind === 'mknod') {
    try { execFileSync('mknod', [file, 'c', '1', '1'], { stdio: 'pipe' }); } catch (err) { return { ok: false, code: 'EPERM' }; }
  }
  return { ok: true };
}
`;

for (const backend of ['image', 'quota-dir'] as const) {
  describe(`volume attacks on the host side (${backend})`, () => {
    let server: TestServer;
    let qfs: QuotaFs | undefined;
    let auth: { projectId: string; token: string };
    let victim: { projectId: string; token: string };
    let canaryDir: string;
    const api = (p: string) => `${server.url}/v2/projects/${auth.projectId}/volumes/data${p}`;
    const plant = async (body: Record<string, string>) => {
      const res = await http(`${server.url}/v4/${auth.projectId}/planter/plant`, {
        method: 'POST',
        token: auth.token,
        body,
      });
      assert.equal(res.status, 200, res.text);
      return res.json.result as { ok: boolean; code?: string };
    };
    /** Where a volume's files are on the host: an image's mount point, or the quota-dir volume's folder. */
    const rootOf = (projectId: string, name: string) =>
      backend === 'image'
        ? volumePaths(server.services.config.volumesDir, projectId, name).mountPoint
        : path.join(server.services.config.volumesDir, projectId, name);
    const mountPoint = () => rootOf(auth.projectId, 'data');

    before(async () => {
      if (backend === 'quota-dir') {
        const made = await makeQuotaFs('btrfs');
        assert.ok(typeof made !== 'string', String(made));
        qfs = made;
        server = await startServer({ volumesDir: made.volumesDir, volumesBackend: 'quota-dir' });
      } else {
        server = await startServer();
      }
      auth = await server.bootstrap(`attacker-${randomBytes(4).toString('hex')}`);
      victim = await server.bootstrap(`victim-${randomBytes(4).toString('hex')}`);
      for (const [who, name] of [
        [auth, 'data'],
        [victim, 'secret'],
      ] as const) {
        const res = await http(`${server.url}/v2/projects/${who.projectId}/volumes`, {
          method: 'POST',
          token: who.token,
          body: { name, size_mib: 32 },
        });
        assert.equal(res.status, 201, res.text);
      }
      const put = await http(`${server.url}/v2/projects/${victim.projectId}/volumes/secret/file?path=key.txt`, {
        method: 'PUT',
        token: victim.token,
        body: Buffer.from('victim-secret'),
      });
      assert.equal(put.status, 201);
      await deployFiles(server, auth, 'planter', {
        'ferry.toml': '[app]\nname = "planter"\n\n[[volumes]]\nname = "data"\nmount = "/data"\n',
        'main.mjs': PLANT_APP,
      });
      canaryDir = await tempDir('ferry-canary-');
      await fs.writeFile(path.join(canaryDir, 'canary.txt'), 'host file');
    });

    after(async () => {
      await server?.close();
      await fs.rm(canaryDir, { recursive: true, force: true });
      await qfs?.close();
      const loops = execFileSync('losetup', ['-a'], { encoding: 'utf8' });
      assert.ok(!loops.includes(server.dataDir), loops);
    });

    it('a symlink to a host file is never read (x -> /etc/shadow)', async () => {
      assert.deepEqual(await plant({ kind: 'symlink', file: '/data/x', target: '/etc/shadow' }), { ok: true });
      const res = await http(api('/file?path=x'), { token: auth.token });
      assert.equal(res.status, 422, res.text);
      assert.equal(res.json.error.code, 'FERRY_VOLUME_FILE_REFUSED');
      // Listed as a link, never followed.
      const list = await http(api('/files'), { token: auth.token });
      assert.deepEqual(
        list.json.entries.filter((e: { name: string }) => e.name === 'x').map((e: { type: string }) => e.type),
        ['link'],
      );
      const leak = await withoutDefence('noFollow', () => http(api('/file?path=x'), { token: auth.token }));
      assert.equal(leak.status, 200, 'with the defence off the attack works');
      assert.match(leak.text, /^root:/);
    });

    it('a symlinked folder on the way is never entered (d -> /etc, then d/passwd)', async () => {
      await plant({ kind: 'symlink', file: '/data/d', target: '/etc' });
      const res = await http(api('/file?path=d/passwd'), { token: auth.token });
      assert.equal(res.status, 422, res.text);
      const list = await http(api('/files?path=d'), { token: auth.token });
      assert.equal(list.status, 422);
      const leak = await withoutDefence('noFollow', () => http(api('/files?path=d'), { token: auth.token }));
      assert.equal(leak.status, 200);
      assert.ok(leak.json.entries.some((e: { name: string }) => e.name === 'passwd'));
    });

    it('another project’s volume is not reachable through a link', async () => {
      const theirs = rootOf(victim.projectId, 'secret');
      await plant({ kind: 'symlink', file: '/data/steal', target: `${theirs}/key.txt` });
      const res = await http(api('/file?path=steal'), { token: auth.token });
      assert.equal(res.status, 422);
      const leak = await withoutDefence('noFollow', () => http(api('/file?path=steal'), { token: auth.token }));
      assert.equal(leak.text, 'victim-secret');
      // Nor by a path: ".." is refused before anything opens.
      const dots = await http(api(`/file?path=${encodeURIComponent('../../x')}`), { token: auth.token });
      assert.equal(dots.status, 400);
      assert.equal(dots.json.error.code, 'FERRY_VOLUME_PATH_INVALID');
    });

    it('a FIFO does not block the API', async () => {
      await plant({ kind: 'fifo', file: '/data/fifo' });
      const res = await http(api('/file?path=fifo'), { token: auth.token });
      assert.equal(res.status, 422, res.text);
      // With the defence off the open waits for a writer: the request does not end on its own.
      const hung = withoutDefence('regularOnly', () =>
        fetch(api('/file?path=fifo'), { headers: { authorization: `Bearer ${auth.token}` } }).then((r) => r.status),
      );
      const outcome = await Promise.race([hung, new Promise((r) => setTimeout(() => r('blocked'), 3000))]);
      assert.equal(outcome, 'blocked');
      // Release the blocked open (a writer comes and goes) so the server can close.
      const writer = await fs.open(path.join(mountPoint(), 'fifo'), fs.constants.O_WRONLY);
      await writer.close();
      await hung.catch(() => {});
    });

    it('a device node is refused (the sandbox cannot make one; planted by root, the mount is nodev)', async () => {
      assert.deepEqual(await plant({ kind: 'mknod', file: '/data/mem' }), { ok: false, code: 'EPERM' });
      execFileSync('mknod', [path.join(mountPoint(), 'mem'), 'c', '1', '3']);
      const res = await http(api('/file?path=mem'), { token: auth.token });
      assert.equal(res.status, 422, res.text);
      const options = execFileSync('findmnt', ['-no', 'OPTIONS', '-T', mountPoint()], { encoding: 'utf8' });
      assert.match(options, /\bnodev\b/);
      await fs.rm(path.join(mountPoint(), 'mem'));
    });

    it('a hard link to a host file cannot be made; one inside the volume is not read', async () => {
      assert.deepEqual(await plant({ kind: 'hardlink', file: '/data/pw', target: '/etc/passwd' }), {
        ok: false,
        code: 'EXDEV',
      });
      const put = await http(api('/file?path=a.txt'), { method: 'PUT', token: auth.token, body: Buffer.from('a') });
      assert.equal(put.status, 201);
      await plant({ kind: 'hardlink', file: '/data/b.txt', target: '/data/a.txt' });
      const res = await http(api('/file?path=b.txt'), { token: auth.token });
      assert.equal(res.status, 422, res.text);
      const read = await withoutDefence('singleLink', () => http(api('/file?path=b.txt'), { token: auth.token }));
      assert.equal(read.text, 'a');
    });

    it('an upload replaces a planted link instead of writing through it', async () => {
      const canary = path.join(canaryDir, 'canary.txt');
      await plant({ kind: 'symlink', file: '/data/up', target: canary });
      const res = await http(api('/file?path=up'), { method: 'PUT', token: auth.token, body: Buffer.from('upload') });
      assert.equal(res.status, 201, res.text);
      assert.equal(await fs.readFile(canary, 'utf8'), 'host file');
      const list = await http(api('/files'), { token: auth.token });
      assert.equal(list.json.entries.find((e: { name: string }) => e.name === 'up').type, 'file');
      await plant({ kind: 'symlink', file: '/data/up', target: canary });
      await withoutDefence('renameUploads', () =>
        http(api('/file?path=up'), { method: 'PUT', token: auth.token, body: Buffer.from('overwritten') }),
      );
      assert.equal(await fs.readFile(canary, 'utf8'), 'overwritten', 'with the defence off the attack works');
      await fs.writeFile(canary, 'host file');
    });

    it('a recursive delete removes a planted folder link, not what it points to', async () => {
      const canary = path.join(canaryDir, 'canary.txt');
      await plant({ kind: 'symlink', file: '/data/tree', target: canaryDir });
      const res = await http(api('/file?path=tree&recursive=true'), { method: 'DELETE', token: auth.token });
      assert.equal(res.status, 204, res.text);
      assert.equal(await fs.readFile(canary, 'utf8'), 'host file');
      // Deeper: a real folder holding a link to the host folder.
      const put = await http(api('/file?path=deep/keep.txt'), {
        method: 'PUT',
        token: auth.token,
        body: Buffer.from('k'),
      });
      assert.equal(put.status, 201);
      await plant({ kind: 'symlink', file: '/data/deep/host', target: canaryDir });
      const res2 = await http(api('/file?path=deep&recursive=true'), { method: 'DELETE', token: auth.token });
      assert.equal(res2.status, 204);
      assert.equal(await fs.readFile(canary, 'utf8'), 'host file');
      // No switched-off run here: a link is told from a folder by lstat and by the entry's type before any
      // open, and O_NOFOLLOW on the open only closes the race of a folder swapped for a link in between,
      // which a test cannot win on demand.
    });
  });
}
