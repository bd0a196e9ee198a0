/**
 * Every error Ferry answers, in one place.
 *
 * Each entry has a stable code (never renamed once released), the HTTP status it answers with, and a
 * default message. `docs/errors.md` documents each code; `test/errors-doc.test.ts` fails when the two drift.
 * Error bodies are `{"error": {"code", "message"}}` (run errors add `run_id`), written by http/answer.ts
 * alone; they never carry a stack trace or echo a secret.
 */

export const ERRORS = {
  // Requests in general
  FERRY_ROUTE_NOT_FOUND: { status: 404, message: 'No such route' },
  FERRY_METHOD_NOT_ALLOWED: { status: 405, message: 'Method not allowed on this route' },
  FERRY_VALIDATION: { status: 400, message: 'The request is not valid' },
  FERRY_INVALID_JSON: { status: 400, message: 'The request body is not valid JSON' },
  FERRY_BODY_NOT_OBJECT: { status: 400, message: 'The request body must be a JSON object' },
  FERRY_UNSUPPORTED_MEDIA_TYPE: { status: 415, message: 'Unsupported Content-Type' },
  FERRY_BODY_TOO_LARGE: { status: 413, message: 'The request body is too large' },
  FERRY_BAD_URL: { status: 400, message: 'The request URL is not valid' },
  FERRY_BAD_REQUEST: { status: 400, message: 'The request is not valid HTTP' },
  FERRY_HEADERS_TOO_LARGE: { status: 431, message: 'The request headers are larger than the server allows' },
  FERRY_REQUEST_TIMEOUT: { status: 408, message: 'The request was not received in time' },
  FERRY_INTERNAL: { status: 500, message: 'Internal error' },
  FERRY_STORE_UNAVAILABLE: { status: 503, message: 'The database cannot be reached; retry later' },
  FERRY_ARTIFACTS_UNAVAILABLE: {
    status: 503,
    message: 'The artifact store (NATS JetStream) cannot be reached; retry later',
  },
  FERRY_STORE_BUSY: {
    status: 503,
    message: 'The store is busy: another process holds a lock on the database; retry later',
  },
  FERRY_STORAGE_FULL: {
    status: 507,
    message: 'The server is out of storage space: nothing was written; retry later',
  },

  // Authentication and authorization
  FERRY_UNAUTHENTICATED: { status: 401, message: 'A bearer token is required' },
  FERRY_TOKEN_INVALID: { status: 401, message: 'The token is not valid' },
  FERRY_TOKEN_EXPIRED: { status: 401, message: 'The token has expired' },
  FERRY_TOKEN_REVOKED: { status: 401, message: 'The token has been revoked' },
  FERRY_FORBIDDEN_PROJECT: { status: 403, message: 'The token does not give access to this project' },
  FERRY_MISSING_SCOPE: { status: 403, message: 'The token lacks the scope this request needs' },

  // Resources
  FERRY_PROJECT_NOT_FOUND: { status: 404, message: 'No such project' },
  FERRY_APP_NOT_FOUND: { status: 404, message: 'No such app' },
  FERRY_BUILD_NOT_FOUND: { status: 404, message: 'No such build' },
  FERRY_SERVICE_ACCOUNT_NOT_FOUND: { status: 404, message: 'No such service account' },
  FERRY_BUILD_NOT_CANCELLABLE: { status: 409, message: 'The build has already finished' },
  FERRY_BUILD_NOT_READY: { status: 409, message: 'Only a ready build can be activated' },
  FERRY_BUILD_ACTIVE: { status: 409, message: 'The active build cannot be deleted' },
  FERRY_BUILD_IN_PROGRESS: { status: 409, message: 'The build is still being made: cancel it first' },
  FERRY_SCALING_INVALID: { status: 400, message: 'The scaling settings are not valid' },
  FERRY_SCHEDULE_NOT_FOUND: { status: 404, message: 'No such schedule' },
  FERRY_PROJECT_SCHEDULES_FULL: {
    status: 409,
    message: 'The project would have more schedules than the server allows',
  },

  // App configuration (ferry.toml)
  FERRY_CONFIG_MISSING: { status: 400, message: 'The archive has no ferry.toml at its root' },
  FERRY_CONFIG_INVALID: { status: 400, message: 'ferry.toml is not valid' },
  FERRY_APP_NAME_MISMATCH: { status: 400, message: 'The app name in ferry.toml does not match the app in the path' },

  // Images ([image] in ferry.toml): configuration, pulls of base images, unpacking, the node's cache
  FERRY_IMAGE_CONFIG_INVALID: { status: 400, message: 'The [image] table of ferry.toml is not valid' },
  FERRY_IMAGE_REFERENCE_INVALID: { status: 400, message: 'The image reference is not valid' },
  FERRY_IMAGE_NOT_FOUND: { status: 422, message: 'The registry has no such image' },
  FERRY_IMAGE_REGISTRY_UNREACHABLE: { status: 502, message: 'The image registry cannot be reached' },
  FERRY_IMAGE_REGISTRY_AUTH: {
    status: 422,
    message: 'The image registry refused the pull (credentials missing or refused)',
  },
  FERRY_IMAGE_REGISTRY_BLOCKED: {
    status: 422,
    message: 'The image registry is at an internal address the server may not reach',
  },
  FERRY_IMAGE_DIGEST_MISMATCH: { status: 422, message: 'Image content does not match its digest' },
  FERRY_IMAGE_LAYER_UNSAFE: { status: 422, message: 'An image layer has an entry that cannot be unpacked safely' },
  FERRY_IMAGE_TOO_LARGE: { status: 422, message: 'The image is larger than the server allows' },
  FERRY_IMAGE_UNSUPPORTED: { status: 422, message: 'The image has a format the server does not support' },
  FERRY_IMAGE_CACHE_FULL: {
    status: 503,
    message: 'The images in use on this node leave no room for this image in FERRY_IMAGE_CACHE_MIB',
  },
  FERRY_IMAGE_NO_PYTHON: { status: 422, message: 'The image has no usable python3 (3.9 or newer) for a Python app' },
  FERRY_IMAGE_NO_SANDBOX: {
    status: 422,
    message: 'Apps with [image] need the sandbox (bubblewrap), which this server does not have',
  },
  // Image builds (apt/run steps and Dockerfiles, src/images/image-builder.ts)
  FERRY_IMAGE_STEP_FAILED: { status: 422, message: 'A step of the image build failed' },
  FERRY_IMAGE_BUILD_TIMEOUT: { status: 422, message: 'The image build took longer than the server allows' },
  FERRY_IMAGE_DOCKERFILE_NOT_FOUND: {
    status: 422,
    message: 'The Dockerfile named in ferry.toml is not in the app folder',
  },
  FERRY_IMAGE_DOCKERFILE_INVALID: { status: 422, message: 'The Dockerfile cannot be built' },
  FERRY_IMAGE_ADD_URL_REFUSED: { status: 422, message: 'ADD from a URL is not supported: download in a RUN step' },
  FERRY_IMAGE_CONTEXT_ESCAPE: { status: 422, message: 'A COPY or ADD source is outside the build context' },

  // Uploaded archives
  FERRY_ZIP_CORRUPT: { status: 400, message: 'The archive is not a readable ZIP file' },
  FERRY_ZIP_EMPTY: { status: 400, message: 'The archive has no files' },
  FERRY_ZIP_ABSOLUTE_PATH: { status: 400, message: 'An archive entry has an absolute path' },
  FERRY_ZIP_PATH_TRAVERSAL: { status: 400, message: 'An archive entry path leaves the archive folder' },
  FERRY_ZIP_PATH_TOO_LONG: { status: 400, message: 'An archive entry path is longer than the file system allows' },
  FERRY_ZIP_SYMLINK: { status: 400, message: 'An archive entry is a symbolic link' },
  FERRY_ZIP_SPECIAL_FILE: { status: 400, message: 'An archive entry is a device, FIFO or socket' },
  FERRY_ZIP_DUPLICATE_ENTRY: { status: 400, message: 'Two archive entries have the same path' },
  FERRY_ZIP_TOO_MANY_ENTRIES: { status: 400, message: 'The archive has too many entries' },
  FERRY_ZIP_TOO_LARGE: { status: 400, message: 'The archive expands to more than the allowed size' },
  FERRY_ZIP_RATIO: {
    status: 400,
    message: 'The archive or one of its entries has a compression ratio that suggests a ZIP bomb',
  },
  FERRY_ZIP_ENCRYPTED: { status: 400, message: 'Encrypted archive entries are not supported' },

  // Runs
  FERRY_FUNCTION_NOT_FOUND: { status: 404, message: 'The app has no such public function' },
  FERRY_NO_READY_BUILD: { status: 503, message: 'The app has no ready build yet' },
  FERRY_QUEUE_FULL: { status: 503, message: 'The app is at capacity and its queue is full; retry later' },
  FERRY_FUNCTION_ERROR: { status: 500, message: 'The function raised an error' },
  FERRY_ARGUMENT_ERROR: { status: 400, message: 'The function was called with arguments it does not take' },
  FERRY_RESULT_NOT_SERIALIZABLE: { status: 500, message: 'The function returned a value that is not JSON' },
  FERRY_RESULT_TOO_LARGE: { status: 500, message: 'The function returned a result larger than the server allows' },
  FERRY_STREAM_ITEM_TOO_LARGE: { status: 500, message: 'The function yielded an item larger than the server allows' },
  FERRY_RUN_TIMEOUT: { status: 504, message: 'The run took longer than the app’s response_grace_period' },
  FERRY_RUN_CANCELLED: { status: 409, message: 'The run was cancelled' },
  FERRY_RUN_FINISHED: { status: 409, message: 'The run has already finished' },
  FERRY_RUN_NOT_FINISHED: { status: 409, message: 'The run has not finished yet' },
  FERRY_RUN_INPUT_NOT_KEPT: { status: 409, message: 'The run’s input was not kept, so it cannot be run again' },
  FERRY_REPLICA_DIED: { status: 502, message: 'The replica running the function stopped during the run' },
  FERRY_OUT_OF_MEMORY: {
    status: 502,
    message: 'The function used more memory than the app’s [resources].memory limit',
  },
  FERRY_REPLICA_START_FAILED: { status: 502, message: 'The app’s replica could not start' },
  FERRY_RUN_NOT_FOUND: { status: 404, message: 'No such run' },
  FERRY_NO_WORKERS: { status: 503, message: 'No worker of the cluster is available to run the app; retry later' },
  FERRY_WORKER_LOST: {
    status: 502,
    message: 'The worker running the call stopped or could not be reached during the run',
  },
  FERRY_CLUSTER_UNAUTHENTICATED: {
    status: 401,
    message: 'This is a worker’s internal listener: only calls authenticated as coming from the cluster are served',
  },
  FERRY_CLIENT_GONE: { status: 499, message: 'The caller went away before the run finished' },
  FERRY_ASYNC_BACKLOG_FULL: { status: 429, message: 'Too many async runs are waiting; retry later' },
  FERRY_PROJECT_BACKLOG_FULL: {
    status: 429,
    message: 'This project has too many async runs queued or running; retry later',
  },
  FERRY_WEBHOOK_URL_INVALID: { status: 400, message: 'webhookEndpoint must be an absolute http or https URL' },
  FERRY_IDEMPOTENCY_KEY_INVALID: { status: 400, message: 'Idempotency-Key must be 1 to 255 visible ASCII characters' },
  FERRY_IDEMPOTENCY_KEY_REUSED: {
    status: 422,
    message: 'This Idempotency-Key was used for another function of this app within 24 hours',
  },
  FERRY_LAST_EVENT_ID_INVALID: {
    status: 400,
    message: 'Last-Event-ID must be an event id this stream sent: <run_id>:<sequence number>',
  },
  FERRY_STREAM_GONE: {
    status: 410,
    message: 'The run’s stream is not kept (unknown, another app’s, or forgotten): it cannot be resumed',
  },
  FERRY_STREAM_EVENTS_DROPPED: {
    status: 410,
    message: 'Some events after Last-Event-ID are no longer kept; the stream goes on from the oldest kept one',
  },
  FERRY_CORTEX_CALL: {
    status: 405,
    message: 'Functions of a cortex app are called with POST /v4/{project_id}/{app_name}/{function}',
  },

  // WebSockets (custom runtime)
  FERRY_WEBSOCKET_WEBHOOK: {
    status: 400,
    message: 'Webhook forwarding is for HTTP requests only, not WebSockets: drop webhookEndpoint',
  },
  FERRY_WEBSOCKET_ASYNC: { status: 400, message: 'A WebSocket cannot be an async run: drop async=true' },
  FERRY_WEBSOCKET_NOT_CUSTOM: { status: 400, message: 'WebSockets are proxied to custom-runtime apps only' },
  FERRY_WEBSOCKET_INVALID: { status: 400, message: 'Not a valid WebSocket upgrade request' },

  // Webhooks
  FERRY_NO_WEBHOOK: { status: 409, message: 'The run has no webhook delivery to send' },
  FERRY_WEBHOOK_IN_FLIGHT: {
    status: 409,
    message: 'Another Ferry server is sending this webhook right now; ask again when its attempt has ended',
  },
  FERRY_WEBHOOK_EXPIRED: {
    status: 410,
    message: 'The run’s webhook delivery ended more than 7 days ago and can no longer be redelivered',
  },

  // Secrets
  FERRY_SECRET_NOT_FOUND: { status: 404, message: 'No such secret' },

  // Registry logins (images/registry-logins.ts)
  FERRY_REGISTRY_LOGIN_NOT_FOUND: { status: 404, message: 'The project has no login for that registry' },

  // Volumes
  FERRY_VOLUME_NOT_FOUND: { status: 404, message: 'No such volume' },
  FERRY_VOLUME_EXISTS: { status: 409, message: 'The project already has a volume of that name' },
  FERRY_VOLUME_IN_USE: {
    status: 409,
    message: 'A deployed app mounts the volume: redeploy it without the volume, or delete with force=true',
  },
  FERRY_VOLUME_TOO_LARGE: {
    status: 400,
    message: 'The volume is larger than this server allows (FERRY_VOLUME_MAX_MIB)',
  },
  FERRY_VOLUMES_TOTAL_EXCEEDED: {
    status: 507,
    message: 'The volumes of this server would together be larger than it allows (FERRY_VOLUMES_TOTAL_MIB)',
  },
  FERRY_VOLUMES_UNAVAILABLE: {
    status: 503,
    message: 'Volumes cannot be used on this server (see `ferry doctor`, "volumes")',
  },
  FERRY_VOLUME_FULL: { status: 413, message: 'The volume has no room left for this file (its size_mib)' },
  FERRY_VOLUME_PATH_INVALID: {
    status: 400,
    message: 'The path is not a valid path inside the volume (no "..", no NUL, at most 4096 bytes)',
  },
  FERRY_VOLUME_FILE_NOT_FOUND: { status: 404, message: 'No such file or folder in the volume' },
  FERRY_VOLUME_FILE_REFUSED: {
    status: 422,
    message: 'Ferry does not read, follow or replace this entry (a link, FIFO, device, socket or hard-linked file)',
  },
  FERRY_VOLUME_PATH_CONFLICT: {
    status: 409,
    message: 'The path is a folder where a file is needed, or a file where a folder is needed',
  },
  FERRY_BUILD_DEPENDENCIES_FAILED: { status: 422, message: "The app's dependencies could not be installed" },
  FERRY_BUILD_VOLUME_MISSING: {
    status: 400,
    message: 'ferry.toml mounts a volume the project does not have: create it first (ferry volumes create)',
  },
} as const satisfies Record<string, { status: number; message: string }>;

export type ErrorCode = keyof typeof ERRORS;

/** The error type every part of Ferry throws for a known failure; the HTTP layer turns it into a response. */
export class FerryError extends Error {
  readonly code: ErrorCode;
  readonly status: number;
  /** Extra headers for the response, such as `Retry-After`. */
  readonly headers: Record<string, string>;
  /** Extra public members of the error object, such as the `type` of a function's exception. */
  readonly details: Record<string, string>;

  constructor(
    code: ErrorCode,
    message?: string,
    options?: { cause?: unknown; headers?: Record<string, string>; details?: Record<string, string> },
  ) {
    super(message ?? ERRORS[code].message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.name = 'FerryError';
    this.code = code;
    this.status = ERRORS[code].status;
    this.headers = options?.headers ?? {};
    this.details = options?.details ?? {};
  }

  /**
   * The error's public members (the `error` of the envelope http/answer.ts writes): its code, message and
   * details; never the stack or the cause, however the error is serialized.
   */
  toJSON(): { code: ErrorCode; message: string } & Record<string, string> {
    return { code: this.code, message: this.message, ...this.details };
  }
}

/** Turns anything thrown (user code can throw strings, objects, null) into an Error, keeping it as `cause`. */
export function toError(value: unknown): Error {
  if (value instanceof Error) return value;
  let text: string;
  try {
    text = typeof value === 'string' ? value : JSON.stringify(value);
  } catch {
    text = String(value);
  }
  return new Error(text ?? String(value), { cause: value });
}

/** `n` bytes as people read it: "10485760 bytes (10 MiB)". */
export function formatBytes(n: number): string {
  const mib = n / 1024 ** 2;
  if (n >= 1024 ** 2 && Number.isInteger(mib * 10)) return `${n} bytes (${mib} MiB)`;
  const kib = n / 1024;
  if (n >= 1024 && Number.isInteger(kib * 10)) return `${n} bytes (${kib} KiB)`;
  return `${n} bytes`;
}

/** The 413 of a body over `limit` bytes, stating the limit. */
export function bodyTooLarge(limit: number, what = 'The request body'): FerryError {
  return new FerryError('FERRY_BODY_TOO_LARGE', `${what} is larger than the limit of ${formatBytes(limit)}`);
}
