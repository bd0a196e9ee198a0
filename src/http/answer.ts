/**
 * The one error answer, the way hono's `onError` and h3's `errorResponse` are one function: `answer`
 * turns anything thrown into the status, headers and body Ferry answers with (docs/errors.md), and thin
 * writers put that answer on each kind of connection Ferry has: a Fastify reply, a raw Node response (the
 * run endpoint's fast path, the custom-runtime proxy, the worker API), a socket that asked to upgrade or
 * that Node's HTTP parser refused, a server-sent event, and a line of the worker protocol. No other module
 * builds the envelope `{"error": {"code", "message", …}}` (with `run_id` when the run endpoint's call
 * became a run).
 *
 * What it maps: a FerryError keeps its code, status and headers; Fastify's own errors (validation, content
 * type, body size, bad JSON, bad URL) become the matching Ferry code; a store that cannot be reached is
 * 503 FERRY_STORE_UNAVAILABLE with Retry-After, and a write refused for lack of space (SQLITE_FULL,
 * PostgreSQL's 53100, ENOSPC, EDQUOT: disk-space.ts) is 507 FERRY_STORAGE_FULL with Retry-After (both also
 * when a run's code wrapped them in FERRY_INTERNAL); anything else is FERRY_INTERNAL, whose body says
 * nothing about the cause (the caller logs it).
 */
import { type ServerResponse, STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import { isStorageFull, storageFull } from '../disk-space.js';
import { type ErrorCode, FerryError } from '../errors.js';
import { isStoreUnavailable } from '../store/index.js';
import { acceptedType, bodyTooLarge, unsupportedMediaType } from './body-parsers.js';

const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_INVALID_MEDIA_TYPE: 'FERRY_UNSUPPORTED_MEDIA_TYPE',
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: 'FERRY_VALIDATION',
  FST_ERR_CTP_BODY_TOO_LARGE: 'FERRY_BODY_TOO_LARGE',
  FST_ERR_CTP_EMPTY_JSON_BODY: 'FERRY_INVALID_JSON',
  FST_ERR_CTP_INVALID_JSON_BODY: 'FERRY_INVALID_JSON',
  FST_ERR_CTP_INVALID_TYPE: 'FERRY_VALIDATION',
  FST_ERR_BAD_URL: 'FERRY_BAD_URL',
};

/** Seconds a caller is asked to wait after a store outage: about what a database restart or failover takes. */
const STORE_RETRY_AFTER_S = '5';
const JSON_TYPE = 'application/json; charset=utf-8';

/**
 * Maps any thrown value to a FerryError (internal errors become FERRY_INTERNAL). With the request, a 415
 * names the type the route takes and a 413 states the route's limit. A store that cannot be reached, even
 * when a run's code wrapped it in FERRY_INTERNAL, is FERRY_STORE_UNAVAILABLE; a write refused for lack of
 * space, likewise, FERRY_STORAGE_FULL.
 */
export function toFerryError(err: unknown, request?: FastifyRequest): FerryError {
  if (err instanceof FerryError) {
    if (err.code !== 'FERRY_INTERNAL') return err;
    if (!isStoreUnavailable(err.cause) && !isStorageFull(err.cause)) return err;
  }
  if (isStoreUnavailable(err)) {
    return new FerryError('FERRY_STORE_UNAVAILABLE', undefined, {
      cause: err,
      headers: { 'retry-after': STORE_RETRY_AFTER_S },
    });
  }
  if (isStorageFull(err)) return storageFull(err);
  const fe = err as Partial<FastifyError> & { validation?: unknown; statusCode?: number };
  if (fe && typeof fe === 'object') {
    if (fe.validation)
      return new FerryError('FERRY_VALIDATION', `Invalid request: ${fe.message ?? 'validation failed'}`);
    const mapped = fe.code ? FASTIFY_CODES[fe.code] : undefined;
    if (mapped === 'FERRY_UNSUPPORTED_MEDIA_TYPE') {
      return unsupportedMediaType(request?.headers['content-type'], request ? acceptedType(request) : undefined);
    }
    if (mapped === 'FERRY_BODY_TOO_LARGE' && request?.routeOptions.bodyLimit) {
      return bodyTooLarge(request.routeOptions.bodyLimit);
    }
    if (mapped === 'FERRY_BAD_URL') {
      return new FerryError(mapped, 'The request URL is not valid: a %-escape does not decode to UTF-8');
    }
    if (mapped) return new FerryError(mapped);
    // JSON.parse errors from the body parser arrive as SyntaxError with status 400.
    if (err instanceof SyntaxError && fe.statusCode === 400) return new FerryError('FERRY_INVALID_JSON');
    if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
      return new FerryError(fe.statusCode === 413 ? 'FERRY_BODY_TOO_LARGE' : 'FERRY_VALIDATION', fe.message);
    }
  }
  return new FerryError('FERRY_INTERNAL', undefined, { cause: err });
}

/** The error member of the envelope: the code, the message and the error's public details (never its cause). */
export type ErrorObject = { code: ErrorCode; message: string } & Record<string, string>;

/** The body of every error answer. */
export interface ErrorEnvelope {
  error: ErrorObject;
  /**
   * The run endpoint's errors of a call that became a run (recorded: `GET …/runs/{run_id}` finds it): its
   * id, as the response's `X-Request-Id`. A call refused before any run existed has none.
   */
  run_id?: string;
}

/** An error as Ferry answers it, whatever the connection. */
export interface ErrorAnswer {
  /** The error answered (its code for logs and metrics). */
  error: FerryError;
  status: number;
  /** The error's own headers (such as Retry-After), the content type, and `x-request-id` on the run endpoint. */
  headers: Record<string, string>;
  /** The envelope as JSON. */
  body: string;
}

/** The envelope's `error` member of a FerryError: its public members (FerryError.toJSON). */
export function errorObject(ferry: FerryError): ErrorObject {
  return ferry.toJSON();
}

/**
 * The answer to anything thrown: see the module comment. On the run endpoint, `requestId` is the call's id,
 * answered as `x-request-id` whatever happened; `runId`, given only once the call became a run (recorded:
 * `GET …/runs/{id}` finds it), adds `run_id` to the body as well. A call refused before any run existed
 * (401, 404, 415, …) so never names a run that does not exist (issue 43), and still has its request id for
 * the logs. `request` lets Fastify's content-type and size errors name what the route takes.
 *
 * @example
 *   const { status, headers, body } = answer(new FerryError('FERRY_APP_NOT_FOUND'));
 */
export function answer(
  err: unknown,
  options: { requestId?: string | undefined; runId?: string | undefined; request?: FastifyRequest } = {},
): ErrorAnswer {
  const ferry = toFerryError(err, options.request);
  const envelope: ErrorEnvelope = { error: errorObject(ferry) };
  const headers: Record<string, string> = { ...ferry.headers, 'content-type': JSON_TYPE };
  const requestId = options.runId ?? options.requestId;
  if (requestId !== undefined) headers['x-request-id'] = requestId;
  if (options.runId !== undefined) envelope.run_id = options.runId;
  return { error: ferry, status: ferry.status, headers, body: JSON.stringify(envelope) };
}

/** The answer's headers less an `x-request-id` the response has already (a stream resumed names its run). */
function headersFor(answered: ErrorAnswer, has: (name: string) => boolean): Record<string, string> {
  if (answered.headers['x-request-id'] === undefined || !has('x-request-id')) return answered.headers;
  const { 'x-request-id': _, ...rest } = answered.headers;
  return rest;
}

/** Sends the answer on a Fastify reply. */
export function replyWithAnswer(reply: FastifyReply, answered: ErrorAnswer): void {
  void reply
    .code(answered.status)
    .headers(headersFor(answered, (name) => reply.hasHeader(name)))
    .send(answered.body);
}

/**
 * Writes the answer on a raw Node response. A response already under way cannot become an error: it is cut
 * (the caller sees it break); one already ended or gone is left alone.
 */
export function writeAnswer(res: ServerResponse, answered: ErrorAnswer): void {
  if (res.destroyed || res.writableEnded) return;
  if (res.headersSent) {
    res.destroy();
    return;
  }
  res.writeHead(answered.status, {
    ...headersFor(answered, (name) => res.hasHeader(name)),
    'content-length': String(Buffer.byteLength(answered.body)),
  });
  res.end(answered.body);
}

/**
 * Writes the answer on a socket as an HTTP/1.1 response (a WebSocket upgrade refused, or a request Node's
 * parser refused before Fastify saw it), then closes the socket once it is written.
 */
export function refuseOnSocket(socket: Socket, answered: ErrorAnswer): void {
  if (socket.destroyed) return;
  if (socket.writable) {
    let head = `HTTP/1.1 ${answered.status} ${STATUS_CODES[answered.status] ?? 'Error'}\r\n`;
    for (const [name, value] of Object.entries(answered.headers)) head += `${name}: ${value}\r\n`;
    socket.write(
      `${head}content-length: ${Buffer.byteLength(answered.body)}\r\nconnection: close\r\n\r\n${answered.body}`,
    );
  }
  socket.destroySoon();
}

/**
 * The data of a run stream's `error` event (an SSE comment or named event, http/routes/run.ts): the run's
 * id first, then the error, as `{"run_id", "error"}`.
 */
export function errorEventData(err: unknown, runId: string): string {
  return JSON.stringify({ run_id: runId, error: errorObject(toFerryError(err)) });
}

/** A line of the worker protocol (http/worker-api.ts) telling the gateway how its call failed. */
export interface WorkerErrorLine {
  e: 'error';
  error: ErrorObject;
  status: number;
  headers: Record<string, string>;
}

/** The worker protocol's error line for anything thrown (read back by runs/remote-invoker.ts). */
export function workerErrorLine(err: unknown): WorkerErrorLine {
  const ferry = toFerryError(err);
  return { e: 'error', error: errorObject(ferry), status: ferry.status, headers: ferry.headers };
}
