/**
 * The gateway's invoker (`ferry serve --role gateway`): the same Invoker interface the run routes use on
 * one process, but each call goes over HTTP to a worker's internal listener (http/worker-api.ts), which
 * runs it with its own invoker and records it. The gateway runs no user code and records nothing itself.
 *
 * Placement (cluster/placement.ts): the live workers (cluster/workers.ts) in rendezvous order of the app,
 * those without room moved back, so an app's warm replicas are reused and a full worker spills over.
 * A worker that refuses the connection is marked down and the next one is tried: nothing was sent, so
 * nothing ran. A worker lost once the call was sent fails the call with FERRY_WORKER_LOST (it may have
 * started); no worker at all answers FERRY_NO_WORKERS.
 */
import net from 'node:net';
import { Readable } from 'node:stream';
import { StringDecoder } from 'node:string_decoder';
import tls from 'node:tls';
import type { Logger } from 'pino';
import { type Dispatcher, Pool } from 'undici';
import type { ClusterAuth } from '../cluster/cluster-auth.js';
import { placeCall, withOwnCalls } from '../cluster/placement.js';
import {
  type CallMeta,
  callLine,
  doneEvent,
  parseLine,
  sessionRequestHead,
  WORKER_PATHS,
} from '../cluster/protocol.js';
import type { WorkerAnnouncement, WorkerDirectory } from '../cluster/workers.js';
import { ERRORS, type ErrorCode, FerryError } from '../errors.js';
import type {
  HttpBodySink,
  HttpInvokeRequest,
  InvokeRequest,
  InvokeResult,
  Invoker,
  RunRequestBase,
} from './invoke.js';
import { DEFAULT_CALLER_STALL_MS } from './invoke.js';

export interface RemoteInvokerDeps {
  directory: WorkerDirectory;
  auth: ClusterAuth;
  /** This gateway's node id, as workers count its calls in their announcements. */
  nodeId: string;
  logger: Logger;
  /** How long a caller may leave its response full before it is cut (FERRY_CALLER_STALL_SECONDS). */
  callerStallMs?: number;
}

export interface RemoteInvoker extends Invoker {
  /** Calls this gateway has in flight on each worker (for `GET /v2/cluster` and placement). */
  inflight(): Map<string, number>;
  close(): Promise<void>;
}

/** Connection failures that prove nothing was sent: the call may go to another worker. */
const NOT_CONNECTED = new Set([
  'ECONNREFUSED',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'UND_ERR_CONNECT_TIMEOUT',
]);

function notConnected(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return typeof code === 'string' && NOT_CONNECTED.has(code);
}

export function createRemoteInvoker(deps: RemoteInvokerDeps): RemoteInvoker {
  const { directory, auth, logger } = deps;
  const stallMs = deps.callerStallMs ?? DEFAULT_CALLER_STALL_MS;
  const pools = new Map<string, Pool>();
  const inflight = new Map<string, number>();
  const appInflight = new Map<string, number>();

  function poolFor(url: string): Pool {
    let pool = pools.get(url);
    if (!pool) {
      pool = new Pool(url, {
        connections: 256,
        keepAliveTimeout: 30_000,
        headersTimeout: 0,
        bodyTimeout: 0,
        connectTimeout: 2_000,
      });
      pools.set(url, pool);
    }
    return pool;
  }

  /**
   * Workers to try, in order, for the app of `request`. An announcement is up to a second old: of its
   * calls in flight, the other gateways' part is taken as announced and this gateway's own part is what it
   * has in flight now, so a burst spreads and a worker that just freed slots is seen to have room.
   */
  function candidates(request: RunRequestBase): WorkerAnnouncement[] {
    const appKey = `${request.build.projectId}/${request.build.appId}`;
    const live = directory.live().map((w) =>
      withOwnCalls(w, appKey, {
        nodeId: deps.nodeId,
        mine: appInflight.get(`${w.id}\0${appKey}`) ?? 0,
        mineOnWorker: inflight.get(w.id) ?? 0,
        scaling: request.build.config.scaling,
      }),
    );
    return placeCall(appKey, live, { maxReplicas: request.build.config.scaling.max_replicas });
  }

  /** Sends the call to the first worker that takes the connection; counts it in flight until `done`. */
  async function dispatch<T>(request: RunRequestBase, send: (worker: WorkerAnnouncement) => Promise<T>): Promise<T> {
    const appKey = `${request.build.projectId}/${request.build.appId}`;
    const tried = new Set<string>();
    for (let attempt = 0; attempt < 8; attempt++) {
      const worker = candidates(request).find((w) => !tried.has(w.id));
      if (!worker) break;
      tried.add(worker.id);
      const key = `${worker.id}\0${appKey}`;
      inflight.set(worker.id, (inflight.get(worker.id) ?? 0) + 1);
      appInflight.set(key, (appInflight.get(key) ?? 0) + 1);
      try {
        return await send(worker);
      } catch (err) {
        if (err instanceof NotConnected) {
          logger.warn({ worker: worker.id, url: worker.url, err: err.cause }, 'worker unreachable; trying another');
          directory.markDown(worker.id);
          continue;
        }
        throw err;
      } finally {
        const n = (inflight.get(worker.id) ?? 1) - 1;
        if (n > 0) inflight.set(worker.id, n);
        else inflight.delete(worker.id);
        const m = (appInflight.get(key) ?? 1) - 1;
        if (m > 0) appInflight.set(key, m);
        else appInflight.delete(key);
      }
    }
    throw new FerryError('FERRY_NO_WORKERS', undefined, { headers: { 'retry-after': '1' } });
  }

  function metaOf(request: RunRequestBase): CallMeta {
    return {
      v: 1,
      runId: request.runId,
      projectId: request.build.projectId,
      appId: request.build.appId,
      buildId: request.build.buildId,
      fn: request.fn,
      mode: request.mode,
      ...(request.webhookUrl ? { webhookUrl: request.webhookUrl } : {}),
      ...(request.webhookSecret ? { webhookSecret: request.webhookSecret } : {}),
    };
  }

  /** One POST to a worker; connection failures become NotConnected, a caller gone its own abort reason. */
  async function post(
    worker: WorkerAnnouncement,
    path: string,
    body: Buffer | Readable,
    signal: AbortSignal | undefined,
  ): Promise<Dispatcher.ResponseData> {
    try {
      const res = await poolFor(worker.url).request({
        method: 'POST',
        path,
        headers: { authorization: auth.header(), 'content-type': 'application/octet-stream' },
        body,
        ...(signal ? { signal } : {}),
      });
      if (res.statusCode !== 200) {
        const text = await res.body.text().catch(() => '');
        // Refused before the answer began: the envelope is the body and its headers (Retry-After of a 503)
        // are the response's; they were lost here (test/contract-invoker.test.ts).
        throw errorFromWorker(withHeaders(parseLine(text), res.headers), res.statusCode);
      }
      return res;
    } catch (err) {
      if (signal?.aborted) throw signal.reason;
      if (err instanceof FerryError) throw err;
      if (notConnected(err)) throw new NotConnected(err);
      throw new FerryError('FERRY_WORKER_LOST', undefined, { cause: err });
    }
  }

  return {
    inflight: () => new Map(inflight),

    // A gateway runs nothing: the worker running the run cancels it (the change feed's run.cancel).
    cancel: () => false,

    invoke(given: InvokeRequest): Promise<InvokeResult> {
      const request = withSignal(given);
      const body = Buffer.concat([callLine(metaOf(request)), request.body]);
      return dispatch(request, async (worker) => {
        const res = await post(worker, WORKER_PATHS.invoke, body, request.signal);
        // The worker answers 200 only once its invoker took the call, which records the run first.
        request.onRecorded?.();
        try {
          // A sync call's answer is one line: read it whole, without the line splitter's iterator.
          const events = request.mode === 'stream' ? lines(res.body) : oneLine(res.body);
          for await (const event of events) {
            if (event.e === 'started') request.onStarted?.();
            else if (event.e === 'item') {
              request.onItem?.(event.d);
              // The caller is full: the worker's answer is not read meanwhile, so the worker holds its run.
              const flow = request.flow;
              if (flow?.blocked) await new Promise<void>((ready) => flow.whenReady(ready));
            } else if (event.e === 'done') {
              return {
                result: event.result,
                ...(typeof event.resultJson === 'string' ? { resultJson: event.resultJson } : {}),
                streamed: event.streamed === true,
                runTimeMs: Number(event.runTimeMs) || 0,
                coldStart: event.coldStart === true,
                statusCode: Number(event.statusCode) || 200,
              };
            } else if (event.e === 'error') throw errorFromWorker(event, Number(event.status) || 500);
          }
        } catch (err) {
          if (err instanceof FerryError) throw err;
          if (request.signal?.aborted) throw request.signal.reason;
          throw new FerryError('FERRY_WORKER_LOST', undefined, { cause: err });
        }
        throw new FerryError('FERRY_WORKER_LOST', 'The worker ended the call without a result');
      });
    },

    invokeHttp(given: HttpInvokeRequest): Promise<InvokeResult> {
      const request = withSignal(given);
      const http = request.http;
      const meta: CallMeta = {
        ...metaOf(request),
        http: { method: http.method, path: http.path, headers: http.headers, hasBody: http.body !== null },
        input: request.input ?? null,
      };
      const line = callLine(meta);
      const started = Date.now();
      return dispatch(request, async (worker) => {
        const res = await post(
          worker,
          WORKER_PATHS.http,
          Readable.from(bodyOf(line, http.body), { objectMode: false }),
          request.signal,
        );
        // As for `invoke`: a 200 comes once the worker's invoker took the call, which records the run.
        request.onRecorded?.();
        let statusCode = 0;
        let sink: HttpBodySink | undefined;
        let pending: Buffer = Buffer.alloc(0);
        try {
          for await (const chunk of res.body as AsyncIterable<Buffer>) {
            if (statusCode === 0) {
              pending = pending.length ? Buffer.concat([pending, chunk]) : chunk;
              const nl = pending.indexOf(10);
              if (nl < 0) {
                if (pending.length > 1024 * 1024) throw new Error('the answer head is too long');
                continue;
              }
              const head = parseLine(pending.subarray(0, nl).toString('utf8')) as Record<string, unknown> | undefined;
              if (!head || head.e === 'error') throw errorFromWorker(head, Number(head?.status) || 502);
              statusCode = Number(head.status) || 502;
              sink = request.onResponse?.({
                statusCode,
                headers: (head.headers ?? {}) as Record<string, string | string[] | undefined>,
              });
              const rest = pending.subarray(nl + 1);
              pending = Buffer.alloc(0);
              if (rest.length > 0 && sink && !sink.write(rest)) await drained(sink, request.signal, stallMs);
              continue;
            }
            if (sink && !sink.write(chunk)) await drained(sink, request.signal, stallMs);
          }
        } catch (err) {
          if (!res.body.destroyed) res.body.destroy();
          if (err instanceof FerryError) throw err;
          if (request.signal?.aborted) throw request.signal.reason;
          throw new FerryError('FERRY_WORKER_LOST', undefined, { cause: err });
        }
        if (statusCode === 0) throw new FerryError('FERRY_WORKER_LOST', 'The worker ended the call without an answer');
        sink?.end();
        return { result: null, streamed: false, runTimeMs: Date.now() - started, coldStart: false, statusCode };
      });
    },

    invokeSession(given, session) {
      // Never `onRecorded` here: the tunnel is open before the worker says anything, and a worker's answer
      // that refuses the session is relayed to the caller as the worker wrote it (with its run_id, if any).
      const request = withSignal(given);
      const meta = metaOf(request);
      const started = Date.now();
      const signal = request.signal ?? new AbortController().signal;
      return dispatch(request, async (worker) => {
        const socket = await connectTunnel(worker.url, meta, auth.header());
        // The session waits for `connect` on what `connect()` returns: the tunnel is already open.
        const replica = {
          connect() {
            queueMicrotask(() => socket.emit('connect'));
            return socket;
          },
        };
        const statusCode = await session(replica as never, signal, request.runId);
        return { result: null, streamed: false, runTimeMs: Date.now() - started, coldStart: false, statusCode };
      });
    },

    async close() {
      await Promise.allSettled([...pools.values()].map((p) => p.close()));
      pools.clear();
    },
  };
}

class NotConnected extends Error {
  constructor(cause: unknown) {
    super('the worker could not be reached', { cause });
  }
}

/** Opens a TCP (or TLS) connection to the worker and sends the tunnel's head; the rest is the caller's. */
function connectTunnel(workerUrl: string, meta: CallMeta, authorization: string): Promise<net.Socket> {
  const url = new URL(workerUrl);
  const port = Number(url.port) || (url.protocol === 'https:' ? 443 : 80);
  return new Promise((resolve, reject) => {
    const socket =
      url.protocol === 'https:'
        ? tls.connect({ host: url.hostname, port, servername: url.hostname })
        : net.connect({ host: url.hostname, port });
    const onError = (err: Error) => {
      socket.destroy();
      reject(
        notConnected(err) ? new NotConnected(err) : new FerryError('FERRY_WORKER_LOST', undefined, { cause: err }),
      );
    };
    socket.once('error', onError);
    const timer = setTimeout(
      () => onError(Object.assign(new Error('connect timeout'), { code: 'UND_ERR_CONNECT_TIMEOUT' })),
      2_000,
    );
    socket.once(url.protocol === 'https:' ? 'secureConnect' : 'connect', () => {
      clearTimeout(timer);
      socket.removeListener('error', onError);
      socket.write(sessionRequestHead(url.host, authorization, meta));
      resolve(socket as net.Socket);
    });
  });
}

/** The call line, then the request body to forward (bytes or a stream). */
async function* bodyOf(line: Buffer, body: Readable | Buffer | null): AsyncGenerator<Buffer> {
  yield line;
  if (body === null) return;
  if (Buffer.isBuffer(body)) {
    if (body.length > 0) yield body;
    return;
  }
  for await (const chunk of body as AsyncIterable<Buffer>) yield chunk;
}

/** A sync call's answer: one event (or none, if the worker went away). */
async function* oneLine(body: Dispatcher.ResponseData['body']): AsyncGenerator<Record<string, unknown>> {
  const event = doneEvent(await body.text());
  if (event && typeof event === 'object') yield event as Record<string, unknown>;
}

/**
 * The events of an NDJSON answer, as they arrive. Linear: an unfinished line's pieces are kept in a list
 * and joined once its newline comes (a long item is not searched and copied again for every chunk).
 */
async function* lines(body: AsyncIterable<Buffer>): AsyncGenerator<Record<string, unknown>> {
  let pending: string[] = [];
  // A character split between two chunks is joined, not replaced.
  const decoder = new StringDecoder('utf8');
  for await (const chunk of body) {
    const text = decoder.write(chunk);
    let start = 0;
    let nl = text.indexOf('\n');
    while (nl >= 0) {
      pending.push(text.slice(start, nl));
      const line = pending.length === 1 ? pending[0]! : pending.join('');
      pending = [];
      start = nl + 1;
      const event = parseLine(line);
      if (event && typeof event === 'object') yield event as Record<string, unknown>;
      nl = text.indexOf('\n', start);
    }
    if (start < text.length) pending.push(text.slice(start));
  }
}

/** An error envelope with the headers of the response it came in that a caller is answered with. */
function withHeaders(envelope: unknown, headers: Dispatcher.ResponseData['headers']): unknown {
  const retryAfter = headers['retry-after'];
  if (typeof retryAfter !== 'string' || !envelope || typeof envelope !== 'object') return envelope;
  const own = (envelope as { headers?: Record<string, unknown> }).headers;
  return { ...envelope, headers: { 'retry-after': retryAfter, ...own } };
}

/** The worker's coded error as this gateway's own (an unknown code, from another version: internal). */
function errorFromWorker(value: unknown, status: number): FerryError {
  const v = (value ?? {}) as { error?: Record<string, unknown>; headers?: Record<string, unknown> };
  const error = v.error ?? {};
  const code = typeof error.code === 'string' && error.code in ERRORS ? (error.code as ErrorCode) : undefined;
  // The worker refused this gateway's signature: the keys differ (a misconfigured cluster), not the caller's fault.
  if (code === 'FERRY_CLUSTER_UNAUTHENTICATED') {
    return new FerryError('FERRY_INTERNAL', 'A worker refused this gateway: check that they share the keys directory');
  }
  if (!code) {
    return new FerryError(status >= 500 ? 'FERRY_WORKER_LOST' : 'FERRY_INTERNAL', undefined, {
      cause: new Error(`the worker answered ${status}`),
    });
  }
  const details: Record<string, string> = {};
  for (const [k, val] of Object.entries(error)) {
    if (k !== 'code' && k !== 'message' && typeof val === 'string') details[k] = val;
  }
  const headers: Record<string, string> = {};
  for (const [k, val] of Object.entries(v.headers ?? {})) if (typeof val === 'string') headers[k] = val;
  return new FerryError(code, typeof error.message === 'string' ? error.message : undefined, { details, headers });
}

/** Waits until the caller's response takes more data (or goes away). */
/** The request with its caller's RunAbort as an AbortSignal too: this invoker's transport takes signals. */
function withSignal<T extends RunRequestBase>(request: T): T {
  return request.abort && !request.signal ? { ...request, signal: request.abort.signal } : request;
}

/** Waits until the caller's response takes more; a caller that takes nothing for `stallMs` is cut. */
function drained(sink: HttpBodySink, signal: AbortSignal | undefined, stallMs: number): Promise<void> {
  if (sink.destroyed) return Promise.reject(signal?.reason ?? new Error('the caller went away'));
  return new Promise((resolve) => {
    // Cut: its close ends the wait, and the caller's abort ends the call as a caller gone away.
    const stall = setTimeout(() => sink.destroy(), stallMs);
    stall.unref();
    const done = () => {
      clearTimeout(stall);
      sink.removeListener('drain', done);
      sink.removeListener('close', done);
      resolve();
    };
    sink.once('drain', done);
    sink.once('close', done);
  });
}
