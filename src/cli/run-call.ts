/**
 * `ferry run APP [FUNCTION]`: a call from the command line in each of the run endpoint's modes (issue 45).
 *
 *   ferry run hello -d '{"name":"Ada"}'          sync: prints the result (JSON), exit 0 on success
 *   ferry run hello -d @input.json | -d -        the arguments from a file, or from standard input
 *   ferry run counter count --stream             each item's text as it arrives, one line per item
 *   ferry run counter count --stream --sse       the raw `id:`/`data:` lines
 *   ferry run hello --async [--json] [--wait]    the run id at once (--json: the 202 body); --wait: its result
 *   ferry run hello --async --webhook URL        the result POSTed there, signed with FERRY_WEBHOOK_SECRET or
 *                                                --webhook-secret-stdin (never on the command line: ps shows it)
 *   ferry run hello --async --idempotency-key K  a repeat answers the first call's run
 *
 * The exit code says whether the run succeeded (1 when it failed, timed out or was cancelled; 2 for bad
 * flags). A broken stream is resumed with Last-Event-ID (the run goes on, nothing runs twice).
 */
import fs from 'node:fs/promises';
import { request } from 'undici';
import { isFinalState } from '../runs/lifecycle.js';
import { type ApiClient, CliError, createClient, printJson } from './client.js';
import { safeJson, safeText } from './terminal.js';

export interface RunOptions {
  data?: string;
  json?: boolean;
  stream?: boolean;
  sse?: boolean;
  async?: boolean;
  wait?: boolean;
  webhook?: string;
  webhookSecretStdin?: boolean;
  idempotencyKey?: string;
}

/** Reconnects in a row of a broken stream before giving up. */
const STREAM_RECONNECTS = 5;

async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString('utf8');
}

/** The call's arguments: `-d` as JSON, `@file`, or `-` (standard input); checked to be a JSON object. */
async function readInput(data: string | undefined): Promise<string> {
  let text = data ?? '{}';
  if (text === '-') text = await readStdin();
  else if (text.startsWith('@')) {
    text = await fs.readFile(text.slice(1), 'utf8').catch((err: NodeJS.ErrnoException) => {
      throw new CliError(`-d ${data}: cannot read ${text.slice(1)} (${err.code ?? err.message})`, 2);
    });
  }
  try {
    const parsed = JSON.parse(text) as unknown;
    if (parsed === null || typeof parsed !== 'object' || Array.isArray(parsed)) throw new Error('not an object');
  } catch {
    throw new CliError(`-d must be a JSON object, like '{"name": "Ferry"}' (or @file, or - for standard input)`, 2);
  }
  return text;
}

export async function runCommand(app: string, fn: string | undefined, options: RunOptions): Promise<void> {
  if (options.stream && options.async) throw new CliError('--stream and --async do not go together', 2);
  if (options.wait && !options.async) throw new CliError('--wait goes with --async', 2);
  if (options.sse && !options.stream) throw new CliError('--sse goes with --stream', 2);
  if (options.webhookSecretStdin && options.data === '-') {
    throw new CliError('--webhook-secret-stdin and -d - both read standard input: put the arguments in a file', 2);
  }
  const client = createClient();
  const body = await readInput(options.data);
  const headers: Record<string, string> = {
    authorization: `Bearer ${client.token}`,
    'content-type': 'application/json',
  };
  const query = new URLSearchParams();
  if (options.async) query.set('async', 'true');
  if (options.webhook) {
    query.set('webhookEndpoint', options.webhook);
    const secret = options.webhookSecretStdin
      ? (await readStdin()).replace(/\r?\n$/, '')
      : process.env.FERRY_WEBHOOK_SECRET;
    if (secret) headers['x-webhook-secret'] = secret;
  } else if (options.webhookSecretStdin) throw new CliError('--webhook-secret-stdin goes with --webhook', 2);
  if (options.idempotencyKey) headers['idempotency-key'] = options.idempotencyKey;
  const url = `${client.url}/v4/${client.project}/${encodeURIComponent(app)}/${encodeURIComponent(fn ?? 'run')}${query.size > 0 ? `?${query}` : ''}`;
  if (options.stream) return streamCall(url, body, headers, options);
  const res = await post(client, url, body, headers);
  const text = await res.body.text();
  const runId = res.headers['x-request-id'];
  let answer: { run_id?: string; result?: unknown; run_time_ms?: number; error?: { code: string; message: string } };
  try {
    answer = JSON.parse(text) as typeof answer;
  } catch {
    throw new CliError(`The server answered ${res.statusCode}: ${safeText(text.slice(0, 200))}`);
  }
  if (options.async && res.statusCode === 202) {
    if (!options.wait) {
      if (options.json) printJson(answer);
      else process.stdout.write(`${answer.run_id}\n`);
      return;
    }
    return waitFor(client, app, String(answer.run_id), options);
  }
  if (options.json) {
    printJson(answer);
    if (res.statusCode >= 400) process.exitCode = 1;
    return;
  }
  if (res.statusCode >= 400) {
    throw new CliError(
      `${runId && answer.run_id ? `run ${String(runId)}` : 'the call'} failed: ${safeText(answer.error?.message ?? text)} (${answer.error?.code ?? res.statusCode})`,
    );
  }
  process.stdout.write(`${safeJson(JSON.stringify(answer.result, null, 2))}\n`);
  process.stderr.write(`run ${String(runId)} in ${answer.run_time_ms} ms\n`);
}

async function post(client: ApiClient, url: string, body: string, headers: Record<string, string>) {
  try {
    return await request(url, { method: 'POST', headers, body, headersTimeout: 0, bodyTimeout: 0 });
  } catch (err) {
    throw new CliError(`Cannot reach Ferry at ${client.url}: ${(err as Error).message}`);
  }
}

/** `--async --wait`: the run's end (GET …/runs/{id}?wait=60 until it has ended), printed like a sync call. */
async function waitFor(client: ApiClient, app: string, runId: string, options: RunOptions): Promise<void> {
  process.stderr.write(`run ${runId} accepted; waiting for it to end\n`);
  for (;;) {
    const run = await client.call<{
      state: string;
      result?: unknown;
      error?: { code: string; message: string } | null;
    }>('GET', `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs/${runId}?wait=60`);
    if (!isFinalState(run.state)) continue;
    if (options.json) {
      printJson(run);
      if (run.state !== 'success') process.exitCode = 1;
      return;
    }
    if (run.state !== 'success') {
      throw new CliError(
        `run ${runId} ended ${run.state}${run.error ? `: ${safeText(run.error.message)} (${run.error.code})` : ''}`,
      );
    }
    process.stdout.write(`${safeJson(JSON.stringify(run.result ?? null, null, 2))}\n`);
    return;
  }
}

/**
 * `--stream`: each item's text as it arrives (with `--sse`, the raw lines); `: error` goes to stderr and
 * `: end` sets the exit code. A broken connection is resumed with the last id it had.
 */
async function streamCall(
  url: string,
  body: string,
  headers: Record<string, string>,
  options: RunOptions,
): Promise<void> {
  let lastId: string | undefined;
  let failures = 0;
  for (;;) {
    const res = await request(url, {
      method: 'POST',
      headers: { ...headers, accept: 'text/event-stream', ...(lastId ? { 'last-event-id': lastId } : {}) },
      body,
      headersTimeout: 0,
      bodyTimeout: 0,
    }).catch((err: Error) => {
      if (lastId === undefined || failures >= STREAM_RECONNECTS)
        throw new CliError(`Cannot reach Ferry: ${err.message}`);
      return null;
    });
    if (res === null) {
      failures++;
      await new Promise((r) => setTimeout(r, 1000));
      continue;
    }
    if (res.statusCode === 204) return; // resumed after the last item: the run is over
    if (res.statusCode !== 200) {
      const text = await res.body.text();
      let error: { code?: string; message?: string } | undefined;
      try {
        error = (JSON.parse(text) as { error?: typeof error }).error;
      } catch {
        error = undefined;
      }
      throw new CliError(
        `the call failed: ${safeText(error?.message ?? text.slice(0, 200))} (${error?.code ?? res.statusCode})`,
      );
    }
    let buffer = '';
    let data: string[] = [];
    let id: string | undefined;
    let ended: { state?: string } | undefined;
    try {
      for await (const chunk of res.body) {
        buffer += (chunk as Buffer).toString('utf8');
        let newline = buffer.indexOf('\n');
        while (newline >= 0 && !ended) {
          const line = buffer.slice(0, newline).replace(/\r$/, '');
          buffer = buffer.slice(newline + 1);
          newline = buffer.indexOf('\n');
          if (options.sse && !line.startsWith(':')) process.stdout.write(`${safeText(line)}\n`);
          if (line === '') {
            if (data.length > 0) {
              if (id !== undefined) lastId = id;
              failures = 0;
              if (!options.sse) process.stdout.write(`${safeText(data.join('\n'))}\n`);
            }
            data = [];
            id = undefined;
          } else if (line.startsWith(': error ')) {
            const error = (JSON.parse(line.slice(8)) as { error?: { code: string; message: string } }).error;
            if (error && error.code !== 'FERRY_STREAM_EVENTS_DROPPED') {
              process.stderr.write(`error: ${safeText(error.message)} (${error.code})\n`);
            }
          } else if (line.startsWith(': end ')) {
            ended = JSON.parse(line.slice(6)) as { state?: string };
          } else if (line.startsWith('data:')) data.push(line.slice(line.startsWith('data: ') ? 6 : 5));
          else if (line.startsWith('id:')) id = line.slice(line.startsWith('id: ') ? 4 : 3);
        }
        if (ended) break;
      }
    } catch {
      // A broken connection: resumed below.
    }
    if (ended) {
      if (ended.state !== 'success') process.exitCode = 1;
      return;
    }
    if (lastId === undefined || failures >= STREAM_RECONNECTS) {
      throw new CliError('the stream broke before it ended and could not be resumed');
    }
    failures++;
    await new Promise((r) => setTimeout(r, 1000));
  }
}
