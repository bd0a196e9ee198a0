/**
 * The async worker: performs the internal synchronous call of every accepted async run (spec 4.3).
 *
 * Runs come from the run endpoint (already committed to the store) and, at start, from the store itself:
 * queued runs left by an earlier process run now; runs that were running when it died end `failure` with
 * reason `interrupted` (invariant 1). Each app gets at most as many runs in flight as its replicas can take
 * (max_replicas × replica_concurrency), so a burst waits here, durably, instead of overflowing the app's
 * in-memory queue.
 */
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { PoolBuild } from '../replicas/pool.js';
import type { Store } from '../store/index.js';
import { buildWebhookPayload } from '../webhooks/payload.js';
import type { Invoker } from './invoke.js';
import type { RunRecorder } from './recorder.js';
import type { RunTargets } from './targets.js';

export interface AsyncWorker {
  /** Queues a committed async run. */
  enqueue(run: { id: string; projectId: string; appId: string }): void;
  /** Async runs accepted and not finished. */
  readonly backlog: number;
  /** Ends runs an earlier process left unfinished, re-queues its queued async runs, and starts working. */
  start(): Promise<{ requeued: number; interrupted: number }>;
  close(): Promise<void>;
}

interface Queued {
  id: string;
  projectId: string;
  appId: string;
}

export function createAsyncWorker(deps: {
  store: Store;
  targets: RunTargets;
  invoker: Invoker;
  recorder: RunRecorder;
  logger: Logger;
  /** When a run finds its app at capacity, how long before it is tried again. */
  retryDelayMs?: number;
}): AsyncWorker {
  const { store, invoker, recorder, logger } = deps;
  const queues = new Map<string, Queued[]>();
  const inflight = new Map<string, number>();
  const running = new Set<Promise<void>>();
  let backlog = 0;
  let closed = false;
  const abort = new AbortController();

  const keyOf = (q: { projectId: string; appId: string }) => `${q.projectId}/${q.appId}`;

  async function target(q: Queued): Promise<PoolBuild | undefined> {
    const found = await deps.targets.get(q.projectId, q.appId);
    if (!found?.buildId || !found.config) return undefined;
    return { projectId: q.projectId, appId: q.appId, buildId: found.buildId, config: found.config };
  }

  async function execute(q: Queued, build: PoolBuild): Promise<'done' | 'retry'> {
    const run = await store
      .selectFrom('runs')
      .select(['input', 'function_name', 'webhook_endpoint', 'state', 'http_request'])
      .where('id', '=', q.id)
      .executeTakeFirst();
    if (run?.state !== 'queued') return 'done';
    const common = {
      runId: q.id,
      build,
      fn: run.function_name,
      mode: 'async' as const,
      recorded: true,
      webhookUrl: run.webhook_endpoint ?? undefined,
      signal: abort.signal,
    };
    try {
      if (run.http_request) {
        // A custom app's request, as the caller sent it (its target server may have changed runtime since:
        // the call is still forwarded, and a cortex build answers it with a clear error).
        const stored = JSON.parse(run.http_request) as {
          method: string;
          path: string;
          headers: Record<string, string | string[]>;
          body_base64: string;
        };
        if (build.config.app.runtime !== 'custom') {
          failRun(q, 'FERRY_CORTEX_CALL', 'The app was redeployed as a cortex app before this HTTP request ran');
          return 'done';
        }
        const body = Buffer.from(stored.body_base64, 'base64');
        await invoker.invokeHttp({
          ...common,
          http: { method: stored.method, path: stored.path, headers: stored.headers, body: body.length ? body : null },
        });
      } else if (build.config.app.runtime === 'custom') {
        failRun(q, 'FERRY_CORTEX_CALL', 'The app was redeployed as a custom app before this function call ran');
        return 'done';
      } else {
        await invoker.invoke({ ...common, body: Buffer.from(run.input ?? '{}') });
      }
    } catch (err) {
      // The app is at capacity (its other callers filled it): wait here rather than fail an accepted run.
      if (err instanceof FerryError && err.code === 'FERRY_QUEUE_FULL') return 'retry';
      // Every other outcome is already recorded on the run by the invoker.
    }
    return 'done';
  }

  const pumping = new Set<string>();
  const again = new Set<string>();

  function pump(): void {
    if (closed) return;
    for (const key of queues.keys()) pumpApp(key);
  }

  /** One dispatch loop per app at a time: two loops could otherwise take the same queued run. */
  function pumpApp(key: string): void {
    if (pumping.has(key)) {
      again.add(key);
      return;
    }
    pumping.add(key);
    void dispatch(key)
      .catch((err: unknown) => logger.error({ err, app: key }, 'async dispatch failed'))
      .finally(() => {
        pumping.delete(key);
        if (again.delete(key)) pumpApp(key);
      });
  }

  async function dispatch(key: string): Promise<void> {
    const queue = queues.get(key);
    if (!queue) return;
    while (queue.length > 0 && !closed) {
      const head = queue[0]!;
      const build = await target(head);
      if (!build) {
        queue.shift();
        backlog -= 1;
        failWithoutBuild(head);
        continue;
      }
      const capacity = build.config.scaling.max_replicas * build.config.scaling.replica_concurrency;
      if ((inflight.get(key) ?? 0) >= capacity) return;
      queue.shift();
      inflight.set(key, (inflight.get(key) ?? 0) + 1);
      const task: Promise<void> = execute(head, build)
        .then(async (outcome) => {
          if (outcome === 'retry') {
            queue.unshift(head);
            await new Promise<void>((r) => setTimeout(r, deps.retryDelayMs ?? 200));
            return;
          }
          backlog -= 1;
        })
        .catch((err: unknown) => {
          backlog -= 1;
          logger.error({ err, runId: head.id }, 'async run failed unexpectedly');
        })
        .finally(() => {
          inflight.set(key, (inflight.get(key) ?? 1) - 1);
          running.delete(task);
          pumpApp(key);
        });
      running.add(task);
    }
    if (queue.length === 0 && (inflight.get(key) ?? 0) === 0) queues.delete(key);
  }

  function failWithoutBuild(q: Queued): void {
    failRun(q, 'FERRY_NO_READY_BUILD', 'The app has no ready build (it was removed or never built)');
  }

  /** Ends a run the worker cannot perform, with its webhook (if any) told why. */
  function failRun(q: Queued, code: 'FERRY_NO_READY_BUILD' | 'FERRY_CORTEX_CALL', message: string): void {
    const now = Date.now();
    const status = code === 'FERRY_NO_READY_BUILD' ? 503 : 405;
    void store
      .selectFrom('runs')
      .select('webhook_endpoint')
      .where('id', '=', q.id)
      .executeTakeFirst()
      .then((run) => {
        recorder.finish(
          q.id,
          {
            state: 'failure',
            status_code: status,
            error_code: code,
            error_message: message,
            finished_at: new Date(now).toISOString(),
          },
          run?.webhook_endpoint
            ? {
                runId: q.id,
                url: run.webhook_endpoint,
                payload: buildWebhookPayload({
                  runId: q.id,
                  finishedAt: now,
                  statusCode: status,
                  runTimeMs: null,
                  error: { code, message },
                }),
              }
            : undefined,
        );
      });
  }

  return {
    enqueue(run) {
      backlog += 1;
      const key = keyOf(run);
      const queue = queues.get(key);
      if (queue) queue.push(run);
      else queues.set(key, [run]);
      pump();
    },
    get backlog() {
      return backlog;
    },
    async start() {
      const now = Date.now();
      // Async runs that were running, and sync or stream runs in any unfinished state (their caller is gone),
      // cannot finish now: they end `failure`, reason `interrupted`, and their webhooks say so.
      const interruptedRuns = await store
        .selectFrom('runs')
        .select(['id', 'webhook_endpoint', 'started_at'])
        .where((eb) =>
          eb.or([
            eb.and([eb('mode', '=', 'async'), eb('state', '=', 'running')]),
            eb.and([eb('mode', '!=', 'async'), eb('state', 'in', ['queued', 'running'])]),
          ]),
        )
        .execute();
      const message = 'The server stopped while the run was in progress';
      for (const run of interruptedRuns) {
        const runTimeMs = run.started_at ? now - Date.parse(run.started_at) : null;
        recorder.finish(
          run.id,
          {
            state: 'failure',
            status_code: 502,
            reason: 'interrupted',
            error_code: 'FERRY_REPLICA_DIED',
            error_message: message,
            finished_at: new Date(now).toISOString(),
          },
          run.webhook_endpoint
            ? {
                runId: run.id,
                url: run.webhook_endpoint,
                payload: buildWebhookPayload({
                  runId: run.id,
                  finishedAt: now,
                  statusCode: 502,
                  runTimeMs,
                  error: { code: 'FERRY_REPLICA_DIED', message },
                }),
              }
            : undefined,
        );
      }
      await recorder.flush();
      const queued = await store
        .selectFrom('runs')
        .select(['id', 'project_id', 'app_id'])
        .where('mode', '=', 'async')
        .where('state', '=', 'queued')
        .orderBy('id')
        .execute();
      for (const run of queued) this.enqueue({ id: run.id, projectId: run.project_id, appId: run.app_id });
      if (interruptedRuns.length > 0 || queued.length > 0) {
        logger.info({ requeued: queued.length, interrupted: interruptedRuns.length }, 'recovered async runs');
      }
      return { requeued: queued.length, interrupted: interruptedRuns.length };
    },
    async close() {
      closed = true;
      // Runs in flight finish (their replicas get the grace period); queued ones stay queued for the next start.
      await Promise.allSettled([...running]);
    },
  };
}
