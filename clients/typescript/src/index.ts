/**
 * `@ferry/client`: call functions deployed on Ferry from TypeScript or JavaScript (Node 20+, nothing else).
 *
 *   import { Ferry } from '@ferry/client';
 *   const ferry = new Ferry();                        // FERRY_URL, FERRY_TOKEN, FERRY_PROJECT, or { url, token, project }
 *   const hello = ferry.app('hello');
 *   await hello.call('run', { name: 'Ada' });         // the function's result
 *   const run = await hello.spawn('run', { name: 'Bob' }, { webhook, webhookSecret, idempotencyKey });
 *   await run.result({ timeout: 60_000 });
 *   for await (const item of hello.stream('count', { n: 3 })) console.log(item);
 *
 * Receivers verify webhooks with `verifyWebhook` (also alone as `@ferry/client/webhooks`).
 */
import { errorFor, FerryConnectionError, FerryError, RunFailedError } from './errors.js';

export * from './errors.js';
export { DEFAULT_TOLERANCE_SECONDS, signWebhook, verifyWebhook, type WebhookHeaders } from './webhooks.js';

/** A run's states that are final. */
export const FINAL_STATES = ['success', 'failure', 'timeout', 'cancelled'] as const;

export interface FerryOptions {
  /** The server's address (`FERRY_URL`). */
  url?: string;
  /** A token (`FERRY_TOKEN`). */
  token?: string;
  /** The project's id (`FERRY_PROJECT`). */
  project?: string;
}

/** A run's record (`GET …/runs/{id}`): the members every run has, and the rest as Ferry sends them. */
export interface RunRecord {
  id: string;
  state: 'queued' | 'running' | (typeof FINAL_STATES)[number];
  result?: unknown;
  error?: { code: string; message: string; [k: string]: unknown } | null;
  attempts?: number;
  [k: string]: unknown;
}

export interface LogLine {
  seq: number;
  at: string;
  stream: 'stdout' | 'stderr' | 'system';
  line: string;
}

const enc = encodeURIComponent;

export class Ferry {
  readonly url: string;
  readonly token: string | undefined;
  readonly project: string;
  private runUrlPromise: Promise<string> | undefined;

  constructor(options: FerryOptions = {}) {
    const url = options.url ?? process.env.FERRY_URL;
    const project = options.project ?? process.env.FERRY_PROJECT;
    if (!url) throw new TypeError('new Ferry({ url }) or FERRY_URL is required (the server address)');
    if (!project) throw new TypeError('new Ferry({ project }) or FERRY_PROJECT is required (a project id)');
    this.url = url.replace(/\/+$/, '');
    this.token = options.token ?? process.env.FERRY_TOKEN;
    this.project = project;
  }

  /** The app `name` of the project. */
  app(name: string): App {
    return new App(this, name);
  }

  /**
   * Where apps are called: the project's `run_url` when the server serves runs apart from its API
   * (`FERRY_RUN_PORT`), else the server's own address (also for a token that may not read the project).
   */
  runUrl(): Promise<string> {
    this.runUrlPromise ??= this.json<{ run_url?: string | null }>('GET', this.api('')).then(
      (p) => (p.run_url ?? this.url).replace(/\/+$/, ''),
      (err: unknown) => {
        if (err instanceof FerryError && (err.status === 401 || err.status === 403)) return this.url;
        this.runUrlPromise = undefined;
        throw err;
      },
    );
    return this.runUrlPromise;
  }

  /** `{base_url}/v2/projects/{project}` + `rest`. */
  api(rest: string): string {
    return `${this.url}/v2/projects/${enc(this.project)}${rest}`;
  }

  /** One request; its body parsed; an error answer thrown as its class. */
  async json<T>(method: string, url: string, body?: unknown, headers: Record<string, string> = {}): Promise<T> {
    const res = await this.fetch(method, url, body, headers);
    const text = await res.text().catch((err: unknown) => {
      throw new FerryConnectionError('FERRY_CLIENT_CONNECTION', `${method} ${url}: ${(err as Error).message}`);
    });
    return answer<T>(res, text);
  }

  /** The raw response (for streams). */
  async fetch(
    method: string,
    url: string,
    body?: unknown,
    headers: Record<string, string> = {},
    signal?: AbortSignal,
  ): Promise<Response> {
    const all: Record<string, string> = { 'user-agent': 'ferry-client-typescript/0.1.0', ...headers };
    if (this.token) all.authorization = `Bearer ${this.token}`;
    if (body !== undefined) all['content-type'] = 'application/json';
    try {
      return await fetch(url, {
        method,
        headers: all,
        ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
        ...(signal ? { signal } : {}),
      });
    } catch (err) {
      throw new FerryConnectionError('FERRY_CLIENT_CONNECTION', `${method} ${url}: ${(err as Error).message}`);
    }
  }
}

export interface SpawnOptions {
  /** Ferry posts the result there (`webhookEndpoint`). */
  webhook?: string;
  /** Signs the webhook's deliveries (`X-Webhook-Secret`). */
  webhookSecret?: string;
  /** A repeat with the same key within 24 hours returns the first call's run (`Idempotency-Key`). */
  idempotencyKey?: string;
}

export interface StreamOptions {
  /** Decode each item sent as JSON (default); `false` yields each item's text as sent. */
  decode?: boolean;
  /** Reconnects in a row after a broken connection (default 5). */
  reconnects?: number;
  signal?: AbortSignal;
}

export class App {
  constructor(
    readonly ferry: Ferry,
    readonly name: string,
  ) {}

  private async endpoint(fn: string, query?: Record<string, string>): Promise<string> {
    const base = `${await this.ferry.runUrl()}/v4/${enc(this.ferry.project)}/${enc(this.name)}/${enc(fn)}`;
    return query ? `${base}?${new URLSearchParams(query)}` : base;
  }

  /**
   * Calls `fn` with `input` (its arguments) and returns its result. Throws the error Ferry answered
   * (`RunFailedError` when the function threw: `details.type` is the exception's type).
   */
  async call<T = unknown>(fn: string, input: Record<string, unknown> = {}): Promise<T> {
    const body = await this.ferry.json<{ result: T }>('POST', await this.endpoint(fn), input);
    return body.result;
  }

  /** Starts `fn` without waiting (`?async=true`) and returns its run. */
  async spawn(fn: string, input: Record<string, unknown> = {}, options: SpawnOptions = {}): Promise<Run> {
    const query: Record<string, string> = { async: 'true' };
    if (options.webhook) query.webhookEndpoint = options.webhook;
    const headers: Record<string, string> = {};
    if (options.webhookSecret) headers['x-webhook-secret'] = options.webhookSecret;
    if (options.idempotencyKey) headers['idempotency-key'] = options.idempotencyKey;
    const body = await this.ferry.json<{ run_id: string }>('POST', await this.endpoint(fn, query), input, headers);
    return new Run(this, body.run_id);
  }

  /** A run of this app by its id. */
  run(id: string): Run {
    return new Run(this, id);
  }

  /**
   * Calls a generator function and yields each item as it comes. A broken connection is resumed where
   * it broke (`Last-Event-ID`: the run goes on, nothing runs twice). Throws the run's error after the
   * items it sent. Leaving the loop early closes the connection.
   */
  async *stream<T = unknown>(
    fn: string,
    input: Record<string, unknown> = {},
    options: StreamOptions = {},
  ): AsyncGenerator<T> {
    const url = await this.endpoint(fn);
    const decode = options.decode ?? true;
    const reconnects = options.reconnects ?? 5;
    let lastId: string | undefined;
    let failures = 0;
    let retryMs = 1000;
    for (;;) {
      const controller = new AbortController();
      const onAbort = () => controller.abort();
      options.signal?.addEventListener('abort', onAbort, { once: true });
      const headers: Record<string, string> = { accept: 'text/event-stream' };
      if (lastId !== undefined) headers['last-event-id'] = lastId;
      let res: Response;
      try {
        res = await this.ferry.fetch('POST', url, input, headers, controller.signal);
      } catch (err) {
        options.signal?.removeEventListener('abort', onAbort);
        if (lastId === undefined || failures >= reconnects || options.signal?.aborted) throw err;
        failures++;
        await sleep(retryMs);
        continue;
      }
      let ended = false;
      let error: FerryError | undefined;
      try {
        if (res.status === 204) return; // resumed after the last item: the run is over
        if (res.status !== 200) answer(res, await res.text());
        for await (const event of events(res)) {
          if (event.kind === 'retry') retryMs = event.ms;
          else if (event.kind === 'item') {
            if (event.id !== undefined) lastId = event.id;
            failures = 0;
            yield (decode ? decodeItem(event.data) : event.data) as T;
          } else if (event.kind === 'error') {
            const found = errorFor(500, event.body);
            // Said on a resume when events were dropped: the stream goes on from the oldest kept one.
            if (found.code !== 'FERRY_STREAM_EVENTS_DROPPED') error = found;
          } else {
            ended = true;
            const state = (event.body as { state?: string; run_id?: string }).state;
            if (!error && state !== 'success') {
              error = new RunFailedError(`FERRY_CLIENT_RUN_${String(state).toUpperCase()}`, `the run ended ${state}`, {
                runId: (event.body as { run_id?: string }).run_id,
              });
            }
            break;
          }
        }
      } catch (err) {
        if (err instanceof FerryError) throw err;
        // A broken connection: resumed below.
      } finally {
        controller.abort();
        options.signal?.removeEventListener('abort', onAbort);
      }
      if (ended) {
        if (error) {
          throw error instanceof RunFailedError
            ? error
            : new RunFailedError(error.code, error.message, { runId: error.runId, details: error.details });
        }
        return;
      }
      if (options.signal?.aborted) return;
      if (lastId === undefined || failures >= reconnects) {
        throw new FerryConnectionError(
          'FERRY_CLIENT_CONNECTION',
          'the stream broke before it ended and could not be resumed',
        );
      }
      failures++;
      await sleep(retryMs);
    }
  }
}

export class Run {
  constructor(
    readonly app: App,
    readonly id: string,
  ) {}

  private path(rest = ''): string {
    return this.app.ferry.api(`/apps/${enc(this.app.name)}/runs/${enc(this.id)}${rest}`);
  }

  /** The run's record; with `wait` (0–60 s) Ferry answers as soon as the run has ended, or after `wait`. */
  status(wait = 0): Promise<RunRecord> {
    return this.app.ferry.json<RunRecord>('GET', this.path(wait > 0 ? `?wait=${Math.floor(wait)}` : ''));
  }

  /**
   * Waits for the run to end and returns its result; throws `RunFailedError` when it did not succeed and
   * `FerryError('FERRY_CLIENT_TIMEOUT')` after `timeout` ms. A result over the server's stored bound (256 KiB
   * by default) is not kept: `undefined` then.
   */
  async result<T = unknown>(options: { timeout?: number } = {}): Promise<T> {
    const deadline = options.timeout === undefined ? undefined : Date.now() + options.timeout;
    for (;;) {
      const left = deadline === undefined ? 60 : Math.max(0, Math.min(60, Math.floor((deadline - Date.now()) / 1000)));
      const record = await this.status(left);
      if (record.state === 'success') return record.result as T;
      if ((FINAL_STATES as readonly string[]).includes(record.state)) {
        const { code, message, ...details } = record.error ?? { code: '', message: '' };
        throw new RunFailedError(
          code || `FERRY_CLIENT_RUN_${record.state.toUpperCase()}`,
          message || `the run ended ${record.state}`,
          {
            runId: this.id,
            details,
          },
        );
      }
      if (deadline !== undefined && Date.now() >= deadline) {
        throw new FerryError('FERRY_CLIENT_TIMEOUT', `the run is still ${record.state} after ${options.timeout} ms`, {
          runId: this.id,
        });
      }
    }
  }

  /** Cancels the run; its record. `FERRY_RUN_FINISHED` (409) when it had already finished. */
  cancel(): Promise<RunRecord> {
    return this.app.ferry.json<RunRecord>('POST', this.path('/cancel'), {});
  }

  /** What the function printed during the run. */
  async logs(): Promise<LogLine[]> {
    const lines: LogLine[] = [];
    let after: number | undefined;
    for (let page = 0; page < 1000; page++) {
      const body = await this.app.ferry.json<{ lines: LogLine[] }>(
        'GET',
        this.path(`/logs${after !== undefined ? `?after=${after}` : ''}`),
      );
      if (body.lines.length === 0) break;
      lines.push(...body.lines);
      after = body.lines[body.lines.length - 1]!.seq;
    }
    return lines;
  }
}

function answer<T>(res: Response, text: string): T {
  let body: unknown = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (res.status >= 200 && res.status < 300) return body as T;
  const retry = res.headers.get('retry-after');
  throw errorFor(
    res.status,
    body,
    res.headers.get('x-request-id') ?? undefined,
    retry && /^\d+(\.\d+)?$/.test(retry) ? Number(retry) : undefined,
  );
}

function decodeItem(data: string): unknown {
  try {
    return JSON.parse(data);
  } catch {
    return data;
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

type SseEvent =
  | { kind: 'retry'; ms: number }
  | { kind: 'item'; id: string | undefined; data: string }
  | { kind: 'error' | 'end'; body: unknown };

/** Server-sent events of a response, with the `: error` and `: end` comments Ferry ends a stream with. */
async function* events(res: Response): AsyncGenerator<SseEvent> {
  if (!res.body) return;
  const decoder = new TextDecoder();
  let buffer = '';
  let data: string[] = [];
  let id: string | undefined;
  for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
    buffer += decoder.decode(chunk, { stream: true });
    let newline = buffer.indexOf('\n');
    while (newline >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, '');
      buffer = buffer.slice(newline + 1);
      newline = buffer.indexOf('\n');
      if (line === '') {
        if (data.length > 0) yield { kind: 'item', id, data: data.join('\n') };
        data = [];
        id = undefined;
      } else if (line.startsWith(':')) {
        const match = /^:\s*(error|end) (.*)$/.exec(line);
        if (match) {
          try {
            yield { kind: match[1] as 'error' | 'end', body: JSON.parse(match[2]!) };
          } catch {
            // not Ferry's: skipped as any comment
          }
        }
      } else {
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'data') data.push(value);
        else if (field === 'id') id = value;
        else if (field === 'retry' && /^\d+$/.test(value)) yield { kind: 'retry', ms: Number(value) };
      }
    }
  }
}
