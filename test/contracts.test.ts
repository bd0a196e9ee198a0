/**
 * Contract suites: one suite body run against every implementation of a seam (docs/architecture.md,
 * "The seams"), the way hono runs one suite against every router. An implementation that breaks the
 * interface's promise fails here under its own name.
 *
 * - artifacts (`builds/artifact-store.ts`): the folder, and the JetStream object store (a bucket of a
 *   random cluster name on the machine's NATS, deleted after);
 * - change feed (`cluster/change-feed.ts`): in process, and PostgreSQL LISTEN/NOTIFY (a fresh database,
 *   test/helpers/store.ts).
 *
 * The other seams have theirs in files of their own (each a few seconds, run beside this one):
 * test/contract-run-queue.test.ts (the store queue, JetStream), test/contract-build-output.test.ts (the
 * artifacts folder, the object store), test/contract-invoker.test.ts (local, remote through a worker's
 * listener); the store runs every suite of test/postgres/ on both SQLite and PostgreSQL.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { jetstreamManager } from '@nats-io/jetstream';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import { type ArtifactStore, createDiskArtifactStore } from '../src/builds/artifact-store.js';
import { createNatsArtifactStore } from '../src/builds/nats-artifact-store.js';
import {
  type ChangeEvent,
  type ChangeFeed,
  createLocalChangeFeed,
  type FeedEvent,
} from '../src/cluster/change-feed.js';
import { clusterNames } from '../src/cluster/nats.js';
import { createPgChangeFeed } from '../src/cluster/pg-change-feed.js';
import { uuidv7 as newBuildId } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { tempDir } from './helpers/ferry.js';
import { NATS_URL } from './helpers/nats.js';
import { createTestDatabase, type TestDatabase } from './helpers/store.js';

const logger = createLogger({ level: process.env.FERRY_TEST_LOG ?? 'silent', pretty: false });

/** One implementation under a contract: how to make it, and how to remove what making it left behind. */
interface Implementation<T> {
  name: string;
  open(): Promise<T>;
  cleanUp(): Promise<void>;
}

// ---- artifacts ----

function artifactsContract(impl: Implementation<ArtifactStore>): void {
  describe(`artifacts contract: ${impl.name}`, () => {
    let store: ArtifactStore;
    let scratch: string;
    before(async () => {
      store = await impl.open();
      scratch = await tempDir('ferry-contract-upload-');
    });
    after(async () => {
      await fs.rm(scratch, { recursive: true, force: true });
      await impl.cleanUp();
    });

    /** An uploaded archive's temporary file, as upload.ts hands it over. */
    async function uploaded(bytes: Buffer): Promise<string> {
      const file = path.join(scratch, `upload-${randomBytes(4).toString('hex')}.zip`);
      await fs.writeFile(file, bytes);
      return file;
    }

    it('keeps what was put, byte for byte, and takes the uploaded file over', async () => {
      const buildId = newBuildId();
      const bytes = randomBytes(200_000);
      const file = await uploaded(bytes);
      await store.put(buildId, file);
      await assert.rejects(fs.access(file), 'the uploaded file is the store’s now (moved, not copied)');
      const kept = await store.localPath(buildId);
      assert.ok(kept, 'a local path to the archive');
      assert.deepEqual(await fs.readFile(kept), bytes);
      assert.equal((await fs.stat(kept)).mode & 0o077, 0, 'readable by Ferry’s own user only');
    });

    it('answers undefined for an archive it never had', async () => {
      assert.equal(await store.localPath(newBuildId()), undefined);
    });

    it('forgets a deleted archive, and a second delete is no error', async () => {
      const buildId = newBuildId();
      await store.put(buildId, await uploaded(Buffer.from('PK\x05\x06')));
      assert.ok(await store.localPath(buildId));
      await store.delete(buildId);
      assert.equal(await store.localPath(buildId), undefined);
      await store.delete(buildId);
    });

    it('keeps archives apart', async () => {
      const [a, b] = [newBuildId(), newBuildId()];
      await store.put(a, await uploaded(Buffer.from('first')));
      await store.put(b, await uploaded(Buffer.from('second')));
      await store.delete(a);
      assert.equal(await store.localPath(a), undefined);
      const kept = await store.localPath(b);
      assert.ok(kept);
      assert.equal(await fs.readFile(kept, 'utf8'), 'second');
    });
  });
}

{
  let folder = '';
  artifactsContract({
    name: 'folder',
    async open() {
      folder = await tempDir('ferry-contract-artifacts-');
      return createDiskArtifactStore(folder);
    },
    cleanUp: () => fs.rm(folder, { recursive: true, force: true }),
  });
}

{
  let nc: NatsConnection | undefined;
  let cacheDir = '';
  const cluster = `t${randomBytes(6).toString('hex')}`;
  artifactsContract({
    name: 'JetStream object store',
    async open() {
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
      cacheDir = await tempDir('ferry-contract-archive-cache-');
      return createNatsArtifactStore({ nc, bucket: clusterNames(cluster).artifactsBucket, cacheDir, logger });
    },
    async cleanUp() {
      if (nc) {
        const jsm = await jetstreamManager(nc);
        await jsm.streams.delete(`OBJ_${clusterNames(cluster).artifactsBucket}`).catch(() => false);
        await nc.close();
      }
      await fs.rm(cacheDir, { recursive: true, force: true });
    },
  });
}

// ---- the change feed ----

function changeFeedContract(impl: Implementation<ChangeFeed>): void {
  describe(`change feed contract: ${impl.name}`, () => {
    let feed: ChangeFeed;
    before(async () => {
      feed = await impl.open();
    });
    after(() => impl.cleanUp());

    const event = (): ChangeEvent => ({ type: 'secrets.changed', projectId: `p-${randomBytes(4).toString('hex')}` });

    it("tells this process's subscribers before publish's first await", async () => {
      const seen: FeedEvent[] = [];
      const stop = feed.subscribe((e) => seen.push(e));
      const sent = event();
      const publishing = feed.publish(sent);
      assert.deepEqual(seen, [sent], 'delivered synchronously');
      await publishing;
      stop();
    });

    it('calls every subscriber in turn, one that throws stopping neither the others nor the publisher', async () => {
      const order: string[] = [];
      const stops = [
        feed.subscribe(() => order.push('first')),
        feed.subscribe(() => {
          order.push('second');
          throw new Error('a subscriber failing');
        }),
        feed.subscribe(() => order.push('third')),
      ];
      await feed.publish(event());
      assert.deepEqual(order, ['first', 'second', 'third']);
      for (const stop of stops) stop();
    });

    it('counts the same function subscribed twice as two subscriptions, each stopped on its own', async () => {
      let calls = 0;
      const handler = () => calls++;
      const stopOne = feed.subscribe(handler);
      const stopTwo = feed.subscribe(handler);
      await feed.publish(event());
      assert.equal(calls, 2);
      stopOne();
      await feed.publish(event());
      assert.equal(calls, 3);
      stopTwo();
      await feed.publish(event());
      assert.equal(calls, 3, 'nothing after both stopped');
    });

    it('never rejects a publish, and tells nothing once closed', async () => {
      let calls = 0;
      feed.subscribe(() => calls++);
      await feed.close();
      await feed.publish(event());
      assert.equal(calls, 0);
    });
  });
}

changeFeedContract({
  name: 'in process',
  open: async () => createLocalChangeFeed({ logger }),
  cleanUp: async () => {},
});

{
  let database: TestDatabase | undefined;
  changeFeedContract({
    name: 'PostgreSQL LISTEN/NOTIFY',
    async open() {
      database = await createTestDatabase();
      return createPgChangeFeed({ databaseUrl: database.url, logger });
    },
    cleanUp: async () => database?.drop(),
  });
}
