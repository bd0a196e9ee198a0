/**
 * The invoke path: one way to run a function, with three front doors (sync now; async and stream reuse it).
 *
 * Records the run, takes a replica slot (waiting in the app's queue, cold-starting a replica when needed),
 * calls the function over the replica protocol with the app's `response_grace_period` as its deadline, sends
 * the function's output to the run's log, and records how it ended.
 */
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import type { ReplicaManager } from '../replicas/manager.js';
import type { PoolBuild } from '../replicas/pool.js';
import type { RunMode, RunState } from '../store/schema.js';
import { buildWebhookPayload, MAX_WEBHOOK_RESULT_BYTES } from '../webhooks/payload.js';
import { newRunRow, type RunRecorder } from './recorder.js';

/** Inputs over this size are not kept on the run record (the run still gets them). */
export const MAX_STORED_INPUT_BYTES = 64 * 1024;
/** Default for results kept on the run record (FERRY_MAX_STORED_RESULT_BYTES); the caller still gets larger ones. */
export const MAX_STORED_RESULT_BYTES = 256 * 1024;

const TIMED_OUT = Symbol('timed out');

export interface InvokeRequest {
  runId: string;
  build: PoolBuild;
  fn: string;
  /** The JSON arguments object, as the caller sent it. */
  body: Buffer;
  mode: RunMode;
  /** Aborted when the caller is gone (sync, stream): the run stops. */
  signal?: AbortSignal | undefined;
  /** Stream mode: receives each item as it is yielded. Without it items are collected into an array. */
  onItem?: ((data: unknown) => void) | undefined;
  /** Set when the record already exists (async runs are inserted before they are acknowledged). */
  recorded?: boolean;
  /** Where to forward the response payload when the run ends (written to the outbox with the final state). */
  webhookUrl?: string | undefined;
  /** The run's X-Webhook-Secret, already encrypted for storage (the deliverer signs with it). */
  webhookSecret?: string | undefined;
  /** Called once a replica slot is taken and the call begins (stream mode sends its headers then). */
  onStarted?: (() => void) | undefined;
}

export interface InvokeResult {
  result: unknown;
  /** The function was a generator: its items went to `onItem` (or were collected into `result`). */
  streamed: boolean;
  runTimeMs: number;
  coldStart: boolean;
}

export interface Invoker {
  invoke(request: InvokeRequest): Promise<InvokeResult>;
}

export interface InvokerDeps {
  /** Results larger than this many bytes are not stored on the run (a note in its logs says so). */
  maxStoredResultBytes?: number;
  replicas: ReplicaManager;
  recorder: RunRecorder;
  logger: Logger;
  /** Told when a run ends, for metrics. */
  onFinished?: (build: PoolBuild, state: RunState, statusCode: number, seconds: number, coldStart: boolean) => void;
}

function storedInput(body: Buffer): string | null {
  return body.length <= MAX_STORED_INPUT_BYTES ? body.toString('utf8') : null;
}

export function createInvoker(deps: InvokerDeps): Invoker {
  const { recorder } = deps;

  return {
    async invoke(request) {
      const { runId, build } = request;
      const created = Date.now();
      if (!request.recorded) {
        recorder.start(
          newRunRow({
            id: runId,
            build,
            fn: request.fn,
            mode: request.mode,
            input: storedInput(request.body),
            webhookUrl: request.webhookUrl,
            webhookSecret: request.webhookSecret,
            createdAt: created,
          }),
        );
        if (request.body.length > MAX_STORED_INPUT_BYTES) {
          recorder.log(
            runId,
            'system',
            `input of ${request.body.length} bytes not stored (limit ${MAX_STORED_INPUT_BYTES})`,
          );
        }
      }

      const grace = build.config.scaling.response_grace_period * 1000;
      const deadline = new AbortController();
      // A sentinel, made into the real error only when it fires: an Error per run (stack capture) is costly.
      const timeout = TIMED_OUT;
      const timer = setTimeout(() => deadline.abort(timeout), grace);
      const signal = request.signal ? AbortSignal.any([request.signal, deadline.signal]) : deadline.signal;

      let coldStart = false;
      let started = 0;
      let slot: Awaited<ReturnType<ReturnType<ReplicaManager['pool']>['acquire']>> | undefined;
      try {
        // During a redeploy the manager may hand out the newer build's pool: record the build that really ran.
        const pool = deps.replicas.pool(build);
        slot = await pool.acquire(signal);
        coldStart = slot.coldStart;
        started = Date.now();
        recorder.update(runId, {
          state: 'running',
          build_id: pool.build.buildId,
          started_at: new Date(started).toISOString(),
          cold_start: coldStart ? 1 : 0,
        });
        if (coldStart) recorder.log(runId, 'system', `cold start: waited ${started - created} ms for a replica`);
        request.onStarted?.();

        let result: unknown;
        const items: unknown[] = [];
        let ended = false;
        let streamed = false;
        let itemsBytes = 0;
        let itemsOmitted = false;
        for await (const frame of slot.replica.call(request.fn, runId, request.body, signal)) {
          if (frame.type === 'log') recorder.log(runId, frame.stream, frame.line);
          else if (frame.type === 'item') {
            if (request.onItem) {
              request.onItem(frame.data);
              // Kept for the webhook of a streaming call (its items are its `result`), up to the payload limit:
              // an endless stream must not grow the gateway's memory.
              if (request.webhookUrl && !itemsOmitted) {
                itemsBytes += Buffer.byteLength(JSON.stringify(frame.data) ?? 'null');
                if (itemsBytes > MAX_WEBHOOK_RESULT_BYTES) {
                  itemsOmitted = true;
                  items.length = 0;
                } else items.push(frame.data);
              }
            } else items.push(frame.data);
          } else if (frame.type === 'result') {
            result = frame.data;
            ended = true;
          } else if (frame.type === 'end') {
            result = request.onItem && !request.webhookUrl ? null : items;
            ended = true;
            streamed = true;
          } else if (frame.type === 'error') {
            const { type, message, stack } = frame.error;
            if (stack) for (const line of stack.split('\n')) recorder.log(runId, 'stderr', line);
            else recorder.log(runId, 'stderr', `${type}: ${message}`);
            if (type === 'SerializationError') throw new FerryError('FERRY_RESULT_NOT_SERIALIZABLE', message);
            if (type === 'ArgumentError') throw new FerryError('FERRY_ARGUMENT_ERROR', message, { details: { type } });
            throw new FerryError('FERRY_FUNCTION_ERROR', `${type}: ${message}`, { details: { type } });
          }
        }
        if (!ended) throw new FerryError('FERRY_REPLICA_DIED', 'The replica ended the call without a result');

        const runTimeMs = Date.now() - started;
        const text = JSON.stringify(result) ?? 'null';
        const keep = Buffer.byteLength(text) <= MAX_STORED_RESULT_BYTES;
        if (!keep)
          recorder.log(
            runId,
            'system',
            `result of ${Buffer.byteLength(text)} bytes not stored (limit ${MAX_STORED_RESULT_BYTES})`,
          );
        finish(
          'success',
          200,
          { result: keep ? text : null, run_time_ms: runTimeMs },
          itemsOmitted ? { resultOmitted: `the items are larger than ${MAX_WEBHOOK_RESULT_BYTES} bytes` } : { result },
        );
        return { result, runTimeMs, coldStart, streamed };
      } catch (caught) {
        const timedOut = caught === timeout || signal.reason === timeout;
        const err = timedOut
          ? new FerryError(
              'FERRY_RUN_TIMEOUT',
              `The run took longer than the app's response_grace_period (${build.config.scaling.response_grace_period} s)`,
            )
          : caught;
        if (timedOut && slot) slot.release({ poisoned: true });
        const ferry = err instanceof FerryError ? err : undefined;
        const clientGone = !ferry && request.signal?.aborted === true;
        const state: RunState = timedOut ? 'timeout' : clientGone ? 'cancelled' : 'failure';
        if (!ferry && !clientGone) deps.logger.error({ err, runId }, 'run failed with an unexpected error');
        const code = ferry?.code ?? (clientGone ? 'FERRY_CLIENT_GONE' : 'FERRY_INTERNAL');
        const message = ferry?.message ?? (clientGone ? 'the caller went away' : 'internal error');
        finish(
          state,
          ferry?.status ?? (clientGone ? 499 : 500),
          {
            error_code: code,
            error_message: message,
            reason: clientGone ? 'client_disconnected' : (ferry?.code ?? null),
            run_time_ms: started ? Date.now() - started : null,
          },
          { error: { code, message, type: ferry?.details.type } },
        );
        throw ferry ?? (clientGone ? caught : new FerryError('FERRY_INTERNAL', undefined, { cause: caught }));
      } finally {
        clearTimeout(timer);
        slot?.release();
      }

      function finish(
        state: RunState,
        statusCode: number,
        values: Parameters<RunRecorder['update']>[1],
        outcome: {
          result?: unknown;
          resultOmitted?: string;
          error?: { code: string; message: string; type?: string | undefined };
        },
      ): void {
        const now = Date.now();
        const outbox = request.webhookUrl
          ? {
              runId,
              url: request.webhookUrl,
              payload: buildWebhookPayload({
                runId,
                finishedAt: now,
                statusCode,
                runTimeMs: values.run_time_ms ?? null,
                ...outcome,
              }),
            }
          : undefined;
        recorder.finish(
          runId,
          { ...values, state, status_code: statusCode, finished_at: new Date(now).toISOString() },
          outbox,
        );
        deps.onFinished?.(build, state, statusCode, (now - created) / 1000, coldStart);
      }
    },
  };
}
