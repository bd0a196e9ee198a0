/**
 * Pulling images (issue 26, the ground of it) against a real registry on loopback (Debian's
 * docker-registry), with a base image the test makes from busybox-static: the pull through src/images
 * lands a verified OCI layout, and unpacking gives busybox back; a blob altered in the registry's storage
 * is refused by digest (and nothing of it kept); a registry behind htpasswd works with the credentials
 * of FERRY_REGISTRY_AUTH_FILE and refuses without them, or with a wrong password, each with its code;
 * a loopback registry not listed in FERRY_INSECURE_REGISTRIES is refused by the address guard before
 * anything is sent, by address and by a name resolving to loopback; a registry's Bearer token flow works
 * (anonymous and with credentials), while a token realm or a blob redirect aimed at an internal address or
 * at plain HTTP is refused (SSRF through the registry's answers); the image store pulls once per digest
 * (a tag it has the digest of costs the manifest and config, no layer).
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { ImageSettings } from '../src/config.js';
import { FerryError } from '../src/errors.js';
import { parseImageConfig } from '../src/images/image-config.js';
import { createImageStore } from '../src/images/image-store.js';
import { blobPath, readIndexEntry } from '../src/images/oci-layout.js';
import { pullImage } from '../src/images/pull.js';
import { parseImageReference } from '../src/images/reference.js';
import { registryAccess } from '../src/images/registry-guard.js';
import { detectSandbox } from '../src/sandbox/launch.js';
import { tempDir } from './helpers/ferry.js';
import {
  type BaseImage,
  makeBaseImage,
  requireImageTools,
  startRegistry,
  type TestRegistry,
  writeAuthFile,
} from './helpers/registry.js';

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

describe('images: pulls from a registry on loopback', () => {
  let work: string;
  let image: BaseImage;
  let open: TestRegistry;
  let locked: TestRegistry;
  const creds = { username: 'ferry', password: `pw-${process.pid}` };

  before(async () => {
    await requireImageTools();
    work = await tempDir('ferry-images-');
    image = await makeBaseImage(work, { files: { 'srv/hello.txt': 'hello from the image\n' } });
    [open, locked] = await Promise.all([startRegistry(), startRegistry({ auth: creds })]);
  });
  after(async () => {
    await Promise.all([open?.stop(), locked?.stop()]);
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  it('pulls a pushed image into an OCI layout, verified, and its config says how to run it', async () => {
    const pushed = await open.push(image, 'test/base:1');
    const layout = path.join(work, 'pull-1');
    const progress: string[] = [];
    const pulled = await pullImage(parseImageReference(`${open.host}/test/base:1`), layout, 'base', {
      access: registryAccess(open.host, ''),
      maxBytes: 64 * MiB,
      onProgress: (line) => progress.push(line),
    });
    assert.equal(pulled.digest, pushed, 'the digest is the one the registry stored');
    assert.equal(pulled.manifest.layers.length, 1);
    assert.match(progress.join('\n'), /pulling layer 1\/1 sha256:/);
    const entry = await readIndexEntry(layout, 'base');
    assert.equal(entry.digest, pushed);
    for (const blob of [pulled.manifest.config, ...pulled.manifest.layers]) {
      assert.equal((await fs.stat(blobPath(layout, blob.digest))).size, blob.size);
    }
    const config = parseImageConfig(pulled.config!);
    assert.deepEqual(config.cmd, ['/bin/sh']);
    assert.deepEqual(
      config.env.find(([name]) => name === 'GREETING'),
      ['GREETING', 'hello'],
    );
    assert.equal(config.workingDir, '/srv');
    assert.deepEqual(config.exposedPorts, [8080]);

    // By digest too: the reference pins what arrives.
    const byDigest = await pullImage(
      parseImageReference(`${open.host}/test/base@${pushed}`),
      path.join(work, 'pull-2'),
      'x',
      {
        access: registryAccess(open.host, ''),
        maxBytes: 64 * MiB,
      },
    );
    assert.equal(byDigest.digest, pushed);
    assert.equal(pulled.layersSkipped, false);

    // A caller that has the image already (the node's cache): the tag is resolved and the manifest checked
    // as always, and nothing else is fetched or written (the caller has the config and layers it names).
    const knownLayout = path.join(work, 'pull-known');
    const lines: string[] = [];
    const known = await pullImage(parseImageReference(`${open.host}/test/base:1`), knownLayout, 'k', {
      access: registryAccess(open.host, ''),
      maxBytes: 64 * MiB,
      known: (digest) => digest === pushed,
      onProgress: (line) => lines.push(line),
    });
    assert.equal(known.digest, pushed);
    assert.equal(known.layersSkipped, true);
    assert.equal(known.config, undefined);
    assert.match(lines.join('\n'), /layer 1\/1 sha256:\S+ already on this node/);
    assert.doesNotMatch(lines.join('\n'), /pulling layer/);
    await assert.rejects(fs.stat(blobPath(knownLayout, known.manifest.layers[0]!.digest)), { code: 'ENOENT' });
    await assert.rejects(fs.stat(blobPath(knownLayout, known.manifest.config.digest)), { code: 'ENOENT' });
  });

  it('refuses a blob whose bytes do not match its digest, and keeps nothing of it', async () => {
    // An image of its own: the registry stores a blob once for every repository that has it.
    const own = await makeBaseImage(path.join(work, 'tamper'), { files: { 'srv/tampered.txt': 'mine\n' } });
    const pushed = await open.push(own, 'test/tampered:1');
    const layout = path.join(work, 'pull-clean');
    const clean = await pullImage(parseImageReference(`${open.host}/test/tampered:1`), layout, 't', {
      access: registryAccess(open.host, ''),
      maxBytes: 64 * MiB,
    });
    assert.equal(clean.digest, pushed);
    const layer = clean.manifest.layers[0]!;
    // The registry's stored layer is altered in place (same length): a compromised or corrupt mirror.
    const file = open.blobFile(layer.digest);
    const bytes = await fs.readFile(file);
    bytes[bytes.length - 5] = bytes[bytes.length - 5]! ^ 0xff;
    await fs.writeFile(file, bytes);
    const fresh = path.join(work, 'pull-tampered');
    const err = await rejectsWith(
      pullImage(parseImageReference(`${open.host}/test/tampered:1`), fresh, 't', {
        access: registryAccess(open.host, ''),
        maxBytes: 64 * MiB,
      }),
      'FERRY_IMAGE_DIGEST_MISMATCH',
      /refused/,
    );
    assert.ok(!err.message.includes(work), 'no host path in the message');
    const left = await fs.readdir(path.join(fresh, 'blobs', 'sha256'));
    assert.ok(!left.some((name) => layer.digest.endsWith(name) || name.endsWith('.part')), `kept: ${left.join(', ')}`);

    // A reference pinning a digest the registry does not answer with is refused too.
    const other = `sha256:${'0'.repeat(64)}`;
    await rejectsWith(
      pullImage(parseImageReference(`${open.host}/test/tampered@${other}`), path.join(work, 'pull-other'), 't', {
        access: registryAccess(open.host, ''),
        maxBytes: 64 * MiB,
      }),
      'FERRY_IMAGE_NOT_FOUND',
    );
  });

  it('pulls from a private registry with the credentials of the auth file, and refuses without them', async () => {
    await locked.push(image, 'private/base:1');
    const ref = parseImageReference(`${locked.host}/private/base:1`);
    const access = registryAccess(locked.host, '');
    const good = await writeAuthFile(work, { [`http://${locked.host}`]: creds });
    const pulled = await pullImage(ref, path.join(work, 'private-ok'), 'p', {
      access,
      authFile: good,
      maxBytes: 64 * MiB,
    });
    assert.equal(pulled.manifest.layers.length, 1);

    const none = await rejectsWith(
      pullImage(ref, path.join(work, 'private-none'), 'p', { access, maxBytes: 64 * MiB }),
      'FERRY_IMAGE_REGISTRY_AUTH',
      /requires credentials/,
    );
    assert.ok(!none.message.includes(creds.password));
    const wrong = await writeAuthFile(work, { [locked.host]: { username: creds.username, password: 'not-it' } });
    const refused = await rejectsWith(
      pullImage(ref, path.join(work, 'private-wrong'), 'p', { access, authFile: wrong, maxBytes: 64 * MiB }),
      'FERRY_IMAGE_REGISTRY_AUTH',
      /refused the credentials/,
    );
    assert.ok(!refused.message.includes('not-it'), 'the password is never in the message');
    // Another registry's entry is not sent here.
    const elsewhere = await writeAuthFile(work, { 'registry.example:5000': creds });
    await rejectsWith(
      pullImage(ref, path.join(work, 'private-elsewhere'), 'p', { access, authFile: elsewhere, maxBytes: 64 * MiB }),
      'FERRY_IMAGE_REGISTRY_AUTH',
      /requires credentials/,
    );
  });

  it('refuses a loopback registry that FERRY_INSECURE_REGISTRIES does not list, before sending anything', async () => {
    await open.push(image, 'test/guarded:1');
    const port = open.host.split(':')[1]!;
    const cases = [
      { reference: `${open.host}/test/guarded:1`, access: registryAccess('', ''), address: /127\.0\.0\.1.*loopback/ },
      // Listed, but another port of the same host: still guarded.
      { reference: `${open.host}/test/guarded:1`, access: registryAccess('127.0.0.1:1', ''), address: /loopback/ },
      // A name that resolves to loopback is judged by its address.
      { reference: `localhost:${port}/test/guarded:1`, access: registryAccess('', ''), address: /loopback/ },
    ];
    for (const { reference, access, address } of cases) {
      const err = await rejectsWith(
        pullImage(parseImageReference(reference), path.join(work, 'guarded'), 'g', { access, maxBytes: 64 * MiB }),
        'FERRY_IMAGE_REGISTRY_BLOCKED',
        address,
      );
      assert.match(err.message, /FERRY_INSECURE_REGISTRIES/);
    }
    // The same registry, listed: pulled.
    const listed = await pullImage(parseImageReference(`${open.host}/test/guarded:1`), path.join(work, 'listed'), 'g', {
      access: registryAccess(`registry.example:5000, ${open.host}`, ''),
      maxBytes: 64 * MiB,
    });
    assert.equal(listed.manifest.layers.length, 1);
  });

  it('refuses an image larger than the bound before fetching its layers', async () => {
    await open.push(image, 'test/big:1');
    await rejectsWith(
      pullImage(parseImageReference(`${open.host}/test/big:1`), path.join(work, 'big'), 'b', {
        access: registryAccess(open.host, ''),
        maxBytes: 64 * 1024,
      }),
      'FERRY_IMAGE_TOO_LARGE',
    );
  });

  /**
   * A front of the test's own before the real registry, listed in FERRY_INSECURE_REGISTRIES: it asks
   * for a Bearer token from `realm` (its own /token, or an address under test), and answers blob
   * requests with `blobRedirect` when set.
   */
  async function front(options: { realm?: (self: string) => string; blobRedirect?: string; user?: string }) {
    const tokens = new Set<string>();
    const seen: string[] = [];
    const server = http.createServer((req, res) => {
      const self = `127.0.0.1:${(server.address() as AddressInfo).port}`;
      seen.push(
        `${req.method} ${req.url} ${req.headers.authorization ? req.headers.authorization.split(' ')[0] : '-'}`,
      );
      if (req.url?.startsWith('/token')) {
        const url = new URL(req.url, `http://${self}`);
        const basic = req.headers.authorization?.startsWith('Basic ')
          ? Buffer.from(req.headers.authorization.slice(6), 'base64').toString()
          : undefined;
        if (options.user !== undefined && basic !== `${options.user}:${creds.password}`) {
          res.writeHead(401).end();
          return;
        }
        const token = `tok-${tokens.size}-${url.searchParams.get('scope')}`;
        tokens.add(token);
        res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ token }));
        return;
      }
      const bearer = req.headers.authorization?.startsWith('Bearer ') ? req.headers.authorization.slice(7) : '';
      if (!tokens.has(bearer)) {
        const realm = options.realm ? options.realm(self) : `http://${self}/token`;
        res.writeHead(401, { 'www-authenticate': `Bearer realm="${realm}",service="front"` }).end();
        return;
      }
      if (options.blobRedirect && req.url?.includes('/blobs/')) {
        res.writeHead(307, { location: options.blobRedirect }).end();
        return;
      }
      const upstream = http.request(
        {
          host: '127.0.0.1',
          port: Number(open.host.split(':')[1]),
          path: req.url,
          method: req.method,
          headers: { accept: req.headers.accept ?? '*/*' },
        },
        (up) => {
          res.writeHead(up.statusCode ?? 502, up.headers);
          up.pipe(res);
        },
      );
      upstream.on('error', () => res.destroy());
      upstream.end();
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
    return { host, seen, close: () => new Promise<void>((resolve) => server.close(() => resolve())) };
  }

  it('takes a Bearer token from the registry’s realm, anonymous or with credentials', async () => {
    await open.push(image, 'test/bearer:1');
    const anonymous = await front({});
    try {
      const pulled = await pullImage(
        parseImageReference(`${anonymous.host}/test/bearer:1`),
        path.join(work, 'bearer'),
        'b',
        {
          access: registryAccess(anonymous.host, ''),
          maxBytes: 64 * MiB,
        },
      );
      assert.equal(pulled.manifest.layers.length, 1);
      assert.ok(
        anonymous.seen.some((line) =>
          line.startsWith('GET /token?service=front&scope=repository%3Atest%2Fbearer%3Apull'),
        ),
      );
      assert.ok(
        anonymous.seen.some((line) => /\/blobs\/.* Bearer$/.test(line)),
        anonymous.seen.join('\n'),
      );
    } finally {
      await anonymous.close();
    }
    const withUser = await front({ user: creds.username });
    try {
      const ref = parseImageReference(`${withUser.host}/test/bearer:1`);
      const access = registryAccess(withUser.host, '');
      const authFile = await writeAuthFile(work, { [withUser.host]: creds });
      await pullImage(ref, path.join(work, 'bearer-user'), 'b', { access, authFile, maxBytes: 64 * MiB });
      await rejectsWith(
        pullImage(ref, path.join(work, 'bearer-none'), 'b', { access, maxBytes: 64 * MiB }),
        'FERRY_IMAGE_REGISTRY_AUTH',
        /token service refused an anonymous pull/,
      );
    } finally {
      await withUser.close();
    }
  });

  it('refuses a token realm or a blob redirect aimed at an internal address or at plain HTTP', async () => {
    await open.push(image, 'test/ssrf:1');
    const cases: Array<{ options: Parameters<typeof front>[0]; code: string; why: RegExp }> = [
      // The realm on loopback over HTTPS: the guard refuses it before connecting.
      {
        options: { realm: () => 'https://127.0.0.1:9/token' },
        code: 'FERRY_IMAGE_REGISTRY_BLOCKED',
        why: /127\.0\.0\.1.*loopback/,
      },
      // The cloud metadata address.
      {
        options: { realm: () => 'https://169.254.169.254/latest/meta-data' },
        code: 'FERRY_IMAGE_REGISTRY_BLOCKED',
        why: /cloud metadata/,
      },
      // Plain HTTP elsewhere than the listed registry itself.
      {
        options: { realm: () => 'http://127.0.0.2:9/token' },
        code: 'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        why: /plain-HTTP token realm/,
      },
      // A blob redirect to an internal HTTPS address, and to plain HTTP.
      { options: { blobRedirect: 'https://10.0.0.1/blob' }, code: 'FERRY_IMAGE_REGISTRY_BLOCKED', why: /private/ },
      {
        options: { blobRedirect: 'http://127.0.0.2:9/blob' },
        code: 'FERRY_IMAGE_REGISTRY_UNREACHABLE',
        why: /redirected to a plain-HTTP/,
      },
    ];
    for (const { options, code, why } of cases) {
      const f = await front(options);
      try {
        await rejectsWith(
          pullImage(parseImageReference(`${f.host}/test/ssrf:1`), path.join(work, 'ssrf'), 's', {
            access: registryAccess(f.host, ''),
            maxBytes: 64 * MiB,
          }),
          code,
          why,
        );
      } finally {
        await f.close();
      }
    }
  });

  it('the image store pulls, unpacks into the cache and pins; a digest it has needs no registry', async (t) => {
    const own = await startRegistry(); // stopped halfway: a registry of this test's own
    t.after(() => own.stop());
    const pushed = await own.push(image, 'test/store:1');
    const settings: ImageSettings = {
      authFile: undefined,
      sharedRegistries: [],
      insecureRegistries: own.host,
      registryAllow: '',
      cacheBytes: 256 * MiB,
      buildTimeoutMs: 60_000,
    };
    const store = await createImageStore({ dir: path.join(work, 'store'), settings, sandbox: await detectSandbox() });
    const forProject = { projectId: 'p-pulls' };
    const first = await store.acquire(`${own.host}/test/store:1`, forProject);
    assert.equal(first.digest, pushed);
    assert.deepEqual(first.config.cmd, ['/bin/sh']);
    const busybox = await fs.readFile(path.join(first.image.rootfs, 'bin', 'busybox'));
    assert.deepEqual(busybox, await fs.readFile('/bin/busybox'));
    assert.equal(await fs.readlink(path.join(first.image.rootfs, 'bin', 'sh')), 'busybox');
    assert.equal(
      await fs.readFile(path.join(first.image.rootfs, 'srv', 'hello.txt'), 'utf8'),
      'hello from the image\n',
    );
    assert.equal(store.cache.usage().images[0]?.pins, 1);

    // The tag again: resolved at the registry, and its digest is in the cache, so no layer is fetched.
    const lines: string[] = [];
    const byTag = await store.acquire(`${own.host}/test/store:1`, {
      ...forProject,
      onProgress: (line) => lines.push(line),
    });
    assert.equal(byTag.image.rootfs, first.image.rootfs);
    assert.match(lines.join('\n'), /already on this node/);
    assert.doesNotMatch(lines.join('\n'), /pulling layer/);
    byTag.release();

    await own.stop(); // the registry is gone: a pinned digest of a public image is served from the cache
    const again = await store.acquire(`${own.host}/test/store@${pushed}`, forProject);
    assert.equal(again.image.rootfs, first.image.rootfs);
    assert.equal(store.cache.usage().images[0]?.pins, 2);
    first.release();
    again.release();
    assert.equal(store.cache.usage().images[0]?.pins, 0);
    // A tag must be asked of the registry (a tag moves): it is unreachable now, and said so.
    await rejectsWith(
      store.acquire(`${own.host}/test/store:1`, forProject),
      'FERRY_IMAGE_REGISTRY_UNREACHABLE',
      /ECONNREFUSED/,
    );
  });
});
