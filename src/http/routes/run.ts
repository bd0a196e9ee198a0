/**
 * The run endpoint, `POST /v4/{project_id}/{app_name}/{function}` (the spec's `.../run` calls `run`).
 *
 * Every response, errors included, carries `X-Request-Id`, equal to the run id; an error names the run in
 * its body (`run_id`) only once the call became one (`request.runRecorded`): a call refused before, with
 * a 401, 404 or 415, has no run to look up (issue 43). Authentication uses the
 * `run` scope unless the app's active build has `disable_auth = true`. The body is a JSON object whose
 * members are the function's arguments; it is forwarded to the replica as the caller sent it.
 */
import { createGzip, constants as zlibConstants } from 'node:zlib';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { Type } from 'typebox';
import type { ServerConfig } from '../../config.js';
import { FerryError } from '../../errors.js';
import { uuidv7 } from '../../ids.js';
import { MAX_STORED_INPUT_BYTES } from '../../runs/invoke.js';
import { type CallParts, checkFunction, type RunService, type RunTarget } from '../../runs/run-service.js';
import type { ReplayStream, StreamEndState, StreamReader, StreamReplay } from '../../runs/stream-replay.js';
import { runtimeOf } from '../../runtimes/index.js';
import { blockedReason, parseAllowList } from '../../webhooks/address-guard.js';
import { webhookSecretOf } from '../../webhooks/secret.js';
import { parseWebhookUrl, WebhookUrlError } from '../../webhooks/webhook-url.js';
import { errorEventData } from '../answer.js';
import { useJsonBodies } from '../body-parsers.js';
import { type CallerFlow, watchCaller } from '../caller-flow.js';
import { attachWebSocketProxy, type CustomProxyDeps, type ProxyOptions, proxyHttp } from '../custom-proxy.js';
import { formatComment, formatEvent, startEventStream, wantsEventStream } from '../sse.js';
import type { TypedServer } from '../typed-server.js';

declare module 'fastify' {
  interface FastifyRequest {
    runId?: string;
    /** The call was recorded as the run `runId` (RunRequestBase.onRecorded): its error answer names it. */
    runRecorded?: boolean;
    runTarget?: RunTarget;
  }
}

interface RawJson {
  raw: Buffer;
}

/** What the run endpoint uses. */
export interface RunRouteDeps extends CustomProxyDeps {
  runs: RunService;
  /** Streaming runs' events, kept for a reconnect (runs/stream-replay.ts). */
  streams: Pick<StreamReplay, 'open' | 'get'>;
  config: Pick<ServerConfig, 'maxBodyBytes' | 'callerStallSeconds' | 'streamBufferBytes' | 'webhookAllow'>;
}

const RunParams = Type.Object({
  project_id: Type.String({ maxLength: 64 }),
  app_name: Type.String({ maxLength: 64 }),
  function: Type.String({ maxLength: 128 }),
});

/** Checks the body is one JSON object and keeps its bytes. */
export function parseRunBody(raw: Buffer): RawJson {
  if (raw.length === 0) return { raw: Buffer.from('{}') };
  let value: unknown;
  try {
    value = JSON.parse(raw.toString('utf8'));
  } catch {
    throw new FerryError(
      'FERRY_INVALID_JSON',
      'The request body is not valid JSON (a body sent without Content-Type or as text/plain is read as JSON too)',
    );
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value))
    throw new FerryError('FERRY_BODY_NOT_OBJECT');
  return { raw };
}

/**
 * The reader of the `webhookEndpoint` query parameter: normalized (webhooks/webhook-url.ts has the rule),
 * or undefined. A literal address in a range this server's deliveries may not reach (FERRY_WEBHOOK_ALLOW)
 * is refused now, as a bad URL, not accepted and failed at delivery (issue 43).
 */
function webhookEndpointReader(webhookAllow: string): (value: unknown) => string | undefined {
  const allow = parseAllowList(webhookAllow);
  const options = { blocked: (address: string) => blockedReason(address, allow) };
  return function parseWebhookEndpoint(value) {
    if (value === undefined) return undefined;
    try {
      return parseWebhookUrl(value, options);
    } catch (err) {
      if (err instanceof WebhookUrlError)
        throw new FerryError('FERRY_WEBHOOK_URL_INVALID', `webhookEndpoint ${err.message}`);
      throw err;
    }
  };
}

/** The `Idempotency-Key` header: up to 255 visible ASCII characters, or undefined when not sent. */
export function parseIdempotencyKey(key: string | string[] | undefined): string | undefined {
  if (key === undefined) return undefined;
  if (typeof key !== 'string' || !/^[\x21-\x7e]{1,255}$/.test(key))
    throw new FerryError('FERRY_IDEMPOTENCY_KEY_INVALID');
  return key;
}

/** `?async=true` through Fastify: 202 {"run_id"} once the run is committed (RunService.acceptAsync). */
async function acceptAsync(
  services: RunRouteDeps,
  request: FastifyRequest,
  reply: FastifyReply,
  call: CallParts,
): Promise<FastifyReply> {
  const idempotencyKey = parseIdempotencyKey(request.headers['idempotency-key']);
  const runId = await services.runs.acceptAsync(call, idempotencyKey);
  return reply.code(202).header('x-request-id', runId).type('application/json; charset=utf-8').send({ run_id: runId });
}

/** What a streaming run's clients are told to wait before reconnecting (the SSE `retry:` field), ms. */
export const STREAM_RECONNECT_MS = 1000;

/** The `<run_id>:<seq>` a reconnecting client sends as `Last-Event-ID` (or `?lastEventId=`). */
interface LastEventId {
  runId: string;
  seq: number;
}

/** The Last-Event-ID header, else the `lastEventId` query parameter; undefined when neither is given. */
function parseLastEventId(header: unknown, query: unknown): LastEventId | undefined {
  const value = header !== undefined && header !== '' ? header : query;
  if (value === undefined || value === '') return undefined;
  const match =
    typeof value === 'string'
      ? /^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}):(\d{1,9})$/i.exec(value)
      : null;
  if (!match) throw new FerryError('FERRY_LAST_EVENT_ID_INVALID');
  return { runId: match[1]!.toLowerCase(), seq: Number(match[2]) };
}

/**
 * Whether the caller asked for the stream's named events (`?events=true` or `X-Ferry-Stream-Events: true`;
 * `1` is taken too). Without them the only `data:` lines are the yielded items (spec 4.4 and 6: no named
 * event types): a stream's error and end are SSE comments, which `data:` readers and EventSource skip.
 */
export function wantsStreamEvents(request: FastifyRequest): boolean {
  const on = (value: unknown) => value === 'true' || value === '1';
  return on((request.query as Record<string, unknown>).events) || on(request.headers['x-ferry-stream-events']);
}

/** One control event (`error`, `end`) in the default form: a comment `: <name> <data>`, with no id. */
function controlComment(event: string, data: string): string {
  return formatComment(`${event} ${data}`);
}

/**
 * One caller's connection to a run's events. The response starts on first use (headers, then `retry:`);
 * events go out as they come, gzip-compressed and flushed per event when the caller accepts gzip. Items are
 * `id:` + `data:`; the run's `error` and `end` are named events with `named`, else comments with no id.
 * Back-pressure (caller-flow.ts): the reader is `blocked` while the connection holds more than
 * FERRY_STREAM_BUFFER_BYTES unsent, which pauses the run's replica; after FERRY_CALLER_STALL_SECONDS
 * blocked, the connection is cut (a caller gone away: the stream's resume grace applies).
 */
function eventConnection(
  services: RunRouteDeps,
  request: FastifyRequest,
  reply: FastifyReply,
  runId: string,
  named: boolean,
) {
  const res = reply.raw;
  const gzip = /\bgzip\b/i.test(String(request.headers['accept-encoding'] ?? ''));
  const { streamBufferBytes, callerStallSeconds } = services.config;
  let out: { write(text: string): void; end(): void } | undefined;
  let flow: CallerFlow | undefined;
  /** The stream this connection reads, told when the connection takes its bytes again. */
  let following: ReplayStream | undefined;
  const open = () => {
    if (out) return out;
    reply.hijack();
    startEventStream(res, {
      'x-request-id': runId,
      'transfer-encoding': 'chunked',
      ...(gzip ? { 'content-encoding': 'gzip', vary: 'Accept-Encoding' } : {}),
    });
    const z = gzip ? createGzip() : undefined;
    const watched = watchCaller({
      full: () => res.writableLength + (z ? z.writableLength + z.readableLength : 0) > streamBufferBytes,
      drains: z ? [res, z] : [res],
      stallMs: callerStallSeconds * 1000,
      onStalled: () => {
        services.runs.note(runId, `the caller read nothing for ${callerStallSeconds} s: disconnected`);
        res.destroy();
      },
      onReady: () => following?.readerReady(),
    });
    flow = watched;
    res.once('close', () => watched.stop());
    if (z) {
      z.pipe(res);
      out = {
        write(text) {
          z.write(text);
          // Z_SYNC_FLUSH per event: compressed, yet each event reaches the client as it is yielded.
          z.flush(zlibConstants.Z_SYNC_FLUSH);
          watched.wrote();
        },
        end: () => z.end(),
      };
    } else {
      out = {
        write(text) {
          res.write(text);
          watched.wrote();
        },
        end: () => res.end(),
      };
    }
    out.write(`retry: ${STREAM_RECONNECT_MS}\n\n`);
    return out;
  };
  const reader: StreamReader = {
    send(event) {
      if (res.destroyed) return;
      const text =
        event.event && !named
          ? controlComment(event.event, event.data)
          : formatEvent(event.data, event.event, event.id);
      open().write(text);
    },
    end: () => open().end(),
    get blocked() {
      return flow?.blocked ?? false;
    },
  };
  /** Attaches this connection to `stream` after `afterSeq`. */
  const follow = (stream: ReplayStream, afterSeq: number) => {
    following = stream;
    stream.attach(reader, afterSeq);
  };
  return { open, reader, res, follow };
}

function eventText(value: unknown): string {
  return typeof value === 'string' ? value : JSON.stringify(value);
}

/** How a stream that failed ends, as the run records it. */
function endStateOf(err: FerryError, clientGone: boolean): StreamEndState {
  if (err.code === 'FERRY_RUN_TIMEOUT') return 'timeout';
  // Cancelled through the API (POST .../runs/{run_id}/cancel): an error FERRY_RUN_CANCELLED, then this.
  if (err.code === 'FERRY_RUN_CANCELLED') return 'cancelled';
  return clientGone ? 'cancelled' : 'failure';
}

/**
 * `Accept: text/event-stream`: each yielded item is one event (strings as they are, other values as JSON),
 * with the id `<run_id>:<seq>`, the moment it is yielded; an `end` closes every stream, after an `error`
 * when the run failed: comments `: end {"run_id","state"}` and `: error {...}` by default, named events
 * (`event: end`, `event: error`, with ids) when the caller asks (wantsStreamEvents). Errors before the call
 * starts answer a normal JSON error.
 *
 * The events are kept (services.streams) so a reconnect can resume; a caller that goes away once the
 * stream has started leaves the run going for the resume grace period. Before that it stops the run.
 */
async function streamRun(
  services: RunRouteDeps,
  request: FastifyRequest,
  reply: FastifyReply,
  call: Omit<Parameters<RunService['invoke']>[0], 'mode' | 'signal'>,
): Promise<void> {
  const gone = new AbortController();
  const stop = () => gone.abort(new Error('client disconnected'));
  const connection = eventConnection(services, request, reply, call.runId, wantsStreamEvents(request));
  const recorded = () => {
    request.runRecorded = true;
  };
  let stream: ReplayStream | undefined;
  const begin = (): ReplayStream => {
    if (stream) return stream;
    connection.open();
    stream = services.streams.open({
      runId: call.runId,
      projectId: call.build.projectId,
      appId: call.build.appId,
      fn: call.fn,
      stop,
    });
    connection.follow(stream, 0);
    return stream;
  };
  connection.res.on('close', () => {
    if (connection.res.writableFinished) return;
    if (stream) stream.detach(connection.reader);
    else stop();
  });
  try {
    const outcome = await services.runs.invoke({
      ...call,
      mode: 'stream',
      signal: gone.signal,
      onRecorded: recorded,
      onStarted: () => void begin(),
      onItem: (item) => begin().push(eventText(item)),
      // While the caller's connection is full, the replica's answer waits (not read, not buffered here).
      flow: {
        get blocked() {
          return stream?.blocked ?? false;
        },
        whenReady: (ready) => (stream ? stream.whenReady(ready) : setImmediate(ready)),
      },
    });
    // A plain (non-generator) function called as a stream: its result is the one event.
    if (!outcome.streamed) begin().push(eventText(outcome.result));
    begin().end('success');
  } catch (err) {
    if (!stream) throw err; // nothing sent yet: a normal JSON error response
    const clientGone = !(err instanceof FerryError) && gone.signal.aborted;
    const ferry = err instanceof FerryError ? err : new FerryError(clientGone ? 'FERRY_CLIENT_GONE' : 'FERRY_INTERNAL');
    stream.push(errorEventData(ferry, call.runId), 'error');
    stream.end(endStateOf(ferry, clientGone));
  }
}

/**
 * A reconnect carrying `Last-Event-ID: <run_id>:<seq>`: sends the run's kept events after `seq`, then the
 * live ones, and nothing is run. 204 once there is nothing more (which tells EventSource to stop); 410
 * when the run's stream is not kept here; an error (comment or named event, as for the run's) first when
 * events after `seq` were dropped.
 */
function resumeStream(
  services: RunRouteDeps,
  request: FastifyRequest,
  reply: FastifyReply,
  target: RunTarget,
  fn: string,
  last: LastEventId,
): FastifyReply | undefined {
  void reply.header('x-request-id', last.runId);
  const stream = services.streams.get(last.runId);
  // Another app's run answers as an unknown one: a token for this app learns nothing about others.
  if (
    !stream ||
    stream.projectId !== target.build.projectId ||
    stream.appId !== target.build.appId ||
    stream.fn !== fn
  ) {
    throw new FerryError('FERRY_STREAM_GONE');
  }
  if (last.seq > stream.lastSeq) {
    throw new FerryError('FERRY_LAST_EVENT_ID_INVALID', `This stream has sent no event ${last.runId}:${last.seq}`);
  }
  const named = wantsStreamEvents(request);
  // Over: nothing after the client's last event, or (without named events, whose end and error carry no
  // id, so a client's last id is an item's) no item after it. 204 tells EventSource to stop.
  if (stream.done && (last.seq >= stream.lastSeq || (!named && last.seq >= stream.lastItemSeq))) {
    return reply.code(204).send();
  }

  const connection = eventConnection(services, request, reply, last.runId, named);
  connection.open();
  connection.res.on('close', () => {
    if (!connection.res.writableFinished) stream.detach(connection.reader);
  });
  const first = stream.firstSeq;
  if (last.seq + 1 < first) {
    const dropped = new FerryError(
      'FERRY_STREAM_EVENTS_DROPPED',
      `Events ${last.seq + 1} to ${first - 1} of this run are no longer kept; the stream goes on from event ${first}`,
      { details: { resumes_at: `${last.runId}:${first}` } },
    );
    // No id: it is not one of the run's events, and the client's last id stays where it was.
    const data = errorEventData(dropped, last.runId);
    connection.open().write(named ? formatEvent(data, 'error') : controlComment('error', data));
  }
  connection.follow(stream, last.seq);
  return undefined;
}

/** `options`: whether custom apps' answers are sandboxed on this server (custom-proxy.ts, ProxyOptions). */
export function registerRunRoutes(app: TypedServer, services: RunRouteDeps, options: ProxyOptions): void {
  const parseWebhookEndpoint = webhookEndpointReader(services.config.webhookAllow);
  attachWebSocketProxy(app.server, services, (projectId, appName, authorization) =>
    services.runs.resolveTarget(projectId, appName, authorization),
  );
  // Its own scope, so the raw-body JSON parser (which keeps the bytes to forward) applies to the run endpoint only.
  void app.register(async function runEndpoint(scope: FastifyInstance) {
    useJsonBodies(scope, parseRunBody, services.config.maxBodyBytes);

    /**
     * Resolves the app (authenticating); a custom app is served here and now, before Fastify reads the body,
     * by the proxy. `functionRoute`: the path is a cortex call (`POST .../{function}`).
     */
    const resolveOrProxy = (functionRoute: boolean) => async (request: FastifyRequest, reply: FastifyReply) => {
      const runId = uuidv7();
      request.runId = runId;
      void reply.header('x-request-id', runId);
      const { project_id, app_name } = request.params as { project_id: string; app_name: string };
      const target = await services.runs.resolveTarget(project_id, app_name, request.headers.authorization);
      request.runTarget = target;
      if (runtimeOf(target.build).calls === 'http') {
        return proxyHttp(services, options, request, reply, target, runId, parseWebhookEndpoint, (call) =>
          acceptAsync(services, request, reply, {
            ...call,
            runId,
            target,
            input: call.body.length <= MAX_STORED_INPUT_BYTES ? call.body.toString('utf8') : null,
          }),
        );
      }
      if (!functionRoute) {
        throw new FerryError('FERRY_CORTEX_CALL', undefined, { headers: { allow: 'POST' } });
      }
      return undefined;
    };

    // Custom apps take every method on every path under the app; cortex apps answer FERRY_CORTEX_CALL there.
    const anyPath = { schema: { hide: true }, onRequest: resolveOrProxy(false) };
    const refuse = async () => {
      throw new FerryError('FERRY_CORTEX_CALL', undefined, { headers: { allow: 'POST' } });
    };
    scope.all('/v4/:project_id/:app_name', anyPath, refuse);
    scope.all('/v4/:project_id/:app_name/*', anyPath, refuse);
    for (const method of ['GET', 'PUT', 'DELETE', 'PATCH', 'OPTIONS'] as const) {
      scope.route({ method, url: '/v4/:project_id/:app_name/:function', ...anyPath, handler: refuse });
    }

    scope.post(
      '/v4/:project_id/:app_name/:function',
      {
        schema: { params: RunParams },
        onRequest: resolveOrProxy(true),
      },
      async (request, reply) => {
        const target = request.runTarget!;
        const runId = request.runId!;
        const fn = (request.params as { function: string }).function;
        checkFunction(target, fn);
        const query = request.query as Record<string, unknown>;
        const streaming = wantsEventStream(request.headers.accept);
        const last = streaming ? parseLastEventId(request.headers['last-event-id'], query.lastEventId) : undefined;
        // A reconnect resumes the run it names; the body and other parameters are the first call's.
        if (last) return resumeStream(services, request, reply, target, fn, last);

        const body = (request.body as RawJson | undefined)?.raw ?? Buffer.from('{}');
        const webhookUrl = parseWebhookEndpoint(query.webhookEndpoint);
        const webhookSecret = webhookSecretOf(
          services.secretsKey,
          runId,
          webhookUrl,
          request.headers['x-webhook-secret'],
        );

        // Exactly "true" turns async on; any other value is as if the parameter were absent (documented).
        if (query.async === 'true') {
          return acceptAsync(services, request, reply, { runId, target, fn, body, webhookUrl, webhookSecret });
        }

        const common = { runId, build: target.build, fn, body, webhookUrl, webhookSecret };
        if (streaming) return streamRun(services, request, reply, common);

        // The caller going away ends a sync run (its slot freed).
        const gone = new AbortController();
        reply.raw.on('close', () => {
          if (!reply.raw.writableFinished) gone.abort(new Error('client disconnected'));
        });
        // The run is recorded as cancelled (client_disconnected); the error handler logs it at debug level.
        const orGone = (err: unknown): never => {
          if (gone.signal.aborted && !(err instanceof FerryError)) throw new FerryError('FERRY_CLIENT_GONE');
          throw err;
        };
        const recorded = () => {
          request.runRecorded = true;
        };
        const outcome = await services.runs
          .invoke({ ...common, signal: gone.signal, mode: 'sync', onRecorded: recorded })
          .catch(orGone);
        // The result's JSON, made once by the invoker for the run record, is spliced into the envelope.
        const result = outcome.resultJson ?? JSON.stringify(outcome.result) ?? 'null';
        return reply
          .type('application/json; charset=utf-8')
          .send(`{"run_id":"${runId}","result":${result},"run_time_ms":${outcome.runTimeMs}}`);
      },
    );
  });
}
