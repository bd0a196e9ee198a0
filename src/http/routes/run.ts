/**
 * The run endpoint, `POST /v4/{project_id}/{app_name}/{function}` (the spec's `.../run` calls `run`).
 *
 * Every response, errors included, carries `X-Request-Id`, equal to the run id. Authentication uses the
 * `run` scope unless the app's active build has `disable_auth = true`. The body is a JSON object whose
 * members are the function's arguments; it is forwarded to the replica as the caller sent it.
 */
import { createGzip, constants as zlibConstants } from 'node:zlib';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { Type } from 'typebox';
import { FerryError } from '../../errors.js';
import { uuidv7 } from '../../ids.js';
import type { PoolBuild } from '../../replicas/pool.js';
import { MAX_STORED_INPUT_BYTES } from '../../runs/invoke.js';
import { newRunRow } from '../../runs/recorder.js';
import type { Services } from '../../services.js';
import { webhookSecretOf } from '../../webhooks/secret.js';
import { useJsonBodies } from '../body-parsers.js';
import { attachWebSocketProxy, proxyHttp } from '../custom-proxy.js';
import type { TypedServer } from '../server.js';
import { formatEvent, startEventStream, wantsEventStream } from '../sse.js';

declare module 'fastify' {
  interface FastifyRequest {
    runId?: string;
    runTarget?: RunTarget;
  }
}

/** The app and build a run call resolved to. */
export interface RunTarget {
  build: PoolBuild;
  /** Public function names known from the build, or undefined when the builder could not tell. */
  functions: string[] | undefined;
}

interface RawJson {
  raw: Buffer;
}

const RunParams = Type.Object({
  project_id: Type.String({ maxLength: 64 }),
  app_name: Type.String({ maxLength: 64 }),
  function: Type.String({ maxLength: 128 }),
});

/** Checks the body is one JSON object and keeps its bytes. */
function parseRunBody(raw: Buffer): RawJson {
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

/** Finds the app's active build, authenticating unless the build turns auth off. */
async function resolveTarget(
  services: Services,
  projectId: string,
  appName: string,
  authorization: string | undefined,
): Promise<RunTarget> {
  const found = await services.runTargets.get(projectId, appName);
  if (!found?.config?.app.disable_auth) await services.auth.authenticate(authorization, projectId, 'run');
  if (!found) throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${appName}" in this project`);
  if (!found.config || !found.buildId) {
    throw new FerryError('FERRY_NO_READY_BUILD', undefined, { headers: { 'retry-after': '5' } });
  }
  return {
    build: { projectId, appId: found.appId, buildId: found.buildId, config: found.config },
    functions: found.functions,
  };
}

/** The `webhookEndpoint` query parameter: an absolute http(s) URL without credentials, or undefined. */
function parseWebhookEndpoint(value: unknown): string | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'string' || value === '' || value.length > 2048)
    throw new FerryError('FERRY_WEBHOOK_URL_INVALID');
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new FerryError('FERRY_WEBHOOK_URL_INVALID');
  }
  if ((url.protocol !== 'http:' && url.protocol !== 'https:') || url.username || url.password) {
    throw new FerryError('FERRY_WEBHOOK_URL_INVALID');
  }
  return url.toString();
}

const IDEMPOTENCY_WINDOW_MS = 24 * 3600 * 1000;

interface CallParts {
  runId: string;
  target: RunTarget;
  fn: string;
  body: Buffer;
  webhookUrl: string | undefined;
  webhookSecret: string | undefined;
  /** Custom runtime: the whole HTTP request to forward, as JSON (the run's `http_request`). */
  httpRequest?: string;
  /** What the run record shows as its input (default: the body as text). */
  input?: string | null;
}

/**
 * `?async=true`: stores the run with its input and answers 202 {"run_id"} only once it is committed.
 * With `Idempotency-Key`, a repeat within 24 hours answers the first call's run id and runs nothing.
 */
async function acceptAsync(
  services: Services,
  request: FastifyRequest,
  reply: FastifyReply,
  call: CallParts,
): Promise<FastifyReply> {
  const { store } = services;
  const key = request.headers['idempotency-key'];
  let idempotencyKey: string | undefined;
  if (key !== undefined) {
    if (typeof key !== 'string' || !/^[\x21-\x7e]{1,255}$/.test(key))
      throw new FerryError('FERRY_IDEMPOTENCY_KEY_INVALID');
    idempotencyKey = key;
  }
  const { build } = call.target;
  const replay = async (): Promise<string | undefined> => {
    if (!idempotencyKey) return undefined;
    const earlier = await store
      .selectFrom('runs')
      .select(['id', 'created_at'])
      .where('project_id', '=', build.projectId)
      .where('app_id', '=', build.appId)
      .where('idempotency_key', '=', idempotencyKey)
      .executeTakeFirst();
    if (!earlier) return undefined;
    if (Date.now() - Date.parse(earlier.created_at) < IDEMPOTENCY_WINDOW_MS) return earlier.id;
    // Past the window the key is free again: the old run keeps its record but lets go of the key.
    await store.updateTable('runs').set({ idempotency_key: null }).where('id', '=', earlier.id).execute();
    return undefined;
  };
  const send = (runId: string) =>
    reply.code(202).header('x-request-id', runId).type('application/json; charset=utf-8').send({ run_id: runId });

  const earlier = await replay();
  if (earlier) return send(earlier);
  if (services.asyncWorker.backlog >= services.config.maxAsyncBacklog) {
    throw new FerryError('FERRY_ASYNC_BACKLOG_FULL', undefined, { headers: { 'retry-after': '5' } });
  }
  try {
    await services.recorder.insertNow(
      newRunRow({
        id: call.runId,
        build,
        fn: call.fn,
        mode: 'async',
        // Kept whole whatever its size: the worker runs the call from it (custom apps: from httpRequest).
        input: call.input !== undefined ? call.input : call.body.toString('utf8'),
        httpRequest: call.httpRequest,
        webhookUrl: call.webhookUrl,
        webhookSecret: call.webhookSecret,
        idempotencyKey,
      }),
    );
  } catch (err) {
    // Two calls with one key at once: the unique index lets one in; the other answers its run id.
    const winner = await replay();
    if (winner) return send(winner);
    throw err;
  }
  services.asyncWorker.enqueue({ id: call.runId, projectId: build.projectId, appId: build.appId });
  return send(call.runId);
}

/**
 * `Accept: text/event-stream`: each yielded item is sent as one event the moment it is yielded (strings as
 * they are, other values as JSON), gzip-compressed and flushed per event when the caller accepts gzip.
 * Errors before the call starts answer a normal JSON error; after it, an `event: error` ends the stream.
 */
async function streamRun(
  services: Services,
  request: FastifyRequest,
  reply: FastifyReply,
  call: Omit<Parameters<Services['invoker']['invoke']>[0], 'mode'>,
): Promise<void> {
  const res = reply.raw;
  const gzip = /\bgzip\b/i.test(String(request.headers['accept-encoding'] ?? ''));
  let out: { write(text: string): void; end(): void } | undefined;
  const open = () => {
    if (out) return out;
    reply.hijack();
    startEventStream(res, {
      'x-request-id': call.runId,
      'transfer-encoding': 'chunked',
      ...(gzip ? { 'content-encoding': 'gzip', vary: 'Accept-Encoding' } : {}),
    });
    if (gzip) {
      const z = createGzip();
      z.pipe(res);
      out = {
        write(text) {
          z.write(text);
          // Z_SYNC_FLUSH per event: compressed, yet each event reaches the client as it is yielded.
          z.flush(zlibConstants.Z_SYNC_FLUSH);
        },
        end: () => z.end(),
      };
    } else {
      out = { write: (text) => res.write(text), end: () => res.end() };
    }
    return out;
  };
  try {
    const outcome = await services.invoker.invoke({
      ...call,
      mode: 'stream',
      onStarted: () => void open(),
      onItem: (item) => open().write(formatEvent(typeof item === 'string' ? item : JSON.stringify(item))),
    });
    // A plain (non-generator) function called as a stream: its result is the one event.
    if (!outcome.streamed) {
      const value = outcome.result;
      open().write(formatEvent(typeof value === 'string' ? value : JSON.stringify(value)));
    }
    open().end();
  } catch (err) {
    if (!out) throw err; // nothing sent yet: a normal JSON error response
    const ferry = err instanceof FerryError ? err : new FerryError('FERRY_INTERNAL');
    if (!res.destroyed) {
      out.write(formatEvent(JSON.stringify({ run_id: call.runId, ...ferry.toJSON() }), 'error'));
      out.end();
    }
  }
}

export function registerRunRoutes(app: TypedServer, services: Services): void {
  attachWebSocketProxy(app.server, services, (projectId, appName, authorization) =>
    resolveTarget(services, projectId, appName, authorization),
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
      const target = await resolveTarget(services, project_id, app_name, request.headers.authorization);
      request.runTarget = target;
      if (target.build.config.app.runtime === 'custom') {
        return proxyHttp(services, request, reply, target, runId, parseWebhookEndpoint, (call) =>
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
        if (fn.startsWith('_') || (target.functions && !target.functions.includes(fn))) {
          throw new FerryError('FERRY_FUNCTION_NOT_FOUND', `The app has no public function "${fn}"`);
        }
        const body = (request.body as RawJson | undefined)?.raw ?? Buffer.from('{}');
        const query = request.query as Record<string, unknown>;
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

        // The caller going away ends the run (its generator is stopped, its slot freed).
        const gone = new AbortController();
        reply.raw.on('close', () => {
          if (!reply.raw.writableFinished) gone.abort(new Error('client disconnected'));
        });
        const common = { runId, build: target.build, fn, body, signal: gone.signal, webhookUrl, webhookSecret };

        // The run is recorded as cancelled (client_disconnected); the error handler logs it at debug level.
        const orGone = (err: unknown): never => {
          if (gone.signal.aborted && !(err instanceof FerryError)) throw new FerryError('FERRY_CLIENT_GONE');
          throw err;
        };
        if (wantsEventStream(request.headers.accept)) {
          return streamRun(services, request, reply, common).catch(orGone);
        }
        const outcome = await services.invoker.invoke({ ...common, mode: 'sync' }).catch(orGone);
        return reply
          .type('application/json; charset=utf-8')
          .send({ run_id: runId, result: outcome.result, run_time_ms: outcome.runTimeMs });
      },
    );
  });
}
