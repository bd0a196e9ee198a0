/**
 * The build output's contract (`BuildOutput`, builds/local-build-cache.ts; the seam of
 * docs/architecture.md): one suite body run against both places builds are published, each behind the
 * same local build cache:
 *
 * - the shared artifacts folder (`createBuildOutput`, builds/build-output.ts), every node with a data
 *   directory of its own and one artifacts folder between them;
 * - the JetStream object store (`createNatsBuildOutput`, builds/nats-build-output.ts), every node with its
 *   own data directory and archive cache and nothing shared but the bucket, on the machine's NATS at
 *   127.0.0.1:4222 under a cluster name of its own (`CONTRACTS_<random>`), whose bucket is deleted after.
 *
 * What the interface promises, proven on both: a build published by one node is fetched by another with an
 * empty local cache as it was (bytes, modes, links as links), once however many ask at once, and marked
 * complete; the publishing node fetches nothing; a second publish of a build keeps the first; a local folder
 * not known complete is replaced by the published build; a build that is nowhere is a coded error
 * (FERRY_REPLICA_START_FAILED) with no server path in it, leaving nothing behind; removal takes the local
 * folder, with `shared` the published copy too (retention, a deleted app), with `keepLocal` only that; a
 * build's source is extracted from its uploaded archive on a node that lacks it.
 *
 * Where the two differ on purpose (said here and in the report, not left out):
 * - Verification: the object store keeps each object's SHA-256 digest and a fetch refuses a copy that does
 *   not match it (its test runs on the object store only: the artifacts folder's is reported skipped with
 *   the reason). The artifacts folder is a file system Ferry's own user alone reads (mode 0700), whose
 *   copies are hard links of the same files: it keeps no digest, and a fetch copies what is there.
 * - Bytes freed by `remove({ shared: true })`: the folder counts the published copy's bytes, the object
 *   store does not (0); both count the local folder's.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Writable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { jetstreamManager } from '@nats-io/jetstream';
import type { ObjectStore } from '@nats-io/obj';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import { type ArtifactStore, createDiskArtifactStore } from '../src/builds/artifact-store.js';
import { BuildFailedError } from '../src/builds/build-failed.js';
import { type BuildOutput, createBuildOutput } from '../src/builds/build-output.js';
import { createNatsArtifactStore, openArtifactsBucket } from '../src/builds/nats-artifact-store.js';
import { createNatsBuildOutput } from '../src/builds/nats-build-output.js';
import { DEFAULT_ZIP_LIMITS } from '../src/builds/zip-archive.js';
import { clusterNames } from '../src/cluster/nats.js';
import { FerryError } from '../src/errors.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { zipFiles } from './helpers/app-zip.js';
import { tempDir } from './helpers/ferry.js';
import { corruptObject, NATS_URL } from './helpers/nats.js';

/** One node: its build output, its `builds/` folder, its artifact store and the messages it logged. */
interface OutputNode {
  output: BuildOutput;
  buildsDir: string;
  artifacts: ArtifactStore;
  messages: string[];
}

interface OutputImplementation {
  name: string;
  /** Paths a message to a caller must not show (the data directories, the shared folder). */
  privatePaths(): string[];
  open(): Promise<void>;
  /** A node with an empty data directory, on the same published builds as every other node. */
  node(): Promise<OutputNode>;
  /** Changes one byte of the published copy of the build (bit rot); absent: the place keeps no digest. */
  corrupt?(buildId: string): Promise<void>;
  /** Why this place has no corruption test (see the module comment). */
  noDigest?: string;
  cleanUp(): Promise<void>;
}

/** A logger whose messages the test reads (`fetched the build from …` counts fetches). */
function capturedLogger() {
  const messages: string[] = [];
  const destination = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString().split('\n').filter(Boolean)) messages.push(JSON.parse(line).msg);
      done();
    },
  });
  return { logger: createLogger({ level: 'info', pretty: false, destination }), messages };
}

const fetches = (n: OutputNode) => n.messages.filter((m) => m.startsWith('fetched the build from')).length;

async function exists(file: string): Promise<boolean> {
  return fs.lstat(file).then(
    () => true,
    () => false,
  );
}

/** Every path below `dir`, with what it is: a file's bytes (base64) and mode, a link's target. */
async function describeTree(dir: string): Promise<Record<string, string>> {
  const tree: Record<string, string> = {};
  for (const entry of (await fs.readdir(dir, { recursive: true })).map(String).sort()) {
    const full = path.join(dir, entry);
    const stat = await fs.lstat(full);
    const mode = (stat.mode & 0o777).toString(8);
    if (stat.isSymbolicLink()) tree[entry] = `link -> ${await fs.readlink(full)}`;
    else if (stat.isDirectory()) tree[entry] = `folder ${mode}`;
    else tree[entry] = `file ${mode} ${(await fs.readFile(full)).toString('base64')}`;
  }
  return tree;
}

/** A build folder as a builder leaves it: source and out, an executable, a private file, links kept as links. */
async function makeBuild(buildsDir: string, buildId: string, marker = 'one'): Promise<string> {
  const folder = path.join(buildsDir, buildId);
  await fs.mkdir(path.join(folder, 'source', 'lib'), { recursive: true });
  await fs.mkdir(path.join(folder, 'out', 'bin'), { recursive: true });
  await fs.writeFile(path.join(folder, 'source', 'main.ts'), `export const run = () => '${marker}';\n`);
  await fs.writeFile(path.join(folder, 'source', 'lib', 'data.bin'), randomBytes(100_000));
  await fs.writeFile(path.join(folder, 'out', 'main.mjs'), `export const run = () => '${marker}';\n`);
  await fs.writeFile(path.join(folder, 'out', 'bin', 'tool'), '#!/bin/sh\necho tool\n', { mode: 0o755 });
  await fs.chmod(path.join(folder, 'out', 'bin', 'tool'), 0o755);
  await fs.writeFile(path.join(folder, 'out', 'private'), 'mine\n', { mode: 0o600 });
  await fs.symlink('../source/main.ts', path.join(folder, 'out', 'relative'));
  await fs.symlink('/etc/hostname', path.join(folder, 'out', 'absolute'));
  await fs.symlink('nowhere', path.join(folder, 'out', 'dangling'));
  return folder;
}

function buildOutputContract(impl: OutputImplementation): void {
  describe(`build output contract: ${impl.name}`, () => {
    before(() => impl.open());
    after(() => impl.cleanUp());

    it('fetches a published build on another node as it was, once however many ask, and marks it complete', async () => {
      const [builder, runner] = [await impl.node(), await impl.node()];
      const buildId = uuidv7();
      const made = await makeBuild(builder.buildsDir, buildId);
      await builder.output.publish(buildId);
      assert.equal(await exists(path.join(runner.buildsDir, buildId)), false, 'the runner never had it');
      await Promise.all(Array.from({ length: 5 }, () => runner.output.ensureLocal(buildId)));
      assert.equal(fetches(runner), 1, 'five callers at once share one fetch');
      await runner.output.ensureLocal(buildId);
      assert.equal(fetches(runner), 1, 'known complete: not fetched again');
      const got = path.join(runner.buildsDir, buildId);
      assert.deepEqual(await describeTree(got), await describeTree(made));
      assert.equal(await exists(path.join(runner.buildsDir, `${buildId}.complete`)), true);
      assert.deepEqual(
        (await fs.readdir(runner.buildsDir)).sort(),
        [buildId, `${buildId}.complete`].sort(),
        'no staging folder or download left',
      );
      await builder.output.ensureLocal(buildId);
      assert.equal(fetches(builder), 0, 'the node that published it fetches nothing');
    });

    it('keeps the first publish of a build: a second one changes nothing', async () => {
      const [first, second, runner] = [await impl.node(), await impl.node(), await impl.node()];
      const buildId = uuidv7();
      const made = await makeBuild(first.buildsDir, buildId, 'first');
      await first.output.publish(buildId);
      await makeBuild(second.buildsDir, buildId, 'second');
      await second.output.publish(buildId);
      await runner.output.ensureLocal(buildId);
      assert.deepEqual(await describeTree(path.join(runner.buildsDir, buildId)), await describeTree(made));
    });

    it('replaces a local folder not known complete (an upload received here, built elsewhere) by the published build', async () => {
      const [builder, runner] = [await impl.node(), await impl.node()];
      const buildId = uuidv7();
      const made = await makeBuild(builder.buildsDir, buildId);
      await builder.output.publish(buildId);
      await fs.mkdir(path.join(runner.buildsDir, buildId, 'source'), { recursive: true });
      await fs.writeFile(path.join(runner.buildsDir, buildId, 'source', 'main.ts'), 'stale\n');
      await runner.output.ensureLocal(buildId);
      assert.equal(fetches(runner), 1);
      assert.deepEqual(await describeTree(path.join(runner.buildsDir, buildId)), await describeTree(made));
    });

    it('refuses a build that is nowhere with FERRY_REPLICA_START_FAILED, no server path, nothing left behind', async () => {
      const runner = await impl.node();
      const buildId = uuidv7();
      await assert.rejects(runner.output.ensureLocal(buildId), (err: unknown) => {
        assert.ok(err instanceof FerryError, String(err));
        assert.equal(err.code, 'FERRY_REPLICA_START_FAILED');
        for (const secret of [...impl.privatePaths(), runner.buildsDir]) {
          assert.ok(!err.message.includes(secret), `the message names ${secret}: ${err.message}`);
        }
        return true;
      });
      assert.deepEqual(await fs.readdir(runner.buildsDir), [], 'no folder, staging folder or download left');
      await assert.rejects(runner.output.ensureLocal('../escape'), /Invalid build id/);
    });

    it('removes the local folder; with `shared` the published copy too; with `keepLocal` only that', async () => {
      const [builder, runner] = [await impl.node(), await impl.node()];
      const kept = uuidv7();
      const retired = uuidv7();
      for (const id of [kept, retired]) {
        await makeBuild(builder.buildsDir, id);
        await builder.output.publish(id);
      }
      await runner.output.ensureLocal(kept);
      // Local only: the runner's copy goes, and comes back from the published build.
      assert.ok((await runner.output.remove(kept)) >= 100_000, 'the local bytes freed are counted');
      assert.equal(await exists(path.join(runner.buildsDir, kept)), false);
      assert.equal(await exists(path.join(runner.buildsDir, `${kept}.complete`)), false);
      await runner.output.ensureLocal(kept);
      assert.equal(fetches(runner), 2, 'fetched again');
      // keepLocal: a replica here still runs it; only the published copy goes.
      await builder.output.remove(retired, { shared: true, keepLocal: true });
      assert.equal(await exists(path.join(builder.buildsDir, retired, 'out', 'main.mjs')), true);
      const other = await impl.node();
      await assert.rejects(other.output.ensureLocal(retired), { code: 'FERRY_REPLICA_START_FAILED' });
      // shared: both.
      await builder.output.remove(kept, { shared: true });
      assert.equal(await exists(path.join(builder.buildsDir, kept)), false);
      const late = await impl.node();
      await assert.rejects(late.output.ensureLocal(kept), { code: 'FERRY_REPLICA_START_FAILED' });
      // Removing what is gone is no error.
      await builder.output.remove(kept, { shared: true });
      await late.output.remove(uuidv7(), { shared: true });
    });

    it('extracts a build’s source from its uploaded archive on a node without it, and says so when it is missing', async () => {
      const [receiver, builder] = [await impl.node(), await impl.node()];
      const buildId = uuidv7();
      const upload = path.join(await tempDir('contracts-upload-'), 'upload.zip');
      await fs.writeFile(
        upload,
        await zipFiles({ 'ferry.toml': '[app]\nname = "contract"\n', 'main.ts': 'export const run = () => 1;\n' }),
      );
      await receiver.artifacts.put(buildId, upload);
      await fs.rm(path.dirname(upload), { recursive: true, force: true });
      await builder.output.ensureSource({ id: buildId });
      assert.equal(
        await fs.readFile(path.join(builder.buildsDir, buildId, 'source', 'main.ts'), 'utf8'),
        'export const run = () => 1;\n',
      );
      await assert.rejects(builder.output.ensureSource({ id: uuidv7() }), (err: unknown) => {
        assert.ok(err instanceof BuildFailedError, String(err));
        assert.match(err.message, /uploaded archive of this build is missing/);
        return true;
      });
    });

    it(
      'refuses a published copy that does not match its digest',
      impl.corrupt ? {} : { skip: impl.noDigest ?? 'no digest' },
      async () => {
        const [builder, runner] = [await impl.node(), await impl.node()];
        const buildId = uuidv7();
        await fs.mkdir(path.join(builder.buildsDir, buildId, 'out'), { recursive: true });
        await fs.writeFile(path.join(builder.buildsDir, buildId, 'out', 'main.mjs'), 'export const run = () => 1;\n');
        await builder.output.publish(buildId);
        await impl.corrupt?.(buildId);
        await assert.rejects(runner.output.ensureLocal(buildId), (err: unknown) => {
          assert.ok(err instanceof FerryError, String(err));
          assert.equal(err.code, 'FERRY_REPLICA_START_FAILED');
          assert.match(err.message, /corrupt/);
          return true;
        });
        assert.deepEqual(await fs.readdir(runner.buildsDir), [], 'no folder, staging folder or download left');
      },
    );
  });
}

// ---- the implementations ----

{
  let root = '';
  let artifactsDir = '';
  let count = 0;
  buildOutputContract({
    name: 'the shared artifacts folder',
    privatePaths: () => [root],
    async open() {
      root = await tempDir('contracts-output-folder-');
      artifactsDir = path.join(root, 'artifacts');
      await fs.mkdir(artifactsDir, { mode: 0o700 });
    },
    async node() {
      const buildsDir = path.join(root, `node-${++count}`, 'builds');
      const { logger, messages } = capturedLogger();
      const artifacts = createDiskArtifactStore(artifactsDir);
      const output = await createBuildOutput({
        buildsDir,
        artifactsDir,
        artifacts,
        zipLimits: DEFAULT_ZIP_LIMITS,
        logger,
      });
      return { output, buildsDir, artifacts, messages };
    },
    noDigest:
      'the artifacts folder keeps no digest: a file system of Ferry’s own user (0700) whose copies are hard links',
    cleanUp: () => fs.rm(root, { recursive: true, force: true }),
  });
}

{
  let root = '';
  let nc: NatsConnection | undefined;
  let bucket: ObjectStore;
  let count = 0;
  const cluster = `CONTRACTS_${randomBytes(6).toString('hex')}`;
  const bucketName = clusterNames(cluster).artifactsBucket;
  buildOutputContract({
    name: 'the JetStream object store',
    privatePaths: () => [root],
    async open() {
      root = await tempDir('contracts-output-nats-');
      try {
        nc = await connect({ servers: NATS_URL, timeout: 5000 });
      } catch (err) {
        throw new Error(
          `this suite needs NATS JetStream at ${NATS_URL}; start it with: bash scripts/start-services.sh`,
          {
            cause: err,
          },
        );
      }
      bucket = await openArtifactsBucket(nc, bucketName);
    },
    async node() {
      const dir = path.join(root, `node-${++count}`);
      const buildsDir = path.join(dir, 'builds');
      const { logger, messages } = capturedLogger();
      const connection = nc;
      assert.ok(connection);
      const artifacts = await createNatsArtifactStore({
        nc: connection,
        bucket: bucketName,
        cacheDir: path.join(dir, 'archive-cache'),
        logger,
      });
      const output = await createNatsBuildOutput({
        buildsDir,
        bucket,
        artifacts,
        zipLimits: DEFAULT_ZIP_LIMITS,
        logger,
      });
      return { output, buildsDir, artifacts, messages };
    },
    async corrupt(buildId) {
      assert.ok(nc);
      await corruptObject(nc, bucket, bucketName, `build/${buildId}`);
    },
    async cleanUp() {
      if (nc) {
        const jsm = await jetstreamManager(nc);
        await jsm.streams.delete(`OBJ_${bucketName}`).catch(() => false);
        await nc.close();
      }
      await fs.rm(root, { recursive: true, force: true });
    },
  });
}
