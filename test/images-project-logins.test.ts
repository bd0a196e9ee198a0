/**
 * A private image belongs to the projects that can pull it (issue 43, point 5), offline: a real registry
 * on loopback behind htpasswd Basic auth (docker-registry), and an open one.
 *
 * - The image store (images/image-store.ts), with a project's login: project A pulls the private image;
 *   project B, without a login, is refused it by tag and by digest though the node's cache has it; A by
 *   digest is asked of the registry and gets the cache's copy without its layers; B gets it from a
 *   repository of its own (the open registry serves the same image) only after every layer was fetched
 *   and verified there, and from then on the image is public, a restart included.
 * - End to end: project A logs in (the API) and deploys its private image; project B cannot deploy it right
 *   after, by tag or by the digest A's build recorded (the cache warm), nor with a wrong login; with its
 *   own login it can. A's replica's environment holds no credential; A's secrets list is empty.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { ImageSettings } from '../src/config.js';
import { FerryError } from '../src/errors.js';
import { createImageStore, type ImageStore } from '../src/images/image-store.js';
import { deployFiles, http, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import {
  type BaseImage,
  makeBaseImage,
  requireImageTools,
  startRegistry,
  type TestRegistry,
} from './helpers/registry.js';

const CREDENTIALS = { username: 'ferry-owner', password: 'proj-login-s3cret-Pa55' };
const MiB = 1024 * 1024;

async function rejectsWith(promise: Promise<unknown>, code: string, message?: RegExp): Promise<FerryError> {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof FerryError, `expected a FerryError ${code}, got ${String(err)}`);
    assert.equal(err.code, code, err.message);
    if (message) assert.match(err.message, message);
    return err;
  }
  assert.fail(`expected ${code}, but it succeeded`);
}

describe('images: a private image is given only to a project that can pull it', () => {
  let locked: TestRegistry;
  let open: TestRegistry;
  let work: string;
  let image: BaseImage;
  let digest: string;

  before(async () => {
    await requireImageTools();
    work = await tempDir('ferry-project-logins-');
    image = await makeBaseImage(path.join(work, 'image'), {
      files: { 'etc/os-release': 'ID=project-private-image' },
      config: { cmd: ['/bin/sh'], env: ['PATH=/bin'], workingdir: '/' },
    });
    locked = await startRegistry({ auth: CREDENTIALS });
    open = await startRegistry();
    digest = await locked.push(image, 'ferry-test/private:1');
    // The registry really is private.
    const anonymous = await fetch(`http://${locked.host}/v2/ferry-test/private/manifests/1`);
    await anonymous.arrayBuffer();
    assert.equal(anonymous.status, 401);
  });

  after(async () => {
    await locked?.stop();
    await open?.stop();
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  describe('the image store', () => {
    let dir: string;
    const settings = (): ImageSettings => ({
      authFile: undefined,
      sharedRegistries: [],
      insecureRegistries: `${locked.host},${open.host}`,
      registryAllow: '',
      cacheBytes: 256 * MiB,
      buildTimeoutMs: 60_000,
    });
    // Project A has a login for the locked registry; B has none.
    const logins = {
      credentials: async (projectId: string, registry: string) =>
        projectId === 'p-a' && registry === locked.host ? CREDENTIALS : undefined,
    };
    const open_ = (d: string): Promise<ImageStore> =>
      createImageStore({ dir: d, settings: settings(), sandbox: null, logins });
    const progress = () => {
      const lines: string[] = [];
      return { lines, onProgress: (line: string) => lines.push(line) };
    };

    before(async () => {
      dir = await tempDir('ferry-project-logins-store-');
    });
    after(() => fs.rm(dir, { recursive: true, force: true }));

    it('gives A its private image, and B neither by tag nor by digest though the cache has it', async () => {
      const store = await open_(dir);
      try {
        const pulledByA = await store.acquire(`${locked.host}/ferry-test/private:1`, { projectId: 'p-a' });
        assert.equal(pulledByA.digest, digest);
        pulledByA.release();
        assert.ok(store.cache.peek(digest), 'the node caches the image');

        await rejectsWith(
          store.acquire(`${locked.host}/ferry-test/private:1`, { projectId: 'p-b' }),
          'FERRY_IMAGE_REGISTRY_AUTH',
          /requires credentials .*the project has no login for it \(ferry registries login 127\.0\.0\.1:\d+\)/,
        );
        await rejectsWith(
          store.acquire(`${locked.host}/ferry-test/private@${digest}`, { projectId: 'p-b' }),
          'FERRY_IMAGE_REGISTRY_AUTH',
          /requires credentials/,
        );

        // A by digest: the registry is asked (the manifest is A's proof), the layers come from the cache.
        const seen = progress();
        const again = await store.acquire(`${locked.host}/ferry-test/private@${digest}`, {
          projectId: 'p-a',
          onProgress: seen.onProgress,
        });
        assert.equal(again.image.rootfs, pulledByA.image.rootfs);
        assert.match(seen.lines.join('\n'), /already on this node/);
        again.release();
      } finally {
        await store.close();
      }
    });

    it('gives B the cached image from its own repository only after fetching every layer there', async () => {
      const copied = await open.push(image, 'mirror/copy:1');
      assert.equal(copied, digest, 'the open registry serves the same image');
      const store = await open_(dir);
      try {
        const cached = store.cache.peek(digest);
        assert.ok(cached, 'the cache kept the image over the restart');
        const seen = progress();
        const pinned = await store.acquire(`${open.host}/mirror/copy:1`, {
          projectId: 'p-b',
          onProgress: seen.onProgress,
        });
        assert.equal(pinned.image.rootfs, cached.rootfs, "the cache's copy, not a second one");
        assert.match(seen.lines.join('\n'), /pulling layer 1\/1/, 'the layers were fetched from B’s repository');
        assert.doesNotMatch(seen.lines.join('\n'), /already on this node/);
        pinned.release();
        // Pulled without any credentials: anyone may have it now, by digest without the registry.
        const byDigest = await store.acquire(`${locked.host}/ferry-test/private@${digest}`, { projectId: 'p-c' });
        assert.equal(byDigest.image.rootfs, cached.rootfs);
        byDigest.release();
      } finally {
        await store.close();
      }
      // What proved it is kept with the image: a restart still knows.
      const restarted = await open_(dir);
      try {
        const seen = progress();
        const byTag = await restarted.acquire(`${open.host}/mirror/copy:1`, {
          projectId: 'p-d',
          onProgress: seen.onProgress,
        });
        assert.match(seen.lines.join('\n'), /already on this node/);
        byTag.release();
      } finally {
        await restarted.close();
      }
    });
  });

  describe('end to end', () => {
    let server: TestServer;
    let a: { projectId: string; token: string };
    let b: { projectId: string; token: string };
    let tagged: string;

    const app = (name: string, base: string) => ({
      'ferry.toml': `[app]\nname = "${name}"\n\n[image]\nbase = "${base}"\n`,
      'main.ts': `import fs from 'node:fs';
export const run = () => ({ os: fs.readFileSync('/etc/os-release', 'utf8'), env: JSON.stringify(process.env) });
`,
    });
    const loginAs = (who: { projectId: string; token: string }, password: string) =>
      http(`${server.url}/v2/projects/${who.projectId}/registries/${encodeURIComponent(locked.host)}`, {
        method: 'PUT',
        token: who.token,
        body: { username: CREDENTIALS.username, password },
      });
    const call = (who: { projectId: string; token: string }, name: string) =>
      http(`${server.url}/v4/${who.projectId}/${name}/run`, { method: 'POST', token: who.token, body: {} });
    const failure = async (who: { projectId: string; token: string }, name: string, base: string) => {
      const build = await deployFiles(server, who, name, app(name, base), { expect: 'failed' });
      const error = String((build as { error?: string }).error);
      assert.ok(error.startsWith(`FERRY_IMAGE_REGISTRY_AUTH: pulling the base image ${base}: `), error);
      assert.ok(!error.includes(CREDENTIALS.password), error);
      return error;
    };

    before(async () => {
      tagged = `${locked.host}/ferry-test/private:1`;
      server = await startServer({ env: { FERRY_INSECURE_REGISTRIES: locked.host } });
      a = await server.bootstrap('owner');
      b = await server.bootstrap('neighbour');
    });
    after(() => server?.close());

    it('A logs in and deploys its private image; B cannot, right after, by tag or digest; B with its own login can', async () => {
      const logged = await loginAs(a, CREDENTIALS.password);
      assert.equal(logged.status, 200, logged.text);
      const built = await deployFiles(server, a, 'mine', app('mine', tagged));
      const shown = await http(`${server.url}/v2/projects/${a.projectId}/apps/mine/builds/${built.id}`, {
        token: a.token,
      });
      const recorded = shown.json.image.reference as string;
      assert.equal(recorded, `${locked.host}/ferry-test/private@${digest}`);
      const res = await call(a, 'mine');
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.result.os, 'ID=project-private-image');
      // A replica's environment carries no credential, and the login is not a secret.
      assert.ok(!res.json.result.env.includes(CREDENTIALS.password), 'the password is in the replica’s environment');
      const secrets = await http(`${server.url}/v2/projects/${a.projectId}/secrets`, { token: a.token });
      assert.deepEqual(secrets.json.secrets, []);

      // The node has the image now: B still gets it neither by tag nor by the digest A's build recorded.
      assert.match(await failure(b, 'by-tag', tagged), /requires credentials .*ferry registries login/);
      assert.match(await failure(b, 'by-digest', recorded), /requires credentials .*ferry registries login/);
      // A wrong login of B's own is refused by the registry, and said so.
      assert.equal((await loginAs(b, 'not-the-password')).status, 200);
      assert.match(await failure(b, 'wrong-login', recorded), /refused the project's login for/);

      // B with its own login: deployed, and runs.
      assert.equal((await loginAs(b, CREDENTIALS.password)).status, 200);
      await deployFiles(server, b, 'theirs', app('theirs', recorded));
      const theirs = await call(b, 'theirs');
      assert.equal(theirs.status, 200, theirs.text);
      assert.equal(theirs.json.result.os, 'ID=project-private-image');
    });
  });
});
