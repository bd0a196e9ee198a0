/**
 * The run queue's contract (`runs/run-queue.ts`, the seam of docs/architecture.md): one suite body run
 * against each implementation, the way test/contracts.test.ts runs the artifacts' and the change feed's.
 *
 * - the store queue (`createStoreRunQueue`: poll and claim) on a SQLite file, and on PostgreSQL (its claims
 *   lock with `FOR UPDATE SKIP LOCKED` there: store/claims.ts);
 * - the JetStream queue (`createJetStreamRunQueue`) on PostgreSQL and the machine's NATS at 127.0.0.1:4222,
 *   under a cluster name of its own (`CONTRACTS_<random>`), whose streams are deleted after.
 *
 * Each node is what services.ts builds for the queue: the real async worker, the real recorder and claims on
 * the real store, with a fake invoker in place of replicas (the queue's promise ends where the invoker is
 * called: test/invoker.test.ts and test/contract-invoker.test.ts prove the rest). Two nodes share one store
 * (and one cluster) where a promise is about several.
 *
 * What the interface promises, proven on both: an accepted run is performed once (started once) wherever it
 * was accepted; a run queued again for later (a retry's `not_before`) is not started before it is due, and
 * is started once it is, nothing waking the queue; a cancelled queued run is never performed; a free queued
 * run (what recovery leaves) is taken after `wake()`; `backlog` counts the runs a node holds, queued or
 * running; `close()` lets the runs it holds and has not started go, and another node performs them.
 *
 * Where the two differ on purpose (asserted per implementation, not left out):
 * - `ownerFor`: the store queue holds a run accepted on a node with room from its insert (the node's id);
 *   the JetStream queue inserts every run free (null) and any consuming node takes it from the stream.
 * - `forgetApp`: only the JetStream queue keeps something per app (a consumer and messages); the store queue
 *   has nothing to forget (a deleted app's queued runs are cancelled in the store, which both heed).
 * - A node that dies without `close()`: its runs wait for recovery (cluster/recovery.ts frees them on lease
 *   expiry, then `wake()`), the same on both; the JetStream message's redelivery after its ack wait is
 *   JetStream's own (test/nats-queue-kill.test.ts). Not part of this suite.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import { after, afterEach, before, describe, it } from 'node:test';
import { jetstreamManager } from '@nats-io/jetstream';
import { parseAppConfig } from '../src/apps/app-config.js';
import { clusterNames, createNatsLink, type NatsLink } from '../src/cluster/nats.js';
import { ERRORS } from '../src/errors.js';
import { isoTime, uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { createAsyncWorker } from '../src/runs/async-worker.js';
import { type InvokeRequest, type Invoker, RunNotClaimedError } from '../src/runs/invoke.js';
import { createJetStreamRunQueue } from '../src/runs/jetstream-queue.js';
import { endRun } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow, type RunRecorder } from '../src/runs/recorder.js';
import { acceptedRun, createStoreRunQueue, type RunQueue } from '../src/runs/run-queue.js';
import { cancelQueued } from '../src/runs/runs.js';
import type { AppTarget, RunTargets } from '../src/runs/targets.js';
import { MAX_RETURNED_CALL } from '../src/store/claims.js';
import { openPostgresStore, openSqliteStore, type Store } from '../src/store/index.js';
import { tempDir } from './helpers/ferry.js';
import { deleteClusterStreams, NATS_URL } from './helpers/nats.js';
import { createTestDatabase, type TestDatabase } from './helpers/store.js';

const logger = createLogger({ level: process.env.FERRY_TEST_LOG ?? 'silent', pretty: false });

/** What happened to runs, across the nodes of one implementation, in order. */
interface Happened {
  kind: 'start' | 'end' | 'not-claimed';
  runId: string;
  node: string;
  at: number;
}

/** A node's invoker: claims the run (its start) and ends it through the lifecycle, as runs/invoke.ts does. */
interface FakeInvoker {
  invoker: Invoker;
  /** Runs held in their call (after their start) until `release`. */
  hold: Set<string>;
  /**
   * The next run to start is held (added to `hold`), whichever it is: the queues do not promise to start an
   * app's runs in the order they were accepted (on JetStream a run whose message is relayed, its first publish
   * failed or not yet claimed, comes after runs accepted later).
   */
  holdNext: boolean;
  release(id: string): void;
  /** Runs whose next attempt ends in a retry after `ms` (a `[retries]` policy's delay), once each. */
  retryAfter: Map<string, number>;
  /** The call each run was performed with (its function, its input, its webhook), by run id. */
  calls: Map<string, { fn: string; body: string; webhookUrl: string | undefined }>;
}

function fakeInvoker(node: string, recorder: RunRecorder, happened: Happened[]): FakeInvoker {
  const waiting = new Map<string, () => void>();
  const fake: FakeInvoker = {
    hold: new Set(),
    holdNext: false,
    retryAfter: new Map(),
    calls: new Map(),
    release(id) {
      fake.hold.delete(id);
      waiting.get(id)?.();
    },
    invoker: {
      async invoke(request: InvokeRequest) {
        const id = request.runId;
        const attempt = await request.claim?.();
        if (attempt === undefined) {
          happened.push({ kind: 'not-claimed', runId: id, node, at: Date.now() });
          throw new RunNotClaimedError(id);
        }
        happened.push({ kind: 'start', runId: id, node, at: Date.now() });
        fake.calls.set(id, { fn: request.fn, body: String(request.body), webhookUrl: request.webhookUrl });
        if (fake.holdNext) {
          fake.holdNext = false;
          fake.hold.add(id);
        }
        if (fake.hold.has(id)) await new Promise<void>((resolve) => waiting.set(id, resolve));
        const delayMs = fake.retryAfter.get(id);
        fake.retryAfter.delete(id);
        const ending =
          delayMs === undefined
            ? ({ kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: '"done"' } } as const)
            : ({
                kind: 'retry',
                why: 'policy',
                delayMs,
                after: {
                  kind: 'failed',
                  error: { code: 'FERRY_FUNCTION_ERROR', message: 'failed once' },
                  runTimeMs: 1,
                },
              } as const);
        recorder.finish(endRun({ id, webhookUrl: request.webhookUrl, attempt }, ending));
        happened.push({ kind: 'end', runId: id, node, at: Date.now() });
        return { result: 'done', streamed: false, runTimeMs: 1, coldStart: false, statusCode: 200 };
      },
      cancel: () => false,
      invokeHttp: () => Promise.reject(new Error('not in this suite')),
      invokeSession: () => Promise.reject(new Error('not in this suite')),
    },
  };
  return fake;
}

/** One node of an implementation: its queue, its invoker and its recorder. */
interface QueueNode {
  id: string;
  queue: RunQueue;
  fake: FakeInvoker;
  recorder: RunRecorder;
  /** Closes the queue (again: a second close is no error), the recorder and the node's NATS link. */
  close(): Promise<void>;
}

/** What an implementation is made of: a store (and NATS), and how to make a node on them. */
interface QueueSetup {
  store: Store;
  /** The owner a run accepted on `node` is inserted with, as this implementation chooses it. */
  expectedOwner(node: QueueNode): string | null;
  /**
   * `relayAfterMs` (JetStream): how old a run with no known message must be before the relay publishes it
   * alone (the tests' default is 100 ms).
   */
  node(deps: { id: string; targets: RunTargets; happened: Happened[]; relayAfterMs?: number }): Promise<QueueNode>;
  /** JetStream: how many messages the runs stream has stored since it was made (its last sequence). */
  streamStored?(): Promise<number>;
  cleanUp(): Promise<void>;
}

interface QueueImplementation {
  name: string;
  /** The queue carries runs in messages (JetStream): the tests of how they are carried apply. */
  messages?: true;
  open(): Promise<QueueSetup>;
}

/** The async worker as services.ts makes it, with the suite's short intervals. */
function workerDeps(store: Store, targets: RunTargets, fake: FakeInvoker, recorder: RunRecorder, owner: string) {
  return {
    store,
    targets,
    invoker: fake.invoker,
    recorder,
    logger,
    owner,
    retryDelayMs: 20,
    pollIntervalMs: 100,
    heldSweepMs: 60_000,
  };
}

function runQueueContract(impl: QueueImplementation): void {
  describe(`run queue contract: ${impl.name}`, () => {
    let setup: QueueSetup;
    /** The nodes of the test running now (each test's nodes are closed after it). */
    let nodes: QueueNode[] = [];
    const happened: Happened[] = [];
    const apps = new Map<string, AppTarget>();
    const targets: RunTargets = {
      get: async (projectId, appId) => apps.get(`${projectId}/${appId}`),
      peek: (projectId, appId) => apps.get(`${projectId}/${appId}`),
      forget: () => {},
    };

    before(async () => {
      setup = await impl.open();
    });
    afterEach(async () => {
      for (const n of nodes) for (const id of [...n.fake.hold]) n.fake.release(id);
      await Promise.all(nodes.map((n) => n.close()));
      nodes = [];
    });
    after(() => setup.cleanUp());

    async function startNode(options: { relayAfterMs?: number } = {}): Promise<QueueNode> {
      const n = await setup.node({ id: `node-${randomBytes(4).toString('hex')}`, targets, happened, ...options });
      nodes.push(n);
      await n.queue.start();
      return n;
    }

    /** An app with a ready build of `capacity` slots (max_replicas 1 × replica_concurrency). */
    function appOf(capacity = 1): { projectId: string; appId: string; buildId: string } {
      const projectId = `p-${randomBytes(4).toString('hex')}`;
      const appId = `a${randomBytes(4).toString('hex')}`;
      const config = parseAppConfig(`[app]\nname = "${appId}"\n`);
      config.scaling.max_replicas = 1;
      config.scaling.replica_concurrency = capacity;
      const buildId = uuidv7();
      apps.set(`${projectId}/${appId}`, { appId, buildId, runtime: 'node', config, functions: undefined });
      return { projectId, appId, buildId };
    }

    /** Accepts an async run on `on` as run-service.ts does: owner from the queue, committed, then told. */
    async function accept(
      on: QueueNode,
      app: { projectId: string; appId: string; buildId: string },
      call: { fn?: string; input?: string; webhookUrl?: string } = {},
    ) {
      const owner = on.queue.ownerFor(app.projectId, app.appId);
      assert.equal(owner, setup.expectedOwner(on), 'the owner this implementation inserts an accepted run with');
      const row = newRunRow({
        id: uuidv7(),
        build: app,
        fn: call.fn ?? 'work',
        mode: 'async',
        input: call.input ?? '{}',
        owner,
        webhookUrl: call.webhookUrl,
      });
      await on.recorder.insertNow(row);
      on.queue.accepted(acceptedRun(row), owner);
      return row.id;
    }

    /** Inserts a queued run nobody holds, as recovery or a retry leaves one (`notBefore`: due then). */
    async function freeQueued(
      app: { projectId: string; appId: string; buildId: string },
      options: { notBefore?: number; ageMs?: number } = {},
    ) {
      const row = newRunRow({
        id: uuidv7(),
        build: app,
        fn: 'work',
        mode: 'async',
        input: '{}',
        owner: null,
        createdAt: Date.now() - (options.ageMs ?? 60_000),
      });
      if (options.notBefore !== undefined) row.not_before = isoTime(options.notBefore);
      await setup.store.insertInto('runs').values(row).execute();
      return row.id;
    }

    async function record(id: string) {
      for (const n of nodes) await n.recorder.flush(true);
      return setup.store.selectFrom('runs').selectAll().where('id', '=', id).executeTakeFirstOrThrow();
    }

    const starts = (id: string) => happened.filter((h) => h.runId === id && h.kind === 'start');

    /** The one of `ids` that started and is held (holdNext), once it has started. */
    async function heldRun(n: QueueNode, ids: string[]): Promise<string> {
      await waitUntil(
        async () => ids.some((id) => n.fake.hold.has(id)),
        'one of the runs to start',
        20_000,
        () => stateOf(n, ids),
      );
      return ids.find((id) => n.fake.hold.has(id))!;
    }

    /**
     * `n` runs accepted on `node` for `app` (capacity 1), the first of them to start held in flight (whichever
     * it is: a queue may start a relayed run after later ones), once the node holds all `n`, running or queued.
     */
    async function oneHeld(node: QueueNode, app: ReturnType<typeof appOf>, n: number) {
      node.fake.holdNext = true;
      const ids: string[] = [];
      for (let i = 0; i < n; i++) ids.push(await accept(node, app));
      const held = await heldRun(node, ids);
      await waitUntil(
        async () => node.queue.backlog === n,
        `the node holding ${n} runs (one running, the others queued)`,
        20_000,
        () => stateOf(node, ids),
      );
      return { ids, held, rest: ids.filter((id) => id !== held) };
    }

    /** What a wait that timed out prints: the node's backlog, the runs' events and their records. */
    async function stateOf(n: QueueNode, ids: string[]) {
      return {
        backlog: n.queue.backlog,
        happened: happened.filter((h) => ids.includes(h.runId)),
        runs: await setup.store
          .selectFrom('runs')
          .select(['id', 'state', 'owner', 'attempts', 'published_at', 'publishes', 'created_at'])
          .where('id', 'in', ids)
          .execute(),
      };
    }

    /** Waits until the run's record is final (its end committed), bounded generously. */
    async function finished(id: string) {
      await waitUntil(async () => {
        const r = await record(id);
        return ['success', 'failure', 'timeout', 'cancelled'].includes(r.state);
      }, `run ${id} to finish`);
      return record(id);
    }

    it('performs every accepted run once, on whichever node accepted it', async () => {
      const a = await startNode();
      const b = await startNode();
      const [one, two] = [appOf(4), appOf(4)];
      const ids: string[] = [];
      for (let i = 0; i < 12; i++) ids.push(await accept(i % 2 ? a : b, i % 3 ? one : two));
      for (const id of ids) {
        const r = await finished(id);
        assert.equal(r.state, 'success', id);
        assert.equal(r.attempts, 1, `${id} started once`);
      }
      await waitUntil(async () => a.queue.backlog === 0 && b.queue.backlog === 0, 'both backlogs empty');
      for (const id of ids) assert.equal(starts(id).length, 1, `${id} performed once`);
      assert.equal(happened.filter((h) => ids.includes(h.runId) && h.kind !== 'start' && h.kind !== 'end').length, 0);
    });

    it('performs each run with the call it was accepted with, small or large, wherever it runs', async () => {
      // The JetStream queue's claim returns a call of up to MAX_RETURNED_CALL characters with the run (no read
      // of the record before it runs); a larger one is read when the run is performed. Both must arrive whole.
      const a = await startNode();
      const b = await startNode();
      const app = appOf(4);
      const large = JSON.stringify({ blob: 'x'.repeat(MAX_RETURNED_CALL + 1000) });
      const wanted = new Map<string, { fn: string; body: string; webhookUrl: string | undefined }>();
      for (let i = 0; i < 8; i++) {
        const call = {
          fn: `fn${i}`,
          input: i % 4 === 3 ? large : JSON.stringify({ i }),
          webhookUrl: i % 2 ? `http://127.0.0.1:9/hook/${i}` : undefined,
        };
        const id = await accept(i % 2 ? a : b, app, call);
        wanted.set(id, { fn: call.fn, body: call.input, webhookUrl: call.webhookUrl });
      }
      for (const [id, call] of wanted) {
        assert.equal((await finished(id)).state, 'success', id);
        const got = a.fake.calls.get(id) ?? b.fake.calls.get(id);
        assert.ok(got, `${id} performed`);
        assert.equal(got.fn, call.fn, `${id}: its function`);
        assert.equal(got.body.length, call.body.length, `${id}: its input's length`);
        assert.equal(got.body, call.body, `${id}: its input`);
        assert.equal(got.webhookUrl, call.webhookUrl, `${id}: its webhook`);
      }
    });

    it('counts in `backlog` the runs a node holds, queued or running, until they end', async () => {
      const a = await startNode();
      // The first run to start is held: it is the one in flight, the others wait behind it (capacity 1).
      const { held: first, rest } = await oneHeld(a, appOf(1), 3);
      for (const id of rest) assert.equal(starts(id).length, 0, 'the app is at capacity: the others wait');
      a.fake.release(first);
      for (const id of [first, ...rest]) assert.equal((await finished(id)).state, 'success');
      await waitUntil(async () => a.queue.backlog === 0, 'the backlog back to 0');
    });

    it('never performs a queued run cancelled before its turn', async () => {
      const a = await startNode();
      const app = appOf(1);
      // Cancelled while the node holds it, waiting behind the run in flight.
      const {
        held: first,
        rest: [doomed],
      } = await oneHeld(a, app, 2);
      assert.ok(doomed);
      const cancelled = await setup.store.transaction().execute((trx) =>
        cancelQueued(trx, [{ id: doomed, webhook_endpoint: null }], {
          message: ERRORS.FERRY_RUN_CANCELLED.message,
          reason: 'cancelled',
        }),
      );
      assert.deepEqual(cancelled, [doomed]);
      const behind = await accept(a, app);
      a.fake.release(first);
      assert.equal((await finished(behind)).state, 'success', 'the run behind it is performed');
      await waitUntil(async () => a.queue.backlog === 0, 'the backlog back to 0');
      assert.equal(starts(doomed).length, 0, 'the cancelled run never started');
      const r = await record(doomed);
      assert.equal(r.state, 'cancelled');
      assert.equal(r.attempts, 0);
    });

    it('performs a run queued again for later (a retry’s not_before) once it is due, not before, unwoken', async () => {
      const a = await startNode();
      const app = appOf(1);
      const id = await accept(a, app);
      a.fake.retryAfter.set(id, 800);
      await waitUntil(async () => starts(id).length === 2, 'the second attempt', 30_000);
      const retried = await record(id);
      const [first, second] = starts(id);
      assert.ok(first && second);
      assert.ok(retried.not_before, 'the retry set not_before');
      assert.ok(
        second.at >= Date.parse(retried.not_before),
        `the second attempt started ${Date.parse(retried.not_before) - second.at} ms before it was due`,
      );
      assert.ok(second.at - first.at >= 800, 'at least the retry delay after the first attempt');
      const r = await finished(id);
      assert.equal(r.state, 'success');
      assert.equal(r.attempts, 2, 'two starts');
    });

    it('takes a free queued run (as recovery leaves one) once woken, and not one that is not due yet', async () => {
      const a = await startNode();
      const app = appOf(2);
      const dueAt = Date.now() + 1000;
      const later = await freeQueued(app, { notBefore: dueAt });
      const now = await freeQueued(app);
      a.queue.wake();
      assert.equal((await finished(now)).state, 'success');
      const r = await finished(later);
      assert.equal(r.state, 'success');
      const [start] = starts(later);
      assert.ok(start && start.at >= dueAt, 'not started before its not_before');
      assert.equal(r.owner, a.id, 'the node that took it');
    });

    it('lets go at close of the runs it holds and has not started; the run in flight finishes; another node performs them', async () => {
      const a = await startNode();
      const { held: first, rest: waiting } = await oneHeld(a, appOf(1), 3);
      const closing = a.queue.close();
      a.fake.release(first);
      await closing;
      assert.equal((await finished(first)).state, 'success', 'the run in flight finished');
      for (const id of waiting) {
        const r = await record(id);
        assert.equal(r.state, 'queued', 'let go, not ended');
        assert.equal(r.owner, null, 'free for any node');
        assert.equal(starts(id).length, 0);
      }
      const b = await startNode();
      b.queue.wake();
      for (const id of waiting) {
        const r = await finished(id);
        assert.equal(r.state, 'success');
        assert.equal(r.owner, b.id, 'performed by the other node');
        assert.equal(r.attempts, 1);
      }
    });

    if (impl.messages) {
      it('carries runs accepted together in one message; no node takes more of it than it has room for; each is performed once', async () => {
        // The relay waits 60 s here: what is counted is how the intake carries runs accepted together. With
        // the tests' 100 ms, a loaded machine's slow publish let the relay also send each run alone (41
        // messages for 40 runs in one CI run: the batch's one, then 40 relays). A run left free by a nak is
        // delivered again by JetStream, not by the relay.
        const a = await startNode({ relayAfterMs: 60_000 });
        const b = await startNode({ relayAfterMs: 60_000 });
        // Capacity 1, every start held until the end: a node holds one run in flight and what room it has
        // queued (the async worker's, 32 at most for an app), fewer than the 40 accepted together here.
        const app = appOf(1);
        const rows = Array.from({ length: 40 }, () =>
          newRunRow({ id: uuidv7(), build: app, fn: 'work', mode: 'async', input: '{}', owner: null }),
        );
        for (const r of rows) {
          a.fake.hold.add(r.id);
          b.fake.hold.add(r.id);
        }
        const ids = rows.map((r) => r.id);
        const storedBefore = (await setup.streamStored?.()) ?? 0;
        // Committed together, then told together, as a write of the recorder's group commit is.
        await Promise.all(rows.map((r) => a.recorder.insertNow(r)));
        for (const r of rows) a.queue.accepted(acceptedRun(r), null);
        await waitUntil(
          async () => a.queue.backlog > 0 && b.queue.backlog > 0,
          'both nodes to take runs of the message',
          20_000,
          () => stateOf(a, ids),
        );
        assert.ok(a.queue.backlog < 40 && b.queue.backlog < 40, `held ${a.queue.backlog} and ${b.queue.backlog} of 40`);
        const free = await setup.store
          .selectFrom('runs')
          .select('id')
          .where('id', 'in', ids)
          .where('owner', 'is', null)
          .where('state', '=', 'queued')
          .execute();
        assert.equal(free.length, 40 - a.queue.backlog - b.queue.backlog, 'the rest wait in the store, free');
        for (const id of ids) {
          a.fake.release(id);
          b.fake.release(id);
        }
        for (const id of ids) {
          const r = await finished(id);
          assert.equal(r.state, 'success', id);
          assert.equal(r.attempts, 1, `${id} started once`);
          assert.equal(starts(id).length, 1, `${id} performed once`);
        }
        const stored = ((await setup.streamStored?.()) ?? 0) - storedBefore;
        assert.ok(stored >= 1 && stored <= 20, `${stored} messages carried the 40 runs`);
      });
    }

    it('closes with nothing in hand, and takes nothing after', async () => {
      const a = await startNode();
      await a.queue.close();
      assert.equal(a.queue.backlog, 0);
      const app = appOf(1);
      const id = await freeQueued(app);
      a.queue.wake();
      await new Promise((resolve) => setTimeout(resolve, 500));
      assert.equal(starts(id).length, 0, 'a closed queue performs nothing');
      assert.equal((await record(id)).state, 'queued');
      // Left for another node (and removed from what later tests' nodes would see).
      await setup.store.deleteFrom('runs').where('id', '=', id).execute();
    });
  });
}

// ---- the implementations ----

/** The store queue on `store`: services.ts without --nats-url. */
function storeQueueSetup(store: Store, cleanUp: () => Promise<void>): QueueSetup {
  return {
    store,
    expectedOwner: (node) => node.id,
    async node({ id, targets, happened }) {
      const recorder = createRunRecorder({ store, logger, owner: id });
      const fake = fakeInvoker(id, recorder, happened);
      const queue = createStoreRunQueue(createAsyncWorker(workerDeps(store, targets, fake, recorder, id)));
      return {
        id,
        queue,
        fake,
        recorder,
        async close() {
          await queue.close();
          await recorder.close();
        },
      };
    },
    cleanUp,
  };
}

runQueueContract({
  name: 'the store queue on SQLite',
  async open() {
    const dir = await tempDir('contracts-queue-sqlite-');
    const store = await openSqliteStore({ dataDir: dir });
    return storeQueueSetup(store, async () => {
      await store.destroy();
      await fs.rm(dir, { recursive: true, force: true });
    });
  },
});

/** A fresh PostgreSQL database (a copy of the migrated template) and a store on it. */
async function postgresStore(): Promise<{ store: Store; database: TestDatabase }> {
  const database = await createTestDatabase();
  try {
    return { store: await openPostgresStore({ databaseUrl: database.url }), database };
  } catch (err) {
    await database.drop();
    throw err;
  }
}

runQueueContract({
  name: 'the store queue on PostgreSQL',
  async open() {
    const { store, database } = await postgresStore();
    return storeQueueSetup(store, async () => {
      await store.destroy();
      await database.drop();
    });
  },
});

runQueueContract({
  name: 'the JetStream queue on PostgreSQL',
  messages: true,
  async open() {
    const { store, database } = await postgresStore();
    const cluster = `CONTRACTS_${randomBytes(6).toString('hex')}`;
    const links: NatsLink[] = [];
    return {
      store,
      expectedOwner: () => null,
      async node({ id, targets, happened, relayAfterMs }) {
        const recorder = createRunRecorder({ store, logger, owner: id });
        const fake = fakeInvoker(id, recorder, happened);
        const link = createNatsLink({ url: NATS_URL, name: id, logger });
        links.push(link);
        await withTimeout(link.ready(), 10_000, `NATS at ${NATS_URL} (start it with bash scripts/start-services.sh)`);
        const queue = createJetStreamRunQueue({
          link,
          names: clusterNames(cluster),
          store,
          logger,
          owner: id,
          consume: true,
          createWorker: (hooks) => createAsyncWorker({ ...workerDeps(store, targets, fake, recorder, id), ...hooks }),
          // Short intervals, so the suite takes seconds: the relay publishes a free run 100 ms after it is
          // found (production: 1 s and 3 s), and apps with messages are looked for every 50 ms.
          relayIntervalMs: 100,
          relayAfterMs: relayAfterMs ?? 100,
          discoverIntervalMs: 50,
        });
        return {
          id,
          queue,
          fake,
          recorder,
          async close() {
            await queue.close();
            await recorder.close();
            await link.close();
          },
        };
      },
      async streamStored() {
        // The newest node's link (the nodes of earlier tests are closed).
        const nc = links.at(-1)?.current();
        assert.ok(nc, 'a node connected to NATS');
        const jsm = await jetstreamManager(nc);
        // Not made yet: nothing stored.
        const info = await jsm.streams.info(clusterNames(cluster).runsStream).catch(() => undefined);
        return info?.state.last_seq ?? 0;
      },
      async cleanUp() {
        for (const link of links) await link.close();
        await deleteClusterStreams(cluster);
        await store.destroy();
        await database.drop();
      },
    };
  },
});

/** Polls `check` every 20 ms, bounded generously (the machine may be busy). */
async function waitUntil(
  check: () => Promise<boolean>,
  what: string,
  ms = 20_000,
  state?: () => Promise<unknown>,
): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) {
      // What the queue and the store showed when it gave up, to tell a lost message from a lost claim.
      const seen = state ? `; state: ${JSON.stringify(await state().catch((err: unknown) => String(err)))}` : '';
      throw new Error(`timed out waiting for ${what}${seen}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  return Promise.race([
    promise,
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), ms);
    }),
  ]).finally(() => clearTimeout(timer));
}
