/**
 * The CLI's HTTP client for the management API: adds the token, turns error bodies into one readable
 * line (`CliError`), and keeps connection failures short ("cannot reach Ferry at ...").
 */
import type { Readable } from 'node:stream';
import { request } from 'undici';
import { resolveCliSettings } from './config-file.js';
import { safeJson, safeText } from './terminal.js';

/** An error the CLI prints as one line and exits non-zero with. */
export class CliError extends Error {
  constructor(
    message: string,
    readonly exitCode = 1,
  ) {
    super(message);
    this.name = 'CliError';
  }
}

export interface ApiClient {
  url: string;
  project: string;
  token: string;
  call<T>(
    method: string,
    path: string,
    options?: { body?: unknown; raw?: Readable; headers?: Record<string, string> },
  ): Promise<T>;
  /** Opens a streaming GET (for server-sent events); the caller reads and closes the body. */
  stream(path: string, headers?: Record<string, string>): Promise<Readable>;
}

function describeNetworkError(url: string, err: unknown): CliError {
  const code = (err as { code?: string }).code ?? (err as { cause?: { code?: string } }).cause?.code;
  const reason =
    code === 'ECONNREFUSED' ? 'connection refused' : (code ?? (err instanceof Error ? err.message : String(err)));
  return new CliError(
    `Cannot reach Ferry at ${url} (${reason}). Is \`ferry serve\` running? Set FERRY_URL or run \`ferry login\`.`,
  );
}

async function failure(status: number, body: Readable): Promise<CliError> {
  const text = await new Response(body as unknown as ReadableStream).text().catch(() => '');
  try {
    const parsed = JSON.parse(text) as { error?: { code?: string; message?: string } };
    if (parsed.error?.message) return new CliError(`${parsed.error.message} (${parsed.error.code ?? status})`);
  } catch {
    // not JSON; fall through
  }
  return new CliError(`The server answered ${status}${text ? `: ${text.slice(0, 200)}` : ''}`);
}

export function createClient(options: { needProject?: boolean } = {}): ApiClient {
  const settings = resolveCliSettings();
  const url = settings.url ?? 'http://127.0.0.1:8000';
  if (!settings.token) {
    throw new CliError(
      'No token. Run `ferry login --token <token>` or set FERRY_TOKEN (get one with `ferry admin bootstrap`).',
    );
  }
  if (options.needProject !== false && !settings.project) {
    throw new CliError('No project. Set FERRY_PROJECT or run `ferry login` with a project token.');
  }
  const token = settings.token;
  const auth = { authorization: `Bearer ${token}` };
  return {
    url,
    token,
    project: settings.project ?? '',
    async call<T>(
      method: string,
      path: string,
      opts: { body?: unknown; raw?: Readable; headers?: Record<string, string> } = {},
    ) {
      let res: Awaited<ReturnType<typeof request>>;
      try {
        res = await request(`${url}${path}`, {
          method: method as 'GET',
          headers: {
            ...auth,
            ...(opts.body !== undefined ? { 'content-type': 'application/json' } : {}),
            ...opts.headers,
          },
          body: opts.raw ?? (opts.body !== undefined ? JSON.stringify(opts.body) : undefined),
        });
      } catch (err) {
        throw describeNetworkError(url, err);
      }
      if (res.statusCode >= 400) throw await failure(res.statusCode, res.body);
      if (res.statusCode === 204) {
        await res.body.dump();
        return undefined as T;
      }
      return (await res.body.json()) as T;
    },
    async stream(path, headers = {}) {
      let res: Awaited<ReturnType<typeof request>>;
      try {
        res = await request(`${url}${path}`, { headers: { ...auth, ...headers }, bodyTimeout: 0 });
      } catch (err) {
        throw describeNetworkError(url, err);
      }
      if (res.statusCode >= 400) throw await failure(res.statusCode, res.body);
      return res.body;
    },
  };
}

/**
 * The run endpoint's base address (`{run_url}`) for URLs the CLI prints: the server's when it serves the
 * run endpoint apart from the API (FERRY_RUN_PORT, FERRY_RUN_URL; `run_url` of the project), else this
 * client's own address, as before that setting existed (an older server does not say either).
 */
export async function runBaseUrl(client: ApiClient): Promise<string> {
  const project = await client.call<{ run_url?: string | null }>('GET', `/v2/projects/${client.project}`);
  return project.run_url ?? client.url;
}

/** Prints `data` as JSON on stdout. */
export function printJson(data: unknown): void {
  process.stdout.write(`${safeJson(JSON.stringify(data, null, 2))}\n`);
}

/** Prints rows as an aligned table. */
export function printTable(rows: Array<Record<string, string | number | null | undefined>>, columns: string[]): void {
  if (rows.length === 0) {
    process.stdout.write('(none)\n');
    return;
  }
  const cells = rows.map((r) => columns.map((c) => safeText(String(r[c] ?? '-'))));
  const widths = columns.map((c, i) => Math.max(c.length, ...cells.map((row) => row[i]!.length)));
  const line = (values: string[]) =>
    values
      .map((v, i) => v.padEnd(widths[i]!))
      .join('  ')
      .trimEnd();
  process.stdout.write(`${line(columns.map((c) => c.toUpperCase()))}\n`);
  for (const row of cells) process.stdout.write(`${line(row)}\n`);
}
