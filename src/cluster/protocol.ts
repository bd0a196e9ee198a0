/**
 * The worker protocol (version 1): what a gateway (runs/remote-invoker.ts, the client) and a worker's
 * internal listener (http/worker-api.ts, the server) say to each other, in one place both import. All of
 * it is HTTP/1.1 keep-alive:
 *
 * - `POST /internal/v1/invoke`: body = the call line (one line of JSON: `CallMeta`) + `\n` + the arguments
 *   JSON. Answer: `application/x-ndjson` lines: `{"e":"started"}` and `{"e":"item","d":…}` (streaming calls
 *   only), then `{"e":"done",…,"result":…}` (the result last, as the replica wrote it: a gateway answers
 *   those bytes as they are, `doneEvent`) or the error line `{"e":"error","error":{code,message,…},
 *   "status":…,"headers":{…}}`.
 * - `POST /internal/v1/http`: body = the call line + the request body to forward, streamed. Answer: one
 *   line `{"e":"head","status":…,"headers":{…}}` (or the error line) then the server's body, streamed.
 *   A failure after the head cuts the answer (the gateway cuts its caller's).
 * - `GET /internal/v1/session` with `Upgrade: ferry-tunnel` and the call in `x-ferry-call` (base64url JSON):
 *   the rest of the connection is the caller's WebSocket request and then its bytes, both ways, to the
 *   app's server (runs/tunnel.ts on both ends). A refusal is written as the HTTP error answer the caller
 *   would get from one process.
 *
 * Every call carries a cluster token (`authorization`, cluster-auth.ts). An error before an answer started
 * is the error envelope with its status, as the public API writes it.
 */
import type { RunMode } from '../store/schema.js';

export const PROTOCOL_VERSION = 1;
export const INTERNAL_PREFIX = '/internal/v1';

/** The worker's routes. */
export const WORKER_PATHS = {
  invoke: `${INTERNAL_PREFIX}/invoke`,
  http: `${INTERNAL_PREFIX}/http`,
  session: `${INTERNAL_PREFIX}/session`,
} as const;

/** The `Upgrade` token of a session, and the header that carries its call. */
export const TUNNEL_UPGRADE = 'ferry-tunnel';
export const CALL_HEADER = 'x-ferry-call';

/** What a gateway tells a worker about a call (the first line of the body, or `x-ferry-call`). */
export interface CallMeta {
  v: typeof PROTOCOL_VERSION;
  runId: string;
  projectId: string;
  appId: string;
  buildId: string;
  fn: string;
  mode: RunMode;
  webhookUrl?: string | undefined;
  webhookSecret?: string | undefined;
  /** Custom runtime: the request to forward. */
  http?: { method: string; path: string; headers: Record<string, string | string[]>; hasBody: boolean };
  /** Custom runtime: the run's stored input. */
  input?: string | null;
}

/** The call line is small (ids, a function name, forwarded headers): past this it is refused. */
export const MAX_META_BYTES = 256 * 1024;
const ID = /^[A-Za-z0-9_.:-]{1,200}$/;
const MODES: readonly RunMode[] = ['sync', 'async', 'stream'];

/** The call in `value` when it is well formed; undefined otherwise (a worker trusts the cluster, not bytes). */
export function parseCallMeta(value: unknown): CallMeta | undefined {
  if (typeof value !== 'object' || value === null) return undefined;
  const v = value as Record<string, unknown>;
  const ok = (key: string) => typeof v[key] === 'string' && ID.test(v[key] as string);
  if (v.v !== PROTOCOL_VERSION || !ok('runId') || !ok('projectId') || !ok('appId') || !ok('buildId')) return undefined;
  if (typeof v.fn !== 'string' || v.fn.length === 0 || v.fn.length > 512) return undefined;
  if (!MODES.includes(v.mode as RunMode)) return undefined;
  for (const key of ['webhookUrl', 'webhookSecret']) {
    if (v[key] !== undefined && typeof v[key] !== 'string') return undefined;
  }
  if (v.input !== undefined && v.input !== null && typeof v.input !== 'string') return undefined;
  if (v.http !== undefined) {
    const h = v.http as Record<string, unknown> | null;
    if (!h || typeof h.method !== 'string' || typeof h.path !== 'string' || !h.path.startsWith('/')) return undefined;
    if (typeof h.headers !== 'object' || h.headers === null || typeof h.hasBody !== 'boolean') return undefined;
  }
  return v as unknown as CallMeta;
}

/** The call line that starts an `invoke` or `http` body. */
export function callLine(meta: CallMeta): Buffer {
  return Buffer.from(`${JSON.stringify(meta)}\n`);
}

/** The call as the `x-ferry-call` header of a session carries it. */
export function encodeHeaderMeta(meta: CallMeta): string {
  return Buffer.from(JSON.stringify(meta)).toString('base64url');
}

/** The call of a session's `x-ferry-call` header; undefined when missing or malformed. Throws on bad JSON. */
export function decodeHeaderMeta(value: string | string[] | undefined): CallMeta | undefined {
  if (typeof value !== 'string' || value.length > MAX_META_BYTES) return undefined;
  return parseCallMeta(JSON.parse(Buffer.from(value, 'base64url').toString('utf8')));
}

/** The request head a gateway sends to open a session; what follows on the connection is the caller's. */
export function sessionRequestHead(host: string, authorization: string, meta: CallMeta): string {
  return (
    `GET ${WORKER_PATHS.session} HTTP/1.1\r\nhost: ${host}\r\nauthorization: ${authorization}\r\n` +
    `connection: Upgrade\r\nupgrade: ${TUNNEL_UPGRADE}\r\n${CALL_HEADER}: ${encodeHeaderMeta(meta)}\r\n\r\n`
  );
}

// ---- The answer's lines ----

export type StartedLine = { e: 'started' };
export type ItemLine = { e: 'item'; d: unknown };
export type HeadLine = { e: 'head'; status: number; headers: Record<string, unknown> };
/**
 * A coded error, as the public envelope's `error` member, with its status and headers (Retry-After…): the
 * worker writes it with http/answer.ts `workerErrorLine`, the one error answer of every writer.
 */
export type ErrorLine = { e: 'error'; error: Record<string, string>; status: number; headers: Record<string, string> };
/** What a `done` line carries besides its result. */
export interface DoneHead {
  streamed: boolean;
  runTimeMs: number;
  coldStart: boolean;
  statusCode: number;
}

/** An NDJSON line of an answer. */
export function line(value: StartedLine | ItemLine | HeadLine | ErrorLine): string {
  return `${JSON.stringify(value)}\n`;
}

/** The `done` line: `result` last, as the replica's bytes, so the gateway answers them as they are. */
export function doneLine(head: DoneHead, resultJson: string): string {
  const text = JSON.stringify({
    e: 'done',
    streamed: head.streamed,
    runTimeMs: head.runTimeMs,
    coldStart: head.coldStart,
    statusCode: head.statusCode,
  });
  return `${text.slice(0, -1)},"result":${resultJson}}\n`;
}

const RESULT_MEMBER = ',"result":';

/**
 * A worker's answer line. A `done` line ends with its result (`doneLine`): the rest is read as JSON and
 * the result is kept as its text (`resultJson`), which the worker took from the replica and checked, so
 * the gateway answers those bytes without parsing and writing them again. Any other line, or a done line
 * of another form, is read as JSON.
 */
export function doneEvent(text: string): unknown {
  if (text.startsWith('{"e":"done",')) {
    const at = text.indexOf(RESULT_MEMBER);
    const end = text.trimEnd();
    if (at > 0 && end.endsWith('}')) {
      const event = parseLine(`${text.slice(0, at)}}`);
      // The head of this form has every other member (an older worker wrote `result` first, then the rest).
      if (event && typeof event === 'object' && typeof (event as { statusCode?: unknown }).statusCode === 'number') {
        const resultJson = end.slice(at + RESULT_MEMBER.length, -1);
        return { ...event, resultJson, result: undefined };
      }
    }
  }
  return parseLine(text);
}

/** One line as JSON; undefined when it is not. */
export function parseLine(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return undefined;
  }
}
