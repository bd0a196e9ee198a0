/**
 * Test helpers: a Ferry server in this process on a real socket (port 0), a real `ferry serve` child
 * process, the CLI as a child process, and a small HTTP helper. Every server gets its own temp data dir,
 * and on PostgreSQL (`FERRY_TEST_STORE=postgres`, test/helpers/store.ts) its own fresh database.
 *
 * Management routes are tested in-process with `server.inject(path, ...)` (Fastify's `inject`: no socket,
 * the same answer shape as `http`); the run endpoint (whose hot case is served before Fastify, see
 * http/run-fast-path.ts), streams, proxies, WebSockets and the CLI go over the socket with `http(url, ...)`.
 *
 * A test server (in this process or `ferry serve`) starts without a warm pool (FERRY_WARM_POOL=0) unless the test sets one: each warm
 * sandbox is a Node or Python process started in the background and stopped at close, the largest part of
 * a server's start-up and close for the many tests that never take one.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type { DestinationStream } from 'pino';
import type { ServerConfig } from '../../src/config.js';
import type { FerryServer } from '../../src/http/server.js';
import type { Services } from '../../src/services.js';
import { createTestDatabase, type TestDatabase, testStoreKind } from './store.js';

/** The repository root (tests run from dist/test, two levels below). */
export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
export const FERRY_BIN = path.join(REPO_ROOT, 'bin', 'ferry.js');

export async function tempDir(prefix = 'ferry-test-'): Promise<string> {
  return fs.mkdtemp(path.join(os.tmpdir(), prefix));
}

export interface TestServer {
  url: string;
  /** The run listener's address (`runPort` in the overrides: 0 for a free port); undefined without one. */
  runUrl: string | undefined;
  services: Services;
  app: FerryServer;
  dataDir: string;
  /** The PostgreSQL database the server uses (undefined on SQLite). */
  databaseUrl: string | undefined;
  bootstrap(projectName?: string): Promise<{ projectId: string; token: string }>;
  /** One request through Fastify's `inject` (no socket): `path` is the URL's path and query. */
  inject(path: string, options?: RequestOptions): Promise<Response>;
  close(): Promise<void>;
}

/**
 * Starts Ferry in this process on 127.0.0.1 with a fresh data dir (or the given one). On PostgreSQL it also
 * gets a fresh database, dropped by `close()`, unless the overrides name one (`databaseUrl`, or
 * `FERRY_DATABASE_URL` in `env`).
 */
export async function startServer(
  overrides: Partial<ServerConfig> & {
    env?: NodeJS.ProcessEnv;
    /** Capture the server's log: JSON lines at `level` written to `destination`. */
    log?: { level: string; destination: DestinationStream };
  } = {},
): Promise<TestServer> {
  const { log, ...configOverrides } = overrides;
  // Loaded here, not at the top: the many test files that import this module only for tempDir, http or
  // the CLI do not load the whole server (about a second of CPU per test process).
  const [{ resolveServerConfig }, { buildServer }, { createLogger }, { createServices }, { bootstrapProject }] =
    await Promise.all([
      import('../../src/config.js'),
      import('../../src/http/server.js'),
      import('../../src/logger.js'),
      import('../../src/services.js'),
      import('../../src/auth/service-accounts.js'),
    ]);
  const dataDir = overrides.dataDir ?? (await tempDir());
  const env = { FERRY_WARM_POOL: '0', ...overrides.env };
  const config = { ...resolveServerConfig({ dataDir, port: 0 }, env), ...configOverrides, dataDir };
  let database: TestDatabase | undefined;
  if (testStoreKind() === 'postgres' && !config.databaseUrl) {
    database = await createTestDatabase();
    config.databaseUrl = database.url;
  }
  const logger = log
    ? createLogger({ level: log.level, pretty: false, destination: log.destination })
    : createLogger({ level: process.env.FERRY_TEST_LOG ?? 'silent', pretty: false });
  let services: Services | undefined;
  let app: FerryServer | undefined;
  let runApp: FerryServer | undefined;
  let url: string;
  let runUrl: string | undefined;
  try {
    services = await createServices(config, logger);
    // As `ferry serve` does (cli/serve.ts): with a run port, a second server for the run endpoint alone,
    // whose address the public server tells (loaded only then, like the rest of the server above).
    const runAddress =
      config.runPort === undefined
        ? undefined
        : (await import('../../src/http/run-address.js')).createRunAddress(config);
    app = await buildServer(services, runAddress ? { runAddress } : {});
    if (runAddress) runApp = await buildServer(services, { surface: 'run', runAddress });
    await services.pipeline.recover();
    await services.asyncWorker.start();
    await services.replicas.warmUp();
    url = await app.listen({ host: '127.0.0.1', port: 0 });
    if (runApp) {
      runUrl = await runApp.listen({ host: '127.0.0.1', port: config.runPort });
      runAddress?.listening(Number(new URL(runUrl).port));
    }
  } catch (err) {
    // A server that did not start leaves no database behind.
    await runApp?.close().catch(() => {});
    await app?.close().catch(() => {});
    await services?.close().catch(() => {});
    await database?.drop().catch(() => {});
    throw err;
  }
  return {
    url,
    runUrl,
    services,
    app,
    dataDir,
    databaseUrl: config.databaseUrl,
    async bootstrap(projectName = 'default') {
      const { project, token } = await bootstrapProject(services.store, services.jwtKey, { projectName });
      return { projectId: project.id, token };
    },
    inject: (path, options) => inject(app, path, options),
    async close() {
      try {
        await runApp?.close();
        await app.close();
        await services.close();
      } finally {
        await database?.drop();
      }
    },
  };
}

export interface Response {
  status: number;
  headers: Headers;
  text: string;
  // biome-ignore lint/suspicious/noExplicitAny: tests read response bodies of many shapes
  json: any;
}

export interface RequestOptions {
  method?: string;
  token?: string;
  body?: unknown;
  headers?: Record<string, string>;
}

/** The headers and body of a request: `body` objects are sent as JSON, Buffers as they are. */
function requestParts(options: RequestOptions): { headers: Record<string, string>; body: Buffer | string | undefined } {
  const headers: Record<string, string> = { ...options.headers };
  if (options.token) headers.authorization = `Bearer ${options.token}`;
  let body: Buffer | string | undefined;
  if (Buffer.isBuffer(options.body)) body = options.body;
  else if (options.body !== undefined) {
    body = JSON.stringify(options.body);
    headers['content-type'] ??= 'application/json';
  }
  return { headers, body };
}

function parsedJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

/** One HTTP request over a socket; `body` objects are sent as JSON, Buffers as they are. */
export async function http(url: string, options: RequestOptions = {}): Promise<Response> {
  const { headers, body } = requestParts(options);
  const res = await fetch(url, { method: options.method ?? 'GET', headers, body, signal: AbortSignal.timeout(30_000) });
  const text = await res.text();
  return { status: res.status, headers: res.headers, text, json: parsedJson(text) };
}

/** One request through Fastify's `inject` (in-process, no socket), answered in the shape `http` has. */
export async function inject(app: FerryServer, path: string, options: RequestOptions = {}): Promise<Response> {
  const { headers, body } = requestParts(options);
  const res = await app.inject({
    method: (options.method ?? 'GET') as 'GET',
    url: path,
    headers,
    ...(body === undefined ? {} : { payload: body }),
  });
  const answered = new Headers();
  for (const [name, value] of Object.entries(res.headers)) {
    if (value === undefined) continue;
    for (const one of Array.isArray(value) ? value : [value]) answered.append(name, String(one));
  }
  return { status: res.statusCode, headers: answered, text: res.body, json: parsedJson(res.body) };
}

export interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/**
 * Another user to run a child process as (the test runs as root), and optionally the `bin/ferry.js` to
 * run: another path to the same checkout, for when that user cannot reach this one (a 0700 home above it).
 */
export interface RunAs {
  uid: number;
  gid: number;
  bin?: string;
}

/** Runs the `ferry` command as a child process, with only the given environment (plus PATH and HOME). */
export function runCli(
  args: string[],
  env: NodeJS.ProcessEnv = {},
  timeoutMs = 120_000,
  as?: RunAs,
): Promise<CliResult> {
  const { bin = FERRY_BIN, ...ids } = as ?? {};
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [bin, ...args], {
      env: { PATH: process.env.PATH, HOME: process.env.HOME, ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
      ...ids,
    });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d));
    child.stderr.on('data', (d: Buffer) => (stderr += d));
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`ferry ${args.join(' ')} timed out\n${stdout}\n${stderr}`));
    }, timeoutMs);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

export interface ServeProcess {
  url: string;
  child: ChildProcess;
  output(): string;
  /** Sends the signal and waits for the process to exit; resolves with its exit code. */
  stop(signal?: NodeJS.Signals): Promise<number | null>;
}

/** Starts a real `ferry serve` child process on a free port (no warm pool unless `env` sets one) and waits until it listens. */
export async function spawnServe(dataDir: string, env: NodeJS.ProcessEnv = {}, as?: RunAs): Promise<ServeProcess> {
  const { bin = FERRY_BIN, ...ids } = as ?? {};
  const child = spawn(process.execPath, [bin, 'serve', '--port', '0', '--data-dir', dataDir], {
    // No warm pool unless the test sets one (see the header).
    env: { PATH: process.env.PATH, HOME: process.env.HOME, FERRY_LOG_FORMAT: 'json', FERRY_WARM_POOL: '0', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
    ...ids,
  });
  let out = '';
  const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => resolve(code)));
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`ferry serve did not start:\n${out}`)), 30_000);
    const onData = (d: Buffer) => {
      out += d;
      const match = /"address":"(http:\/\/[^"]+)"/.exec(out);
      if (match?.[1]) {
        clearTimeout(timer);
        resolve(match[1]);
      }
    };
    child.stdout?.on('data', onData);
    child.stderr?.on('data', (d: Buffer) => (out += d));
    void exited.then((code) => {
      clearTimeout(timer);
      reject(new Error(`ferry serve exited with ${code}:\n${out}`));
    });
  });
  return {
    url,
    child,
    output: () => out,
    async stop(signal = 'SIGTERM') {
      if (child.exitCode !== null) return child.exitCode;
      child.kill(signal);
      return exited;
    },
  };
}

/** Polls `check` until it returns a truthy value or `ms` passes. */
export async function waitFor<T>(
  check: () => Promise<T | undefined | false>,
  ms = 60_000,
  what = 'condition',
): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Uploads an app (files by name) and waits for its build to end; returns the build. */
export async function deployFiles(
  server: { url: string },
  auth: { projectId: string; token: string },
  name: string,
  files: Record<string, string | Buffer>,
  /** `timeoutMs`: how long the build may take (default 60 s). */
  options: { expect?: 'ready' | 'failed'; timeoutMs?: number } = {},
): Promise<{ id: string; state: string }> {
  const { zipFiles } = await import('./app-zip.js');
  const zip = await zipFiles(files);
  const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds`, {
    method: 'POST',
    token: auth.token,
    body: zip,
    headers: { 'content-type': 'application/zip' },
  });
  if (res.status !== 201) throw new Error(`upload of ${name} failed: ${res.text}`);
  const build = await waitFor(
    async () => {
      const b = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${res.json.id}`, {
        token: auth.token,
      });
      return ['ready', 'failed', 'cancelled'].includes(b.json.state) ? b.json : undefined;
    },
    options.timeoutMs ?? 60_000,
    `build of ${name}`,
  );
  if (build.state !== (options.expect ?? 'ready'))
    throw new Error(`build of ${name} ended ${build.state}: ${build.error}`);
  return build;
}
