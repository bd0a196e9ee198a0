/**
 * Turns anything a route throws into Ferry's error body. Known errors keep their code and status;
 * Fastify's own errors (validation, content type, body size, bad JSON) become the matching Ferry code;
 * anything else is a logged 500 whose body says nothing about the cause.
 */
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import { type ErrorCode, FerryError } from '../errors.js';

const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_INVALID_MEDIA_TYPE: 'FERRY_UNSUPPORTED_MEDIA_TYPE',
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: 'FERRY_VALIDATION',
  FST_ERR_CTP_BODY_TOO_LARGE: 'FERRY_BODY_TOO_LARGE',
  FST_ERR_CTP_EMPTY_JSON_BODY: 'FERRY_INVALID_JSON',
  FST_ERR_CTP_INVALID_JSON_BODY: 'FERRY_INVALID_JSON',
  FST_ERR_CTP_INVALID_TYPE: 'FERRY_VALIDATION',
};

/** Maps any thrown value to a FerryError (internal errors become FERRY_INTERNAL). */
export function toFerryError(err: unknown): FerryError {
  if (err instanceof FerryError) return err;
  const fe = err as Partial<FastifyError> & { validation?: unknown; statusCode?: number };
  if (fe && typeof fe === 'object') {
    if (fe.validation)
      return new FerryError('FERRY_VALIDATION', `Invalid request: ${fe.message ?? 'validation failed'}`);
    const mapped = fe.code ? FASTIFY_CODES[fe.code] : undefined;
    if (mapped === 'FERRY_UNSUPPORTED_MEDIA_TYPE') {
      return new FerryError(mapped, 'Unsupported Content-Type for this route');
    }
    if (mapped === 'FERRY_INVALID_JSON') return new FerryError(mapped);
    if (mapped) return new FerryError(mapped);
    // JSON.parse errors from the body parser arrive as SyntaxError with status 400.
    if (err instanceof SyntaxError && fe.statusCode === 400) return new FerryError('FERRY_INVALID_JSON');
    if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
      return new FerryError(fe.statusCode === 413 ? 'FERRY_BODY_TOO_LARGE' : 'FERRY_VALIDATION', fe.message);
    }
  }
  return new FerryError('FERRY_INTERNAL', undefined, { cause: err });
}

export function errorHandler(err: unknown, request: FastifyRequest, reply: FastifyReply): void {
  const ferry = toFerryError(err);
  if (ferry.code === 'FERRY_INTERNAL') request.log.error({ err }, 'unhandled error');
  const body: Record<string, unknown> = ferry.toJSON();
  const runId = (request as { runId?: string }).runId;
  if (runId) body.run_id = runId;
  void reply.code(ferry.status).headers(ferry.headers).type('application/json; charset=utf-8').send(body);
}
