/**
 * The invoker's contract (`Invoker`, runs/invoke.ts; the seam of docs/architecture.md): one suite body run
 * against both implementations, which a caller (the run service) must not be able to tell apart:
 *
 * - local (`createInvoker`): replicas of this process;
 * - remote (`createRemoteInvoker`, a gateway's): each call over HTTP on loopback to a real worker listener
 *   (`createWorkerApi`, the worker protocol of cluster/protocol.ts), which performs it with a local invoker
 *   of its own and records it.
 *
 * Real parts below both: a replica manager and the launcher of services.ts starting the real Node bootstrap
 * in this machine's sandbox (as `ferry serve` would, no warm pool), on an app bundled by esbuild the way the
 * Node builder bundles it, and the real recorder on one SQLite file. The remote invoker's worker directory
 * is a fixed list of the one worker (the directory on NATS has its own test, test/workers-directory).
 *
 * What both promise, proven on each: a sync call answers the function's result (and records it); a stream
 * call hands its items in order; a function that throws is FERRY_FUNCTION_ERROR with its type and message;
 * an unknown function FERRY_FUNCTION_NOT_FOUND; a run past response_grace_period FERRY_RUN_TIMEOUT; a
 * cancel of the run ends it FERRY_RUN_CANCELLED; a caller that goes away ends it `cancelled`
 * (client_disconnected); a build deleted since the call resolved it is 503 FERRY_NO_READY_BUILD with
 * Retry-After (the worker's check, cluster/worker-builds.ts; the launcher's, replicas/launcher.ts: the local
 * invoker answered 500 FERRY_INTERNAL, and the remote one dropped the worker's Retry-After, until this
 * suite found them). Each recorded alike (state, status, error code) in the store; `onRecorded` is called
 * exactly when a run has the call's id (the run endpoint names a run in an error only then, issue 43).
 *
 * Where they differ on purpose (asserted per implementation):
 * - `cancel(runId)`: the local invoker cancels a run it performs (true); a gateway performs nothing, so its
 *   invoker answers false and the cancel reaches the worker performing the run (the change feed's
 *   `run.cancel`, which calls that worker's local invoker): the suite cancels on the performing node.
 * - A sync answer's result: both give it as JSON text (`resultJson`, what callers answer); the local invoker
 *   gives the parsed value in `result` too, the remote one leaves `result` undefined (the worker's bytes are
 *   passed on unparsed, cluster/protocol.ts `doneEvent`). A stream answer's `result` is parsed by both.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import * as esbuild from 'esbuild';
import { parseAppConfig } from '../src/apps/app-config.js';
import { createClusterAuth } from '../src/cluster/cluster-auth.js';
import { createWorkerBuilds } from '../src/cluster/worker-builds.js';
import type { WorkerAnnouncement, WorkerDirectory } from '../src/cluster/workers.js';
import { createWorkerApi, type WorkerApi } from '../src/http/worker-api.js';
import { isoTime, uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { createMetrics } from '../src/metrics.js';
import { createLauncher } from '../src/replicas/launcher.js';
import { createReplicaManager, type ReplicaManager } from '../src/replicas/manager.js';
import type { PoolBuild } from '../src/replicas/pool.js';
import { createInvoker, type InvokeRequest, type Invoker } from '../src/runs/invoke.js';
import { createRunRecorder, type RunRecorder } from '../src/runs/recorder.js';
import { createRemoteInvoker, type RemoteInvoker } from '../src/runs/remote-invoker.js';
import { detectSandbox } from '../src/sandbox/launch.js';
import { createLoopbackOnlyNetwork } from '../src/sandbox/network.js';
import { openSqliteStore, probeStore, type Store } from '../src/store/index.js';
import { rejectsWithCode } from './helpers/coded-error.js';
import { REPO_ROOT, tempDir } from './helpers/ferry.js';

const logger = createLogger({ level: process.env.FERRY_TEST_LOG ?? 'silent', pretty: false });
const PROJECT = 'p-c0417ac7';

const APP_SOURCE = `
export function hello({ name = 'world' }: { name?: string }) { return { message: 'Hello, ' + name + '!' }; }
export function fail() { throw new TypeError('bad input'); }
export async function* count({ n = 3 }: { n?: number }) { for (let i = 0; i < n; i++) yield { i }; }
/** Sleeps \`ms\` unless the run is cancelled (it heeds its signal and returns early). */
export async function sleep({ ms = 60_000 }: { ms?: number }, { signal }: { signal: AbortSignal }) {
  await new Promise<void>((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(timer); resolve(); });
  });
  return { slept: ms };
}
/** Yields once, then waits to be stopped (a caller that goes away stops it). */
export async function* hold(_: unknown, { signal }: { signal: AbortSignal }) {
  yield 'started';
  await new Promise<void>((resolve) => signal.addEventListener('abort', () => resolve()));
}
`;

/** What both implementations run on: the store, its recorder, the app's two builds. */
interface Ground {
  dir: string;
  store: Store;
  recorder: RunRecorder;
  /** The app with a response_grace_period of 30 s. */
  build: PoolBuild;
  /** Another app of the same code whose response_grace_period is 1 s. */
  short: PoolBuild;
}

/** One implementation, opened: the invoker a caller uses, and the invoker of the node performing runs. */
interface Opened {
  invoker: Invoker;
  /** Where a cancel of a run takes effect (see the module comment). */
  performer: Invoker;
  /** The replicas of the node performing runs. */
  replicas: ReplicaManager;
  close(): Promise<void>;
}

interface InvokerImplementation {
  name: string;
  /** What this implementation's own `cancel(runId)` answers for a run in progress (see the module comment). */
  cancelsItself: boolean;
  /** Whether a sync answer's `result` is the parsed value as well as `resultJson` (see the module comment). */
  parsesSyncResult: boolean;
  open(ground: Ground): Promise<Opened>;
}

/** A replica manager and a local invoker as services.ts makes them on a node that runs code. */
async function localNode(ground: Ground, name: string): Promise<{ invoker: Invoker; replicas: ReplicaManager }> {
  const runDir = path.join(ground.dir, `run-${name}`);
  await fs.mkdir(runDir, { recursive: true, mode: 0o711 });
  const launch = createLauncher({
    store: ground.store,
    buildsDir: path.join(ground.dir, 'builds'),
    runDir,
    sandbox: await detectSandbox(),
    network: createLoopbackOnlyNetwork(),
    secrets: async () => ({}),
  });
  const replicas = createReplicaManager({
    store: ground.store,
    launch,
    logger,
    maxQueue: 16,
    startTimeoutMs: 30_000,
  });
  const invoker = createInvoker({ replicas, recorder: ground.recorder, logger, cancelGraceMs: 5_000 });
  return { invoker, replicas };
}

function invokerContract(impl: InvokerImplementation): void {
  describe(`invoker contract: ${impl.name}`, () => {
    let ground: Ground;
    let opened: Opened;
    before(async () => {
      ground = await prepareGround();
      opened = await impl.open(ground);
    });
    after(async () => {
      await opened?.close();
      await ground?.recorder.close();
      await ground?.store.destroy();
      if (ground) await fs.rm(ground.dir, { recursive: true, force: true });
    });

    const request = (fn: string, body: unknown, extra: Partial<InvokeRequest> = {}): InvokeRequest => ({
      runId: uuidv7(),
      build: ground.build,
      fn,
      mode: 'sync',
      body: Buffer.from(JSON.stringify(body)),
      ...extra,
    });

    /** The run's record once it is final (the remote side's recorder writes it on the worker, a little later). */
    async function finalRecord(runId: string) {
      const end = Date.now() + 20_000;
      for (;;) {
        await ground.recorder.flush(true);
        const row = await ground.store.selectFrom('runs').selectAll().where('id', '=', runId).executeTakeFirst();
        if (row && ['success', 'failure', 'timeout', 'cancelled'].includes(row.state)) return row;
        if (Date.now() > end) throw new Error(`run ${runId} not final: ${JSON.stringify(row)}`);
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    }

    it('answers a sync call with the function’s result, and records it', async () => {
      const req = request('hello', { name: 'contract' });
      const answer = await opened.invoker.invoke(req);
      // What a caller answers: `resultJson` when given, else `result` (runs/invoke.ts InvokeResult).
      assert.equal(answer.resultJson, '{"message":"Hello, contract!"}');
      assert.deepEqual(answer.result, impl.parsesSyncResult ? { message: 'Hello, contract!' } : undefined);
      assert.equal(answer.statusCode, 200);
      assert.equal(answer.streamed, false);
      assert.equal(typeof answer.runTimeMs, 'number');
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'success');
      assert.equal(row.status_code, 200);
      assert.deepEqual(JSON.parse(row.result ?? 'null'), { message: 'Hello, contract!' });
      assert.equal(row.input, '{"name":"contract"}');
    });

    it('hands a stream call’s items in order, then answers', async () => {
      const items: unknown[] = [];
      let started = 0;
      const req = request(
        'count',
        { n: 4 },
        { mode: 'stream', onItem: (d) => items.push(d), onStarted: () => started++ },
      );
      const answer = await opened.invoker.invoke(req);
      assert.equal(started, 1, 'told once that the call began');
      assert.deepEqual(items, [{ i: 0 }, { i: 1 }, { i: 2 }, { i: 3 }]);
      assert.equal(answer.streamed, true);
      assert.equal((await finalRecord(req.runId)).state, 'success');
      // A plain function called as a stream: its result is the answer's `result`, parsed, on both.
      const plain = await opened.invoker.invoke(request('hello', {}, { mode: 'stream' }));
      assert.equal(plain.streamed, false);
      assert.deepEqual(plain.result, { message: 'Hello, world!' });
    });

    it('answers a function that throws with FERRY_FUNCTION_ERROR, its type and message, and records a failure', async () => {
      let recorded = 0;
      const req = request('fail', {}, { onRecorded: () => recorded++ });
      const err = await rejectsWithCode(opened.invoker.invoke(req), 'FERRY_FUNCTION_ERROR');
      assert.equal(recorded, 1, 'told once that the run is recorded (the run endpoint then names it)');
      assert.equal(err.status, 500);
      assert.equal(err.details?.type, 'TypeError');
      assert.match(err.message, /bad input/);
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'failure');
      assert.equal(row.status_code, 500);
      assert.equal(row.error_code, 'FERRY_FUNCTION_ERROR');
    });

    it('answers an unknown function with FERRY_FUNCTION_NOT_FOUND, and records it', async () => {
      const req = request('missing', {});
      const err = await rejectsWithCode(opened.invoker.invoke(req), 'FERRY_FUNCTION_NOT_FOUND');
      assert.equal(err.status, 404);
      assert.match(err.message, /"missing"/);
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'failure');
      assert.equal(row.error_code, 'FERRY_FUNCTION_NOT_FOUND');
    });

    it('refuses a build that is not there any more (deleted since the call resolved it): 503 FERRY_NO_READY_BUILD', async () => {
      const gone: PoolBuild = { ...ground.build, appId: 'deleted', buildId: uuidv7() };
      let recorded = 0;
      const req = request('hello', {}, { build: gone, onRecorded: () => recorded++ });
      const err = await rejectsWithCode(opened.invoker.invoke(req), 'FERRY_NO_READY_BUILD');
      assert.equal(err.status, 503);
      assert.equal(err.headers['retry-after'], '1', 'the caller may try again (the app’s build as it is now)');
      // Told it was recorded exactly when a run has its id (issue 43: no run id is handed out for none). The
      // local invoker records every call it begins; a worker refuses this one before recording it.
      await ground.recorder.flush(true);
      const row = await ground.store.selectFrom('runs').select('id').where('id', '=', req.runId).executeTakeFirst();
      assert.equal(recorded, row ? 1 : 0, `recorded: ${recorded}, row: ${JSON.stringify(row)}`);
    });

    it('answers a run past response_grace_period with FERRY_RUN_TIMEOUT, and records a timeout', async () => {
      const req = request('sleep', { ms: 60_000 }, { build: ground.short });
      const err = await rejectsWithCode(opened.invoker.invoke(req), 'FERRY_RUN_TIMEOUT');
      assert.equal(err.status, 504);
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'timeout');
      assert.equal(row.error_code, 'FERRY_RUN_TIMEOUT');
      assert.equal(row.status_code, 504);
    });

    it('ends a cancelled run with FERRY_RUN_CANCELLED, and records it cancelled', async () => {
      const req = request('sleep', { ms: 60_000 });
      const running = opened.invoker.invoke(req);
      running.catch(() => undefined);
      // The cancel takes effect where the run is performed, once it is in progress there.
      const end = Date.now() + 20_000;
      while (!opened.performer.cancel(req.runId)) {
        assert.ok(Date.now() < end, 'the run to be in progress where it is performed');
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      await rejectsWithCode(running, 'FERRY_RUN_CANCELLED');
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'cancelled');
      assert.equal(row.reason, 'cancelled');
      assert.equal(row.error_code, 'FERRY_RUN_CANCELLED');
      assert.equal(opened.performer.cancel(req.runId), false, 'no longer in progress');
    });

    it(`answers ${impl.cancelsItself} to its own cancel of a run in progress`, async () => {
      const req = request('sleep', { ms: 60_000 });
      const running = opened.invoker.invoke(req);
      running.catch(() => undefined);
      // In progress where it is performed: it holds a replica slot there (one run at a time in this suite).
      const end = Date.now() + 20_000;
      while (!opened.replicas.pools().some((p) => p.stats.inflight > 0)) {
        assert.ok(Date.now() < end, 'the run to hold a slot');
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
      assert.equal(opened.invoker.cancel(req.runId), impl.cancelsItself);
      if (!impl.cancelsItself) assert.equal(opened.performer.cancel(req.runId), true, 'the worker cancels it');
      await rejectsWithCode(running, 'FERRY_RUN_CANCELLED');
      assert.equal((await finalRecord(req.runId)).state, 'cancelled');
    });

    it('ends the run `cancelled` (client_disconnected) when its caller goes away', async () => {
      const caller = new AbortController();
      const gone = new Error('the caller closed the connection');
      const req = request(
        'hold',
        {},
        {
          mode: 'stream',
          signal: caller.signal,
          onItem: () => caller.abort(gone),
        },
      );
      await assert.rejects(opened.invoker.invoke(req), (err: unknown) => err === gone);
      const row = await finalRecord(req.runId);
      assert.equal(row.state, 'cancelled');
      assert.equal(row.reason, 'client_disconnected');
      assert.equal(row.status_code, 499);
    });
  });
}

/** A fresh store with the app's two ready builds, bundled as the Node builder bundles an app. */
async function prepareGround(): Promise<Ground> {
  const dir = await tempDir('contracts-invoker-');
  const store = await openSqliteStore({ dataDir: dir });
  const recorder = createRunRecorder({ store, logger, owner: 'contracts-node' });
  const now = isoTime(Date.now());
  await store.insertInto('projects').values({ id: PROJECT, name: 'contracts', created_at: now }).execute();
  const source = path.join(dir, 'main.ts');
  await fs.writeFile(source, APP_SOURCE);
  const make = async (appId: string, grace: number): Promise<PoolBuild> => {
    const toml = `[app]\nname = "${appId}"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 8\nresponse_grace_period = ${grace}\n`;
    const config = parseAppConfig(toml);
    const buildId = uuidv7();
    await esbuild.build({
      entryPoints: [source],
      outfile: path.join(dir, 'builds', buildId, 'out', 'main.mjs'),
      bundle: true,
      platform: 'node',
      format: 'esm',
      logLevel: 'silent',
      absWorkingDir: REPO_ROOT,
    });
    await store
      .insertInto('apps')
      .values({
        id: appId,
        project_id: PROJECT,
        name: appId,
        active_build_id: buildId,
        scaling_json: null,
        created_at: now,
        updated_at: now,
      })
      .execute();
    await store
      .insertInto('builds')
      .values({
        id: buildId,
        project_id: PROJECT,
        app_id: appId,
        state: 'ready',
        config_toml: toml,
        config_json: JSON.stringify(config),
        runtime: 'node',
        entry: 'out/main.mjs',
        archive_bytes: 0,
        file_count: 1,
        functions: null,
        error: null,
        created_at: now,
        started_at: now,
        finished_at: now,
      })
      .execute();
    return { projectId: PROJECT, appId, buildId, runtime: 'node', config };
  };
  return { dir, store, recorder, build: await make('inv', 30), short: await make('inv-short', 1) };
}

// ---- the implementations ----

invokerContract({
  name: 'local (replicas of this process)',
  cancelsItself: true,
  parsesSyncResult: true,
  async open(ground) {
    const { invoker, replicas } = await localNode(ground, 'local');
    return { invoker, performer: invoker, replicas, close: () => replicas.close(1_000) };
  },
});

invokerContract({
  name: 'remote (a worker’s listener over loopback)',
  cancelsItself: false,
  parsesSyncResult: false,
  async open(ground) {
    const key = randomBytes(32);
    const worker = await localNode(ground, 'worker');
    const api: WorkerApi = createWorkerApi({
      builds: createWorkerBuilds(ground.store),
      storeHealth: (ms) => probeStore(ground.store, ms),
      invoker: worker.invoker,
      auth: createClusterAuth({ key, nodeId: 'contracts-worker' }),
      metrics: createMetrics({ node: 'contracts-worker', role: 'worker' }),
      refreshGauges: () => {},
      logger,
      maxBodyBytes: 1024 * 1024,
    });
    await new Promise<void>((resolve) => api.server.listen(0, '127.0.0.1', resolve));
    const { port } = api.server.address() as AddressInfo;
    const announcement: WorkerAnnouncement = {
      id: 'contracts-worker',
      url: `http://127.0.0.1:${port}`,
      role: 'worker',
      version: 'test',
      startedAt: isoTime(Date.now()),
      at: Date.now(),
      load: { capacity: 0, inflight: 0, replicas: 0, apps: {} },
    };
    const directory: WorkerDirectory = {
      start: async () => {},
      live: () => [announcement],
      get: (id) => (id === announcement.id ? announcement : undefined),
      markDown: () => {},
      close: async () => {},
    };
    const remote: RemoteInvoker = createRemoteInvoker({
      directory,
      auth: createClusterAuth({ key, nodeId: 'contracts-gateway' }),
      nodeId: 'contracts-gateway',
      logger,
    });
    return {
      invoker: remote,
      performer: worker.invoker,
      replicas: worker.replicas,
      async close() {
        await remote.close();
        await api.close();
        await worker.replicas.close(1_000);
      },
    };
  },
});
