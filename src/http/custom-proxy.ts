/**
 * The run endpoint for custom-runtime apps: every method and path under `/v4/{project_id}/{app_name}/...`
 * goes to the app's own server, HTTP and WebSocket alike.
 *
 * - The server sees the path after the app name, the query string less Ferry's own `async` and
 *   `webhookEndpoint`, and the caller's headers less `Authorization`, `X-Webhook-Secret` and hop-by-hop
 *   headers, plus `X-Request-Id` (the run id) and `X-Forwarded-For`/`-Host`/`-Proto`/`-Prefix`.
 * - Sync calls stream both ways: the request body as it arrives, the response (SSE included) as the server
 *   writes it. `?async=true` stores the whole request and answers 202; `webhookEndpoint` forwards the
 *   server's response body inside the usual payload. Every call is a run with its own record.
 * - WebSocket upgrades are authenticated like any call (Bearer header, or `?access_token=` for browsers),
 *   hold a replica slot while open, and are closed after `websocket_idle_timeout` seconds of silence.
 * - What the server answers is a tenant's content: on the port that also serves the dashboard it is
 *   sandboxed (`APP_SANDBOX_CSP`), so a page of one tenant never runs with the dashboard's origin (whose
 *   tab keeps another tenant's token); no app widens a service worker's scope past its own path.
 */
import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { Logger } from 'pino';
import type { ServerConfig } from '../config.js';
import { FerryError } from '../errors.js';
import { uuidv7 } from '../ids.js';
import type { HttpResponseHead } from '../runs/invoke.js';
import type { RunService, RunTarget } from '../runs/run-service.js';
import { tunnel } from '../runs/tunnel.js';
import { runtimeOf } from '../runtimes/index.js';
import { webhookSecretOf } from '../webhooks/secret.js';
import { answer, refuseOnSocket, writeAnswer } from './answer.js';
import { watchCaller } from './caller-flow.js';

/** Headers that describe one connection, not the request (RFC 9110 7.6.1), plus `Expect` (undici refuses it). */
const HOP_BY_HOP = new Set([
  'connection',
  'keep-alive',
  'proxy-authenticate',
  'proxy-authorization',
  'proxy-connection',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
  'expect',
]);
/** Ferry's own request headers: they never reach the app. */
const FERRY_HEADERS = new Set(['authorization', 'x-webhook-secret']);
/** Ferry's own query parameters (and, for WebSockets, the browser token). */
const FERRY_PARAMS = new Set(['async', 'webhookEndpoint']);

/**
 * Sent with every response of an app's server on a port that serves the dashboard too (issue 43): its
 * pages run scripts, forms and popups, in an opaque origin, never the dashboard's (no `allow-same-origin`):
 * no access to the dashboard's session storage, cookies or API as the signed-in user, no service worker.
 * A policy the app sends itself is kept beside it; a browser enforces both.
 */
export const APP_SANDBOX_CSP = 'sandbox allow-scripts allow-forms allow-popups';

/**
 * Response headers of an app's server that never reach the caller. `Service-Worker-Allowed` would let a
 * worker script under `/v4/{project_id}/{app_name}/` take a scope above it (`/`: every app, the dashboard).
 */
const DROPPED_RESPONSE_HEADERS = new Set(['service-worker-allowed']);

/** The parts of a `/v4/{project_id}/{app_name}/...` URL that matter to the app's server. */
export interface ForwardTarget {
  /** Path after the app name, raw (still percent-encoded), at least `/`, with the filtered query. */
  path: string;
  /** `/v4/{project_id}/{app_name}` as the caller wrote it (X-Forwarded-Prefix). */
  prefix: string;
  /** Ferry's parameters from the query (decoded). */
  params: Map<string, string>;
}

/** Splits a raw request URL; undefined when it is not under `/v4/{project_id}/{app_name}`. */
export function splitRunUrl(rawUrl: string, dropParams: ReadonlySet<string> = FERRY_PARAMS): ForwardTarget | undefined {
  const q = rawUrl.indexOf('?');
  const pathname = q >= 0 ? rawUrl.slice(0, q) : rawUrl;
  const query = q >= 0 ? rawUrl.slice(q + 1) : '';
  const parts = pathname.split('/');
  if (parts[0] !== '' || parts[1] !== 'v4' || !parts[2] || !parts[3]) return undefined;
  const prefix = parts.slice(0, 4).join('/');
  const rest = parts.length > 4 ? `/${parts.slice(4).join('/')}` : '/';
  const params = new Map<string, string>();
  const kept: string[] = [];
  for (const pair of query.split('&')) {
    if (pair === '') continue;
    const eq = pair.indexOf('=');
    const name = safeDecode(eq >= 0 ? pair.slice(0, eq) : pair);
    if (dropParams.has(name)) {
      params.set(name, safeDecode(eq >= 0 ? pair.slice(eq + 1) : ''));
    } else kept.push(pair);
  }
  return { path: kept.length > 0 ? `${rest}?${kept.join('&')}` : rest, prefix, params };
}

function safeDecode(text: string): string {
  try {
    return decodeURIComponent(text.replaceAll('+', ' '));
  } catch {
    return text;
  }
}

/** Header names a Connection header lists: hop-by-hop for this one message (RFC 9110 7.6.1). */
function connectionTokens(value: string | string[] | undefined): Set<string> {
  return new Set(
    String(value ?? '')
      .split(',')
      .map((token) => token.trim().toLowerCase()),
  );
}

/** The caller's headers as the app's server gets them. */
export function forwardHeaders(
  req: IncomingMessage,
  runId: string,
  prefix: string,
  keep: ReadonlySet<string> = new Set(),
): Record<string, string | string[]> {
  const named = connectionTokens(req.headers.connection);
  const out: Record<string, string | string[]> = {};
  const raw = req.rawHeaders;
  for (let i = 0; i + 1 < raw.length; i += 2) {
    const name = raw[i]!.toLowerCase();
    const value = raw[i + 1]!;
    if (!keep.has(name) && (HOP_BY_HOP.has(name) || named.has(name))) continue;
    if (FERRY_HEADERS.has(name) || name.startsWith('x-forwarded-') || name === 'x-request-id') continue;
    const existing = out[name];
    if (existing === undefined) out[name] = value;
    else out[name] = Array.isArray(existing) ? [...existing, value] : [existing, value];
  }
  const client = req.socket.remoteAddress ?? '';
  const earlier = req.headers['x-forwarded-for'];
  out['x-forwarded-for'] = earlier ? `${String(earlier)}, ${client}` : client;
  out['x-forwarded-host'] = req.headers.host ?? '';
  out['x-forwarded-proto'] = 'encrypted' in req.socket ? 'https' : 'http';
  out['x-forwarded-prefix'] = prefix;
  out['x-request-id'] = runId;
  return out;
}

/**
 * The server's response headers as the caller gets them, with `APP_SANDBOX_CSP` added when `sandbox`
 * (the app's own policies kept, so the browser applies each).
 */
export function responseHeaders(
  head: HttpResponseHead,
  runId: string,
  sandbox: boolean,
): Record<string, string | string[]> {
  const named = connectionTokens(head.headers.connection);
  const out: Record<string, string | string[]> = {};
  for (const [raw, value] of Object.entries(head.headers)) {
    // Lower case whatever said it: a worker relays the head as JSON (cluster/protocol.ts).
    const name = raw.toLowerCase();
    if (value === undefined || HOP_BY_HOP.has(name) || named.has(name) || DROPPED_RESPONSE_HEADERS.has(name)) continue;
    const existing = out[name];
    if (existing === undefined) out[name] = value;
    else out[name] = [existing, value].flat();
  }
  if (sandbox) {
    const own = out['content-security-policy'];
    out['content-security-policy'] = own === undefined ? APP_SANDBOX_CSP : [own, APP_SANDBOX_CSP].flat();
  }
  out['x-request-id'] = runId;
  return out;
}

/** Reads a whole request body, refusing one over `limit` bytes. */
async function readBody(req: IncomingMessage, limit: number): Promise<Buffer> {
  const declared = Number(req.headers['content-length']);
  if (Number.isFinite(declared) && declared > limit) throw new FerryError('FERRY_BODY_TOO_LARGE');
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req as AsyncIterable<Buffer>) {
    size += chunk.length;
    if (size > limit) throw new FerryError('FERRY_BODY_TOO_LARGE');
    chunks.push(chunk);
  }
  return Buffer.concat(chunks);
}

function hasBody(req: IncomingMessage): boolean {
  return req.headers['transfer-encoding'] !== undefined || Number(req.headers['content-length'] ?? 0) > 0;
}

/** What the custom-runtime proxy uses. */
export interface CustomProxyDeps {
  runs: Pick<RunService, 'invokeHttp' | 'invokeSession' | 'note'>;
  config: Pick<ServerConfig, 'maxBodyBytes' | 'callerStallSeconds'>;
  /** Signs a run's webhook (webhooks/secret.ts). */
  secretsKey: Uint8Array;
  logger: Pick<Logger, 'error'>;
}

/** How one server proxies: `sandboxApps` on a port that serves the dashboard too (`APP_SANDBOX_CSP`). */
export interface ProxyOptions {
  sandboxApps: boolean;
}

/**
 * Serves one HTTP call of a custom app, from the run endpoint's onRequest hook (before Fastify reads the
 * body). Errors before anything is sent are thrown (Fastify answers them); after, the response is cut.
 */
export async function proxyHttp(
  services: CustomProxyDeps,
  options: ProxyOptions,
  request: FastifyRequest,
  reply: FastifyReply,
  target: RunTarget,
  runId: string,
  parseWebhook: (value: unknown) => string | undefined,
  acceptAsync: (request: {
    httpRequest: string;
    body: Buffer;
    fn: string;
    webhookUrl: string | undefined;
    webhookSecret: string | undefined;
  }) => Promise<FastifyReply>,
): Promise<FastifyReply | undefined> {
  const req = request.raw;
  const split = splitRunUrl(req.url ?? '/');
  if (!split) throw new FerryError('FERRY_ROUTE_NOT_FOUND');
  const webhookUrl = parseWebhook(split.params.get('webhookEndpoint'));
  const webhookSecret = webhookSecretOf(services.secretsKey, runId, webhookUrl, request.headers['x-webhook-secret']);
  const method = req.method ?? 'GET';
  const fn = `${method} ${split.path.split('?')[0]}`.slice(0, 512);
  const headers = forwardHeaders(req, runId, split.prefix);

  if (split.params.get('async') === 'true') {
    const body = await readBody(req, services.config.maxBodyBytes);
    const stored = JSON.stringify({ method, path: split.path, headers, body_base64: body.toString('base64') });
    return acceptAsync({ httpRequest: stored, body, fn, webhookUrl, webhookSecret });
  }

  reply.hijack();
  const res = reply.raw;
  const gone = new AbortController();
  res.on('close', () => {
    if (!res.writableFinished) gone.abort(new Error('client disconnected'));
  });
  let recorded = false;
  try {
    await services.runs.invokeHttp({
      runId,
      build: target.build,
      fn,
      mode: /text\/event-stream/i.test(String(req.headers.accept ?? '')) ? 'stream' : 'sync',
      signal: gone.signal,
      webhookUrl,
      webhookSecret,
      http: { method, path: split.path, headers, body: hasBody(req) ? req : null },
      onRecorded() {
        recorded = true;
      },
      onResponse(head) {
        res.writeHead(head.statusCode, responseHeaders(head, runId, options.sandboxApps));
        // The head goes out now, not with the first body chunk: an SSE client sees the stream open.
        res.flushHeaders();
        res.socket?.setNoDelay(true);
        return method === 'HEAD' ? undefined : res;
      },
    });
    if (!res.writableEnded) res.end();
  } catch (err) {
    failResponse(res, runId, err, recorded);
  }
  return undefined;
}

/**
 * Answers a JSON error when nothing was sent yet; otherwise cuts the response (the caller sees it break).
 * `recorded`: the call became the run `runId` (RunRequestBase.onRecorded), which the answer then names.
 */
function failResponse(res: ServerResponse, runId: string, err: unknown, recorded: boolean): void {
  writeAnswer(res, answer(err, recorded ? { runId } : { requestId: runId }));
}

// ---- WebSockets ----

const WS_KEEP = new Set(['upgrade', 'connection']);
const WS_PARAMS = new Set([...FERRY_PARAMS, 'access_token']);

/**
 * Writes an HTTP error answer on a socket that asked to upgrade, and closes it. `recorded`: the call became
 * the run `runId`, which the answer then names.
 */
export function refuseUpgrade(socket: Socket, runId: string, err: unknown, recorded = false): void {
  refuseOnSocket(socket, answer(err, recorded ? { runId } : { requestId: runId }));
}

/**
 * Proxies WebSocket upgrades on `/v4/...` to custom apps. `resolve` authenticates and finds the app the
 * way every run call does.
 */
export function attachWebSocketProxy(
  server: Server,
  services: CustomProxyDeps,
  resolve: (projectId: string, appName: string, authorization: string | undefined) => Promise<RunTarget>,
): void {
  server.on('upgrade', (req: IncomingMessage, socket: Socket, head: Buffer) => {
    const runId = uuidv7();
    const call = { recorded: false };
    socket.on('error', () => socket.destroy());
    void upgrade(req, socket, head, runId, call).catch((err: unknown) => {
      if (!(err instanceof FerryError)) services.logger.error({ err, runId }, 'WebSocket proxy failed');
      if (!socket.destroyed) refuseUpgrade(socket, runId, err, call.recorded);
    });
  });

  async function upgrade(
    req: IncomingMessage,
    socket: Socket,
    head: Buffer,
    runId: string,
    call: { recorded: boolean },
  ): Promise<void> {
    const split = splitRunUrl(req.url ?? '/', WS_PARAMS);
    if (!split) throw new FerryError('FERRY_ROUTE_NOT_FOUND');
    if (String(req.headers.upgrade ?? '').toLowerCase() !== 'websocket' || !req.headers['sec-websocket-key']) {
      throw new FerryError('FERRY_WEBSOCKET_INVALID');
    }
    const [, , projectId, appName] = split.prefix.split('/').map(safeDecode);
    const token = split.params.get('access_token');
    const authorization = req.headers.authorization ?? (token ? `Bearer ${token}` : undefined);
    const target = await resolve(projectId!, appName!, authorization);
    if (runtimeOf(target.build).calls !== 'http') throw new FerryError('FERRY_WEBSOCKET_NOT_CUSTOM');
    if (split.params.has('webhookEndpoint')) throw new FerryError('FERRY_WEBSOCKET_WEBHOOK');
    if (split.params.has('async')) throw new FerryError('FERRY_WEBSOCKET_ASYNC');
    const idleMs = target.build.config.runtime.custom!.websocket_idle_timeout * 1000;

    const headers = forwardHeaders(req, runId, split.prefix, WS_KEEP);
    headers.connection = 'Upgrade';
    headers.upgrade = 'websocket';
    const gone = new AbortController();
    socket.once('close', () => gone.abort(new Error('client disconnected')));
    let answered = false;
    await services.runs
      .invokeSession(
        {
          runId,
          build: target.build,
          fn: `WEBSOCKET ${split.path.split('?')[0]}`.slice(0, 512),
          mode: 'stream',
          signal: gone.signal,
          noDeadline: true,
          onRecorded: () => {
            call.recorded = true;
          },
        },
        (replica, signal) =>
          tunnel(socket, replica, signal, {
            request: requestHead(req.method ?? 'GET', split.path, headers),
            head,
            onAnswered: () => {
              answered = true;
            },
            onFlowing: (upstream, close) => {
              // A caller that leaves its side full past FERRY_CALLER_STALL_SECONDS is cut.
              const stallSeconds = services.config.callerStallSeconds;
              const flow = watchCaller({
                full: () => socket.writableNeedDrain,
                drains: [socket],
                stallMs: stallSeconds * 1000,
                onStalled: () => {
                  services.runs.note(runId, `the caller read nothing for ${stallSeconds} s: disconnected`);
                  close();
                },
              });
              socket.once('close', () => flow.stop());
              // After pipe's own listener: checked once the data went to the caller's socket.
              upstream.on('data', () => flow.wrote());
              // Silence both ways for idleMs closes the pair (a socket's timeout counts its reads and writes).
              socket.setTimeout(idleMs, () => {
                services.runs.note(runId, `closed after ${idleMs / 1000} s without traffic`);
                close();
              });
            },
          }),
      )
      .catch((err: unknown) => {
        // Once the server answered, the caller has its response; the run's record has the rest.
        if (answered || socket.destroyed) return;
        throw err;
      });
  }
}

/** The caller's upgrade request as the app's server gets it: its line, then the forwarded headers. */
function requestHead(method: string, path: string, headers: Record<string, string | string[]>): string {
  const lines = [`${method} ${path} HTTP/1.1`];
  for (const [name, value] of Object.entries(headers)) {
    for (const one of Array.isArray(value) ? value : [value]) lines.push(`${name}: ${one}`);
  }
  return `${lines.join('\r\n')}\r\n\r\n`;
}
