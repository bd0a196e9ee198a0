/**
 * The invoke path: one way to run a function, with three front doors (sync now; async and stream reuse it).
 *
 * Records the run, takes a replica slot (waiting in the app's queue, cold-starting a replica when needed),
 * calls the function over the replica protocol with the app's `response_grace_period` as its deadline, sends
 * the function's output to the run's log, and records how it ended. A run past its deadline is recorded
 * `timeout` first; then its replica is stopped (pool.ts: SIGTERM, RUN_TIMEOUT_KILL_GRACE_MS, SIGKILL).
 *
 * A server stopping past its grace (FERRY_SHUTDOWN_GRACE_SECONDS, cli/shutdown.ts) interrupts the runs
 * still in progress here (`interrupt`): each is recorded as recovery records a run whose node stopped
 * (runs/lifecycle.ts `interruption`: an async run queued again by `retry_interrupted` or its retry policy,
 * any other `failure`, reason `interrupted`), by this node, before it exits, so nothing waits for a lease
 * to run out; an async run that had not started yet is let go, still queued.
 */
import type { Readable } from 'node:stream';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import { isoTime } from '../ids.js';
import { DEFAULT_FRAME_LIMITS, type Frame, type FrameLimits } from '../replicas/frames.js';
import type { ReplicaManager } from '../replicas/manager.js';
import type { PoolBuild } from '../replicas/pool.js';
import type { CallFlow } from '../replicas/replica.js';
import { runtimeOf } from '../runtimes/index.js';
import type { RunMode, RunState } from '../store/schema.js';
import { MAX_WEBHOOK_RESULT_BYTES } from '../webhooks/payload.js';
import { InFlightRuns } from './in-flight.js';
import { endRun, failedAnswer, INTERRUPTED_MESSAGE, interruption, type RunEnding, withRetries } from './lifecycle.js';
import { newRunRow, type RunRecorder } from './recorder.js';
import type { RetryPolicy } from './retries.js';
import { RunAbort } from './run-abort.js';

/** Inputs over this size are not kept on the run record (the run still gets them). */
export const MAX_STORED_INPUT_BYTES = 64 * 1024;
/** Default for results kept on the run record (FERRY_MAX_STORED_RESULT_BYTES); the caller still gets larger ones. */
export const MAX_STORED_RESULT_BYTES = 256 * 1024;

const TIMED_OUT = Symbol('timed out');
const CANCELLED = Symbol('cancelled');
const INTERRUPTED = Symbol('interrupted');
/** How long a cancelled function has to return before its replica is stopped (FERRY_CANCEL_GRACE_SECONDS). */
export const DEFAULT_CANCEL_GRACE_MS = 5_000;
/** How long a caller may leave its response full before it is cut (FERRY_CALLER_STALL_SECONDS). */
export const DEFAULT_CALLER_STALL_MS = 30_000;

/** What every run has, whatever the runtime. */
export interface RunRequestBase {
  runId: string;
  build: PoolBuild;
  /** Cortex: the function's name. Custom: the path forwarded to the server (recorded as the run's function). */
  fn: string;
  mode: RunMode;
  /** Aborted when the caller is gone (sync, stream): the run stops. */
  signal?: AbortSignal | undefined;
  /**
   * The run's own abort, made by the caller, which aborts it when it is gone (instead of `signal`); the
   * invoker aborts it too, for the deadline and a cancel. The run endpoint's hot path passes one: an
   * AbortSignal costs microseconds to make (run-abort.ts).
   */
  abort?: RunAbort | undefined;
  /** Set when the record already exists (async runs are inserted before they are acknowledged). */
  recorded?: boolean;
  /** Where to forward the response payload when the run ends (written to the outbox with the final state). */
  webhookUrl?: string | undefined;
  /** The run's X-Webhook-Secret, already encrypted for storage (the deliverer signs with it). */
  webhookSecret?: string | undefined;
  /** Called once a replica slot is taken and the call begins (stream mode sends its headers then). */
  onStarted?: (() => void) | undefined;
  /**
   * Called once the run is recorded (its id names a run `GET …/runs/{id}` finds), before the invoke settles:
   * the run endpoint answers an error with `run_id` only then. A local invoke records the run as it begins;
   * a gateway's, once a worker took the call; a call refused before (no worker, a worker's refusal) has no
   * run.
   */
  onRecorded?: (() => void) | undefined;
  /** No response_grace_period deadline (a WebSocket session lives as long as both sides want). */
  noDeadline?: boolean;
  /**
   * Async runs: called once a replica slot is taken, before the call; marks the run started in the store
   * (store/claims.ts startRun) and resolves with the start's number (its `attempts`: the run's end belongs
   * to it). Undefined: the run is not this node's to run any more, nothing is called or recorded, and the
   * invoke rejects with RunNotClaimedError. While it has not been called, an app at capacity
   * (FERRY_QUEUE_FULL) is not recorded on the run either: the caller tries again later.
   */
  claim?: (() => Promise<number | undefined>) | undefined;
  /**
   * Async runs of an app with `[retries]` (max_attempts above 1): the policy and the record's attempts so
   * far. A failed attempt the policy retries ends in a retry (queued after its delay, no webhook), the last
   * one records `dead` (runs/lifecycle.ts withRetries).
   */
  retries?: { policy: RetryPolicy; log: string | null } | undefined;
}

/** Marking the run started failed (the store failed): nothing was called or recorded; try again later. */
export class RunStartError extends Error {
  constructor(
    readonly runId: string,
    cause: unknown,
  ) {
    super(`run ${runId} could not be marked started`, { cause });
    this.name = 'RunStartError';
  }
}

/** The run was not this node's to perform (see RunRequestBase.claim): nothing was called or recorded. */
export class RunNotClaimedError extends Error {
  constructor(readonly runId: string) {
    super(`run ${runId} is no longer this node's to perform`);
    this.name = 'RunNotClaimedError';
  }
}

/**
 * An async run interrupted (a server stopping past its grace) before it was started: nothing was called or
 * recorded, it is still queued and this node's; the async worker lets it go for any node to take.
 */
export class RunInterruptedError extends Error {
  constructor(readonly runId: string) {
    super(`run ${runId} was interrupted before it started`);
    this.name = 'RunInterruptedError';
  }
}

export interface InvokeRequest extends RunRequestBase {
  /** The JSON arguments object, as the caller sent it. */
  body: Buffer;
  /** Stream mode: receives each item as it is yielded. Without it items are collected into an array. */
  onItem?: ((data: unknown) => void) | undefined;
  /** Stream mode: the caller's back-pressure; while it is blocked the replica's answer is not read. */
  flow?: CallFlow | undefined;
}

/** A custom-runtime run: one HTTP request forwarded to the app's own server. */
export interface HttpInvokeRequest extends RunRequestBase {
  http: {
    method: string;
    /** Path and query as the server sees them (`/predict?x=1`). */
    path: string;
    headers: Record<string, string | string[]>;
    body: Readable | Buffer | null;
  };
  /**
   * Sync calls: receives the server's response head and answers where to write its body (the caller's
   * response), or nothing to only collect it. The body is written chunk by chunk as it arrives.
   */
  onResponse?: ((head: HttpResponseHead) => HttpBodySink | undefined) | undefined;
  /** Stored as the run's input (the body as text, when small enough and text). */
  input?: string | null;
}

export interface HttpResponseHead {
  statusCode: number;
  headers: Record<string, string | string[] | undefined>;
}

/** Where a proxied response body goes: the caller's response. */
export interface HttpBodySink {
  write(chunk: Buffer): boolean;
  once(event: 'drain' | 'close', listener: () => void): unknown;
  removeListener(event: 'drain' | 'close', listener: () => void): unknown;
  end(): void;
  /** Cuts the caller's connection (a caller that stopped reading). */
  destroy(): void;
  readonly destroyed: boolean;
}

export interface InvokeResult {
  /**
   * The function's result. Undefined when `resultJson` is given by an invoker that did not parse it (the
   * remote invoker's sync answers carry the worker's bytes as they are): read `resultJson` first.
   */
  result: unknown;
  /** `result` as JSON, when the invoker made it (for the record): callers send these bytes instead of stringifying again. */
  resultJson?: string | undefined;
  /** The function was a generator: its items went to `onItem` (or were collected into `result`). */
  streamed: boolean;
  runTimeMs: number;
  coldStart: boolean;
  /** The status the run answered: 200 for cortex functions, the server's own status for custom apps. */
  statusCode: number;
}

export interface Invoker {
  invoke(request: InvokeRequest): Promise<InvokeResult>;
  /**
   * Cancels a run this process is performing (POST .../runs/{run_id}/cancel): one still waiting for a slot
   * ends at once; a cortex function is told (its AbortSignal, or asyncio cancellation) and has the cancel
   * grace to return, after which its replica is stopped; a custom app's request is closed. The run ends
   * `cancelled`. False when no run of that id is in progress here.
   */
  cancel(runId: string): boolean;
  /** Custom runtime: forwards one HTTP request to the app's server, recorded as a run like any other. */
  invokeHttp(request: HttpInvokeRequest): Promise<InvokeResult>;
  /**
   * A session that holds a replica slot while it lasts (a proxied WebSocket): `session` runs with the
   * replica and resolves with the status the server answered when the session is over.
   */
  invokeSession(
    request: RunRequestBase,
    session: (replica: Slot['replica'], signal: AbortSignal, runId: string) => Promise<number>,
  ): Promise<InvokeResult>;
}

/** The invoker of this node's own replicas: an Invoker that can also interrupt what it runs. */
export interface LocalInvoker extends Invoker {
  /**
   * Interrupts every run in progress here (a server stopping past its grace): each ends as an interrupted
   * run (see the module comment) and its caller, if any, is answered FERRY_REPLICA_DIED. Returns how many.
   */
  interrupt(): number;
}

/** What one call produced, whatever the runtime. */
interface CallOutcome {
  result: unknown;
  streamed: boolean;
  statusCode: number;
  /** Set when the result is too large to keep for the webhook (a long stream, a large body). */
  resultOmitted?: string | undefined;
  resultEncoding?: 'base64' | undefined;
  /** `result` as JSON, as the replica wrote it (checked): recorded and answered as it is. */
  resultJson?: string | undefined;
}

type Slot = Awaited<ReturnType<ReturnType<ReplicaManager['pool']>['acquire']>>;

export interface InvokerDeps {
  /** Results larger than this many bytes are not stored on the run (a note in its logs says so). */
  maxStoredResultBytes?: number;
  replicas: ReplicaManager;
  recorder: RunRecorder;
  logger: Logger;
  /** Told when a run ends, for metrics. */
  onFinished?: (build: PoolBuild, state: RunState, statusCode: number, seconds: number, coldStart: boolean) => void;
  /** How long a cancelled cortex function has to return before its replica is stopped. */
  cancelGraceMs?: number;
  /** Size limits of results, stream items and log lines (FERRY_MAX_RESULT_BYTES and the like). */
  frameLimits?: FrameLimits;
  /**
   * How long a custom app's caller may leave its response full without reading before it is cut (and the
   * run ends as a caller gone away): FERRY_CALLER_STALL_SECONDS.
   */
  callerStallMs?: number;
}

function storedInput(body: Buffer): string | null {
  return body.length <= MAX_STORED_INPUT_BYTES ? body.toString('utf8') : null;
}

export function createInvoker(deps: InvokerDeps): LocalInvoker {
  const { recorder } = deps;
  const maxStoredResult = deps.maxStoredResultBytes ?? MAX_STORED_RESULT_BYTES;
  const cancelGraceMs = deps.cancelGraceMs ?? DEFAULT_CANCEL_GRACE_MS;
  const callerStallMs = deps.callerStallMs ?? DEFAULT_CALLER_STALL_MS;
  const frameOptions = { limits: deps.frameLimits };
  const maxResultBytes = deps.frameLimits?.resultBytes ?? DEFAULT_FRAME_LIMITS.resultBytes;
  /** Runs in progress here, by id: how to cancel or interrupt each (in-flight.ts says why not a Map). */
  const cancels = new InFlightRuns<(how: 'cancel' | 'interrupt') => void>();

  /**
   * The one path every run takes: record it, take a replica slot within the app's response_grace_period,
   * let `call` talk to the replica, then record how it ended (and queue its webhook) in one step.
   */
  async function perform(
    request: RunRequestBase,
    input: { stored: string | null; bytes: number },
    call: (slot: Slot, abort: RunAbort, runId: string) => Promise<CallOutcome>,
    /** Cortex functions are told of a cancel and given time to return; custom apps' requests are closed. */
    cooperative = false,
  ): Promise<InvokeResult> {
    const { runId, build } = request;
    const created = Date.now();
    if (!request.recorded) {
      recorder.start(
        newRunRow({
          id: runId,
          build,
          fn: request.fn,
          mode: request.mode,
          input: input.stored,
          webhookUrl: request.webhookUrl,
          webhookSecret: request.webhookSecret,
          createdAt: created,
        }),
      );
      if (input.stored === null && input.bytes > 0) {
        recorder.log(runId, 'system', `input of ${input.bytes} bytes not stored (limit ${MAX_STORED_INPUT_BYTES})`);
      }
    }
    request.onRecorded?.();

    const grace = build.config.scaling.response_grace_period * 1000;
    // One abort for the run: the caller going away, the deadline and a cancel all end the call through it.
    const run = request.abort ?? new RunAbort();
    // A sentinel, made into the real error only when it fires: an Error per run (stack capture) is costly.
    const timeout = TIMED_OUT;
    const timer = request.noDeadline ? undefined : setTimeout(() => run.abort(timeout), grace);
    const unfollow = request.signal ? run.follow(request.signal) : undefined;

    let coldStart = false;
    let started = 0;
    let slot: Slot | undefined;
    let claimed = false;
    /** The start of an async run this call is (see `claim`). */
    let attempt: number | undefined;
    let cancelRequested = false;
    let stopReplica = false;
    let cancelTimer: NodeJS.Timeout | undefined;
    // One closure per run for both (the run path's allocations are counted, issue 15).
    const stop = (how: 'cancel' | 'interrupt') => {
      if (how === 'interrupt') {
        run.abort(INTERRUPTED);
        return;
      }
      if (cancelRequested) return;
      cancelRequested = true;
      const taken = slot;
      if (!taken || started === 0 || !cooperative) {
        run.abort(CANCELLED);
        return;
      }
      // Told first; the call goes on until the function returns, or until the grace is over.
      void taken.replica.cancel(runId).then((found) => {
        // The bootstrap may not have the run yet (the call was just sent): once more, a moment later.
        if (!found && !run.aborted) setTimeout(() => void taken.replica.cancel(runId), 200).unref();
      });
      cancelTimer = setTimeout(() => {
        stopReplica = true;
        run.abort(CANCELLED);
      }, cancelGraceMs);
      cancelTimer.unref();
    };
    const cancelSlot = cancels.add(runId, stop);
    try {
      // During a redeploy the manager may hand out the newer build's pool, or hand a run waiting in the old
      // one to the new one: the slot's build is the build that really runs it, and is recorded.
      const pool = deps.replicas.pool(build);
      // A free slot is taken without a Promise; waiting for one needs an AbortSignal (made only then).
      slot = pool.tryAcquire() ?? (await pool.acquire(run.signal));
      if (request.claim) {
        try {
          attempt = await request.claim();
        } catch (err) {
          throw new RunStartError(runId, err);
        }
        if (attempt === undefined) throw new RunNotClaimedError(runId);
        claimed = true;
        if (request.retries) recorder.attemptStarted(runId, attempt, request.retries.policy.max_attempts);
      }
      coldStart = slot.coldStart;
      started = Date.now();
      // `cold_start` is the run's, over all its attempts, as its log is: set by an attempt that waited for a
      // replica to start, never cleared by a later warm one (a new row starts at 0). Issue 43: a retried
      // run's record said `false` while its log told of the first attempt's wait.
      recorder.update(
        runId,
        coldStart
          ? { state: 'running', build_id: slot.build.buildId, started_at: isoTime(started), cold_start: 1 }
          : { state: 'running', build_id: slot.build.buildId, started_at: isoTime(started) },
      );
      if (coldStart) recorder.log(runId, 'system', `cold start: waited ${started - created} ms for a replica`);
      request.onStarted?.();

      const outcome = await call(slot, run, runId);
      // Cancelled while it ran: it returned within the grace, but the run was cancelled all the same.
      if (cancelRequested) throw CANCELLED;
      const { result } = outcome;
      const runTimeMs = Date.now() - started;
      const text = outcome.resultOmitted ? null : (outcome.resultJson ?? JSON.stringify(result) ?? 'null');
      const keep = text !== null && Buffer.byteLength(text) <= maxStoredResult;
      if (text !== null && !keep)
        recorder.log(
          runId,
          'system',
          `result of ${Buffer.byteLength(text)} bytes not stored (limit ${maxStoredResult})`,
        );
      finish({
        kind: 'answered',
        statusCode: outcome.statusCode,
        runTimeMs,
        result: outcome.resultOmitted
          ? { stored: null, omitted: outcome.resultOmitted }
          : {
              stored: keep ? text : null,
              value: result,
              json: text ?? undefined,
              encoding: outcome.resultEncoding,
            },
      });
      return {
        result,
        resultJson: text ?? undefined,
        runTimeMs,
        coldStart,
        streamed: outcome.streamed,
        statusCode: outcome.statusCode,
      };
    } catch (caught) {
      if (caught instanceof RunNotClaimedError || caught instanceof RunStartError) throw caught;
      if (run.reason === INTERRUPTED) {
        // Not started (no slot yet, or not marked started): still queued, for any node to take.
        if (request.claim && !claimed) throw new RunInterruptedError(runId);
        const now = Date.now();
        const startedAt = started ? isoTime(started) : null;
        const retryInterrupted = build.config.app.retry_interrupted === true;
        finish(
          interruption({ mode: request.mode, attempts: attempt ?? 0, started_at: startedAt }, retryInterrupted, now),
        );
        throw new FerryError('FERRY_REPLICA_DIED', INTERRUPTED_MESSAGE);
      }
      // Not started, and the app is only busy: the async worker tries again later, nothing to record.
      if (request.claim && !claimed && caught instanceof FerryError && caught.code === 'FERRY_QUEUE_FULL') throw caught;
      const timedOut = caught === timeout || run.reason === timeout;
      const cancelled = !timedOut && cancelRequested;
      const err = timedOut
        ? new FerryError(
            'FERRY_RUN_TIMEOUT',
            `The run took longer than the app's response_grace_period (${build.config.scaling.response_grace_period} s)`,
          )
        : cancelled
          ? new FerryError(
              'FERRY_RUN_CANCELLED',
              stopReplica
                ? `The run was cancelled; the function did not return within ${cancelGraceMs / 1000} s, so its replica was stopped`
                : undefined,
            )
          : caught;
      const ferry = err instanceof FerryError ? err : undefined;
      // Aborted for a reason of the caller's own: it went away.
      const clientGone = !ferry && run.aborted && run.reason !== timeout && run.reason !== CANCELLED;
      if (!ferry && !clientGone) deps.logger.error({ err, runId }, 'run failed with an unexpected error');
      const runTimeMs = started ? Date.now() - started : null;
      finish(
        timedOut && ferry
          ? { kind: 'timed-out', message: ferry.message, runTimeMs }
          : cancelled && ferry
            ? { kind: 'cancelled', why: 'cancelled', message: ferry.message, runTimeMs }
            : ferry
              ? {
                  kind: 'failed',
                  error: { code: ferry.code, message: ferry.message, type: ferry.details.type },
                  runTimeMs,
                }
              : clientGone
                ? { kind: 'caller-gone', runTimeMs }
                : { kind: 'internal-error', runTimeMs },
      );
      // Recorded as `timeout` first; then the replica, which may still be running it, is stopped.
      if (timedOut && slot) slot.release({ timedOut: true });
      if (stopReplica && slot) slot.release({ timedOut: true, reason: 'a cancelled run did not return' });
      throw ferry ?? (clientGone ? caught : new FerryError('FERRY_INTERNAL', undefined, { cause: caught }));
    } finally {
      clearTimeout(timer);
      clearTimeout(cancelTimer);
      unfollow?.();
      cancels.remove(cancelSlot);
      slot?.release();
    }

    /** Records how the run ended (runs/lifecycle.ts), with its webhook, and tells the metrics. */
    function finish(ending: RunEnding): void {
      const now = Date.now();
      const retries =
        request.retries && attempt !== undefined
          ? {
              policy: request.retries.policy,
              log: request.retries.log,
              attempt,
              startedAt: started ? isoTime(started) : null,
            }
          : undefined;
      const end = endRun(
        { id: runId, webhookUrl: request.webhookUrl, attempt, retries },
        withRetries(ending, retries),
        now,
      );
      recorder.finish(end);
      // An attempt the retry policy tries again is not the run's end (metrics count runs, not attempts).
      if (end.final) deps.onFinished?.(build, end.state, end.statusCode ?? 0, (now - created) / 1000, coldStart);
    }
  }

  /** Cortex: calls the function over the replica protocol and gathers its frames. */
  function callFunction(request: InvokeRequest) {
    return async (slot: Slot, abort: RunAbort, runId: string): Promise<CallOutcome> => {
      let result: unknown;
      let resultJson: string | undefined;
      const items: unknown[] = [];
      let ended = false;
      let streamed = false;
      let itemsBytes = 0;
      let itemsOmitted = false;
      /** Bytes of the items collected into the result (a generator called without an event stream). */
      let collectedBytes = 0;
      const onFrame = (frame: Frame, bytes: number): void => {
        if (frame.type === 'log') recorder.log(runId, frame.stream, frame.line);
        else if (frame.type === 'item') {
          if (!request.onItem) {
            // Collected into one array: held to the result's limit, not only each item to its own.
            collectedBytes += bytes;
            if (collectedBytes > maxResultBytes) {
              throw new FerryError(
                'FERRY_RESULT_TOO_LARGE',
                `The generator's items, collected into one result (called without Accept: text/event-stream), are larger than the limit of ${maxResultBytes} bytes`,
              );
            }
          }
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
          resultJson = frame.json;
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
      };
      await slot.replica.callFrames(
        request.fn,
        runId,
        request.body,
        abort,
        onFrame,
        request.flow ? { limits: deps.frameLimits, flow: request.flow } : frameOptions,
      );
      if (!ended) throw new FerryError('FERRY_REPLICA_DIED', 'The replica ended the call without a result');
      if (itemsOmitted) {
        return {
          result,
          streamed,
          statusCode: 200,
          resultOmitted: `the items are larger than ${MAX_WEBHOOK_RESULT_BYTES} bytes`,
        };
      }
      return { result, resultJson, streamed, statusCode: 200 };
    };
  }

  /**
   * Custom runtime: forwards the request to the app's server and passes the response on as it arrives,
   * keeping the body (up to a limit) as the run's result for the record and the webhook.
   */
  function callServer(request: HttpInvokeRequest) {
    return async (slot: Slot, abort: RunAbort, runId: string): Promise<CallOutcome> => {
      const signal = abort.signal;
      const res = await slot.replica.forward({ ...request.http, signal });
      const sink = request.onResponse?.({ statusCode: res.statusCode, headers: res.headers });
      // An async or webhook run's body is its result, up to the webhook limit; a sync run keeps what the
      // run record can store.
      const limit = request.webhookUrl || request.mode === 'async' ? MAX_WEBHOOK_RESULT_BYTES : maxStoredResult;
      const kept: Buffer[] = [];
      let bytes = 0;
      let tooLarge = false;
      try {
        for await (const chunk of res.body as AsyncIterable<Buffer>) {
          if (!tooLarge) {
            bytes += chunk.length;
            if (bytes > limit) {
              tooLarge = true;
              kept.length = 0;
            } else kept.push(chunk);
          }
          if (sink && !sink.write(chunk)) {
            // Not read from the server until the caller takes this; cut past the stall limit.
            await drained(sink, signal, callerStallMs, () =>
              recorder.log(runId, 'system', `the caller read nothing for ${callerStallMs / 1000} s: disconnected`),
            );
          }
        }
      } catch (err) {
        throw await slot.replica.failure(err, signal);
      } finally {
        if (!res.body.destroyed) res.body.destroy();
      }
      sink?.end();
      if (failedAnswer(res.statusCode)) recorder.log(runId, 'system', `the server answered ${res.statusCode}`);
      if (tooLarge) {
        recorder.log(runId, 'system', `response body over ${limit} bytes: not kept as the run's result`);
        return {
          result: null,
          streamed: false,
          statusCode: res.statusCode,
          resultOmitted: `the response body is larger than ${limit} bytes`,
        };
      }
      const decoded = decodeBody(Buffer.concat(kept), res.headers['content-type']);
      return { ...decoded, streamed: false, statusCode: res.statusCode };
    };
  }

  return {
    invoke(request) {
      return perform(
        request,
        { stored: storedInput(request.body), bytes: request.body.length },
        callFunction(request),
        runtimeOf(request.build).calls === 'frames',
      );
    },
    cancel(runId) {
      const stop = cancels.find(runId);
      if (!stop) return false;
      stop('cancel');
      return true;
    },
    interrupt() {
      const runs = cancels.all();
      for (const stop of runs) stop('interrupt');
      return runs.length;
    },
    invokeHttp(request) {
      const bytes = Buffer.isBuffer(request.http.body) ? request.http.body.length : 0;
      return perform(request, { stored: request.input ?? null, bytes }, callServer(request));
    },
    invokeSession(request, session) {
      return perform(request, { stored: null, bytes: 0 }, async (slot, abort, runId) => {
        const statusCode = await session(slot.replica, abort.signal, runId);
        return { result: null, streamed: false, statusCode };
      });
    },
  };
}

/**
 * Waits until the caller's response takes more data (or goes away, or the run is aborted). A caller that
 * takes nothing for `stallMs` is cut (`sink.destroy()`): its close aborts the run as a caller gone away.
 */
function drained(sink: HttpBodySink, signal: AbortSignal, stallMs: number, onStalled: () => void): Promise<void> {
  if (sink.destroyed) throw signal.reason ?? new Error('the caller went away');
  return new Promise((resolve, reject) => {
    const stall = setTimeout(() => {
      onStalled();
      sink.destroy();
    }, stallMs);
    stall.unref();
    const done = () => {
      clearTimeout(stall);
      sink.removeListener('drain', done);
      sink.removeListener('close', done);
      signal.removeEventListener('abort', aborted);
      resolve();
    };
    const aborted = () => {
      clearTimeout(stall);
      sink.removeListener('drain', done);
      sink.removeListener('close', done);
      reject(signal.reason);
    };
    sink.once('drain', done);
    sink.once('close', done);
    signal.addEventListener('abort', aborted, { once: true });
  });
}

const STRICT_UTF8 = new TextDecoder('utf-8', { fatal: true });

/**
 * A response body as a run result: JSON bodies as their value, other text as a string, anything else
 * base64-encoded (and marked so in the webhook payload).
 */
export function decodeBody(
  body: Buffer,
  contentType: string | string[] | undefined,
): { result: unknown; resultEncoding?: 'base64' } {
  const type = String(contentType ?? '').toLowerCase();
  let text: string;
  try {
    text = STRICT_UTF8.decode(body);
  } catch {
    return { result: body.toString('base64'), resultEncoding: 'base64' };
  }
  if (/^application\/([\w.+-]*\+)?json\b/.test(type) && text.trim() !== '') {
    try {
      return { result: JSON.parse(text) };
    } catch {
      // Says JSON but is not: keep the text.
    }
  }
  return { result: text };
}
