/**
 * Artifacts in the JetStream object store (issue 13, item 2): with `--nats-url`, uploaded archives and
 * build outputs go to the cluster's artifacts bucket, so processes that share no folder (each its own
 * data dir and artifacts folder) run and build each other's builds.
 *
 * Real NATS JetStream on 127.0.0.1:4222 and the machine's PostgreSQL; a fresh cluster name per test (its
 * bucket deleted at the end) and a fresh database per server pair.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable, Writable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { jetstreamManager } from '@nats-io/jetstream';
import { Objm } from '@nats-io/obj';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import tar from 'tar-stream';
import { createNatsArtifactStore, openArtifactsBucket, putObject } from '../src/builds/nats-artifact-store.js';
import { createNatsBuildOutput } from '../src/builds/nats-build-output.js';
import { DEFAULT_ZIP_LIMITS } from '../src/builds/zip-archive.js';
import { clusterNames } from '../src/cluster/nats.js';
import type { FerryError } from '../src/errors.js';
import { createLogger } from '../src/logger.js';
import { helloApp } from './helpers/app-zip.js';
import { deployFiles, http, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { corruptObject } from './helpers/nats.js';
import { takeOverBuild } from './helpers/recovery.js';
import { createTestDatabase, type TestDatabase } from './helpers/store.js';

const NATS_URL = process.env.FERRY_TEST_NATS_URL ?? 'nats://127.0.0.1:4222';
const freshCluster = () => `t${randomBytes(6).toString('hex')}`;

async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}

/** Every path below `dir` (relative), folders included. */
async function listTree(dir: string): Promise<string[]> {
  const entries = await fs.readdir(dir, { recursive: true }).catch(() => [] as string[]);
  return entries.map(String).sort();
}

/** A logger whose JSON lines the test can read. */
function capturedLogger() {
  const lines: Array<{ msg: string; [key: string]: unknown }> = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString().split('\n').filter(Boolean)) lines.push(JSON.parse(line));
      done();
    },
  });
  return { logger: createLogger({ level: 'info', pretty: false, destination }), lines };
}

/** A NATS connection for the test itself, and the removal of a cluster's artifacts bucket. */
async function natsForTest(): Promise<NatsConnection> {
  try {
    return await connect({ servers: NATS_URL, timeout: 5000 });
  } catch (err) {
    throw new Error(`these tests need NATS JetStream at ${NATS_URL}; start it with: bash scripts/start-services.sh`, {
      cause: err,
    });
  }
}

async function deleteBucket(nc: NatsConnection, cluster: string): Promise<void> {
  const bucket = clusterNames(cluster).artifactsBucket;
  const jsm = await jetstreamManager(nc);
  await jsm.streams.delete(`OBJ_${bucket}`).catch(() => false);
}

const helloToml = (name: string) => `[app]\nname = "${name}"\n`;

describe('two processes sharing PostgreSQL and NATS, and no folder', () => {
  let db: TestDatabase;
  let cluster: string;
  let nc: NatsConnection;
  let a: TestServer;
  let b: TestServer;
  let artifactsA: string;
  let artifactsB: string;
  let auth: { projectId: string; token: string };

  before(async () => {
    nc = await natsForTest();
    db = await createTestDatabase();
    cluster = freshCluster();
    const keysDir = await tempDir('ferry-keys-');
    artifactsA = await tempDir('ferry-artifacts-a-');
    artifactsB = await tempDir('ferry-artifacts-b-');
    const shared = { databaseUrl: db.url, keysDir, natsUrl: NATS_URL, clusterName: cluster };
    a = await startServer({ ...shared, artifactsDir: artifactsA });
    b = await startServer({ ...shared, artifactsDir: artifactsB });
    auth = await a.bootstrap('nats-artifacts');
  });

  after(async () => {
    await b?.close();
    await a?.close();
    await db?.drop();
    if (nc) {
      await deleteBucket(nc, cluster);
      await nc.close();
    }
  });

  it('runs through B a build deployed through A, fetched from the object store', async () => {
    const build = await deployFiles(a, auth, 'nats-hello', {
      'ferry.toml': helloToml('nats-hello'),
      'main.ts': "export function run({ name = 'world' }) { return { message: 'Hello, ' + name + '!' }; }\n",
    });
    assert.equal(await exists(path.join(b.dataDir, 'builds', build.id)), false, 'B never had this build');
    const os = await openArtifactsBucket(nc, clusterNames(cluster).artifactsBucket);
    const stored = await os.info(`build/${build.id}`);
    assert.ok(stored && !stored.deleted, 'A put the build output in the object store');
    assert.match(stored.digest, /^SHA-256=/);
    assert.ok(await os.info(`archive/${build.id}`), 'A put the uploaded archive in the object store');

    const res = await http(`${b.url}/v4/${auth.projectId}/nats-hello/run`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'B' },
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { message: 'Hello, B!' });
    assert.equal(await exists(path.join(b.dataDir, 'builds', build.id, 'out')), true, 'B fetched it');
    assert.equal(await exists(path.join(b.dataDir, 'builds', `${build.id}.complete`)), true);
    const leftovers = (await fs.readdir(path.join(b.dataDir, 'builds'))).filter((n) => n.startsWith('.staging-'));
    assert.deepEqual(leftovers, [], 'no staging folder or download left behind');

    // B lists the archive it never received: fetched from the object store into its own cache.
    const listing = await http(
      `${b.url}/v2/projects/${auth.projectId}/apps/nats-hello/builds/${build.id}/zip-contents`,
      { token: auth.token },
    );
    assert.equal(listing.status, 200, listing.text);
    assert.deepEqual(listing.json.files.map((f: { path: string }) => f.path).sort(), ['ferry.toml', 'main.ts']);

    // Neither artifacts folder was used: nothing travelled through a filesystem.
    assert.deepEqual(await listTree(artifactsA), []);
    assert.deepEqual(await listTree(artifactsB), []);
  });

  // It stops A's build pipeline and lease: keep it last.
  it('builds on B an upload A received, from the archive in the object store; A then runs it', async () => {
    await a.services.pipeline.close(); // A takes no more builds, so B must build what A receives
    const upload = await http(`${a.url}/v2/projects/${auth.projectId}/apps/nats-built-on-b/builds`, {
      method: 'POST',
      token: auth.token,
      body: await helloApp('nats-built-on-b'),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(upload.status, 201, upload.text);
    const id: string = upload.json.id;
    assert.equal(await exists(path.join(b.dataDir, 'builds', id)), false);
    await a.services.node.close();
    await takeOverBuild(b, id);
    const built = await waitFor(
      async () => {
        const res = await http(`${b.url}/v2/projects/${auth.projectId}/apps/nats-built-on-b/builds/${id}`, {
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
    assert.equal(await exists(path.join(a.dataDir, 'builds', id, 'out')), false);
    const res = await http(`${a.url}/v4/${auth.projectId}/nats-built-on-b/run`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'A' },
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { message: 'Hello, A!' });
    assert.equal(await exists(path.join(a.dataDir, 'builds', id, 'out')), true);
    assert.deepEqual(await listTree(artifactsA), []);
    assert.deepEqual(await listTree(artifactsB), []);
  });
});

describe('build outputs in the object store', () => {
  const buildId = '0190f000-0000-7000-8000-00000000cafe';
  let nc: NatsConnection;
  const clusters: string[] = [];

  before(async () => {
    nc = await natsForTest();
  });
  after(async () => {
    if (!nc) return;
    for (const cluster of clusters) await deleteBucket(nc, cluster);
    await nc.close();
  });

  /** Two processes' data dirs on one fresh cluster's bucket. */
  async function setup() {
    const cluster = freshCluster();
    clusters.push(cluster);
    const root = await tempDir('ferry-nats-output-');
    const bucketName = clusterNames(cluster).artifactsBucket;
    const bucket = await openArtifactsBucket(nc, bucketName);
    const make = async (name: string) => {
      const { logger, lines } = capturedLogger();
      const artifacts = await createNatsArtifactStore({
        nc,
        bucket: bucketName,
        cacheDir: path.join(root, name, 'archive-cache'),
        logger,
      });
      const buildsDir = path.join(root, name, 'builds');
      const output = await createNatsBuildOutput({
        buildsDir,
        bucket,
        artifacts,
        zipLimits: DEFAULT_ZIP_LIMITS,
        logger,
      });
      return { output, buildsDir, lines };
    };
    return { root, bucket, bucketName, one: await make('one'), two: await make('two') };
  }

  /** A build folder as a builder leaves it, with links (relative, absolute, dangling) and modes. */
  async function makeBuild(buildsDir: string): Promise<string> {
    const folder = path.join(buildsDir, buildId);
    await fs.mkdir(path.join(folder, 'source', 'lib'), { recursive: true });
    await fs.mkdir(path.join(folder, 'out', 'bin'), { recursive: true });
    await fs.writeFile(path.join(folder, 'source', 'main.ts'), 'export const x = 1;\n');
    await fs.writeFile(path.join(folder, 'source', 'lib', 'big.bin'), randomBytes(300_000)); // several chunks
    await fs.writeFile(path.join(folder, 'out', 'bin', 'tool'), '#!/bin/sh\necho hi\n', { mode: 0o755 });
    await fs.chmod(path.join(folder, 'out', 'bin', 'tool'), 0o755);
    await fs.writeFile(path.join(folder, 'out', 'private'), 'p', { mode: 0o600 });
    await fs.chmod(path.join(folder, 'out', 'private'), 0o600);
    await fs.symlink('../source/main.ts', path.join(folder, 'out', 'main-link'));
    await fs.symlink('/etc/passwd', path.join(folder, 'out', 'absolute-link'));
    await fs.symlink('nowhere', path.join(folder, 'out', 'dangling'));
    await fs.symlink('../source/lib', path.join(folder, 'out', 'lib-link'));
    return folder;
  }

  it('keeps links as links and modes as they were; one fetch for concurrent callers', async () => {
    const { one, two } = await setup();
    const made = await makeBuild(one.buildsDir);
    await one.output.publish(buildId);

    await Promise.all(Array.from({ length: 5 }, () => two.output.ensureLocal(buildId)));
    const fetches = two.lines.filter((l) => l.msg === 'fetched the build from the object store');
    assert.equal(fetches.length, 1, 'five concurrent callers share one fetch');
    await two.output.ensureLocal(buildId); // known complete: no second fetch
    assert.equal(two.lines.filter((l) => l.msg === 'fetched the build from the object store').length, 1);

    const got = path.join(two.buildsDir, buildId);
    assert.deepEqual(await listTree(got), await listTree(made));
    for (const [link, target] of [
      ['out/main-link', '../source/main.ts'],
      ['out/absolute-link', '/etc/passwd'],
      ['out/dangling', 'nowhere'],
      ['out/lib-link', '../source/lib'],
    ] as const) {
      const stat = await fs.lstat(path.join(got, link));
      assert.equal(stat.isSymbolicLink(), true, `${link} stays a link`);
      assert.equal(await fs.readlink(path.join(got, link)), target);
    }
    assert.equal((await fs.stat(path.join(got, 'out', 'bin', 'tool'))).mode & 0o777, 0o755);
    assert.equal((await fs.stat(path.join(got, 'out', 'private'))).mode & 0o777, 0o600);
    assert.deepEqual(
      await fs.readFile(path.join(got, 'source', 'lib', 'big.bin')),
      await fs.readFile(path.join(made, 'source', 'lib', 'big.bin')),
    );
    assert.equal(await exists(path.join(two.buildsDir, `${buildId}.complete`)), true);
  });

  it('refuses a corrupted object (digest mismatch) with a clear error, leaving no folder', async () => {
    const { one, two, bucket, bucketName } = await setup();
    await fs.mkdir(path.join(one.buildsDir, buildId, 'out'), { recursive: true });
    await fs.writeFile(path.join(one.buildsDir, buildId, 'out', 'index.js'), 'module.exports = 1;\n');
    await one.output.publish(buildId);
    await corruptObject(nc, bucket, bucketName, `build/${buildId}`);

    await assert.rejects(two.output.ensureLocal(buildId), (err: FerryError) => {
      assert.equal(err.code, 'FERRY_REPLICA_START_FAILED');
      assert.match(err.message, /corrupt/);
      assert.match(err.message, /SHA-256 digest/);
      return true;
    });
    assert.deepEqual(await fs.readdir(two.buildsDir), [], 'no build folder, staging folder or download left');
  });

  it('refuses a tar that would write outside the build folder or through a link', async () => {
    const { two, bucket, root } = await setup();
    const outside = path.join(root, 'outside');
    await fs.mkdir(outside);
    const hostile = async (entries: Array<{ name: string; type: 'file' | 'symlink'; linkname?: string }>) => {
      const pack = tar.pack();
      for (const e of entries) {
        if (e.type === 'file') pack.entry({ name: e.name, type: 'file' }, 'owned\n');
        else pack.entry({ name: e.name, type: 'symlink', linkname: e.linkname ?? '' });
      }
      pack.finalize();
      const chunks: Buffer[] = [];
      for await (const chunk of pack) chunks.push(Buffer.from(chunk as Uint8Array));
      await putObject(bucket, `build/${buildId}`, Readable.from([Buffer.concat(chunks)]));
    };
    const cases: Array<{ entries: Parameters<typeof hostile>[0]; reason: RegExp }> = [
      { entries: [{ name: `../../outside/evil`, type: 'file' }], reason: /leaves the build folder/ },
      { entries: [{ name: `${outside}/evil`, type: 'file' }], reason: /absolute path/ },
      {
        entries: [
          { name: 'out/link', type: 'symlink', linkname: outside },
          { name: 'out/link/evil', type: 'file' },
        ],
        reason: /below "out\/link", which is a symlink/,
      },
      {
        entries: [
          { name: 'out/a', type: 'file' },
          { name: 'out/a', type: 'symlink', linkname: outside },
        ],
        reason: /same path as an earlier entry/,
      },
    ];
    for (const { entries, reason } of cases) {
      await hostile(entries);
      await assert.rejects(two.output.ensureLocal(buildId), (err: FerryError) => {
        assert.equal(err.code, 'FERRY_REPLICA_START_FAILED');
        assert.match(err.message, reason);
        return true;
      });
      assert.deepEqual(await fs.readdir(outside), [], 'nothing written outside');
      assert.deepEqual(await fs.readdir(two.buildsDir), [], 'no build folder, staging folder or download left');
    }
  });

  it('puts, fetches once into the cache, and deletes uploaded archives', async () => {
    const { root, bucket, bucketName } = await setup();
    const { logger } = capturedLogger();
    const here = await createNatsArtifactStore({ nc, bucket: bucketName, cacheDir: path.join(root, 'c1'), logger });
    const captured = capturedLogger();
    const there = await createNatsArtifactStore({
      nc,
      bucket: bucketName,
      cacheDir: path.join(root, 'c2'),
      logger: captured.logger,
    });
    const upload = path.join(root, 'upload.zip');
    const zip = await helloApp('cached');
    await fs.writeFile(upload, zip);
    await here.put(buildId, upload);
    assert.equal(await exists(upload), false, 'the upload was taken over');
    assert.equal(await here.localPath(buildId), path.join(root, 'c1', `${buildId}.zip`), 'kept where received');

    const paths = await Promise.all([there.localPath(buildId), there.localPath(buildId)]);
    assert.deepEqual(paths, [path.join(root, 'c2', `${buildId}.zip`), path.join(root, 'c2', `${buildId}.zip`)]);
    assert.deepEqual(await fs.readFile(paths[0] as string), zip);
    assert.equal(captured.lines.filter((l) => l.msg.startsWith('fetched the uploaded archive')).length, 1);

    await corruptObject(nc, bucket, bucketName, `archive/${buildId}`);
    await fs.rm(path.join(root, 'c2', `${buildId}.zip`));
    await assert.rejects(there.localPath(buildId), (err: FerryError) => {
      assert.equal(err.code, 'FERRY_ARTIFACTS_UNAVAILABLE');
      assert.match(err.message, /corrupt/);
      return true;
    });
    assert.deepEqual(await fs.readdir(path.join(root, 'c2')), [], 'no partial download left');

    await here.delete(buildId);
    assert.equal(await here.localPath(buildId), undefined);
    assert.equal(await there.localPath(buildId), undefined);
  });
});

// The object store itself, so the bucket this file makes is the one Ferry names.
describe('the artifacts bucket', () => {
  it('is named under the cluster name', async () => {
    const nc = await natsForTest();
    const cluster = freshCluster();
    try {
      await openArtifactsBucket(nc, clusterNames(cluster).artifactsBucket);
      const names: string[] = [];
      for await (const status of new Objm(nc).list()) names.push(status.bucket);
      assert.ok(names.includes(`${cluster}_artifacts`));
    } finally {
      await deleteBucket(nc, cluster);
      await nc.close();
    }
  });
});
