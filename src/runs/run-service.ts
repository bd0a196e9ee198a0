/**
 * The run service: what the run endpoint and the runs routes ask of runs, behind one object. Resolving a
 * call's app and build (authenticating unless the build turns auth off), accepting an async run (its
 * idempotency, the admission checks, the owner the run queue chooses, the commit), performing sync and
 * streaming runs through the invoker, cancelling, and the reads (list, get, wait, logs), each flushing the
 * recorder's pending rows first so a read sees every run this process has recorded.
 *
 * The HTTP layer (http/routes/run.ts, http/run-fast-path.ts, http/routes/runs.ts) only translates requests
 * and answers; every rule about runs it used to hold lives here. How a run ends is not here: the invoker,
 * the async worker and cancel (runs/runs.ts) end runs.
 */
import { findApp } from '../apps/apps.js';
import type { Authenticator } from '../auth/authenticate.js';
import type { ChangeFeed } from '../cluster/change-feed.js';
import type { DiskSpace } from '../disk-space.js';
import { FerryError } from '../errors.js';
import { uuidv7 } from '../ids.js';
import type { PoolBuild } from '../replicas/pool.js';
import type { Store } from '../store/index.js';
import type { Run, RunMode, RunState } from '../store/schema.js';
import { decryptWebhookSecret, encryptWebhookSecret } from '../webhooks/secret.js';
import { type WebhookView, webhookView } from '../webhooks/view.js';
import type { Invoker } from './invoke.js';
import { isFinalState } from './lifecycle.js';
import type { ProjectBacklog } from './project-backlog.js';
import { type NewRunFields, newRunRow, type RunRecorder } from './recorder.js';
import { acceptedRun, type RunQueue } from './run-queue.js';
import type { RunWaiters } from './run-waiters.js';
import { cancelQueuedRun, findRun, listRuns, type RunView, runLogDrops, runLogs, viewRun } from './runs.js';
import type { RunTargets } from './targets.js';

/** The app and build a run call resolved to. */
export interface RunTarget {
  build: PoolBuild;
  /** Public function names known from the build, or undefined when the builder could not tell. */
  functions: string[] | undefined;
}

/** What an accepted call is made of (the run endpoint and the custom proxy build it from the request). */
export interface CallParts {
  runId: string;
  target: RunTarget;
  fn: string;
  body: Buffer;
  webhookUrl: string | undefined;
  webhookSecret: string | undefined;
  /** Custom runtime: the whole HTTP request to forward, as JSON (the run's `http_request`). */
  httpRequest?: string | undefined;
  /** What the run record shows as its input (default: the body as text). */
  input?: string | null;
}

/** A run as `GET .../runs/{run_id}` shows it: the record, its input and result, and its webhook. */
export type RunDetail = RunView & { webhook: WebhookView | null };

export const FINAL_RUN_STATES: ReadonlySet<RunState> = new Set<RunState>([
  'success',
  'failure',
  'timeout',
  'cancelled',
]);

/** How long an `Idempotency-Key` holds its run. */
const IDEMPOTENCY_WINDOW_MS = 24 * 3600 * 1000;

/** A run of the stats window: what the per-minute series is counted from. */
export interface RunTiming {
  state: RunState;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  run_time_ms: number | null;
}

export interface RunServiceDeps {
  store: Store;
  recorder: Pick<RunRecorder, 'flush' | 'insertNow' | 'log'>;
  runTargets: Pick<RunTargets, 'get' | 'peek'>;
  auth: Pick<Authenticator, 'authenticate' | 'peek'>;
  invoker: Pick<Invoker, 'invoke' | 'invokeHttp' | 'invokeSession'>;
  /** The run queue: its backlog, the owner it chooses, and the hand-over of a committed run. */
  runQueue: Pick<RunQueue, 'backlog' | 'ownerFor' | 'accepted'>;
  projectBacklog: Pick<ProjectBacklog, 'admit' | 'admitNow'>;
  /** FERRY_MAX_ASYNC_BACKLOG: async runs this node holds at most before it refuses more. */
  maxAsyncBacklog: number;
  runWaiters: Pick<RunWaiters, 'wait' | 'finished'>;
  changes: Pick<ChangeFeed, 'publish'>;
  webhooks: { wake(): void; redeliver(projectId: string, appId: string, runId: string): Promise<unknown> };
  /** How long a cancel waits for the run to end before answering 202 (FERRY_CANCEL_GRACE_SECONDS + 10 s). */
  cancelWaitMs: number;
  /** Encrypts webhook secrets per run (a retried run's secret is the old run's, under its own id). */
  secretsKey?: Uint8Array;
  /**
   * The data folder's free space (disk-space.ts): while it is `low`, new runs of every mode (calls, retries,
   * schedules' ticks) are refused with 507 FERRY_STORAGE_FULL before anything is written, so that the runs
   * accepted already keep the room to end. A flag read per call.
   */
  space?: Pick<DiskSpace, 'low' | 'intakeRefused'>;
}

/** A new async run as `commitAsync` takes it: `newRunRow`'s fields (the mode and owner it decides). */
export type AsyncRunFields = NewRunFields;

export interface RunService {
  /** Finds the app's active build, authenticating unless the build turns auth off. */
  resolveTarget(projectId: string, appName: string, authorization: string | undefined): Promise<RunTarget>;
  /**
   * `resolveTarget` without a Promise when the app's target and the token's check are both cached (the
   * warm path of the run endpoint); undefined when either is not, or when something is wrong (then
   * `resolveTarget` finds it again and throws the coded error).
   */
  resolveTargetCached(projectId: string, appName: string, authorization: string | undefined): RunTarget | undefined;
  /**
   * Stores an async run with its input and resolves with its run id only once it is committed. With an
   * idempotency key, a repeat within 24 hours (same function) resolves with the first call's run id and runs
   * nothing; the key reused for another function of the app answers FERRY_IDEMPOTENCY_KEY_REUSED.
   */
  acceptAsync(call: CallParts, idempotencyKey: string | undefined): Promise<string>;
  /**
   * The one admission rule of new async runs (calls, `runs retry`, schedules' ticks): resolves when this
   * node's backlog (FERRY_MAX_ASYNC_BACKLOG) and the project's (FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT) have
   * room for one more; throws 503 FERRY_ASYNC_BACKLOG_FULL or FERRY_PROJECT_BACKLOG_FULL (Retry-After: 5),
   * or 507 FERRY_STORAGE_FULL while the data folder is low on space (`space`).
   */
  admitAsync(projectId: string): Promise<void>;
  /**
   * Commits a new async run (durably, before it resolves) and hands it to the run queue. Resolves with the
   * id of the run holding its idempotency key: its own, or the earlier run's (then nothing is queued).
   */
  commitAsync(fields: AsyncRunFields): Promise<string>;
  /** Performs a sync or streaming run of a cortex function (the invoker records it). */
  invoke: Invoker['invoke'];
  /** Performs one HTTP call of a custom app. */
  invokeHttp: Invoker['invokeHttp'];
  /** Performs one WebSocket session of a custom app. */
  invokeSession: Invoker['invokeSession'];
  /** A note in the run's log (stream `system`). */
  note(runId: string, line: string): void;
  list(
    projectId: string,
    appId: string,
    query: {
      limit: number;
      before?: string | undefined;
      state?: RunState | undefined;
      mode?: RunMode | undefined;
      dead?: boolean | undefined;
    },
  ): Promise<RunView[]>;
  /**
   * `runs retry`: a finished run performed again as a new async run of the app's active build, with the
   * old run's stored input (and webhook), linked to it (`retry_of`). Resolves with the new run's id.
   */
  retry(projectId: string, appId: string, runId: string): Promise<string>;
  /** One run; with `waitMs`, once it has ended or the time has passed (or `signal` aborts), whichever is first. */
  get(projectId: string, appId: string, runId: string, wait?: { ms: number; signal: AbortSignal }): Promise<RunDetail>;
  /**
   * Cancels a run wherever it is (queued: here; running: on the node performing it) and waits for its end
   * up to `cancelWaitMs` (or `signal`); `ended` says whether it had ended by the answer. `requested` is
   * called once the cancel is sent, before the wait.
   */
  cancel(
    projectId: string,
    appId: string,
    runId: string,
    signal: AbortSignal,
    requested?: () => void,
  ): Promise<{ run: RunDetail; ended: boolean }>;
  logs(
    projectId: string,
    appId: string,
    runId: string,
    after: number,
  ): Promise<{
    run_id: string;
    lines: Awaited<ReturnType<typeof runLogs>>;
    dropped_lines: number;
    dropped_bytes: number;
  }>;
  /** Sends a run's webhook again (webhooks/deliverer.ts). */
  redeliverWebhook(projectId: string, appId: string, runId: string): Promise<void>;
  /** The app's runs created since `from` (ms), newest first, at most `limit`: the stats window. */
  recentRuns(projectId: string, appId: string, from: number, limit: number): Promise<RunTiming[]>;
}

/** Refuses a function the app does not have, or one that is not public (a leading `_`). */
export function checkFunction(target: RunTarget, fn: string): void {
  if (fn.startsWith('_') || (target.functions && !target.functions.includes(fn))) {
    throw new FerryError('FERRY_FUNCTION_NOT_FOUND', `The app has no public function "${fn}"`);
  }
}

/**
 * A repeat of a call of the function that holds the key answers that run (its body is not compared: the
 * first call's stands, as documented); the key reused for another function of the app is refused (422)
 * rather than silently answering a run of another function.
 */
function sameFunctionOrRefuse(earlier: { id: string; function_name: string }, fn: string): string {
  if (earlier.function_name === fn) return earlier.id;
  throw new FerryError('FERRY_IDEMPOTENCY_KEY_REUSED', undefined, { details: { held_by: earlier.id } });
}

/** The smallest UUIDv7 of the millisecond `ms`: run ids sort by creation time, so this bounds an index scan. */
export function uuidv7Floor(ms: number): string {
  const hex = Math.max(0, Math.floor(ms)).toString(16).padStart(12, '0');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-0000-0000-000000000000`;
}

export function createRunService(deps: RunServiceDeps): RunService {
  const { store, recorder, runTargets, auth, runQueue, runWaiters, space } = deps;

  async function replayKey(target: RunTarget, fn: string, idempotencyKey: string): Promise<string | undefined> {
    const { build } = target;
    const earlier = await store
      .selectFrom('runs')
      .select(['id', 'created_at', 'function_name'])
      .where('project_id', '=', build.projectId)
      .where('app_id', '=', build.appId)
      .where('idempotency_key', '=', idempotencyKey)
      .executeTakeFirst();
    if (!earlier) return undefined;
    if (Date.now() - Date.parse(earlier.created_at) < IDEMPOTENCY_WINDOW_MS) return sameFunctionOrRefuse(earlier, fn);
    // Past the window the key is free again: the old run keeps its record but lets go of the key.
    await store.updateTable('runs').set({ idempotency_key: null }).where('id', '=', earlier.id).execute();
    return undefined;
  }

  /**
   * admitAsync without a Promise when the project's count is fresh (nearly every call): true when admitted,
   * undefined when the count must be read first (then admitAsync); throws as admitAsync does.
   */
  function admitAsyncNow(projectId: string): true | undefined {
    if (space?.low) throw space.intakeRefused();
    if (runQueue.backlog >= deps.maxAsyncBacklog) {
      throw new FerryError('FERRY_ASYNC_BACKLOG_FULL', undefined, { headers: { 'retry-after': '5' } });
    }
    const admitted = deps.projectBacklog.admitNow(projectId);
    if (admitted === false) {
      throw new FerryError('FERRY_PROJECT_BACKLOG_FULL', undefined, { headers: { 'retry-after': '5' } });
    }
    return admitted;
  }

  async function admitAsync(projectId: string): Promise<void> {
    if (admitAsyncNow(projectId)) return;
    if (!(await deps.projectBacklog.admit(projectId))) {
      throw new FerryError('FERRY_PROJECT_BACKLOG_FULL', undefined, { headers: { 'retry-after': '5' } });
    }
  }

  function commitAsync(fields: AsyncRunFields): Promise<string> {
    // Held by this node when it has room to run it soon; otherwise free for whichever node has room first.
    const owner = runQueue.ownerFor(fields.build.projectId, fields.build.appId);
    const row = newRunRow(fields, 'async', owner);
    return recorder.insertNow(row).then((holder) => {
      if (holder === row.id) runQueue.accepted(acceptedRun(row), owner);
      return holder;
    });
  }

  /** The fields of an async call's run (`idempotencyKey`: its key, if any). */
  function asyncFields(call: CallParts, idempotencyKey: string | undefined): AsyncRunFields {
    return {
      id: call.runId,
      build: call.target.build,
      fn: call.fn,
      // Kept whole whatever its size: the worker runs the call from it (custom apps: from httpRequest).
      input: call.input !== undefined ? call.input : call.body.toString('utf8'),
      httpRequest: call.httpRequest,
      webhookUrl: call.webhookUrl,
      webhookSecret: call.webhookSecret,
      idempotencyKey,
    };
  }

  /** acceptAsync with an Idempotency-Key, or when the project's count must be read first. */
  async function acceptAsyncWaiting(call: CallParts, idempotencyKey: string | undefined): Promise<string> {
    const earlier = idempotencyKey ? await replayKey(call.target, call.fn, idempotencyKey) : undefined;
    if (earlier) return earlier;
    await admitAsync(call.target.build.projectId);
    // Calls sharing a key in one group commit: one row takes the key, the others answer its run id.
    const runId = await commitAsync(asyncFields(call, idempotencyKey));
    if (runId !== call.runId) {
      // Another call took the key in the same group commit (or just before): the same function, or refused.
      const winner = await store
        .selectFrom('runs')
        .select(['id', 'function_name'])
        .where('id', '=', runId)
        .executeTakeFirst();
      return winner ? sameFunctionOrRefuse(winner, call.fn) : runId;
    }
    return call.runId;
  }

  async function detail(run: Run): Promise<RunDetail> {
    return { ...viewRun(run, true), webhook: await webhookView(store, run.id) };
  }

  return {
    async resolveTarget(projectId, appName, authorization) {
      const found = await runTargets.get(projectId, appName);
      if (!found?.config?.app.disable_auth) await auth.authenticate(authorization, projectId, 'run');
      if (!found) throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${appName}" in this project`);
      if (!found.config || !found.buildId) {
        throw new FerryError('FERRY_NO_READY_BUILD', undefined, { headers: { 'retry-after': '5' } });
      }
      return {
        build: { projectId, appId: found.appId, buildId: found.buildId, runtime: found.runtime, config: found.config },
        functions: found.functions,
      };
    },

    resolveTargetCached(projectId, appName, authorization) {
      const found = runTargets.peek(projectId, appName);
      if (!found?.config || !found.buildId) return undefined;
      if (!found.config.app.disable_auth && !auth.peek(authorization, projectId, 'run')) return undefined;
      return {
        build: { projectId, appId: found.appId, buildId: found.buildId, runtime: found.runtime, config: found.config },
        functions: found.functions,
      };
    },

    acceptAsync(call, idempotencyKey) {
      // The hot path (no key, the project's count fresh): the commit's own Promise, nothing around it. A
      // run without a key always holds its own row, so the commit answers its id.
      if (idempotencyKey === undefined) {
        try {
          if (admitAsyncNow(call.target.build.projectId)) return commitAsync(asyncFields(call, undefined));
        } catch (err) {
          return Promise.reject(err);
        }
      }
      return acceptAsyncWaiting(call, idempotencyKey);
    },

    admitAsync,
    commitAsync,

    invoke: (request) => (space?.low ? Promise.reject(space.intakeRefused()) : deps.invoker.invoke(request)),
    invokeHttp: (request) => (space?.low ? Promise.reject(space.intakeRefused()) : deps.invoker.invokeHttp(request)),
    invokeSession: (...args) =>
      space?.low ? Promise.reject(space.intakeRefused()) : deps.invoker.invokeSession(...args),
    note: (runId, line) => recorder.log(runId, 'system', line),

    async list(projectId, appId, query) {
      await findApp(store, projectId, appId);
      await recorder.flush();
      return (await listRuns(store, projectId, appId, query)).map((r) => viewRun(r));
    },

    async retry(projectId, appId, runId) {
      await findApp(store, projectId, appId);
      await recorder.flush();
      const old = await findRun(store, projectId, appId, runId);
      if (!isFinalState(old.state)) {
        throw new FerryError(
          'FERRY_RUN_NOT_FINISHED',
          `Run ${runId} is ${old.state}: only a finished run can be retried`,
        );
      }
      const target = await runTargets.get(projectId, appId);
      if (!target?.config || !target.buildId) {
        throw new FerryError('FERRY_NO_READY_BUILD', undefined, { headers: { 'retry-after': '5' } });
      }
      // A custom app's call is its HTTP request; a cortex call its JSON arguments. Either must have been kept.
      const custom = target.config.app.runtime === 'custom';
      if (custom ? old.http_request === null : old.input === null || old.http_request !== null) {
        throw new FerryError(
          'FERRY_RUN_INPUT_NOT_KEPT',
          old.http_request === null && old.input === null
            ? `Run ${runId}'s input was not kept (larger than 64 KiB, or a custom app's synchronous call): it cannot be retried`
            : `Run ${runId} was a call of the app's other runtime: it cannot be retried on the active build`,
        );
      }
      await admitAsync(projectId);
      const build = { projectId, appId: target.appId, buildId: target.buildId };
      const id = uuidv7();
      let webhookSecret: string | undefined;
      if (old.webhook_endpoint && old.webhook_secret && deps.secretsKey) {
        try {
          const secret = decryptWebhookSecret(deps.secretsKey, old.id, old.webhook_secret);
          webhookSecret = encryptWebhookSecret(deps.secretsKey, id, secret);
        } catch {
          // Erased (the delivery ended over 7 days ago) or unreadable: the new run's webhook is signed as without one.
        }
      }
      return commitAsync({
        id,
        build,
        fn: old.function_name,
        input: old.input,
        httpRequest: old.http_request ?? undefined,
        webhookUrl: old.webhook_endpoint ?? undefined,
        webhookSecret,
        origin: { trigger: 'retry', retryOf: old.id },
      });
    },

    async get(projectId, appId, runId, wait) {
      await recorder.flush();
      let found = await findRun(store, projectId, appId, runId);
      if (wait && wait.ms > 0 && !isFinalState(found.state)) {
        // Registered before the second read: a run that ends in between wakes it, or that read sees the end.
        const done = new AbortController();
        const stop = () => done.abort();
        wait.signal.addEventListener('abort', stop, { once: true });
        const waited = runWaiters.wait(runId, wait.ms, done.signal);
        found = await findRun(store, projectId, appId, runId);
        if (isFinalState(found.state)) done.abort();
        await waited;
        wait.signal.removeEventListener('abort', stop);
        if (!isFinalState(found.state)) {
          await recorder.flush();
          found = await findRun(store, projectId, appId, runId);
        }
      }
      return detail(found);
    },

    async cancel(projectId, appId, runId, signal, requested) {
      await recorder.flush();
      const found = await findRun(store, projectId, appId, runId);
      if (isFinalState(found.state)) {
        throw new FerryError('FERRY_RUN_FINISHED', `Run ${runId} has already finished (${found.state})`);
      }
      const ended = runWaiters.wait(runId, deps.cancelWaitMs, signal);
      if (await cancelQueuedRun(store, found)) {
        runWaiters.finished([runId]);
        deps.webhooks.wake();
      }
      // The node performing it (this one or another) stops it; one holding it queued lets it go.
      await deps.changes.publish({ type: 'run.cancel', projectId, appId, runId });
      requested?.();
      await ended;
      await recorder.flush();
      const run = await findRun(store, projectId, appId, runId);
      return { run: await detail(run), ended: isFinalState(run.state) };
    },

    async logs(projectId, appId, runId, after) {
      await recorder.flush();
      await findRun(store, projectId, appId, runId);
      const lines = await runLogs(store, runId, after);
      return { run_id: runId, lines, ...(await runLogDrops(store, runId)) };
    },

    async redeliverWebhook(projectId, appId, runId) {
      // A run that finished a moment ago may still have its outbox row in the recorder's next batch.
      await recorder.flush();
      await deps.webhooks.redeliver(projectId, appId, runId);
    },

    async recentRuns(projectId, appId, from, limit) {
      await recorder.flush();
      return store
        .selectFrom('runs')
        .select(['state', 'created_at', 'started_at', 'finished_at', 'run_time_ms'])
        .where('project_id', '=', projectId)
        .where('app_id', '=', appId)
        .where('id', '>=', uuidv7Floor(from))
        .where('created_at', '>=', new Date(from).toISOString())
        .orderBy('id', 'desc')
        .limit(limit)
        .execute();
    },
  };
}
