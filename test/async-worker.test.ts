/**
 * The async worker (`runs/async-worker.ts`, `createAsyncWorker`) as a component: a fake invoker the test
 * scripts, fake run targets (the app's active build), and the real recorder and claims on a SQLite file.
 * Covers the order a node performs the async runs it holds: claimed before called, an app's capacity
 * respected, a busy app retried, a run not this node's any more dropped, a run without a build failed,
 * free queued runs claimed from the store, and runs let go at close. No sandbox, no server, no socket.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { FerryError } from '../src/errors.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { type AsyncWorker, createAsyncWorker } from '../src/runs/async-worker.js';
import { type InvokeRequest, type Invoker, RunInterruptedError, RunNotClaimedError } from '../src/runs/invoke.js';
import { endRun } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow, type RunRecorder } from '../src/runs/recorder.js';
import type { AppTarget, RunTargets } from '../src/runs/targets.js';
import { openSqliteStore, type Store } from '../src/store/index.js';
import { tempDir } from './helpers/ferry.js';

const OWNER = 'node-worker-test';
const logger = createLogger({ level: 'silent', pretty: false });

/**
 * What the fake invoker does with a run: answer once claimed, or throw before the claim (`interrupted`:
 * waiting for a slot, held until released, when a server stopping past its grace interrupts it).
 */
type Behaviour = 'answer' | 'busy' | 'not-claimed' | 'interrupted';

interface FakeInvoker {
  invoker: Invoker;
  /** In order: `claim:<id>`, `start:<id>`, `end:<id>`, `busy:<id>`, `not-claimed:<id>`, `waiting:<id>`. */
  events: string[];
  behaviour: Map<string, Behaviour[]>;
  /** Runs held in their call until released (to hold an app at capacity). */
  hold: Set<string>;
  release(id: string): void;
}

function fakeInvoker(recorder: RunRecorder): FakeInvoker {
  const waiting = new Map<string, () => void>();
  const fake: FakeInvoker = {
    events: [],
    behaviour: new Map(),
    hold: new Set(),
    release(id) {
      fake.hold.delete(id);
      waiting.get(id)?.();
    },
    invoker: {
      async invoke(request: InvokeRequest) {
        const id = request.runId;
        const next = fake.behaviour.get(id)?.shift() ?? 'answer';
        if (next === 'busy') {
          fake.events.push(`busy:${id}`);
          throw new FerryError('FERRY_QUEUE_FULL');
        }
        if (next === 'not-claimed') {
          fake.events.push(`not-claimed:${id}`);
          throw new RunNotClaimedError(id);
        }
        if (next === 'interrupted') {
          fake.events.push(`waiting:${id}`);
          if (fake.hold.has(id)) await new Promise<void>((resolve) => waiting.set(id, resolve));
          throw new RunInterruptedError(id);
        }
        fake.events.push(`claim:${id}`);
        const attempt = await request.claim?.();
        if (attempt === undefined) throw new RunNotClaimedError(id);
        fake.events.push(`start:${id}`);
        if (fake.hold.has(id)) await new Promise<void>((resolve) => waiting.set(id, resolve));
        // Ended as the invoker ends it: through runs/lifecycle.ts, fenced by the start the claim gave.
        const stored = JSON.stringify(JSON.parse(request.body.toString()));
        recorder.finish(
          endRun(
            { id, webhookUrl: request.webhookUrl, attempt },
            { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored } },
          ),
        );
        fake.events.push(`end:${id}`);
        return { result: null, streamed: false, runTimeMs: 1, coldStart: false, statusCode: 200 };
      },
      cancel: () => false,
      invokeHttp: () => Promise.reject(new Error('not in this test')),
      invokeSession: () => Promise.reject(new Error('not in this test')),
    },
  };
  return fake;
}

describe('the async worker with a fake invoker and the real recorder', () => {
  let dir: string;
  let store: Store;
  let recorder: RunRecorder;
  const workers: AsyncWorker[] = [];
  /** The apps' targets the fake RunTargets answers, by `<project>/<app>`. */
  const apps = new Map<string, AppTarget>();
  const targets: RunTargets = {
    get: async (projectId, appId) => apps.get(`${projectId}/${appId}`),
    peek: (projectId, appId) => apps.get(`${projectId}/${appId}`),
    forget: () => {},
  };

  before(async () => {
    dir = await tempDir('ferry-async-worker-');
    store = await openSqliteStore({ dataDir: dir });
    recorder = createRunRecorder({ store, logger, owner: OWNER });
  });
  after(async () => {
    for (const worker of workers) await worker.close();
    await recorder.close();
    await store.destroy();
    await fs.rm(dir, { recursive: true, force: true });
  });

  /** An app with a ready build of `max_replicas` × `replica_concurrency` slots. */
  function appOf(capacity: { replicas: number; concurrency: number } = { replicas: 1, concurrency: 1 }) {
    const projectId = 'p-async';
    const appId = `a${uuidv7().slice(-8)}`;
    const config = parseAppConfig(`[app]\nname = "${appId}"\n`);
    config.scaling.max_replicas = capacity.replicas;
    config.scaling.replica_concurrency = capacity.concurrency;
    apps.set(`${projectId}/${appId}`, { appId, buildId: uuidv7(), runtime: 'node', config, functions: undefined });
    return { projectId, appId, buildId: uuidv7(), runtime: 'node', config };
  }

  function workerOf(fake: FakeInvoker, options: { claimFromStore?: boolean; pollIntervalMs?: number } = {}) {
    const worker = createAsyncWorker({
      store,
      targets,
      invoker: fake.invoker,
      recorder,
      logger,
      owner: OWNER,
      retryDelayMs: 10,
      claimFromStore: options.claimFromStore ?? false,
      pollIntervalMs: options.pollIntervalMs ?? 60_000,
    });
    workers.push(worker);
    return worker;
  }

  /** Inserts a queued async run (held by this node, or free) and returns its id. */
  async function queued(
    app: { projectId: string; appId: string },
    owner: string | null = OWNER,
    input = '{"n":1}',
    webhookUrl?: string,
  ) {
    const id = uuidv7();
    const build = { ...app, buildId: apps.get(`${app.projectId}/${app.appId}`)?.buildId ?? uuidv7() };
    await recorder.insertNow(
      newRunRow({
        id,
        build,
        fn: 'work',
        mode: 'async',
        input,
        owner: owner ?? undefined,
        webhookUrl,
      }),
    );
    return id;
  }

  async function row(id: string) {
    await recorder.flush(true);
    return store.selectFrom('runs').selectAll().where('id', '=', id).executeTakeFirstOrThrow();
  }

  it('claims a run it holds before performing it, and its end is the invoker’s', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const id = await queued(app, OWNER, '{"n":7}');
    worker.enqueue({ id, ...app });
    await waitUntil(() => fake.events.includes(`end:${id}`));
    assert.deepEqual(fake.events, [`claim:${id}`, `start:${id}`, `end:${id}`]);
    const stored = await row(id);
    assert.equal(stored.state, 'success');
    assert.equal(stored.result, '{"n":7}');
    assert.equal(stored.attempts, 1, 'one start');
    await waitUntil(() => worker.backlog === 0);
  });

  it('performs no more of an app’s runs at once than its capacity, in the order they came', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf({ replicas: 1, concurrency: 2 });
    const ids = [await queued(app), await queued(app), await queued(app)];
    fake.hold.add(ids[0]!);
    fake.hold.add(ids[1]!);
    for (const id of ids) worker.enqueue({ id, ...app });
    await waitUntil(() => fake.events.filter((e) => e.startsWith('start:')).length === 2);
    // Two slots, both busy: the third waits in the queue until one is given back.
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.ok(!fake.events.includes(`claim:${ids[2]}`), 'the third is not called while the app is full');
    fake.release(ids[1]!);
    await waitUntil(() => fake.events.includes(`end:${ids[2]}`));
    fake.release(ids[0]!);
    await waitUntil(() => fake.events.includes(`end:${ids[0]}`));
    const starts = fake.events.filter((e) => e.startsWith('start:'));
    assert.deepEqual(
      starts,
      ids.map((id) => `start:${id}`),
    );
    assert.ok(fake.events.indexOf(`end:${ids[1]}`) < fake.events.indexOf(`claim:${ids[2]}`));
    for (const id of ids) assert.equal((await row(id)).state, 'success');
  });

  it('tries a run again when its app is busy (FERRY_QUEUE_FULL), without failing it', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const id = await queued(app);
    fake.behaviour.set(id, ['busy', 'busy', 'answer']);
    worker.enqueue({ id, ...app });
    await waitUntil(() => fake.events.includes(`end:${id}`));
    assert.deepEqual(fake.events, [`busy:${id}`, `busy:${id}`, `claim:${id}`, `start:${id}`, `end:${id}`]);
    assert.equal((await row(id)).state, 'success');
  });

  it('drops a run that is no longer this node’s, leaving its record alone', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const id = await queued(app);
    fake.behaviour.set(id, ['not-claimed']);
    worker.enqueue({ id, ...app });
    await waitUntil(() => worker.backlog === 0);
    assert.deepEqual(fake.events, [`not-claimed:${id}`], 'called once, never again');
    assert.equal((await row(id)).state, 'queued');
  });

  it('does not perform a run another node took: the claim finds it not this node’s', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const id = await queued(app, 'node-elsewhere');
    worker.enqueue({ id, ...app });
    await waitUntil(() => worker.backlog === 0);
    assert.ok(!fake.events.includes(`start:${id}`));
    const stored = await row(id);
    assert.equal(stored.state, 'queued');
    assert.equal(stored.owner, 'node-elsewhere');
  });

  it('fails a run whose app has no ready build (FERRY_NO_READY_BUILD), without calling anything', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    apps.set(`${app.projectId}/${app.appId}`, {
      appId: app.appId,
      buildId: null,
      runtime: null,
      config: undefined,
      functions: [],
    });
    const id = await queued(app, OWNER, '{}', 'http://127.0.0.1:9/hook');
    worker.enqueue({ id, ...app });
    await waitUntil(() => worker.backlog === 0);
    assert.deepEqual(fake.events, []);
    const stored = await row(id);
    assert.equal(stored.state, 'failure');
    assert.equal(stored.error_code, 'FERRY_NO_READY_BUILD');
    assert.equal(stored.status_code, 503);
    const hooks = await store.selectFrom('webhook_deliveries').select('payload').where('run_id', '=', id).execute();
    assert.equal(hooks.length, 1);
    assert.equal(JSON.parse(hooks[0]!.payload).state, 'failure', 'the payload says the state (docs/webhooks.md)');
  });

  it('claims free queued runs from the store when started, and performs them', async () => {
    const fake = fakeInvoker(recorder);
    const app = appOf();
    const id = await queued(app, null);
    const worker = workerOf(fake, { claimFromStore: true, pollIntervalMs: 20 });
    await worker.start();
    await waitUntil(() => fake.events.includes(`end:${id}`));
    const stored = await row(id);
    assert.equal(stored.owner, OWNER);
    assert.equal(stored.state, 'success');
  });

  it('lets the runs it holds but has not started go at close, for any node to take', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const first = await queued(app);
    const second = await queued(app);
    fake.hold.add(first);
    worker.enqueue({ id: first, ...app });
    worker.enqueue({ id: second, ...app });
    await waitUntil(() => fake.events.includes(`start:${first}`));
    const closing = worker.close();
    fake.release(first);
    await closing;
    assert.equal((await row(first)).state, 'success', 'the run in flight finished');
    const let_go = await row(second);
    assert.equal(let_go.state, 'queued');
    assert.equal(let_go.owner, null, 'free for any node');
    assert.ok(!fake.events.includes(`claim:${second}`));
  });

  it('lets a run interrupted before it started go at close, for any node to take (issue 43)', async () => {
    const fake = fakeInvoker(recorder);
    const worker = workerOf(fake);
    const app = appOf();
    const id = await queued(app);
    fake.behaviour.set(id, ['interrupted']);
    fake.hold.add(id);
    worker.enqueue({ id, ...app });
    await waitUntil(() => fake.events.includes(`waiting:${id}`));
    const closing = worker.close();
    // The shutdown's grace is over: the run, still waiting for a slot, is interrupted.
    fake.release(id);
    await closing;
    const let_go = await row(id);
    assert.equal(let_go.state, 'queued');
    assert.equal(let_go.owner, null, 'free for any node');
    assert.equal(worker.backlog, 0);
  });
});

/** Polls `check` every few milliseconds (bounded generously: the machine may be busy). */
async function waitUntil(check: () => boolean, ms = 30_000): Promise<void> {
  const end = Date.now() + ms;
  while (!check()) {
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
