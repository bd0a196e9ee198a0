/**
 * Several Ferry processes sharing one PostgreSQL store, one keys folder and one artifacts folder (issue 12,
 * points 3 and 4): build outputs travel through the artifacts folder (build-output.ts), and changes made
 * through one process reach the others through the change feed (PostgreSQL LISTEN/NOTIFY).
 *
 * Two servers run in this process on real sockets, each with its own data directory, on a database this
 * file creates on the machine's PostgreSQL and drops at the end. The build-output tests use real folders
 * (on two file systems where the machine has them: /tmp and /dev/shm).
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { createDiskArtifactStore } from '../src/builds/artifact-store.js';
import { BuildFailedError } from '../src/builds/build-failed.js';
import { createBuildOutput, STALE_STAGING_MS } from '../src/builds/build-output.js';
import { DEFAULT_ZIP_LIMITS } from '../src/builds/zip-archive.js';
import type { ChangeEvent, FeedEvent } from '../src/cluster/change-feed.js';
import { createPgChangeFeed, LISTENER_APPLICATION_NAME } from '../src/cluster/pg-change-feed.js';
import type { FerryError } from '../src/errors.js';
import { createLogger } from '../src/logger.js';
import { helloApp } from './helpers/app-zip.js';
import { deployFiles, http, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { makeZip } from './helpers/raw-zip.js';
import { takeOverBuild } from './helpers/recovery.js';

/** The machine's PostgreSQL, as the maintenance database (trust auth). */
const ADMIN_URL = process.env.FERRY_TEST_PG_ADMIN_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';

/** A fresh database for this file, and the function that drops it (whoever is still connected). */
async function createDatabase(): Promise<{ url: string; name: string; drop(): Promise<void> }> {
  const name = `ferry_shared_${randomBytes(6).toString('hex')}`;
  const admin = async (statement: string) => {
    const client = new pg.Client({ connectionString: ADMIN_URL });
    await client.connect();
    try {
      await client.query(statement);
    } finally {
      await client.end();
    }
  };
  await admin(`CREATE DATABASE ${name}`);
  const url = new URL(ADMIN_URL);
  url.pathname = `/${name}`;
  return { url: url.toString(), name, drop: () => admin(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`) };
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}

/** A logger whose JSON lines the test can read. */
function capturedLogger() {
  const lines: string[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(...chunk.toString().split('\n').filter(Boolean));
      done();
    },
  });
  return { logger: createLogger({ level: 'info', pretty: false, destination }), lines };
}

const helloToml = (name: string, extra = '') => `[app]\nname = "${name}"\n${extra}`;

describe('several processes on one PostgreSQL, keys folder and artifacts folder', () => {
  let db: Awaited<ReturnType<typeof createDatabase>>;
  let a: TestServer;
  let b: TestServer;
  let artifactsDir: string;
  let auth: { projectId: string; token: string };

  before(async () => {
    db = await createDatabase();
    const keysDir = await tempDir('ferry-keys-');
    artifactsDir = await tempDir('ferry-artifacts-');
    const shared = { databaseUrl: db.url, keysDir, artifactsDir };
    a = await startServer(shared);
    b = await startServer(shared);
    assert.notEqual(a.dataDir, b.dataDir);
    auth = await a.bootstrap('fleet');
  });

  after(async () => {
    await b?.close();
    await a?.close();
    await db?.drop();
  });

  it('runs a build deployed through A through B at once, fetched from the artifacts folder', async () => {
    const build = await deployFiles(a, auth, 'shared-hello', {
      'ferry.toml': helloToml('shared-hello'),
      'main.ts': "export function run({ name = 'world' }) { return { message: 'Hello, ' + name + '!' }; }\n",
    });
    assert.equal(await exists(path.join(b.dataDir, 'builds', build.id)), false, 'B never had this build');
    assert.equal(await exists(path.join(artifactsDir, 'builds', build.id, 'out')), true, 'A published the output');

    const res = await http(`${b.url}/v4/${auth.projectId}/shared-hello/run`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'B' },
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { message: 'Hello, B!' });
    assert.equal(await exists(path.join(b.dataDir, 'builds', build.id, 'out')), true, 'B fetched it');
    assert.equal(await exists(path.join(b.dataDir, 'builds', `${build.id}.complete`)), true);
    const staging = (await fs.readdir(path.join(b.dataDir, 'builds'))).filter((n) => n.startsWith('.staging-'));
    assert.deepEqual(staging, [], 'no staging folder left behind');
  });

  it('refuses on B, within a second, a token revoked through A', async (t) => {
    const created = await http(`${a.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'to-revoke', scopes: ['manage'] },
    });
    assert.equal(created.status, 201, created.text);
    const token: string = created.json.token;
    const appsOnB = () => http(`${b.url}/v2/projects/${auth.projectId}/apps`, { token });
    // B checks the token once and caches the answer (AUTH_CACHE_MS).
    assert.equal((await appsOnB()).status, 200);
    const seen: FeedEvent[] = [];
    const stop = b.services.changes.subscribe((event) => seen.push(event));
    try {
      const revoke = await http(`${a.url}/v2/projects/${auth.projectId}/service-accounts/${created.json.id}`, {
        method: 'DELETE',
        token: auth.token,
      });
      assert.equal(revoke.status, 200, revoke.text);
      const answered = Date.now();

      // The check: polled every 50 ms, B refuses the token within 1 s of A's answer.
      let refusedAfterMs: number | undefined;
      let attempts = 0;
      for (let attempt = 0; attempt < 40 && Date.now() - answered <= 1000; attempt++) {
        attempts++;
        const sent = Date.now();
        const res = await appsOnB();
        if (res.status === 401) {
          assert.equal(res.json.error.code, 'FERRY_TOKEN_REVOKED');
          refusedAfterMs = sent - answered;
          break;
        }
        assert.equal(res.status, 200, res.text);
        await sleep(50);
      }
      assert.notEqual(refusedAfterMs, undefined, 'B still accepted the revoked token 1 s after A revoked it');
      t.diagnostic(`B refused the revoked token at request ${attempts}, sent ${refusedAfterMs} ms after A answered`);

      // And it is the change feed that did it: B heard of the revocation, and what it answers after that is a
      // refusal (its cache would have accepted the token for a second).
      await waitFor(
        async () => seen.some((e) => e.type === 'service-account.changed' && e.serviceAccountId === created.json.id),
        5000,
        'the revocation to reach B',
      );
      const next = await appsOnB();
      assert.equal(next.status, 401);
      assert.equal(next.json.error.code, 'FERRY_TOKEN_REVOKED');
    } finally {
      stop();
    }
  });

  it('switches B to a newer build activated through A: its replicas and its next runs', async () => {
    const app = 'shared-switch';
    const version = (n: number) => ({
      'ferry.toml': helloToml(app),
      'main.ts': `export function run() { return { version: ${n} }; }\n`,
    });
    const runOnB = () =>
      http(`${b.url}/v4/${auth.projectId}/${app}/run`, { method: 'POST', token: auth.token, body: {} });
    const v1 = await deployFiles(a, auth, app, version(1));
    const first = await runOnB();
    assert.equal(first.status, 200, first.text);
    assert.deepEqual(first.json.result, { version: 1 });
    const poolsOnB = () =>
      b.services.replicas.pools().filter((p) => p.build.projectId === auth.projectId && p.build.appId === app);
    assert.deepEqual(
      poolsOnB().map((p) => p.build.buildId),
      [v1.id],
    );

    const seen: FeedEvent[] = [];
    const stop = b.services.changes.subscribe((event) => seen.push(event));
    try {
      const v2 = await deployFiles(a, auth, app, version(2));
      await waitFor(
        async () => seen.some((e) => e.type === 'build.activated' && e.buildId === v2.id),
        10_000,
        'the activation to reach B',
      );
      // Before any run through B: B made a pool for the new build (the old one drains).
      await waitFor(async () => poolsOnB().some((p) => p.build.buildId === v2.id), 10_000, "B's switch to v2");
      const next = await runOnB();
      assert.equal(next.status, 200, next.text);
      assert.deepEqual(next.json.result, { version: 2 });
      assert.equal(await exists(path.join(b.dataDir, 'builds', v2.id, 'out')), true);
    } finally {
      stop();
    }
  });

  it('tells B when a secret changes through A (replicas read secrets when they start)', async () => {
    const seen: FeedEvent[] = [];
    const stop = b.services.changes.subscribe((event) => seen.push(event));
    try {
      const set = await http(`${a.url}/v2/projects/${auth.projectId}/secrets/GREETING`, {
        method: 'PUT',
        token: auth.token,
        body: { value: 'hi' },
      });
      assert.equal(set.status, 200, set.text);
      await waitFor(
        async () => seen.some((e) => e.type === 'secrets.changed' && e.projectId === auth.projectId),
        5000,
        'the secret change to reach B',
      );
    } finally {
      stop();
    }
  });

  it('answers 502 FERRY_REPLICA_START_FAILED on B, not a 500, when the published build is gone', async () => {
    const build = await deployFiles(a, auth, 'shared-gone', {
      'ferry.toml': helloToml('shared-gone'),
      'main.ts': 'export function run() { return 1; }\n',
    });
    await fs.rm(path.join(artifactsDir, 'builds', build.id), { recursive: true });
    const res = await http(`${b.url}/v4/${auth.projectId}/shared-gone/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 502, res.text);
    assert.equal(res.json.error.code, 'FERRY_REPLICA_START_FAILED');
    assert.equal(res.text.includes(artifactsDir), false, 'no server path in the answer');
  });

  // It stops A's build pipeline: keep it after the tests that deploy through A.
  it('builds on B an upload A received, from the archive in the artifact store; A then runs it', async () => {
    await a.services.pipeline.close(); // A takes no more builds, so B must build what A receives
    const upload = await http(`${a.url}/v2/projects/${auth.projectId}/apps/built-on-b/builds`, {
      method: 'POST',
      token: auth.token,
      body: await helloApp('built-on-b'),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(upload.status, 201, upload.text);
    const id: string = upload.json.id;
    assert.equal(await exists(path.join(a.dataDir, 'builds', id, 'source', 'main.ts')), true);
    assert.equal(await exists(path.join(b.dataDir, 'builds', id)), false);
    const row = await b.services.store.selectFrom('builds').selectAll().where('id', '=', id).executeTakeFirstOrThrow();
    assert.deepEqual([row.state, row.owner], ['pending', a.services.node.id], 'A holds what it received');
    // A lets go of its work as a stopping process does (its lease ends); B takes the build over.
    await a.services.node.close();
    await takeOverBuild(b, id);
    const built = await waitFor(
      async () => {
        const res = await http(`${b.url}/v2/projects/${auth.projectId}/apps/built-on-b/builds/${id}`, {
          token: auth.token,
        });
        return ['ready', 'failed', 'cancelled'].includes(res.json.state) ? res.json : undefined;
      },
      60_000,
      'the build on B',
    );
    assert.equal(built.state, 'ready', built.error);
    assert.equal(await exists(path.join(b.dataDir, 'builds', id, 'source', 'main.ts')), true);

    // A has the source it received but not the output: it replaces its folder with the published build.
    const res = await http(`${a.url}/v4/${auth.projectId}/built-on-b/run`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'A' },
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { message: 'Hello, A!' });
    assert.equal(await exists(path.join(a.dataDir, 'builds', id, 'out')), true);
  });

  it('says which process answered the per-process views (app log, stats)', async () => {
    const node = `${os.hostname()}:${process.pid}`;
    const logs = await http(`${b.url}/v2/projects/${auth.projectId}/apps/shared-hello/logs`, { token: auth.token });
    assert.equal(logs.status, 200, logs.text);
    assert.equal(logs.json.node, node);
    const stats = await http(`${b.url}/v2/projects/${auth.projectId}/apps/shared-hello/stats?minutes=5`, {
      token: auth.token,
    });
    assert.equal(stats.status, 200, stats.text);
    assert.equal(stats.json.node, node);
  });
});

describe('the PostgreSQL change feed', () => {
  let db: Awaited<ReturnType<typeof createDatabase>>;
  before(async () => {
    db = await createDatabase();
  });
  after(async () => {
    await db?.drop();
  });

  it('delivers events to the other processes, skips its own echo, ignores junk, and recovers after its connection is killed', async () => {
    const logger = createLogger({ level: 'silent', pretty: false });
    const options = { databaseUrl: db.url, logger, minBackoffMs: 20, maxBackoffMs: 200 };
    const one = await createPgChangeFeed(options);
    const two = await createPgChangeFeed(options);
    const atOne: FeedEvent[] = [];
    const atTwo: FeedEvent[] = [];
    one.subscribe((e) => atOne.push(e));
    two.subscribe((e) => atTwo.push(e));
    const event = (serviceAccountId: string): ChangeEvent => ({
      type: 'service-account.changed',
      projectId: 'p-00000001',
      serviceAccountId,
    });
    const count = (events: FeedEvent[], id: string) =>
      events.filter((e) => e.type === 'service-account.changed' && e.serviceAccountId === id).length;
    const arrived = (events: FeedEvent[], id: string, what: string) =>
      waitFor(async () => count(events, id) > 0, 10_000, what);
    try {
      await two.publish(event('sa-before'));
      assert.equal(count(atTwo, 'sa-before'), 1, 'the publisher tells its own subscribers at once');
      await arrived(atOne, 'sa-before', 'the first event');

      // Junk on the channel is ignored; what follows still arrives. Notifications reach each listener in
      // commit order, so once `sa-marker` is at `two`, its own echo of `sa-before` has been there too.
      const admin = new pg.Client({ connectionString: db.url });
      await admin.connect();
      try {
        await admin.query(`SELECT pg_notify('ferry_changes', 'not json')`);
        await admin.query(`SELECT pg_notify('ferry_changes', '{"origin":"x","event":{"type":"bogus"}}')`);
      } finally {
        await admin.end();
      }
      await one.publish(event('sa-marker'));
      await arrived(atTwo, 'sa-marker', 'the marker');
      assert.equal(count(atTwo, 'sa-before'), 1, 'a process does not hear its own event twice');

      // Kill both listeners' connections, as a database restart or a network cut would.
      const admin2 = new pg.Client({ connectionString: db.url });
      await admin2.connect();
      let killed: number;
      try {
        const result = await admin2.query(
          'SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity WHERE datname = $1 AND application_name = $2',
          [db.name, LISTENER_APPLICATION_NAME],
        );
        killed = result.rows.filter((r: { ok: boolean }) => r.ok).length;
      } finally {
        await admin2.end();
      }
      assert.equal(killed, 2, 'both listeners were connected');
      // Events sent while a listener was down are lost, so a reconnected feed says everything changed.
      await waitFor(async () => atOne.some((e) => e.type === 'resync'), 10_000, 'one to reconnect');
      await two.publish(event('sa-after'));
      await arrived(atOne, 'sa-after', 'an event after the reconnect');
      const order = atOne
        .map((e) => (e.type === 'resync' ? 'resync' : e.type === 'service-account.changed' ? e.serviceAccountId : ''))
        .filter((x) => x === 'sa-before' || x === 'resync' || x === 'sa-after');
      assert.deepEqual(order, ['sa-before', 'resync', 'sa-after']);
    } finally {
      await one.close();
      await two.close();
    }
  });
});

describe('build outputs in the artifacts folder', () => {
  const buildId = '0190f000-0000-7000-8000-00000000beef';

  /** Two processes' data dirs and one artifacts folder (on /dev/shm when `otherFs`, so files are copied). */
  async function setup(options: { otherFs?: boolean } = {}) {
    const root = await tempDir('ferry-output-');
    const artifactsDir = options.otherFs
      ? await fs.mkdtemp(path.join('/dev/shm', 'ferry-artifacts-'))
      : path.join(root, 'artifacts');
    await fs.mkdir(artifactsDir, { recursive: true });
    const artifacts = createDiskArtifactStore(artifactsDir);
    const make = async (name: string) => {
      const { logger, lines } = capturedLogger();
      const buildsDir = path.join(root, name, 'builds');
      const output = await createBuildOutput({
        buildsDir,
        artifactsDir,
        artifacts,
        zipLimits: DEFAULT_ZIP_LIMITS,
        logger,
      });
      return { output, buildsDir, lines };
    };
    return { root, artifactsDir, artifacts, make };
  }

  /** A build folder as a builder leaves it, with links that must stay links. */
  async function makeBuild(buildsDir: string) {
    const folder = path.join(buildsDir, buildId);
    await fs.mkdir(path.join(folder, 'source'), { recursive: true });
    await fs.mkdir(path.join(folder, 'out', 'bin'), { recursive: true });
    await fs.writeFile(path.join(folder, 'source', 'main.ts'), 'export const run = () => 1;\n');
    await fs.writeFile(path.join(folder, 'out', 'main.mjs'), 'export const run = () => 1;\n');
    await fs.writeFile(path.join(folder, 'out', 'bin', 'tool'), '#!/bin/sh\n', { mode: 0o755 });
    await fs.chmod(path.join(folder, 'out', 'bin', 'tool'), 0o755);
    await fs.symlink('/etc/hostname', path.join(folder, 'out', 'outside'));
    await fs.symlink('/etc', path.join(folder, 'out', 'etc-dir'));
    await fs.symlink('../source/main.ts', path.join(folder, 'out', 'relative'));
    return folder;
  }

  async function checkCopy(from: string, to: string, sameInode: boolean) {
    assert.equal(await fs.readFile(path.join(to, 'out', 'main.mjs'), 'utf8'), 'export const run = () => 1;\n');
    assert.equal((await fs.stat(path.join(to, 'out', 'bin', 'tool'))).mode & 0o777, 0o755);
    for (const [link, target] of [
      ['outside', '/etc/hostname'],
      ['etc-dir', '/etc'],
      ['relative', '../source/main.ts'],
    ] as const) {
      assert.equal((await fs.lstat(path.join(to, 'out', link))).isSymbolicLink(), true, `${link} stays a link`);
      assert.equal(await fs.readlink(path.join(to, 'out', link)), target);
    }
    const a = await fs.stat(path.join(from, 'out', 'main.mjs'));
    const b = await fs.stat(path.join(to, 'out', 'main.mjs'));
    assert.equal(a.ino === b.ino && a.dev === b.dev, sameInode);
  }

  it('publishes a build (hard links on one file system) and fetches it into another data dir once', async () => {
    const { artifactsDir, make } = await setup();
    const builder = await make('a');
    const runner = await make('b');
    const folder = await makeBuild(builder.buildsDir);
    await builder.output.publish(buildId);
    const shared = path.join(artifactsDir, 'builds', buildId);
    await checkCopy(folder, shared, true);

    // Concurrent callers (replicas starting together) share one fetch.
    await Promise.all(Array.from({ length: 5 }, () => runner.output.ensureLocal(buildId)));
    await runner.output.ensureLocal(buildId);
    await checkCopy(shared, path.join(runner.buildsDir, buildId), true);
    assert.equal(runner.lines.filter((l) => l.includes('fetched the build')).length, 1);
    assert.deepEqual(
      (await fs.readdir(runner.buildsDir)).sort(),
      [buildId, `${buildId}.complete`].sort(),
      'nothing else left in builds/',
    );
  });

  it('copies instead of linking across file systems', async () => {
    const tmpDev = (await fs.stat(os.tmpdir())).dev;
    const shmDev = await fs.stat('/dev/shm').then(
      (s) => s.dev,
      () => tmpDev,
    );
    assert.notEqual(shmDev, tmpDev, 'this test needs /dev/shm on another file system than the temp folder');
    const { artifactsDir, make } = await setup({ otherFs: true });
    try {
      const builder = await make('a');
      const runner = await make('b');
      const folder = await makeBuild(builder.buildsDir);
      await builder.output.publish(buildId);
      await checkCopy(folder, path.join(artifactsDir, 'builds', buildId), false);
      await runner.output.ensureLocal(buildId);
      await checkCopy(path.join(artifactsDir, 'builds', buildId), path.join(runner.buildsDir, buildId), false);
    } finally {
      await fs.rm(artifactsDir, { recursive: true, force: true });
    }
  });

  it('replaces a local folder that is not the published build (the upload was received here, built elsewhere)', async () => {
    const { make } = await setup();
    const builder = await make('a');
    const receiver = await make('b');
    await makeBuild(builder.buildsDir);
    await builder.output.publish(buildId);
    await fs.mkdir(path.join(receiver.buildsDir, buildId, 'source'), { recursive: true });
    await fs.writeFile(path.join(receiver.buildsDir, buildId, 'source', 'main.ts'), 'stale\n');
    await receiver.output.ensureLocal(buildId);
    assert.equal(await exists(path.join(receiver.buildsDir, buildId, 'out', 'main.mjs')), true);
    assert.equal(
      await fs.readFile(path.join(receiver.buildsDir, buildId, 'source', 'main.ts'), 'utf8'),
      'export const run = () => 1;\n',
    );
  });

  it('refuses a build that is nowhere, and leaves no staging folder when a copy fails half-way', async () => {
    const { root, artifactsDir, make } = await setup();
    const runner = await make('b');
    await assert.rejects(runner.output.ensureLocal(buildId), (err: FerryError) => {
      assert.equal(err.code, 'FERRY_REPLICA_START_FAILED');
      assert.doesNotMatch(err.message, /\//, 'no server path in what a caller sees');
      return true;
    });
    assert.ok(runner.lines.some((l) => l.includes('neither in this data directory nor in the artifacts folder')));
    await assert.rejects(runner.output.ensureLocal('../escape'), /Invalid build id/);

    // A path that fits under the build folder but not under the (longer) staging folder: the copy fails
    // with ENAMETOOLONG after it has begun.
    const builder = await make('a');
    const folder = path.join(builder.buildsDir, buildId);
    const stagingLength = path.join(artifactsDir, 'builds', `.staging-${buildId}-00000000`).length;
    let deep = path.join(folder, 'out');
    while (deep.length + 200 < 4095 - (stagingLength - folder.length)) deep = path.join(deep, 'd'.repeat(199));
    const file = path.join(deep, 'x'.repeat(Math.max(1, 4095 - deep.length - 2)));
    assert.ok(file.length <= 4095 && file.length + (stagingLength - folder.length) > 4095);
    await fs.mkdir(deep, { recursive: true });
    await fs.writeFile(file, 'deep');
    await fs.writeFile(path.join(folder, 'out', 'a-first'), 'copied before the failure');
    await assert.rejects(builder.output.publish(buildId), { code: 'ENAMETOOLONG' });
    assert.deepEqual(await fs.readdir(path.join(artifactsDir, 'builds')), [], 'no staging folder, no build');
    await fs.rm(root, { recursive: true, force: true });
  });

  it('removes staging folders left by a crash: its own at once, shared ones once old', async () => {
    const { root, artifactsDir, make } = await setup();
    const buildsDir = path.join(root, 'c', 'builds');
    const shared = path.join(artifactsDir, 'builds');
    await fs.mkdir(path.join(buildsDir, '.staging-x-1', 'out'), { recursive: true });
    await fs.mkdir(path.join(shared, '.staging-y-fresh', 'out'), { recursive: true });
    await fs.mkdir(path.join(shared, '.staging-y-old', 'out'), { recursive: true });
    const old = new Date(Date.now() - STALE_STAGING_MS - 60_000);
    await fs.utimes(path.join(shared, '.staging-y-old'), old, old);
    await make('c');
    assert.deepEqual(await fs.readdir(buildsDir), []);
    assert.deepEqual(await fs.readdir(shared), ['.staging-y-fresh']);
  });

  it('extracts the source from the stored archive with the upload checks when this process did not receive it', async () => {
    const { artifacts, make, root } = await setup();
    const builder = await make('a');
    const store = async (id: string, zip: Buffer) => {
      const file = path.join(root, `${id}.zip`);
      await fs.writeFile(file, zip);
      await artifacts.put(id, file);
    };
    await store(buildId, await helloApp('hello'));
    await builder.output.ensureSource({ id: buildId });
    assert.match(await fs.readFile(path.join(builder.buildsDir, buildId, 'source', 'main.ts'), 'utf8'), /Hello/);
    assert.equal(await exists(path.join(builder.buildsDir, buildId, 'source', 'ferry.toml')), true);

    const bad = '0190f000-0000-7000-8000-0000000000ba';
    await store(
      bad,
      makeZip([
        { name: 'ferry.toml', data: '[app]\nname = "x"\n' },
        { name: '../evil', data: 'x' },
      ]),
    );
    await assert.rejects(builder.output.ensureSource({ id: bad }), (err: unknown) => {
      assert.ok(err instanceof BuildFailedError);
      assert.match(err.message, /cannot be extracted/);
      return true;
    });
    const missing = '0190f000-0000-7000-8000-0000000000bb';
    await assert.rejects(builder.output.ensureSource({ id: missing }), /archive of this build is missing/);
    assert.deepEqual((await fs.readdir(builder.buildsDir)).sort(), [buildId], 'nothing of the refused archives');
    assert.equal(await exists(path.join(root, 'a', 'builds', 'evil')), false);
    assert.equal(await exists(path.join(root, 'a', 'evil')), false);
  });
});
