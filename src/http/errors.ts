/**
 * Turns anything a route throws into Ferry's error body. Known errors keep their code and status;
 * Fastify's own errors (validation, content type, body size, bad JSON, bad URL) become the matching Ferry
 * code; a store that cannot be reached is a 503 with Retry-After; anything else is a logged 500 whose body
 * says nothing about the cause.
 */
import { maxHeaderSize, STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyBaseLogger, FastifyError, FastifyReply, FastifyRequest } from 'fastify';
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

/**
 * Maps any thrown value to a FerryError (internal errors become FERRY_INTERNAL). With the request, a 415
 * names the type the route takes and a 413 states the route's limit. A store that cannot be reached, even
 * when a run's code wrapped it in FERRY_INTERNAL, is FERRY_STORE_UNAVAILABLE.
 */
export function toFerryError(err: unknown, request?: FastifyRequest): FerryError {
  if (err instanceof FerryError && !(err.code === 'FERRY_INTERNAL' && isStoreUnavailable(err.cause))) return err;
  if (isStoreUnavailable(err)) {
    return new FerryError('FERRY_STORE_UNAVAILABLE', undefined, {
      cause: err,
      headers: { 'retry-after': STORE_RETRY_AFTER_S },
    });
  }
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

/** Logs what an error answer says about the server: internal errors, the store out of reach, a caller gone. */
export function logError(log: FastifyBaseLogger, ferry: FerryError, err: unknown, runId: string | undefined): void {
  if (ferry.code === 'FERRY_INTERNAL') log.error({ err, runId }, 'unhandled error');
  if (ferry.code === 'FERRY_STORE_UNAVAILABLE') log.warn({ err, runId }, 'the store cannot be reached');
  // The caller hung up on a run: an everyday event, and nobody is left to answer.
  if (ferry.code === 'FERRY_CLIENT_GONE') log.debug({ runId }, 'the caller disconnected before the run ended');
}

/** The one renderer of Ferry's JSON error body for a Fastify reply. */
export function errorHandler(err: unknown, request: FastifyRequest, reply: FastifyReply): void {
  const ferry = toFerryError(err, request);
  const runId = request.runId;
  logError(request.log, ferry, err, runId);
  const body: Record<string, unknown> = ferry.toJSON();
  if (runId) body.run_id = runId;
  void reply.code(ferry.status).headers(ferry.headers).type('application/json; charset=utf-8').send(body);
}

/**
 * Requests Node's HTTP parser refuses before Fastify sees them (not HTTP, headers over the limit, too slow):
 * answered on the socket, in Ferry's shape like every other error, then the connection is closed.
 */
export function clientErrorHandler(err: Error & { code?: string }, socket: Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const ferry =
    err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? new FerryError('FERRY_REQUEST_TIMEOUT')
      : err.code === 'HPE_HEADER_OVERFLOW'
        ? new FerryError(
            'FERRY_HEADERS_TOO_LARGE',
            `The request headers are larger than the limit of ${maxHeaderSize} bytes (all headers together)`,
          )
        : new FerryError('FERRY_BAD_REQUEST');
  const body = JSON.stringify(ferry.toJSON());
  if (socket.writable) {
    socket.write(
      `HTTP/1.1 ${ferry.status} ${STATUS_CODES[ferry.status]}\r\nContent-Type: application/json; charset=utf-8\r\n` +
        `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
    );
  }
  socket.destroy();
}
