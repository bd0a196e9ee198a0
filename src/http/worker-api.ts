/**
 * A worker's internal listener (`ferry serve --role worker`): the only door into a worker. Gateways send it
 * the sync, streaming, custom HTTP and WebSocket calls they accept (runs/remote-invoker.ts); the worker
 * runs them through its own invoker exactly as a single process does (recording the run, its logs and
 * its webhook), and streams what happens back.
 *
 * Every call must carry a cluster token (cluster-auth.ts, signed with the shared keys directory's
 * `cluster.key`); anything else answers 401 FERRY_CLUSTER_UNAUTHENTICATED. `/healthz`, `/readyz` and `/metrics` are
 * open, as on a gateway, for load balancers and scrapers.
 *
 * The protocol (routes, the call line, the answer's lines, the session's tunnel) is cluster/protocol.ts,
 * shared with the client (runs/remote-invoker.ts).
 */
import http, { type IncomingMessage, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import { PassThrough } from 'node:stream';
import type { Logger } from 'pino';
import type { CallerTally } from '../cluster/caller-tally.js';
import type { ClusterAuth } from '../cluster/cluster-auth.js';
import {
  CALL_HEADER,
  type CallMeta,
  decodeHeaderMeta,
  doneLine,
  MAX_META_BYTES,
  parseCallMeta,
  line as protocolLine,
  WORKER_PATHS,
} from '../cluster/protocol.js';
import type { WorkerBuilds } from '../cluster/worker-builds.js';
import type { DiskSpace } from '../disk-space.js';
import { FerryError } from '../errors.js';
import type { Metrics } from '../metrics.js';
import type { Invoker } from '../runs/invoke.js';
import { RunAbort } from '../runs/run-abort.js';
import { tunnel } from '../runs/tunnel.js';
import type { StoreHealth } from '../store/index.js';
import { answer, refuseOnSocket, workerErrorLine, writeAnswer } from './answer.js';

export interface WorkerApiDeps {
  /** The builds calls name, with the app's scaling in force (cluster/worker-builds.ts). */
  builds: WorkerBuilds;
  /** Whether the store answers within `timeoutMs` (`/healthz`). */
  storeHealth(timeoutMs: number): Promise<StoreHealth>;
  /** The data folder's free space (`/readyz` says `storage` while it is under FERRY_MIN_FREE_MIB). */
  space?: Pick<DiskSpace, 'low'>;
  invoker: Invoker;
  auth: ClusterAuth;
  /** Counts each call by app and calling gateway while it lasts (announced with the worker's load). */
  callers?: CallerTally;
  metrics: Metrics;
  refreshGauges(): void;
  logger: Logger;
  /** Largest arguments body taken (the gateway checked it already; this bounds a confused peer). */
  maxBodyBytes: number;
  /**
   * Bytes a streaming answer may hold unsent for the gateway (FERRY_STREAM_BUFFER_BYTES): past it the run
   * stops reading its replica until the gateway takes some (it stops when its own caller is full).
   */
  streamBufferBytes?: number;
}

export interface WorkerApi {
  server: http.Server;
  close(): Promise<void>;
}

export function createWorkerApi(deps: WorkerApiDeps): WorkerApi {
  const { logger } = deps;
  const { builds } = deps;
  const bufferBytes = Math.max(deps.streamBufferBytes ?? 1024 * 1024, 64 * 1024);

  const server = http.createServer({ keepAliveTimeout: 65_000, noDelay: true }, (req, res) => {
    void route(req, res).catch((err: unknown) => {
      if (!(err instanceof FerryError)) logger.error({ err, url: req.url }, 'internal call failed');
      answerError(res, err);
    });
  });
  server.headersTimeout = 30_000;
  server.requestTimeout = 0; // calls last as long as their run (the run's own deadline bounds them)

  async function route(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const url = req.url ?? '/';
    if (req.method === 'GET' && url === '/healthz') {
      const state = await deps.storeHealth(1000).catch(() => 'down' as const);
      const body = state === 'ok' || state === 'busy' ? { status: 'ok', role: 'worker' } : { status: 'unavailable' };
      sendJson(res, state === 'ok' || state === 'busy' ? 200 : 503, body);
      return;
    }
    if (req.method === 'GET' && url === '/readyz') {
      const state = await deps.storeHealth(1000).catch(() => 'down' as const);
      if (state !== 'ok' && state !== 'busy') sendJson(res, 503, { status: 'unavailable', reason: 'store' });
      else if (deps.space?.low) sendJson(res, 503, { status: 'unavailable', reason: 'storage' });
      else sendJson(res, 200, { status: 'ready', role: 'worker' });
      return;
    }
    if (req.method === 'GET' && url === '/metrics') {
      deps.refreshGauges();
      const text = await deps.metrics.registry.metrics();
      res.writeHead(200, { 'content-type': deps.metrics.registry.contentType });
      res.end(text);
      return;
    }
    const caller = deps.auth.verify(req.headers.authorization);
    if (!caller) throw new FerryError('FERRY_CLUSTER_UNAUTHENTICATED');
    if (req.method === 'POST' && url === WORKER_PATHS.invoke) return invoke(req, res, caller.nodeId);
    if (req.method === 'POST' && url === WORKER_PATHS.http) return forwardHttp(req, res, caller.nodeId);
    throw new FerryError('FERRY_ROUTE_NOT_FOUND', `No internal route ${req.method} ${url.split('?')[0]}`);
  }

  /** A cortex call: runs the function, answers its events as lines. */
  async function invoke(req: IncomingMessage, res: ServerResponse, caller: string): Promise<void> {
    const { meta, body } = await readCall(req, deps.maxBodyBytes);
    const leave = deps.callers?.enter(`${meta.projectId}/${meta.appId}`, caller);
    try {
      await invokeCounted(res, meta, body);
    } finally {
      leave?.();
    }
  }

  async function invokeCounted(res: ServerResponse, meta: CallMeta, body: Buffer): Promise<void> {
    const build = await builds.get(meta);
    const gone = goneAbort(res);
    const streaming = meta.mode === 'stream';
    let opened = false;
    const open = () => {
      if (opened) return;
      opened = true;
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      res.flushHeaders();
    };
    const line = (value: Parameters<typeof protocolLine>[0]) => {
      open();
      res.write(protocolLine(value));
    };
    try {
      const outcome = await deps.invoker.invoke({
        runId: meta.runId,
        build,
        fn: meta.fn,
        mode: meta.mode,
        body,
        abort: gone,
        webhookUrl: meta.webhookUrl,
        webhookSecret: meta.webhookSecret,
        ...(streaming
          ? {
              onStarted: () => line({ e: 'started' }),
              onItem: (data: unknown) => line({ e: 'item', d: data ?? null }),
              flow: {
                get blocked() {
                  return res.writableLength > bufferBytes;
                },
                whenReady: (ready: () => void) => {
                  // Over the high-water mark, so `drain` comes once it is all sent (or the call is aborted).
                  res.once('drain', ready);
                },
              },
            }
          : {}),
      });
      // `result` last, as the replica's bytes: the gateway answers them as they are (remote-invoker.ts).
      const done = doneLine(outcome, outcome.resultJson ?? JSON.stringify(outcome.result ?? null));
      if (opened) res.end(done);
      else {
        res.writeHead(200, { 'content-type': 'application/x-ndjson', 'content-length': Buffer.byteLength(done) });
        res.end(done);
      }
    } catch (err) {
      if (gone.aborted && !(err instanceof FerryError)) {
        res.destroy();
        return;
      }
      if (!(err instanceof FerryError)) logger.error({ err, runId: meta.runId }, 'internal invoke failed');
      line(workerErrorLine(err));
      res.end();
    }
  }

  /** A custom app's HTTP call: forwards it to the app's server and streams the answer back. */
  async function forwardHttp(req: IncomingMessage, res: ServerResponse, caller: string): Promise<void> {
    const { meta, rest } = await readMeta(req);
    if (!meta.http) throw new FerryError('FERRY_VALIDATION', 'the call has no request to forward');
    const leave = deps.callers?.enter(`${meta.projectId}/${meta.appId}`, caller);
    try {
      await forwardHttpCounted(req, res, meta, meta.http, rest);
    } finally {
      leave?.();
    }
  }

  async function forwardHttpCounted(
    req: IncomingMessage,
    res: ServerResponse,
    meta: CallMeta,
    call: NonNullable<CallMeta['http']>,
    rest: Buffer,
  ): Promise<void> {
    const build = await builds.get(meta);
    const gone = goneAbort(res);
    let body: PassThrough | null = null;
    if (call.hasBody) {
      body = new PassThrough();
      if (rest.length > 0) body.write(rest);
      req.pipe(body);
    }
    let answered = false;
    try {
      await deps.invoker.invokeHttp({
        runId: meta.runId,
        build,
        fn: meta.fn,
        mode: meta.mode,
        abort: gone,
        webhookUrl: meta.webhookUrl,
        webhookSecret: meta.webhookSecret,
        input: meta.input ?? null,
        http: { method: call.method, path: call.path, headers: call.headers, body },
        onResponse(head) {
          answered = true;
          res.writeHead(200, { 'content-type': 'application/octet-stream' });
          res.write(protocolLine({ e: 'head', status: head.statusCode, headers: head.headers }));
          res.socket?.setNoDelay(true);
          return res;
        },
      });
      if (!res.writableEnded) res.end();
    } catch (err) {
      if (answered || (gone.aborted && !(err instanceof FerryError))) {
        res.destroy();
        return;
      }
      if (!(err instanceof FerryError)) logger.error({ err, runId: meta.runId }, 'internal http call failed');
      res.writeHead(200, { 'content-type': 'application/octet-stream' });
      res.end(protocolLine(workerErrorLine(err)));
    }
  }

  /** A WebSocket session: the connection becomes a tunnel to the app's server for as long as it lasts. */
  server.on('upgrade', (req: IncomingMessage, socket: Socket, head: Buffer) => {
    socket.on('error', () => socket.destroy());
    let meta: CallMeta | undefined;
    try {
      meta = decodeHeaderMeta(req.headers[CALL_HEADER]);
    } catch {
      meta = undefined;
    }
    const runId = meta?.runId ?? 'unknown';
    const caller = deps.auth.verify(req.headers.authorization);
    // The gateway relays a refusal as it is: it names the run (`run_id`) only once one was recorded.
    if (!caller) {
      refuseOnSocket(socket, answer(new FerryError('FERRY_CLUSTER_UNAUTHENTICATED'), { requestId: runId }));
      return;
    }
    if (req.url !== WORKER_PATHS.session || !meta) {
      refuseOnSocket(socket, answer(new FerryError('FERRY_VALIDATION', 'not a session call'), { requestId: runId }));
      return;
    }
    const leave = deps.callers?.enter(`${meta.projectId}/${meta.appId}`, caller.nodeId);
    socket.once('close', () => leave?.());
    const call = { recorded: false };
    void session(meta, socket, head, call).catch((err: unknown) => {
      if (!(err instanceof FerryError)) logger.error({ err, runId }, 'internal session failed');
      if (!socket.destroyed) refuseOnSocket(socket, answer(err, call.recorded ? { runId } : { requestId: runId }));
    });
  });

  async function session(meta: CallMeta, socket: Socket, head: Buffer, call: { recorded: boolean }): Promise<void> {
    const build = await builds.get(meta);
    const gone = new AbortController();
    socket.once('close', () => gone.abort(new Error('gateway went away')));
    let answered = false;
    await deps.invoker
      .invokeSession(
        {
          runId: meta.runId,
          build,
          fn: meta.fn,
          mode: 'stream',
          signal: gone.signal,
          noDeadline: true,
          onRecorded: () => {
            call.recorded = true;
          },
        },
        // What the gateway sent after the tunnel's own head: the caller's request, then its bytes.
        (replica, signal) =>
          tunnel(socket, replica, signal, {
            head,
            onAnswered: () => {
              answered = true;
            },
          }),
      )
      .catch((err: unknown) => {
        if (answered || socket.destroyed) return;
        throw err;
      });
  }

  return {
    server,
    async close() {
      await new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeIdleConnections();
      });
    },
  };
}

/** Aborted when the gateway goes away before the answer is complete (its caller went away, or it died). */
const GATEWAY_GONE = new Error('gateway went away');

/** The run's abort (run-abort.ts), aborted when the gateway closes the call before its answer ended. */
function goneAbort(res: ServerResponse): RunAbort {
  const gone = new RunAbort();
  res.on('close', () => {
    if (!res.writableFinished) gone.abort(GATEWAY_GONE);
  });
  return gone;
}

/** A call that failed before its answer began: the error answer (http/answer.ts); one under way is cut. */
function answerError(res: ServerResponse, err: unknown): void {
  writeAnswer(res, answer(err));
}

function sendJson(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const text = JSON.stringify(body);
  res.writeHead(status, {
    ...headers,
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(text),
  });
  res.end(text);
}

/** Reads the call line; `rest` is what came after it in the same chunk. The request is left paused. */
function readMeta(req: IncomingMessage): Promise<{ meta: CallMeta; rest: Buffer }> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const cleanup = () => {
      req.removeListener('data', onData);
      req.removeListener('end', onEnd);
      req.removeListener('error', onError);
    };
    const fail = (err: unknown) => {
      cleanup();
      reject(err);
    };
    function onData(chunk: Buffer): void {
      const nl = chunk.indexOf(10);
      if (nl < 0) {
        chunks.push(chunk);
        size += chunk.length;
        if (size > MAX_META_BYTES) fail(new FerryError('FERRY_BODY_TOO_LARGE', 'the call line is too long'));
        return;
      }
      req.pause();
      cleanup();
      chunks.push(chunk.subarray(0, nl));
      let parsed: unknown;
      try {
        parsed = JSON.parse(Buffer.concat(chunks).toString('utf8'));
      } catch {
        reject(new FerryError('FERRY_INVALID_JSON', 'the call line is not JSON'));
        return;
      }
      const meta = parseCallMeta(parsed);
      if (!meta) reject(new FerryError('FERRY_VALIDATION', 'the call line is not a valid call'));
      else resolve({ meta, rest: chunk.subarray(nl + 1) });
    }
    function onEnd(): void {
      fail(new FerryError('FERRY_VALIDATION', 'the body has no call line'));
    }
    function onError(err: unknown): void {
      fail(err);
    }
    req.on('data', onData);
    req.once('end', onEnd);
    req.once('error', onError);
  });
}

/** A cortex call's whole body (bounded): the call line, then the arguments. */
function readCall(req: IncomingMessage, limit: number): Promise<{ meta: CallMeta; body: Buffer }> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    req.on('data', (chunk: Buffer) => {
      size += chunk.length;
      if (size > limit + MAX_META_BYTES) {
        req.destroy();
        reject(new FerryError('FERRY_BODY_TOO_LARGE'));
        return;
      }
      chunks.push(chunk);
    });
    req.once('error', reject);
    req.once('end', () => {
      const all = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks);
      const nl = all.indexOf(10);
      if (nl < 0) {
        reject(new FerryError('FERRY_VALIDATION', 'the body has no call line'));
        return;
      }
      let meta: CallMeta | undefined;
      try {
        meta = parseCallMeta(JSON.parse(all.subarray(0, nl).toString('utf8')));
      } catch {
        reject(new FerryError('FERRY_INVALID_JSON', 'the call line is not JSON'));
        return;
      }
      if (!meta) reject(new FerryError('FERRY_VALIDATION', 'the call line is not a valid call'));
      else resolve({ meta, body: all.subarray(nl + 1) });
    });
  });
}
