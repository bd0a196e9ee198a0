/**
 * The hot cases of the run endpoint without Fastify: a plain sync or async call of a cortex function.
 *
 * `POST /v4/{project_id}/{app_name}/{function}` with no query string (or exactly `?async=true`), a JSON
 * body (or none), and no `Accept: text/event-stream` is what almost every call is. Fastify's routing,
 * hooks, content-type parsers, schema validation and reply serialization cost more per call than the call
 * itself; this handler does only what such a run needs, with the same checks, the same records and the
 * same answers (success and error bodies, status codes, `X-Request-Id`, metrics) as the Fastify route in
 * routes/run.ts, which still serves every other case: webhooks, streams, custom apps, other content types.
 *
 * `handle` decides from the request line and headers alone, before any byte of the body is read, and
 * returns false for anything it does not serve; a custom app found after the lookup is handed to Fastify
 * too (its body still unread).
 */
import type { IncomingMessage, ServerResponse } from 'node:http';
import type { Logger } from 'pino';
import { FerryError } from '../errors.js';
import { uuidv7 } from '../ids.js';
import type { Metrics } from '../metrics.js';
import { RunAbort } from '../runs/run-abort.js';
import { checkFunction, type RunService } from '../runs/run-service.js';
import { runtimeOf } from '../runtimes/index.js';
import { answer as errorAnswer, writeAnswer } from './answer.js';
import { bodyTooLarge, JSON_SUFFIX_TYPE, readLimitedBody } from './body-parsers.js';
import { drainRefused, logError } from './errors.js';
import { parseIdempotencyKey, parseRunBody } from './routes/run.js';
import { wantsEventStream } from './sse.js';

/** The route label the Fastify route reports in metrics, kept the same for this path. */
const ROUTE = '/v4/:project_id/:app_name/:function';
/** Path segments this path serves: unescaped, within the route's schema lengths; anything else goes to Fastify. */
const RUN_PATH =
  /^\/v4\/([A-Za-z0-9_][A-Za-z0-9._~-]{0,63})\/([A-Za-z0-9_][A-Za-z0-9._~-]{0,63})\/([A-Za-z0-9_][A-Za-z0-9._~-]{0,127})$/;
const JSON_TYPE = /^application\/json\s*(?:;.*)?$/i;
const CONTENT_TYPE = 'application/json; charset=utf-8';
/** The reason a run is aborted with when its caller hangs up (made once: an Error per run costs a stack). */
const CLIENT_GONE = new Error('client disconnected');

export interface RunFastPath {
  /** Serves the request and returns true, or returns false having touched nothing. */
  handle(req: IncomingMessage, res: ServerResponse): boolean;
  /** Once the server is closing, every request goes to Fastify (which answers 503). */
  close(): void;
}

/** What the fast path uses. */
export interface RunFastPathDeps {
  runs: Pick<RunService, 'resolveTarget' | 'resolveTargetCached' | 'acceptAsync' | 'invoke'>;
  metrics: Pick<Metrics, 'httpRequests' | 'httpDuration'>;
  config: { maxBodyBytes: number };
  logger: Logger;
}

export function createRunFastPath(
  services: RunFastPathDeps,
  fallback: (req: IncomingMessage, res: ServerResponse) => void,
): RunFastPath {
  const { httpRequests, httpDuration } = services.metrics;
  const limit = services.config.maxBodyBytes;
  const { runs } = services;
  let closing = false;
  // Metric children by status: prom-client hashes a labels object on every call otherwise.
  const counted = new Map<number, ReturnType<typeof httpRequests.child>>();
  const timed = httpDuration.child('POST', ROUTE);

  function count(res: ServerResponse, begun: bigint): void {
    const status = res.statusCode;
    let child = counted.get(status);
    if (!child) {
      child = httpRequests.child('POST', ROUTE, String(status));
      counted.set(status, child);
    }
    child.inc();
    timed.observe(Number(process.hrtime.bigint() - begun) / 1e9);
  }

  /** A success: the head as one raw array (no header map to fill and read back). */
  function answer(res: ServerResponse, status: number, body: string, runId: string): void {
    if (res.headersSent || res.destroyed) return;
    res.writeHead(status, [
      'content-type',
      CONTENT_TYPE,
      'content-length',
      String(Buffer.byteLength(body)),
      'x-request-id',
      runId,
    ]);
    res.end(body);
  }

  /** `recorded`: the call became a run (see RunRequestBase.onRecorded), which its answer then names. */
  function fail(req: IncomingMessage, res: ServerResponse, err: unknown, runId: string, recorded: boolean): void {
    const answered = errorAnswer(err, recorded ? { runId } : { requestId: runId });
    logError(services.logger, answered.error, err, runId);
    if (!res.headersSent) writeAnswer(res, answered);
    // A body the caller is still sending (refused before it was read): read and dropped, as for every route
    // (one torn down already cannot be, and its answer is written: Node closes that connection).
    if (!req.complete) drainRefused(req);
  }

  async function serve(
    req: IncomingMessage,
    res: ServerResponse,
    match: RegExpExecArray,
    async: boolean,
    begun: bigint,
  ): Promise<void> {
    const runId = uuidv7();
    // Until the invoker records the run, an error names the request only (no run has its id).
    let recorded = false;
    const [, projectId, appName, fn] = match as unknown as [string, string, string, string];
    // The run's one abort (run-abort.ts): the caller hanging up stops the run.
    const run = new RunAbort();
    const closed = () => {
      if (!res.writableFinished) run.abort(CLIENT_GONE);
      count(res, begun);
    };
    res.on('close', closed);
    try {
      const authorization = req.headers.authorization;
      // Both caches hit on a warm path: no Promise, no await.
      const target =
        runs.resolveTargetCached(projectId, appName, authorization) ??
        (await runs.resolveTarget(projectId, appName, authorization));
      if (runtimeOf(target.build).calls === 'http') {
        // Served by the proxy behind the Fastify route; the body is still unread.
        res.removeListener('close', closed);
        fallback(req, res);
        return;
      }
      checkFunction(target, fn);
      const declared = Number(req.headers['content-length']);
      if (declared > limit) throw bodyTooLarge(limit);
      const body = parseRunBody(await readLimitedBody(req, limit)).raw;
      if (async) {
        const idempotencyKey = parseIdempotencyKey(req.headers['idempotency-key']);
        const call = { runId, target, fn, body, webhookUrl: undefined, webhookSecret: undefined };
        // A repeated Idempotency-Key answers the first call's run id.
        const accepted = await runs.acceptAsync(call, idempotencyKey);
        answer(res, 202, `{"run_id":"${accepted}"}`, accepted);
        return;
      }
      const outcome = await runs
        .invoke({
          runId,
          build: target.build,
          fn,
          body,
          webhookUrl: undefined,
          webhookSecret: undefined,
          abort: run,
          mode: 'sync',
          onRecorded: () => {
            recorded = true;
          },
        })
        .catch((err: unknown) => {
          if (run.reason === CLIENT_GONE && !(err instanceof FerryError)) throw new FerryError('FERRY_CLIENT_GONE');
          throw err;
        });
      // The result's JSON, made once by the invoker for the run record, is spliced into the envelope.
      const result = outcome.resultJson ?? JSON.stringify(outcome.result) ?? 'null';
      answer(res, 200, `{"run_id":"${runId}","result":${result},"run_time_ms":${outcome.runTimeMs}}`, runId);
    } catch (err) {
      fail(req, res, err, runId, recorded);
    }
  }

  return {
    handle(req, res) {
      if (closing || req.method !== 'POST') return false;
      const url = req.url;
      if (url === undefined || !url.startsWith('/v4/')) return false;
      // No query string, or exactly `?async=true`; anything else (webhooks, streams) is Fastify's.
      const query = url.indexOf('?');
      const async = query >= 0 && url.slice(query) === '?async=true';
      if (query >= 0 && !async) return false;
      const match = RUN_PATH.exec(query >= 0 ? url.slice(0, query) : url);
      if (!match) return false;
      const headers = req.headers;
      if (wantsEventStream(headers.accept)) return false;
      const type = headers['content-type'];
      if (
        type !== undefined &&
        !JSON_TYPE.test(type) &&
        !JSON_SUFFIX_TYPE.test(type) &&
        !/^text\/plain\s*(?:;.*)?$/i.test(type)
      )
        return false;
      if (headers['content-encoding'] !== undefined || headers['last-event-id'] !== undefined) return false;
      void serve(req, res, match, async, process.hrtime.bigint());
      return true;
    },
    close() {
      closing = true;
    },
  };
}
