/**
 * An app whose `[image] base` is in a private registry (issue 26: "a private registry with credentials
 * (and refused without)"), deployed end to end, offline: a real registry on loopback behind htpasswd
 * Basic auth (Debian's docker-registry), listed in FERRY_INSECURE_REGISTRIES of every server here.
 *
 * - A server whose FERRY_REGISTRY_AUTH_FILE (a Docker `config.json`) holds the registry's credentials, and
 *   whose FERRY_SHARED_REGISTRIES lists the registry, pulls the base, builds, and its function answers on
 *   the image.
 * - A server without an auth file fails the build with FERRY_IMAGE_REGISTRY_AUTH naming the step and the
 *   registry; one whose file holds the right password but does not share the registry fails the same way
 *   (the file serves only FERRY_SHARED_REGISTRIES, issue 43); one whose file holds a wrong password fails
 *   saying the credentials were refused. No message carries a credential, the auth file's path or the
 *   data directory. (Projects' own logins: test/images-project-logins.)
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import {
  makeBaseImage,
  requireImageTools,
  startRegistry,
  type TestRegistry,
  writeAuthFile,
} from './helpers/registry.js';

const CREDENTIALS = { username: 'ferry-private', password: 'pyimg-s3cret-Pa55' };
const WRONG = { username: 'ferry-private', password: 'pyimg-wrong-Pa55' };

describe('images: a base image from a private registry', () => {
  let registry: TestRegistry;
  let work: string;
  let base: string;
  const servers: TestServer[] = [];
  const files: Record<string, string> = {};

  const serverWith = async (env: NodeJS.ProcessEnv) => {
    const server = await startServer({ env: { FERRY_INSECURE_REGISTRIES: registry.host, ...env } });
    servers.push(server);
    return { server, auth: await server.bootstrap() };
  };
  const app = (name: string) => ({
    'ferry.toml': `[app]\nname = "${name}"\n\n[image]\nbase = "${base}"\n`,
    'main.ts': `import fs from 'node:fs';\nexport const run = () => ({ os: fs.readFileSync('/etc/os-release', 'utf8') });\n`,
  });

  before(async () => {
    await requireImageTools();
    work = await tempDir('pyimg-private-');
    const image = await makeBaseImage(work, {
      files: { 'etc/os-release': 'ID=ferry-private-image' },
      config: { cmd: ['/bin/sh'], env: ['PATH=/bin'], workingdir: '/' },
    });
    registry = await startRegistry({ auth: CREDENTIALS });
    await registry.push(image, 'ferry-test/private:1');
    base = `${registry.host}/ferry-test/private:1`;
    files.good = await writeAuthFile(work, { [registry.host]: CREDENTIALS });
    files.wrong = await writeAuthFile(work, { [registry.host]: WRONG });
    // The registry really is private: an anonymous look at the manifest is refused.
    const anonymous = await fetch(`http://${registry.host}/v2/ferry-test/private/manifests/1`);
    await anonymous.arrayBuffer();
    assert.equal(anonymous.status, 401);
  });

  after(async () => {
    for (const server of servers) await server.close();
    await registry?.stop();
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  it('deploys and runs an app on it with the credentials of FERRY_REGISTRY_AUTH_FILE for a shared registry', async () => {
    const { server, auth } = await serverWith({
      FERRY_REGISTRY_AUTH_FILE: files.good,
      FERRY_SHARED_REGISTRIES: registry.host,
    });
    const build = await deployFiles(server, auth, 'private-ok', app('private-ok'));
    const listed = await http(`${server.url}/v2/projects/${auth.projectId}/apps/private-ok/builds/${build.id}`, {
      token: auth.token,
    });
    assert.match(listed.json.image.reference, new RegExp(`^${registry.host}/ferry-test/private@sha256:[a-f0-9]{64}$`));
    const res = await http(`${server.url}/v4/${auth.projectId}/private-ok/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.equal((res.json.result ?? res.json).os, 'ID=ferry-private-image');
  });

  it('fails the build with FERRY_IMAGE_REGISTRY_AUTH without credentials, or with refused ones, leaking none', async () => {
    for (const [name, env, why] of [
      [
        // The file has the right credentials, but the operator shares no registry: no project gets them.
        'private-unshared',
        { FERRY_REGISTRY_AUTH_FILE: files.good },
        /requires credentials for [\d.:]+\/ferry-test\/private:1 \(HTTP 401\); the project has no login for it/,
      ],
      [
        'private-none',
        {},
        /requires credentials for [\d.:]+\/ferry-test\/private:1 \(HTTP 401\); the project has no login for it \(ferry registries login [\d.:]+\)$/,
      ],
      [
        'private-wrong',
        { FERRY_REGISTRY_AUTH_FILE: files.wrong, FERRY_SHARED_REGISTRIES: registry.host },
        /refused the credentials of FERRY_REGISTRY_AUTH_FILE for [\d.:]+\/ferry-test\/private:1 \(HTTP 401\)/,
      ],
    ] as const) {
      const { server, auth } = await serverWith(env);
      const build = await deployFiles(server, auth, name, app(name), { expect: 'failed' });
      const error = String((build as { error?: string }).error);
      const step = `pulling the base image ${base}`;
      assert.ok(error.startsWith(`FERRY_IMAGE_REGISTRY_AUTH: ${step}: `), error);
      assert.match(error, why);
      for (const secret of [
        CREDENTIALS.password,
        WRONG.password,
        Buffer.from(`${WRONG.username}:${WRONG.password}`).toString('base64'),
        Buffer.from(`${CREDENTIALS.username}:${CREDENTIALS.password}`).toString('base64'),
        files.wrong!,
        files.good!,
        work,
        server.dataDir,
      ]) {
        assert.ok(!error.includes(secret), `the error carries ${secret}: ${error}`);
      }
      assert.doesNotMatch(error, /\n\s+at /);
      // The build log says the same, and carries no secret either.
      const log = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${build.id}/logs`, {
        token: auth.token,
      });
      assert.match(log.text, /FERRY_IMAGE_REGISTRY_AUTH/);
      assert.ok(!log.text.includes(WRONG.password) && !log.text.includes(CREDENTIALS.password), log.text);
    }
  });
});
