/**
 * The invoker (`runs/invoke.ts`, `createInvoker`) as a component: a fake replica manager whose replica the
 * test scripts (answers, hangs, heeds or ignores a cancel), and the real recorder on a SQLite file. Covers
 * how a run ends across timeout × cancel × claim (async runs' start), each case in milliseconds: no
 * sandbox, no server, no socket. What the record and the webhook outbox hold is read back from the store.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { FerryError } from '../src/errors.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import type { Frame } from '../src/replicas/frames.js';
import type { ReplicaManager } from '../src/replicas/manager.js';
import type { PoolBuild, Slot } from '../src/replicas/pool.js';
import {
  createInvoker,
  type Invoker,
  type LocalInvoker,
  RunInterruptedError,
  RunNotClaimedError,
  RunStartError,
} from '../src/runs/invoke.js';
import { createRunRecorder, newRunRow, type RunRecorder } from '../src/runs/recorder.js';
import type { RunAbort } from '../src/runs/run-abort.js';
import { openSqliteStore, type Store } from '../src/store/index.js';
import { tempDir } from './helpers/ferry.js';

/** What the fake replica does with a call. */
type Script =
  | { kind: 'answer'; result: unknown }
  /** Never answers; ends (rejects) only when the run is aborted. */
  | { kind: 'hang' }
  /** Answers `result` once told of a cancel (the function heeding its AbortSignal and returning). */
  | { kind: 'heed-cancel'; result: unknown };

interface Fake {
  manager: ReplicaManager;
  /** What happened, in order: `acquire`, `call`, `cancel`, `release`, `release:timedOut`. */
  events: string[];
  script: Script;
  /** While set, a slot is not free: acquire waits until `freeSlot()` (or the run's abort). */
  busy: boolean;
  freeSlot(): void;
}

function fakeReplicas(build: PoolBuild): Fake {
  let waiting: Array<() => void> = [];
  let cancelled: (() => void) | undefined;
  const fake: Fake = {
    events: [],
    script: { kind: 'answer', result: null },
    busy: false,
    freeSlot() {
      fake.busy = false;
      const wake = waiting;
      waiting = [];
      for (const w of wake) w();
    },
    manager: undefined as unknown as ReplicaManager,
  };
  const replica = {
    async callFrames(
      _fn: string,
      _runId: string,
      _body: Buffer,
      abort: RunAbort,
      onFrame: (frame: Frame, bytes: number) => void,
    ): Promise<void> {
      fake.events.push('call');
      const script = fake.script;
      if (script.kind === 'answer') {
        onFrame({ type: 'result', data: script.result }, 0);
        return;
      }
      await new Promise<void>((resolve, reject) => {
        abort.onAbort(() => reject(abort.reason));
        if (script.kind === 'heed-cancel')
          cancelled = () => {
            onFrame({ type: 'result', data: script.result }, 0);
            resolve();
          };
      });
    },
    async cancel(_runId: string): Promise<boolean> {
      fake.events.push('cancel');
      const heed = cancelled;
      cancelled = undefined;
      heed?.();
      return heed !== undefined;
    },
  };
  const slot = (coldStart: boolean): Slot => ({
    replica: replica as unknown as Slot['replica'],
    build,
    coldStart,
    release(options) {
      fake.events.push(options?.timedOut ? 'release:timedOut' : 'release');
    },
  });
  const pool = {
    build,
    tryAcquire(): Slot | undefined {
      if (fake.busy) return undefined;
      fake.events.push('acquire');
      return slot(false);
    },
    acquire(signal: AbortSignal): Promise<Slot> {
      return new Promise((resolve, reject) => {
        if (signal.aborted) return reject(signal.reason);
        signal.addEventListener('abort', () => reject(signal.reason), { once: true });
        waiting.push(() => {
          fake.events.push('acquire');
          resolve(slot(true));
        });
      });
    },
  };
  fake.manager = { pool: () => pool } as unknown as ReplicaManager;
  return fake;
}

describe('the invoker with a fake replica and the real recorder', () => {
  let dir: string;
  let store: Store;
  let recorder: RunRecorder;
  const logger = createLogger({ level: 'silent', pretty: false });

  before(async () => {
    dir = await tempDir('ferry-invoker-');
    store = await openSqliteStore({ dataDir: dir });
    recorder = createRunRecorder({ store, logger, owner: 'node-test' });
  });
  after(async () => {
    await recorder.close();
    await store.destroy();
    await fs.rm(dir, { recursive: true, force: true });
  });

  /** A build whose response_grace_period is `graceSeconds`. */
  function buildOf(graceSeconds = 30): PoolBuild {
    const config = parseAppConfig('[app]\nname = "comp"\n');
    config.scaling.response_grace_period = graceSeconds;
    return { projectId: 'p-comp', appId: 'comp', buildId: uuidv7(), runtime: 'node', config };
  }

  function invokerOf(fake: Fake, options: { cancelGraceMs?: number } = {}): LocalInvoker {
    return createInvoker({ replicas: fake.manager, recorder, logger, cancelGraceMs: options.cancelGraceMs ?? 60_000 });
  }

  async function record(runId: string) {
    await recorder.flush(true);
    return store.selectFrom('runs').selectAll().where('id', '=', runId).executeTakeFirstOrThrow();
  }

  async function webhookPayloads(runId: string): Promise<Array<Record<string, unknown>>> {
    await recorder.flush(true);
    const rows = await store.selectFrom('webhook_deliveries').select('payload').where('run_id', '=', runId).execute();
    return rows.map((r) => JSON.parse(r.payload) as Record<string, unknown>);
  }

  const request = (build: PoolBuild, extra: Record<string, unknown> = {}) => ({
    runId: uuidv7(),
    build,
    fn: 'work',
    mode: 'sync' as const,
    body: Buffer.from('{"n":1}'),
    webhookUrl: 'http://127.0.0.1:9/hook',
    ...extra,
  });

  it('records a success with its result, and queues its webhook with the state', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    fake.script = { kind: 'answer', result: { ok: true } };
    const req = request(build);
    const answer = await invokerOf(fake).invoke(req);
    assert.deepEqual(answer.result, { ok: true });
    assert.equal(answer.statusCode, 200);
    assert.deepEqual(fake.events, ['acquire', 'call', 'release']);
    const row = await record(req.runId);
    assert.equal(row.state, 'success');
    assert.equal(row.result, '{"ok":true}');
    assert.equal(row.input, '{"n":1}');
    const [payload, more] = await webhookPayloads(req.runId);
    assert.equal(more, undefined, 'one webhook');
    assert.equal(payload?.state, 'success');
  });

  it('ends a run past its deadline `timeout`, and stops its replica after recording it', async () => {
    const build = buildOf(0.05);
    const fake = fakeReplicas(build);
    fake.script = { kind: 'hang' };
    const req = request(build);
    await assert.rejects(invokerOf(fake).invoke(req), (err: unknown) => {
      assert.ok(err instanceof FerryError);
      assert.equal(err.code, 'FERRY_RUN_TIMEOUT');
      return true;
    });
    assert.deepEqual(fake.events.slice(0, 3), ['acquire', 'call', 'release:timedOut']);
    const row = await record(req.runId);
    assert.equal(row.state, 'timeout');
    assert.equal(row.error_code, 'FERRY_RUN_TIMEOUT');
    assert.equal((await webhookPayloads(req.runId))[0]?.state, 'timeout');
  });

  it('times out a run still waiting for a slot: nothing is called', async () => {
    const build = buildOf(0.05);
    const fake = fakeReplicas(build);
    fake.busy = true;
    const req = request(build);
    await assert.rejects(invokerOf(fake).invoke(req), /response_grace_period/);
    assert.deepEqual(fake.events, [], 'no slot taken, no call');
    const row = await record(req.runId);
    assert.equal(row.state, 'timeout');
    assert.equal(row.started_at, null, 'never started');
  });

  it('cancels a run waiting for a slot at once: nothing is called', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    fake.busy = true;
    const invoker = invokerOf(fake);
    const req = request(build);
    const running = invoker.invoke(req);
    // The run is in progress here (waiting for a slot) as soon as invoke was called.
    assert.equal(invoker.cancel(req.runId), true);
    await assert.rejects(running, (err: unknown) => err instanceof FerryError && err.code === 'FERRY_RUN_CANCELLED');
    assert.equal(invoker.cancel(req.runId), false, 'no longer in progress');
    assert.deepEqual(fake.events, []);
    const row = await record(req.runId);
    assert.equal(row.state, 'cancelled');
    assert.equal(row.reason, 'cancelled');
    assert.equal((await webhookPayloads(req.runId))[0]?.state, 'cancelled');
  });

  it('tells a running function of a cancel; one that returns within the grace ends `cancelled`, its replica kept', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    fake.script = { kind: 'heed-cancel', result: 'stopped early' };
    const invoker = invokerOf(fake);
    const req = request(build);
    const running = invoker.invoke(req);
    await waitUntil(() => fake.events.includes('call'));
    assert.equal(invoker.cancel(req.runId), true);
    await assert.rejects(running, (err: unknown) => err instanceof FerryError && err.code === 'FERRY_RUN_CANCELLED');
    assert.deepEqual(fake.events, ['acquire', 'call', 'cancel', 'release']);
    const row = await record(req.runId);
    assert.equal(row.state, 'cancelled');
    assert.equal(row.result, null, 'the cancelled function’s result is not its outcome');
  });

  it('stops the replica of a function that ignores a cancel past the grace', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    fake.script = { kind: 'hang' };
    const invoker = invokerOf(fake, { cancelGraceMs: 50 });
    const req = request(build);
    const running = invoker.invoke(req);
    await waitUntil(() => fake.events.includes('call'));
    assert.equal(invoker.cancel(req.runId), true);
    await assert.rejects(running, /did not return within 0.05 s, so its replica was stopped/);
    assert.deepEqual(fake.events.slice(0, 4), ['acquire', 'call', 'cancel', 'release:timedOut']);
    assert.equal((await record(req.runId)).state, 'cancelled');
  });

  it('keeps `timeout` when a cancel comes after the deadline', async () => {
    const build = buildOf(0.05);
    const fake = fakeReplicas(build);
    fake.script = { kind: 'hang' };
    const invoker = invokerOf(fake);
    const req = request(build);
    await assert.rejects(invoker.invoke(req), /response_grace_period/);
    assert.equal(invoker.cancel(req.runId), false, 'a finished run cannot be cancelled');
    assert.equal((await record(req.runId)).state, 'timeout');
  });

  it('claims an async run once a slot is taken; a run no longer this node’s is neither called nor recorded', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    const row = newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: '{}', owner: 'node-test' });
    await recorder.insertNow(row);
    const order: string[] = [];
    await assert.rejects(
      invokerOf(fake).invoke({
        ...request(build),
        runId: row.id,
        mode: 'async',
        recorded: true,
        claim: async () => {
          order.push(`claim after ${fake.events.join(',')}`);
          return undefined;
        },
      }),
      RunNotClaimedError,
    );
    assert.deepEqual(order, ['claim after acquire']);
    assert.deepEqual(fake.events, ['acquire', 'release'], 'the slot given back, nothing called');
    const stored = await record(row.id);
    assert.equal(stored.state, 'queued', 'left as it was');
    assert.deepEqual(await webhookPayloads(row.id), []);
  });

  it('reports a claim the store failed as RunStartError, recording nothing', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    const row = newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: '{}', owner: 'node-test' });
    await recorder.insertNow(row);
    await assert.rejects(
      invokerOf(fake).invoke({
        ...request(build),
        runId: row.id,
        mode: 'async',
        recorded: true,
        claim: async () => {
          throw new Error('the store is down');
        },
      }),
      RunStartError,
    );
    assert.deepEqual(fake.events, ['acquire', 'release']);
    assert.equal((await record(row.id)).state, 'queued');
  });

  it('times out an async run waiting for a slot before its claim: the claim is never made', async () => {
    const build = buildOf(0.05);
    const fake = fakeReplicas(build);
    fake.busy = true;
    let claims = 0;
    const row = newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: '{}', owner: 'node-test' });
    await recorder.insertNow(row);
    await assert.rejects(
      invokerOf(fake).invoke({
        ...request(build),
        runId: row.id,
        mode: 'async',
        recorded: true,
        claim: async () => {
          claims++;
          return 1;
        },
      }),
      /response_grace_period/,
    );
    assert.equal(claims, 0);
    assert.deepEqual(fake.events, []);
  });

  it('ends a run whose caller went away `cancelled` (client_disconnected)', async () => {
    const build = buildOf();
    const fake = fakeReplicas(build);
    fake.script = { kind: 'hang' };
    const caller = new AbortController();
    const req = request(build, { signal: caller.signal });
    const running = invokerOf(fake).invoke(req);
    await waitUntil(() => fake.events.includes('call'));
    caller.abort(new Error('the caller closed the connection'));
    await assert.rejects(running, /the caller closed the connection/);
    const row = await record(req.runId);
    assert.equal(row.state, 'cancelled');
    assert.equal(row.reason, 'client_disconnected');
    assert.equal(row.status_code, 499);
  });

  describe('interrupted by a server stopping past its grace (issue 43)', () => {
    /** A hanging async run of `build`, started for real (its start written as the async worker writes it). */
    async function startedAsync(build: PoolBuild, fake: Fake, invoker: Invoker) {
      fake.script = { kind: 'hang' };
      const row = newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: '{}', owner: 'node-test' });
      await recorder.insertNow(row);
      const policy = build.config.retries;
      const running = invoker.invoke({
        ...request(build),
        runId: row.id,
        mode: 'async',
        recorded: true,
        claim: () => recorder.startNow(row.id, 'node-test'),
        ...(policy.max_attempts > 1 ? { retries: { policy, log: null } } : {}),
      });
      await waitUntil(() => fake.events.includes('call'));
      return { id: row.id, running };
    }

    it('ends a sync run `failure`, reason `interrupted`, with its webhook; its caller gets FERRY_REPLICA_DIED', async () => {
      const build = buildOf();
      const fake = fakeReplicas(build);
      fake.script = { kind: 'hang' };
      const invoker = invokerOf(fake);
      const req = request(build);
      const running = invoker.invoke(req);
      await waitUntil(() => fake.events.includes('call'));
      assert.equal(invoker.interrupt(), 1);
      await assert.rejects(running, (err: unknown) => err instanceof FerryError && err.code === 'FERRY_REPLICA_DIED');
      assert.equal(invoker.interrupt(), 0, 'nothing left in progress');
      const row = await record(req.runId);
      assert.equal(row.state, 'failure');
      assert.equal(row.reason, 'interrupted');
      assert.equal(row.error_code, 'FERRY_REPLICA_DIED');
      const [payload] = await webhookPayloads(req.runId);
      assert.equal(payload?.state, 'failure');
    });

    it('queues a started async run of an app with retry_interrupted again, for any node, with no webhook', async () => {
      const build = buildOf();
      build.config.app.retry_interrupted = true;
      const fake = fakeReplicas(build);
      const invoker = invokerOf(fake);
      const run = await startedAsync(build, fake, invoker);
      assert.equal(invoker.interrupt(), 1);
      await assert.rejects(
        run.running,
        (err: unknown) => err instanceof FerryError && err.code === 'FERRY_REPLICA_DIED',
      );
      const row = await record(run.id);
      assert.equal(row.state, 'queued');
      assert.equal(row.owner, null);
      assert.equal(row.attempts, 1);
      assert.deepEqual(await webhookPayloads(run.id), []);
    });

    it('follows the retry policy of an app without retry_interrupted: tried again after its delay', async () => {
      const build = buildOf();
      build.config.retries = { max_attempts: 3, initial_delay: 60, backoff: 2, max_delay: 300, on: ['interrupted'] };
      const fake = fakeReplicas(build);
      const invoker = invokerOf(fake);
      const run = await startedAsync(build, fake, invoker);
      invoker.interrupt();
      await assert.rejects(run.running, /stopped while the run was in progress/);
      const row = await record(run.id);
      assert.equal(row.state, 'queued');
      assert.equal(row.owner, null);
      assert.ok(row.not_before && Date.parse(row.not_before) > Date.now() + 30_000, 'after the policy’s delay');
      assert.match(row.attempt_log ?? '', /"error_code":"FERRY_REPLICA_DIED"/);
    });

    it('ends a started async run of an app with neither `failure`, reason `interrupted`', async () => {
      const build = buildOf();
      const fake = fakeReplicas(build);
      const invoker = invokerOf(fake);
      const run = await startedAsync(build, fake, invoker);
      invoker.interrupt();
      await assert.rejects(run.running, /stopped while the run was in progress/);
      const row = await record(run.id);
      assert.equal(row.state, 'failure');
      assert.equal(row.reason, 'interrupted');
    });

    it('lets an async run waiting for a slot before its claim go: RunInterruptedError, still queued', async () => {
      const build = buildOf();
      const fake = fakeReplicas(build);
      fake.busy = true;
      let claims = 0;
      const row = newRunRow({ id: uuidv7(), build, fn: 'work', mode: 'async', input: '{}', owner: 'node-test' });
      await recorder.insertNow(row);
      const invoker = invokerOf(fake);
      const running = invoker.invoke({
        ...request(build),
        runId: row.id,
        mode: 'async',
        recorded: true,
        claim: async () => {
          claims++;
          return 1;
        },
      });
      assert.equal(invoker.interrupt(), 1);
      await assert.rejects(running, RunInterruptedError);
      assert.equal(claims, 0);
      assert.deepEqual(fake.events, [], 'nothing called');
      const stored = await record(row.id);
      assert.equal(stored.state, 'queued', 'left for the async worker to let go');
      assert.deepEqual(await webhookPayloads(row.id), []);
    });
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
