/**
 * The custom-runtime supervisor: the program every replica of a `runtime = "custom"` app runs. It starts the
 * app's own HTTP server (its entrypoint), waits until that server is ready, then listens on the replica's
 * Unix socket and forwards every connection to the server's TCP port byte for byte (a layer-4 forwarder, so
 * keep-alive, streamed responses and WebSocket upgrades pass through untouched). After that it runs the
 * health check periodically and ends the replica when the server exits or stays unhealthy.
 *
 * The gateway treats "the socket accepts" as "the replica is ready", so the socket only exists once the
 * server answers its readiness check.
 *
 * Environment: FERRY_SOCKET, PORT, FERRY_CUSTOM_ENTRYPOINT (JSON: a string run by `/bin/sh -c`, or an argv
 * array), FERRY_CUSTOM_READYCHECK and FERRY_CUSTOM_HEALTHCHECK ("" for a TCP connect, or an absolute path for
 * an HTTP GET answering 200-399), FERRY_CUSTOM_START_TIMEOUT_MS, FERRY_CUSTOM_HEALTH_INTERVAL_MS and
 * FERRY_CUSTOM_HEALTH_FAILURES. The server gets this environment minus FERRY_SOCKET and FERRY_CUSTOM_*.
 *
 * Exit codes: 0 after a SIGTERM/SIGINT once the server has stopped; 2 for a bad environment; 127 when the
 * entrypoint cannot be started; 1 for a start timeout or a failed health check; otherwise the server's own
 * exit code (128 + N when it was killed by signal N, 1 when it exited 0 on its own).
 *
 * The sandbox binds this one compiled file and nothing else (as /ferry/supervisor.mjs), so it imports only
 * `node:` built-ins and nothing from the rest of Ferry.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { unlinkSync } from 'node:fs';
import { request } from 'node:http';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { constants } from 'node:os';

/** Each readiness or health check gives up after this long. */
const CHECK_TIMEOUT_MS = 2_000;
/** Readiness polling starts this fast, then backs off to the maximum. */
const POLL_FIRST_MS = 25;
const POLL_MAX_MS = 250;
/** After a SIGTERM the supervisor sends itself (start timeout, failed health check), SIGKILL follows this late. */
const KILL_AFTER_MS = 3_000;
const IPV4_LOOPBACK = '127.0.0.1';
const IPV6_LOOPBACK = '::1';
/** The longest delay setTimeout takes; a longer one would fire at once. */
const MAX_TIMER_MS = 2_147_483_647;
/** Connection errors that mean "nothing listens at this address", so the other loopback address is worth a try. */
const UNREACHABLE = new Set(['ECONNREFUSED', 'EADDRNOTAVAIL', 'ENETUNREACH', 'EAFNOSUPPORT', 'EHOSTUNREACH']);

interface Config {
  socketPath: string;
  port: number;
  /** The argv to spawn: `/bin/sh -c <string>` for a string entrypoint. */
  command: string[];
  /** '' for a TCP connect, else the path to GET. */
  readycheck: string;
  healthcheck: string;
  startTimeoutMs: number;
  healthIntervalMs: number;
  healthFailures: number;
}

interface CheckResult {
  ok: boolean;
  /** Nothing accepted the connection at that address (refused, or the address family is unavailable). */
  unreachable: boolean;
  /** What the check saw, for messages: "GET /ready answered 503", "connection to port 8080 refused". */
  detail: string;
}

type State = 'starting' | 'ready' | 'stopping';

// With the log pipe gone there is nowhere left to report to; an unheard 'error' would crash the supervisor.
process.stdout.on('error', () => {});
process.stderr.on('error', () => {});

const config = readConfig(process.env);

let state: State = 'starting';
/** The exit code once the child has stopped, after a stop the supervisor asked for. */
let stopExitCode = 0;
/** The loopback address the server answered on; forwarding and health checks use it. */
let target = IPV4_LOOPBACK;
/** What the readiness check last saw, for the start-timeout message. */
let lastReadiness = 'no check has finished yet';
let listener: Server | undefined;
let startTimer: NodeJS.Timeout | undefined;
let healthTimer: NodeJS.Timeout | undefined;
let consecutiveFailures = 0;

const startedAt = performance.now();
removeStaleSocket();
const child = startChild();

process.on('SIGTERM', onStopSignal);
process.on('SIGINT', onStopSignal);
// Best effort: whatever ends the supervisor, the server's process group must not live on without it.
process.on('exit', () => signalGroup('SIGKILL'));

startTimer = setTimeout(onStartTimeout, config.startTimeoutMs);
void waitUntilReady();

function log(message: string): void {
  process.stderr.write(`[ferry] ${message}\n`);
}

function fail(message: string): never {
  log(message);
  process.exit(2);
}

function readConfig(env: NodeJS.ProcessEnv): Config {
  const socketPath = env.FERRY_SOCKET;
  if (!socketPath) fail('FERRY_SOCKET must be set to the path of the replica socket');
  const rawPort = env.PORT;
  if (!rawPort) fail('PORT must be set to the port the server listens on');
  if (!/^\d{1,5}$/.test(rawPort) || Number(rawPort) < 1 || Number(rawPort) > 65_535) {
    fail(`PORT must be a port number from 1 to 65535, not ${JSON.stringify(rawPort)}`);
  }
  return {
    socketPath,
    port: Number(rawPort),
    command: readEntrypoint(env.FERRY_CUSTOM_ENTRYPOINT),
    readycheck: readCheckPath(env, 'FERRY_CUSTOM_READYCHECK'),
    healthcheck: readCheckPath(env, 'FERRY_CUSTOM_HEALTHCHECK'),
    startTimeoutMs: readPositiveInteger(env, 'FERRY_CUSTOM_START_TIMEOUT_MS', 60_000),
    healthIntervalMs: readPositiveInteger(env, 'FERRY_CUSTOM_HEALTH_INTERVAL_MS', 10_000),
    healthFailures: readPositiveInteger(env, 'FERRY_CUSTOM_HEALTH_FAILURES', 3),
  };
}

function readEntrypoint(raw: string | undefined): string[] {
  const name = 'FERRY_CUSTOM_ENTRYPOINT';
  if (!raw) fail(`${name} must be set to the entrypoint as JSON (a command string or an array of strings)`);
  let value: unknown;
  try {
    value = JSON.parse(raw);
  } catch (err) {
    fail(`${name} is not valid JSON: ${err instanceof Error ? err.message : String(err)}`);
  }
  if (typeof value === 'string' && value.trim() !== '') return ['/bin/sh', '-c', value];
  if (
    Array.isArray(value) &&
    value.length > 0 &&
    value.every((part) => typeof part === 'string') &&
    (value[0] as string) !== ''
  ) {
    return value as string[];
  }
  fail(`${name} must be a non-empty command string or a non-empty array of strings, not ${raw}`);
}

function readCheckPath(env: NodeJS.ProcessEnv, name: string): string {
  const value = env[name] ?? '';
  if (value === '' || /^\/[\x21-\x7e]*$/.test(value)) return value;
  fail(`${name} must be empty (a TCP connect) or an absolute path without spaces, not ${JSON.stringify(value)}`);
}

function readPositiveInteger(env: NodeJS.ProcessEnv, name: string, fallback: number): number {
  const raw = env[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (!/^\d+$/.test(raw) || value < 1 || value > MAX_TIMER_MS) {
    fail(`${name} must be a positive whole number (at most ${MAX_TIMER_MS}), not ${JSON.stringify(raw)}`);
  }
  return value;
}

function removeStaleSocket(): void {
  try {
    unlinkSync(config.socketPath);
  } catch {
    // No stale socket; anything else (a folder in the way) makes listen() fail with a clear message.
  }
}

/** The supervisor's environment for the server: PORT and the app's own variables, none of Ferry's plumbing. */
function childEnv(): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = {};
  for (const [key, value] of Object.entries(process.env)) {
    if (key === 'FERRY_SOCKET' || key.startsWith('FERRY_CUSTOM_')) continue;
    env[key] = value;
  }
  return env;
}

function startChild(): ChildProcess {
  const [file, ...args] = config.command as [string, ...string[]];
  // Its own process group, so a signal reaches every process of a `sh -c` pipeline.
  const proc = spawn(file, args, {
    cwd: process.cwd(),
    env: childEnv(),
    detached: true,
    stdio: ['ignore', 'inherit', 'inherit'],
  });
  proc.on('error', (err: NodeJS.ErrnoException) => {
    if (proc.pid === undefined) {
      log(`could not start the entrypoint: ${err.message}`);
      process.exit(127);
    }
    log(`error from the server process: ${err.message}`);
  });
  proc.on('exit', onChildExit);
  return proc;
}

/** Sends a signal to the server's whole process group; quietly does nothing once it is gone. */
function signalGroup(signal: NodeJS.Signals): void {
  const pid = child?.pid;
  if (pid === undefined) return;
  try {
    process.kill(-pid, signal);
  } catch {
    // ESRCH: the group has no process left.
  }
}

function describeExit(code: number | null, signal: NodeJS.Signals | null): string {
  return signal !== null ? `signal ${signal}` : `exit code ${code}`;
}

/** The supervisor's exit code for a server that ended without being asked to: never 0. */
function failureCode(code: number | null, signal: NodeJS.Signals | null): number {
  if (signal !== null) return 128 + (constants.signals[signal] ?? 0);
  return code === null || code === 0 ? 1 : code;
}

function onChildExit(code: number | null, signal: NodeJS.Signals | null): void {
  closeListener();
  if (state === 'stopping') process.exit(stopExitCode);
  if (state === 'starting') {
    log(`the server exited before it was ready (${describeExit(code, signal)})`);
  } else {
    log(`the server exited (${describeExit(code, signal)})`);
  }
  process.exit(failureCode(code, signal));
}

/**
 * Stops the server: no new connections (open ones keep flowing), SIGTERM to its group and, when `killAfter`,
 * SIGKILL a little later. The supervisor exits with `exitCode` once the server is gone.
 */
function stop(exitCode: number, killAfter: boolean): void {
  state = 'stopping';
  stopExitCode = exitCode;
  clearTimeout(startTimer);
  clearTimeout(healthTimer);
  closeListener();
  signalGroup('SIGTERM');
  if (killAfter) setTimeout(() => signalGroup('SIGKILL'), KILL_AFTER_MS);
}

function onStopSignal(): void {
  // A second SIGTERM, or one during a stop the supervisor started itself, changes nothing. Ferry SIGKILLs the
  // whole sandbox after the app's grace period, so there is no kill timer of our own here.
  if (state === 'stopping') return;
  stop(0, false);
}

function onStartTimeout(): void {
  if (state !== 'starting') return;
  log(`the server did not become ready within ${config.startTimeoutMs / 1000} s (${lastReadiness})`);
  stop(1, true);
}

async function waitUntilReady(): Promise<void> {
  let delay = POLL_FIRST_MS;
  while (state === 'starting') {
    const result = await checkAnyLoopback(config.readycheck);
    if (state !== 'starting') return;
    lastReadiness = result.detail;
    if (result.ok) {
      onReady();
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(POLL_MAX_MS, Math.round(delay * 1.5));
  }
}

function onReady(): void {
  state = 'ready';
  clearTimeout(startTimer);
  log(`ready on port ${config.port} (${Math.round(performance.now() - startedAt)} ms)`);
  removeStaleSocket();
  const server = createServer({ allowHalfOpen: true }, forward);
  server.on('error', (err) => {
    log(`cannot listen on ${config.socketPath}: ${err.message}`);
    listener = undefined;
    stop(1, true);
  });
  server.listen(config.socketPath);
  listener = server;
  scheduleHealthCheck();
}

function closeListener(): void {
  const server = listener;
  listener = undefined;
  // Closing also removes the socket file, so the gateway sees at once that no new connection is accepted.
  server?.close();
}

/** Pipes one connection from the gateway to a fresh TCP connection to the server, both ways, byte for byte. */
function forward(client: Socket): void {
  const upstream = connect({ host: target, port: config.port, allowHalfOpen: true });
  upstream.setNoDelay(true);
  const destroyBoth = () => {
    client.destroy();
    upstream.destroy();
  };
  client.on('error', destroyBoth);
  upstream.on('error', destroyBoth);
  // pipe() ends the other side's writable when one side's readable ends: half-closes travel on as FINs.
  client.pipe(upstream);
  upstream.pipe(client);
  // A side that went away without an error (both directions done, or destroyed) leaves the other nowhere to
  // send to: finish writing what is queued, then let it go.
  client.on('close', () => finishThenDestroy(upstream));
  upstream.on('close', () => finishThenDestroy(client));
}

function finishThenDestroy(socket: Socket): void {
  if (socket.destroyed) return;
  if (socket.writableFinished) {
    socket.destroy();
    return;
  }
  socket.once('finish', () => socket.destroy());
  socket.end();
}

function scheduleHealthCheck(): void {
  healthTimer = setTimeout(runHealthCheck, config.healthIntervalMs);
  // Keeps running while the server does, but never keeps the supervisor alive on its own.
  healthTimer.unref();
}

async function runHealthCheck(): Promise<void> {
  if (state !== 'ready') return;
  const result = await check(target, config.healthcheck);
  if (state !== 'ready') return;
  if (result.ok) {
    consecutiveFailures = 0;
  } else {
    consecutiveFailures += 1;
    if (consecutiveFailures >= config.healthFailures) {
      log(
        `health check failed ${consecutiveFailures} times in a row (${result.detail}); stopping so the replica is replaced`,
      );
      stop(1, true);
      return;
    }
  }
  scheduleHealthCheck();
}

/**
 * The readiness check against 127.0.0.1, then ::1 when nothing listens on the first (a server listening on
 * `::` with IPV6_V6ONLY, or on `localhost` resolved to ::1). The address that passes becomes `target`.
 */
async function checkAnyLoopback(path: string): Promise<CheckResult> {
  const v4 = await check(IPV4_LOOPBACK, path);
  if (v4.ok || !v4.unreachable) {
    if (v4.ok) target = IPV4_LOOPBACK;
    return v4;
  }
  const v6 = await check(IPV6_LOOPBACK, path);
  if (v6.ok) target = IPV6_LOOPBACK;
  // Nothing on ::1 either: the IPv4 answer ("refused") is the one that explains most.
  return v6.unreachable ? v4 : v6;
}

function check(host: string, path: string): Promise<CheckResult> {
  return path === '' ? checkTcp(host) : checkHttp(host, path);
}

function checkTcp(host: string): Promise<CheckResult> {
  return new Promise((resolve) => {
    const socket = connect({ host, port: config.port });
    const timer = setTimeout(() => {
      socket.destroy();
      resolve({ ok: false, unreachable: false, detail: `no connection to port ${config.port} within 2 s` });
    }, CHECK_TIMEOUT_MS);
    socket.once('connect', () => {
      clearTimeout(timer);
      socket.destroy();
      resolve({ ok: true, unreachable: false, detail: `port ${config.port} accepts connections` });
    });
    socket.once('error', (err: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(connectFailure(err, undefined));
    });
  });
}

function checkHttp(host: string, path: string): Promise<CheckResult> {
  const what = `GET ${path}`;
  return new Promise((resolve) => {
    let settled = false;
    const settle = (result: CheckResult) => {
      if (settled) return;
      settled = true;
      resolve(result);
    };
    const req = request({
      host,
      port: config.port,
      path,
      method: 'GET',
      agent: false,
      headers: { host: `${IPV4_LOOPBACK}:${config.port}` },
    });
    // Also bounds a body that never ends: the connection is dropped once the time is up.
    const timer = setTimeout(() => {
      settle({ ok: false, unreachable: false, detail: `${what}: no answer within 2 s` });
      req.destroy();
    }, CHECK_TIMEOUT_MS);
    req.on('close', () => clearTimeout(timer));
    req.on('response', (res) => {
      const status = res.statusCode ?? 0;
      settle({ ok: status >= 200 && status <= 399, unreachable: false, detail: `${what} answered ${status}` });
      res.on('error', () => {});
      res.resume();
    });
    req.on('error', (err: NodeJS.ErrnoException) => settle(connectFailure(err, what)));
    req.end();
  });
}

/** A check that got no answer; `what` names the HTTP request ("GET /ready"), undefined for a plain connect. */
function connectFailure(err: NodeJS.ErrnoException, what: string | undefined): CheckResult {
  const code = err.code ?? '';
  const unreachable = UNREACHABLE.has(code);
  const refused = `connection to port ${config.port} refused`;
  if (what === undefined) {
    const detail = code === 'ECONNREFUSED' ? refused : `connecting to port ${config.port} failed: ${err.message}`;
    return { ok: false, unreachable, detail };
  }
  return { ok: false, unreachable, detail: `${what}: ${code === 'ECONNREFUSED' ? refused : err.message}` };
}
