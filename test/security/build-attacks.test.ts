/**
 * Attacks on the build, as a user with an ordinary project token would try them (issue 10): each one a
 * fixture app (test/fixtures/security/) deployed through the real server, whose builds run in the real
 * sandbox. Every test fails if its attack works again: the host file's bytes reach a bundle, or the
 * marker file (a host path the server could write, outside anything the sandbox shows) gets written.
 *
 * Needs bubblewrap (CI installs it, scripts/setup-system.sh): without it builds are plain processes and
 * the app's code runs as the server, which is exactly what these tests catch.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import yazl from 'yazl';
import { FIXTURES, processesWithArgs } from '../helpers/builds.js';
import { http, runCli, spawnServe, startServer, type TestServer, tempDir, waitFor } from '../helpers/ferry.js';
import { LEFTPAD_WHEEL, leftpadWheel } from '../helpers/python-wheel.js';

const TIMEOUT = 120_000;
const SECURITY_FIXTURES = path.join(FIXTURES, 'security');

interface FixtureFile {
  data: Buffer;
  executable: boolean;
}

/** A fixture app's files (those under `skip` left out), with placeholders filled in. */
async function fixture(
  name: string,
  replace: Record<string, string> = {},
  skip: string[] = [],
): Promise<Map<string, FixtureFile>> {
  const root = path.join(SECURITY_FIXTURES, name);
  const files = new Map<string, FixtureFile>();
  for (const entry of await fs.readdir(root, { recursive: true })) {
    const rel = String(entry);
    if (skip.some((dir) => rel === dir || rel.startsWith(`${dir}/`))) continue;
    const stat = await fs.stat(path.join(root, rel));
    if (!stat.isFile()) continue;
    let text = await fs.readFile(path.join(root, rel), 'utf8');
    for (const [placeholder, value] of Object.entries(replace)) text = text.replaceAll(placeholder, value);
    files.set(rel, { data: Buffer.from(text), executable: (stat.mode & 0o111) !== 0 });
  }
  return files;
}

function zip(files: Map<string, FixtureFile>): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const archive = new yazl.ZipFile();
    for (const [name, file] of files) {
      archive.addBuffer(file.data, name, {
        mtime: new Date('2026-01-01T00:00:00Z'),
        mode: file.executable ? 0o100755 : 0o100644,
      });
    }
    archive.end();
    const chunks: Buffer[] = [];
    archive.outputStream.on('data', (c: Buffer) => chunks.push(c));
    archive.outputStream.on('end', () => resolve(Buffer.concat(chunks)));
    archive.outputStream.on('error', reject);
  });
}

/** Every file under `dir` (none when it does not exist). */
async function filesUnder(dir: string): Promise<string[]> {
  const entries = await fs.readdir(dir, { recursive: true }).catch(() => [] as string[]);
  const files: string[] = [];
  for (const entry of entries) {
    const file = path.join(dir, String(entry));
    if ((await fs.lstat(file)).isFile()) files.push(file);
  }
  return files;
}

describe('build attacks', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  /** A folder of the host the server may write and no sandbox shows: markers go here. */
  let hostDir: string;

  const suiteServer = () => server;
  const suiteAuth = () => auth;

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    hostDir = await tempDir('ferry-attack-markers-');
  });
  after(async () => {
    await server?.close();
    await fs.rm(hostDir, { recursive: true, force: true });
  });

  /** A marker path, after checking that the host (the server's user) could write it. */
  async function markerPath(name: string): Promise<string> {
    const marker = path.join(hostDir, name, 'marker');
    await fs.mkdir(path.dirname(marker), { recursive: true });
    await fs.writeFile(marker, 'probe');
    await fs.rm(marker);
    await fs.rm(path.dirname(marker), { recursive: true });
    return marker;
  }

  /** Uploads an app (to the given server, else the suite's) and waits for its build to end. */
  async function deploy(
    app: string,
    files: Map<string, FixtureFile>,
    on?: { server: { url: string }; auth: typeof auth },
  ) {
    const { server, auth } = on ?? { server: suiteServer(), auth: suiteAuth() };
    const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds`, {
      method: 'POST',
      token: auth.token,
      body: await zip(files),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 201, res.text);
    const build = await waitFor(
      async () => {
        const b = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds/${res.json.id}`, {
          token: auth.token,
        });
        return ['ready', 'failed', 'cancelled'].includes(b.json.state) ? b.json : undefined;
      },
      TIMEOUT - 10_000,
      `build of ${app}`,
    );
    const logs = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds/${build.id}/logs`, {
      token: auth.token,
    });
    const log = (logs.json.lines as Array<{ line: string }>).map((l) => l.line).join('\n');
    return { id: build.id as string, state: build.state as string, error: build.error as string | null, log };
  }

  it('runs on a server whose builds are sandboxed', () => {
    assert.ok(server.services.sandbox.bwrap, `bubblewrap is needed: ${server.services.sandbox.reasons.join('; ')}`);
  });

  describe('(a) importing a host file into the bundle', () => {
    let victimBuild = '';

    before(async () => {
      const victim = await deploy('victim', await fixture('victim'));
      assert.equal(victim.state, 'ready', victim.log);
      victimBuild = victim.id;
    });

    const targets: Array<{ what: string; importPath: () => string; secret: () => Promise<Buffer | string> }> = [
      {
        what: "the server's JWT signing key",
        importPath: () => '../../../keys/jwt.key',
        secret: () => fs.readFile(path.join(server.dataDir, 'keys', 'jwt.key')),
      },
      {
        what: '/etc/shadow',
        importPath: () => '/etc/shadow',
        secret: async () => (await fs.readFile('/etc/shadow', 'utf8')).split('\n')[0]!,
      },
      {
        what: "the server's database",
        importPath: () => '../../../ferry.db',
        secret: async () => 'SQLite format 3',
      },
      {
        what: "another build's source",
        importPath: () => `../../${victimBuild}/source/main.ts`,
        secret: async () => 'VICTIM-SOURCE-7f3c9a1e-do-not-leak',
      },
    ];

    for (const target of targets) {
      it(`fails the build with FERRY_BUILD_IMPORT_OUTSIDE_APP for ${target.what}`, { timeout: TIMEOUT }, async () => {
        const importPath = target.importPath();
        const secret = await target.secret();
        assert.ok(secret.length > 0, 'the secret the attack is after exists on the host');
        const build = await deploy('import-host-file', await fixture('import-host-file', { __IMPORT__: importPath }));
        assert.equal(build.state, 'failed', build.log);
        assert.match(build.error ?? '', /FERRY_BUILD_IMPORT_OUTSIDE_APP/);
        // The error names the import and the file that has it.
        assert.ok(build.error?.includes(`"${importPath}"`), build.error ?? '');
        assert.match(build.error ?? '', /main\.ts/);
        assert.match(build.log, /FERRY_BUILD_IMPORT_OUTSIDE_APP/);
        // Not a byte of it in anything the build left: no bundle, nothing in its folders.
        const buildDir = path.join(server.dataDir, 'builds', build.id);
        for (const file of await filesUnder(path.join(buildDir, 'out'))) {
          const bytes = await fs.readFile(file);
          assert.ok(!bytes.includes(secret), `${file} holds the secret`);
        }
        for (const file of await filesUnder(buildDir)) {
          if (file.endsWith(path.join('source', 'main.ts'))) continue; // names the import, holds no secret
          assert.ok(!(await fs.readFile(file)).includes(secret), `${file} holds the secret`);
        }
      });
    }

    it('still bundles a text import of an app file', { timeout: TIMEOUT }, async () => {
      const files = await fixture('import-host-file', { __IMPORT__: './notes.txt' });
      files.set('notes.txt', { data: Buffer.from('APP-OWN-TEXT-42\n'), executable: false });
      const build = await deploy('import-host-file', files);
      assert.equal(build.state, 'ready', build.log);
      const bundle = await fs.readFile(path.join(server.dataDir, 'builds', build.id, 'out', 'main.mjs'), 'utf8');
      assert.match(bundle, /APP-OWN-TEXT-42/);
    });
  });

  it('(b) a pip.py in a Python app does not replace pip', { timeout: TIMEOUT }, async () => {
    const marker = await markerPath('pip-shadow');
    const files = await fixture('pip-shadow', { __MARKER__: marker });
    files.set(`wheels/${LEFTPAD_WHEEL}`, { data: await leftpadWheel(), executable: false });
    const build = await deploy('pip-shadow', files);
    // pip itself ran and installed the wheel: the attack had its chance.
    assert.equal(build.state, 'ready', build.log);
    assert.match(build.log, /Successfully installed leftpad-1\.0\.0/);
    assert.doesNotMatch(build.log, /FERRY-ATTACK pip\.py ran/);
    await assert.rejects(fs.access(marker), 'the marker must not be written on the host');
  });

  it('(c) a source package built through requirements.txt options never runs as the server', {
    timeout: TIMEOUT,
  }, async () => {
    const marker = await markerPath('pip-sdist');
    const files = await fixture('pip-sdist-backend', { __MARKER__: marker }, ['sdist']);
    // The source package: sdist/ packed as dist/evilpkg-1.0.tar.gz, with the marker filled in.
    const work = await tempDir('ferry-sdist-');
    try {
      const tree = path.join(work, 'evilpkg-1.0');
      await fs.mkdir(tree);
      for (const [name, file] of await fixture('pip-sdist-backend', { __MARKER__: marker })) {
        if (name.startsWith('sdist/')) await fs.writeFile(path.join(tree, name.slice('sdist/'.length)), file.data);
      }
      await promisify(execFile)('tar', ['-czf', path.join(work, 'evilpkg-1.0.tar.gz'), '-C', work, 'evilpkg-1.0']);
      files.set('dist/evilpkg-1.0.tar.gz', {
        data: await fs.readFile(path.join(work, 'evilpkg-1.0.tar.gz')),
        executable: false,
      });
    } finally {
      await fs.rm(work, { recursive: true, force: true });
    }
    const build = await deploy('pip-sdist-backend', files);
    // The backend did run (so this test exercises the attack), but only in the sandbox, as nobody.
    const runs = [...build.log.matchAll(/FERRY-ATTACK backend ran as uid (\d+)/g)];
    assert.ok(runs.length > 0, `pip never ran the backend; log:\n${build.log}`);
    for (const match of runs) assert.equal(match[1], '65534', build.log);
    await assert.rejects(fs.access(marker), `the marker must not be written on the host; log:\n${build.log}`);
  });

  it('(d) an .npmrc git= program never runs as the server', { timeout: TIMEOUT }, async () => {
    const marker = await markerPath('npm-gitwrap');
    const build = await deploy('npm-gitwrap', await fixture('npm-gitwrap', { __MARKER__: marker }));
    // npm did run it (so this test exercises the attack), but only in the sandbox, as nobody.
    const runs = [...build.log.matchAll(/FERRY-ATTACK gitwrap ran as uid (\d+)/g)];
    assert.ok(runs.length > 0, `npm never ran the app's git; log:\n${build.log}`);
    for (const match of runs) assert.equal(match[1], '65534', build.log);
    await assert.rejects(fs.access(marker), `the marker must not be written on the host; log:\n${build.log}`);
    assert.equal(build.state, 'failed', build.log);
  });

  describe('(e) limits', () => {
    async function limitedServer(env: Record<string, string>) {
      const limited = await startServer({ env });
      return { server: limited, auth: await limited.bootstrap() };
    }

    it('a build step is held to its memory and process limits', { timeout: TIMEOUT }, async () => {
      const on = await limitedServer({ FERRY_BUILD_MEMORY_MIB: '256', FERRY_BUILD_MAX_PROCESSES: '64' });
      try {
        const memory = await deploy('npm-hog', await fixture('npm-hog', { __MODE__: 'memory' }), on);
        assert.match(memory.log, /FERRY-ATTACK memory hog exit 137/, 'the hog was killed');
        assert.doesNotMatch(memory.log, /FERRY-ATTACK memory hog got 1 GiB/);
        const pids = await deploy('npm-hog', await fixture('npm-hog', { __MODE__: 'pids' }), on);
        assert.match(pids.log, /FERRY-ATTACK fork refused/, pids.log);
        const started = Number(/FERRY-ATTACK pids started (\d+)/.exec(pids.log)?.[1] ?? Number.NaN);
        assert.ok(started > 0 && started < 64, `started ${started} processes; log:\n${pids.log}`);
      } finally {
        await on.server.close();
      }
    });

    it('a build that does not end is stopped at its time limit, with everything it started', {
      timeout: TIMEOUT,
    }, async () => {
      const on = await limitedServer({ FERRY_BUILD_TIMEOUT_SECONDS: '10' });
      const sleep = String(5000 + Math.floor(Math.random() * 4000));
      try {
        const build = await deploy('npm-hog', await fixture('npm-hog', { __MODE__: 'time', __SLEEP__: sleep }), on);
        assert.equal(build.state, 'failed', build.log);
        assert.match(build.error ?? '', /took longer than its time limit \(10 s\)/);
        assert.deepEqual(await processesWithArgs(['sleep', sleep]), [], 'the sleep is gone');
      } finally {
        await on.server.close();
      }
    });
  });

  it('(f) without bubblewrap, the build log says loudly that the build is not sandboxed', {
    timeout: TIMEOUT,
  }, async () => {
    const dataDir = await tempDir();
    const serve = await spawnServe(dataDir, { FERRY_SANDBOX: 'off' });
    try {
      const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json']);
      assert.equal(boot.code, 0, boot.stderr);
      const { project_id: projectId, token } = JSON.parse(boot.stdout) as { project_id: string; token: string };
      const build = await deploy('victim', await fixture('victim'), { server: serve, auth: { projectId, token } });
      assert.equal(build.state, 'ready', build.log);
      assert.match(build.log, /^WARNING: this build is NOT sandboxed/m);
    } finally {
      await serve.stop();
      await fs.rm(dataDir, { recursive: true, force: true });
    }
  });
});
