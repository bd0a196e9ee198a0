/**
 * What an app and an operator write about images, read strictly: image references as Docker reads them
 * (default registry docker.io/library, tag or sha256 digest), the `[image]` table of ferry.toml (each
 * mistake named by key, FERRY_IMAGE_CONFIG_INVALID), the credentials file (Docker's and the containers
 * tools' format), and the server settings (FERRY_INSECURE_REGISTRIES, FERRY_REGISTRY_ALLOW,
 * FERRY_IMAGE_CACHE_MIB, FERRY_IMAGE_BUILD_TIMEOUT_SECONDS) checked at start.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parse as parseToml } from 'smol-toml';
import { AppConfigError, parseAppConfig } from '../src/apps/app-config.js';
import { resolveServerConfig } from '../src/config.js';
import { FerryError } from '../src/errors.js';
import { parseImageTable } from '../src/images/image-spec.js';
import { formatImageReference, parseImageReference } from '../src/images/reference.js';
import { readRegistryCredentials } from '../src/images/registry-auth.js';
import { parseInsecureRegistries } from '../src/images/registry-guard.js';
import { tempDir } from './helpers/ferry.js';

const HEX = 'a'.repeat(64);

function coded(fn: () => unknown, code: string, message: RegExp): void {
  assert.throws(fn, (err: unknown) => {
    assert.ok(err instanceof FerryError, String(err));
    assert.equal(err.code, code);
    assert.match(err.message, message);
    return true;
  });
}

describe('images: references', () => {
  it('reads references as Docker does', () => {
    const cases: Array<[string, string, string, string | undefined, string | undefined]> = [
      ['python', 'docker.io', 'library/python', 'latest', undefined],
      ['python:3.12-slim', 'docker.io', 'library/python', '3.12-slim', undefined],
      ['docker.io/library/python:3.12-slim', 'docker.io', 'library/python', '3.12-slim', undefined],
      ['index.docker.io/org/app', 'docker.io', 'org/app', 'latest', undefined],
      ['org/app:v1', 'docker.io', 'org/app', 'v1', undefined],
      ['ghcr.io/org/team/app:1.0', 'ghcr.io', 'org/team/app', '1.0', undefined],
      ['127.0.0.1:5000/base', '127.0.0.1:5000', 'base', 'latest', undefined],
      ['localhost/base:2', 'localhost', 'base', '2', undefined],
      [`python@sha256:${HEX}`, 'docker.io', 'library/python', undefined, `sha256:${HEX}`],
      [`r.example:443/a/b:t@sha256:${HEX}`, 'r.example:443', 'a/b', 't', `sha256:${HEX}`],
      ['[::1]:5000/base', '[::1]:5000', 'base', 'latest', undefined],
    ];
    for (const [text, registry, repository, tag, digest] of cases) {
      assert.deepEqual(parseImageReference(text), { registry, repository, tag, digest }, text);
    }
    assert.equal(formatImageReference(parseImageReference('python:3')), 'docker.io/library/python:3');
  });

  it('refuses what is not a reference, saying why', () => {
    const bad: Array<[string, RegExp]> = [
      ['', /empty/],
      ['Python', /lower-case/],
      ['https://r.example/a', /URL scheme/],
      ['a b', /spaces/],
      ['python@sha256:abc', /64 lower-case hex/],
      [`python@md5:${'a'.repeat(32)}`, /sha256/],
      ['python:-bad', /tag/],
      ['r.example:99999/a', /port/],
      ['a//b', /lower-case path components/],
      ['../etc', /the registry ".." is not a host name/],
      ['a/../etc', /lower-case path components/],
    ];
    for (const [text, why] of bad) coded(() => parseImageReference(text), 'FERRY_IMAGE_REFERENCE_INVALID', why);
  });
});

describe('images: the [image] table', () => {
  const table = (toml: string) => (parseToml(toml) as { image?: unknown }).image;

  it('takes base/apt/run/env, or a dockerfile, and nothing is an image app without the table', () => {
    assert.equal(parseImageTable(table('[app]\nname = "x"\n')), undefined);
    const spec = parseImageTable(
      table(
        '[image]\nbase = "python:3.12-slim"\napt = ["ffmpeg", "libgl1", "libc6=2.36-9", "gcc-12:amd64"]\nrun = ["pip install numpy"]\nenv = { HF_HOME = "/models" }\n',
      ),
    );
    assert.ok(spec?.kind === 'steps');
    assert.equal(spec.base.repository, 'library/python');
    assert.deepEqual(spec.apt, ['ffmpeg', 'libgl1', 'libc6=2.36-9', 'gcc-12:amd64']);
    assert.deepEqual(spec.run, ['pip install numpy']);
    assert.deepEqual(spec.env, { HF_HOME: '/models' });
    assert.deepEqual(parseImageTable(table('[image]\ndockerfile = "./docker/Dockerfile"\n')), {
      kind: 'dockerfile',
      dockerfile: 'docker/Dockerfile',
      env: {},
    });
  });

  it('names the key of each mistake', () => {
    const bad: Array<[string, RegExp, string?]> = [
      ['[image]\nbase = "python"\nunknown = 1\n', /image\.unknown: unknown key/],
      ['[image]\napt = ["ffmpeg"]\n', /image\.base: is required/],
      ['[image]\nbase = 3\n', /image\.base: must be a string/],
      ['[image]\nbase = "Python"\n', /image\.base: .*lower-case/, 'FERRY_IMAGE_REFERENCE_INVALID'],
      ['[image]\nbase = "python"\napt = ["-o", "x"]\n', /image\.apt\[0\]: "-o" is not a Debian package/],
      ['[image]\nbase = "python"\napt = ["ok", "bad name"]\n', /image\.apt\[1\]/],
      ['[image]\nbase = "python"\napt = "ffmpeg"\n', /image\.apt: must be an array/],
      ['[image]\nbase = "python"\nrun = ["  "]\n', /image\.run\[0\]: is empty/],
      ['[image]\nbase = "python"\nrun = [1]\n', /image\.run\[0\]: must be a string/],
      ['[image]\nbase = "python"\nenv = { "1X" = "a" }\n', /image\.env\.1X: is not a variable name/],
      ['[image]\nbase = "python"\nenv = { FERRY_TOKEN = "a" }\n', /reserved/],
      ['[image]\nbase = "python"\nenv = { A = 1 }\n', /image\.env\.A: must be a string/],
      ['[image]\ndockerfile = "Dockerfile"\nbase = "python"\n', /image\.base: cannot be used with image\.dockerfile/],
      ['[image]\ndockerfile = "/etc/passwd"\n', /image\.dockerfile: must be relative/],
      ['[image]\ndockerfile = "../Dockerfile"\n', /image\.dockerfile: must name a file inside/],
      ['image = "python"\n', /image: must be a table/],
    ];
    for (const [toml, why, code] of bad) {
      coded(() => parseImageTable(table(toml)), code ?? 'FERRY_IMAGE_CONFIG_INVALID', why);
    }
    const many = `[image]\nbase = "python"\nrun = [${Array.from({ length: 101 }, () => '"true"').join(', ')}]\n`;
    coded(() => parseImageTable(table(many)), 'FERRY_IMAGE_CONFIG_INVALID', /image\.run: has more than 100/);
  });
});

describe('images: [image] in ferry.toml', () => {
  it('is part of the app config, with the custom entrypoint and port optional on an image', () => {
    const plain = parseAppConfig('[app]\nname = "x"\n');
    assert.equal(plain.image, undefined);
    const config = parseAppConfig(
      '[app]\nname = "x"\nruntime = "custom"\n[image]\nbase = "127.0.0.1:5000/x:1"\nenv = { A = "b" }\n[runtime.custom]\n',
    );
    assert.ok(config.image?.kind === 'steps');
    assert.equal(config.image.baseText, '127.0.0.1:5000/x:1');
    assert.deepEqual(config.image.env, { A: 'b' });
    assert.equal(config.runtime.custom?.entrypoint, undefined);
    assert.equal(config.runtime.custom?.port, 8080);
    assert.equal(config.runtime.custom?.port_given, false);
    // Survives the JSON a build stores it as.
    assert.equal(JSON.parse(JSON.stringify(config)).image.baseText, '127.0.0.1:5000/x:1');
  });

  it('takes a custom app on an image without a [runtime.custom] table: every key has its default (issue 43)', () => {
    for (const image of ['[image]\ndockerfile = "Dockerfile"\n', '[image]\nbase = "127.0.0.1:5000/x:1"\n']) {
      const config = parseAppConfig(`[app]\nname = "x"\nruntime = "custom"\n${image}`);
      assert.deepEqual(
        config.runtime.custom,
        {
          port: 8080,
          port_given: false,
          healthcheck_endpoint: '',
          readycheck_endpoint: '',
          start_timeout: 60,
          healthcheck_interval: 10,
          websocket_idle_timeout: 300,
        },
        "the same as an empty [runtime.custom]: the image's ENTRYPOINT/CMD and EXPOSE fill the rest",
      );
      assert.deepEqual(
        config.runtime,
        parseAppConfig(`[app]\nname = "x"\nruntime = "custom"\n${image}[runtime.custom]\n`).runtime,
      );
    }
    // A cortex app still has no custom table filled in for it.
    assert.deepEqual(parseAppConfig('[app]\nname = "x"\n[image]\nbase = "python"\n').runtime, {});
  });

  it("answers the [image] table's own codes, naming the key; an entrypoint is required without an image", () => {
    const cases: Array<[string, string, RegExp, string]> = [
      [
        '[image]\nbase = "python"\nbogus = 1\n',
        'FERRY_IMAGE_CONFIG_INVALID',
        /^ferry\.toml: image\.bogus: /,
        'image.bogus',
      ],
      ['[image]\nbase = "Python"\n', 'FERRY_IMAGE_REFERENCE_INVALID', /^ferry\.toml: image\.base: /, 'image.base'],
      ['[image]\nbase = "x"\napt = ["a b"]\n', 'FERRY_IMAGE_CONFIG_INVALID', /image\.apt\[0\]/, 'image.apt[0]'],
      [
        'runtime = "custom"\n[runtime.custom]\nport = 8080\n',
        'FERRY_CONFIG_INVALID',
        /runtime\.custom\.entrypoint: is required/,
        'runtime.custom.entrypoint',
      ],
      [
        'runtime = "custom"\n',
        'FERRY_CONFIG_INVALID',
        /runtime\.custom: is required when app\.runtime is "custom" \(without an \[image\]/,
        'runtime.custom',
      ],
    ];
    for (const [rest, code, message, key] of cases) {
      assert.throws(
        () => parseAppConfig(`[app]\nname = "x"\n${rest}`),
        (err: unknown) => {
          assert.ok(err instanceof AppConfigError, String(err));
          assert.equal(err.code, code);
          assert.match(err.message, message);
          assert.equal(err.key, key);
          return true;
        },
      );
    }
  });
});

describe('images: credentials and server settings', () => {
  let work: string;
  before(async () => {
    work = await tempDir('ferry-image-spec-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it('reads Docker and containers auth files, with Docker Hub aliases', async () => {
    const file = path.join(work, 'config.json');
    await fs.writeFile(
      file,
      JSON.stringify({
        auths: {
          'https://index.docker.io/v1/': { auth: Buffer.from('hub:pass:with:colons').toString('base64') },
          'registry.example:5000': { username: 'u', password: 'p' },
          'token.example': { identitytoken: 'tok' },
        },
      }),
    );
    assert.deepEqual(await readRegistryCredentials(file, 'docker.io'), {
      username: 'hub',
      password: 'pass:with:colons',
    });
    assert.deepEqual(await readRegistryCredentials(file, 'registry.example:5000'), { username: 'u', password: 'p' });
    assert.deepEqual(await readRegistryCredentials(file, 'token.example'), { username: '<token>', password: 'tok' });
    assert.equal(await readRegistryCredentials(file, 'ghcr.io'), undefined);
    assert.equal(await readRegistryCredentials(undefined, 'ghcr.io'), undefined);
    await fs.writeFile(file, '{"auths": {"ghcr.io": {"auth": "bm9jb2xvbg=="}}}'); // "nocolon"
    await assert.rejects(readRegistryCredentials(file, 'ghcr.io'), /entry for ghcr.io is malformed/);
    await fs.writeFile(file, 'secret-not-json');
    await assert.rejects(readRegistryCredentials(file, 'ghcr.io'), (err: Error) => !err.message.includes('secret'));
  });

  it('checks the image settings at start', () => {
    assert.deepEqual(
      [...parseInsecureRegistries(' 127.0.0.1:5000, Registry.Local:443 ,[::1]:5000')],
      ['127.0.0.1:5000', 'registry.local:443', '[::1]:5000'],
    );
    const config = resolveServerConfig(
      {},
      {
        FERRY_INSECURE_REGISTRIES: '127.0.0.1:5000',
        FERRY_REGISTRY_ALLOW: '10.0.0.0/8',
        FERRY_IMAGE_CACHE_MIB: '1024',
        FERRY_IMAGE_BUILD_TIMEOUT_SECONDS: '600',
        FERRY_REGISTRY_AUTH_FILE: 'auth.json',
      },
    );
    assert.equal(config.images.cacheBytes, 1024 * 1024 * 1024);
    assert.equal(config.images.buildTimeoutMs, 600_000);
    assert.equal(config.images.authFile, path.resolve('auth.json'));
    const defaults = resolveServerConfig({}, {});
    assert.equal(defaults.images.cacheBytes, 20_480 * 1024 * 1024);
    assert.equal(defaults.images.buildTimeoutMs, 1_800_000);
    assert.throws(
      () => resolveServerConfig({}, { FERRY_INSECURE_REGISTRIES: '127.0.0.1' }),
      /FERRY_INSECURE_REGISTRIES: "127.0.0.1" is not host:port/,
    );
    assert.throws(() => resolveServerConfig({}, { FERRY_REGISTRY_ALLOW: 'nope' }), /FERRY_REGISTRY_ALLOW/);
    assert.throws(() => resolveServerConfig({}, { FERRY_IMAGE_CACHE_MIB: '10' }), /FERRY_IMAGE_CACHE_MIB must be/);
  });

  it('reads FERRY_SHARED_REGISTRIES: none by default, registries as references name them, or *', () => {
    // By default the auth file serves no registry: each project logs in itself (issue 43).
    assert.deepEqual(resolveServerConfig({}, {}).images.sharedRegistries, []);
    const listed = resolveServerConfig(
      {},
      { FERRY_SHARED_REGISTRIES: ' Registry.Example:5000, index.docker.io,ghcr.io ,localhost' },
    );
    assert.deepEqual(listed.images.sharedRegistries, ['registry.example:5000', 'docker.io', 'ghcr.io', 'localhost']);
    assert.deepEqual(resolveServerConfig({}, { FERRY_SHARED_REGISTRIES: '*' }).images.sharedRegistries, ['*']);
    for (const bad of ['https://ghcr.io', 'ghcr.io/org', 'noport', '*,ghcr.io', 'host:0']) {
      assert.throws(
        () => resolveServerConfig({}, { FERRY_SHARED_REGISTRIES: bad }),
        /FERRY_SHARED_REGISTRIES: ".*" is not a registry/,
        bad,
      );
    }
  });
});
