/**
 * Ferry's errors as classes: every answer Ferry refuses carries a stable code (`FERRY_APP_NOT_FOUND`,
 * docs/errors.md), kept here with the HTTP status, the message and the run id when there is one. The
 * client's own codes start `FERRY_CLIENT_`.
 */

export interface FerryErrorInit {
  status?: number | undefined;
  runId?: string | undefined;
  retryAfter?: number | undefined;
  details?: Record<string, unknown> | undefined;
}

export class FerryError extends Error {
  readonly code: string;
  readonly status: number | undefined;
  readonly runId: string | undefined;
  /** Seconds to wait before trying again, when Ferry said (`Retry-After`). */
  readonly retryAfter: number | undefined;
  /** The other members of Ferry's `error` object (`type` of a function's exception, …). */
  readonly details: Record<string, unknown>;

  constructor(code: string, message: string, init: FerryErrorInit = {}) {
    super(`${code}: ${message}`);
    this.name = new.target.name;
    this.code = code;
    this.status = init.status;
    this.runId = init.runId;
    this.retryAfter = init.retryAfter;
    this.details = init.details ?? {};
  }
}

/** 401 or 403: the token is missing, wrong, expired, or lacks the scope. */
export class AuthError extends FerryError {}
/** 404: no such project, app, function or run. */
export class NotFoundError extends FerryError {}
/** Another 4xx: the request itself is wrong (bad JSON, a bad webhook URL, …). */
export class InvalidRequestError extends FerryError {}
/** 429 or 503: try again later (`retryAfter` says when, if Ferry said). */
export class UnavailableError extends FerryError {}
/** The run ran and did not succeed: the function threw, timed out, or was cancelled. */
export class RunFailedError extends FerryError {}
/** Ferry could not be reached, or the connection broke (`FERRY_CLIENT_CONNECTION`). */
export class FerryConnectionError extends FerryError {}

/** The error for an answer with `status` and its parsed body. */
export function errorFor(status: number, body: unknown, runId?: string, retryAfter?: number): FerryError {
  const envelope = typeof body === 'object' && body !== null ? (body as Record<string, unknown>) : {};
  const error =
    typeof envelope.error === 'object' && envelope.error !== null ? (envelope.error as Record<string, unknown>) : null;
  const code = typeof error?.code === 'string' ? error.code : 'FERRY_CLIENT_UNEXPECTED_ANSWER';
  const message = error ? String(error.message ?? '') : `HTTP ${status} without a Ferry error body`;
  const { code: _c, message: _m, ...details } = error ?? {};
  const init: FerryErrorInit = {
    status,
    runId: typeof envelope.run_id === 'string' ? envelope.run_id : runId,
    retryAfter,
    details,
  };
  if (status === 401 || status === 403) return new AuthError(code, message, init);
  if (status === 404) return new NotFoundError(code, message, init);
  if (status === 429 || status === 503) return new UnavailableError(code, message, init);
  if (status >= 400 && status < 500) return new InvalidRequestError(code, message, init);
  if (code === 'FERRY_FUNCTION_ERROR' || code === 'FERRY_RUN_TIMEOUT' || status === 504) {
    return new RunFailedError(code, message, init);
  }
  return new FerryError(code, message, init);
}
