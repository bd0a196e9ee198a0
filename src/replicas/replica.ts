/**
 * One replica: a (sandboxed) process serving one build of one app over a Unix socket, speaking the replica
 * protocol (docs/replica-protocol.md). This module starts it, waits until its socket accepts, calls its
 * functions through a keep-alive undici pool, stops it gracefully, and explains why it died.
 */
import type { ChildProcess } from 'node:child_process';
import { EventEmitter } from 'node:events';
import fs from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import { createInterface } from 'node:readline';
import type { Readable } from 'node:stream';
import { type Dispatcher, Pool } from 'undici';
import { FerryError } from '../errors.js';
import type { RunAbort } from '../runs/run-abort.js';
import { type Frame, type FrameLimits, FrameSplitter } from './frames.js';

export type { Frame } from './frames.js';

/**
 * Back-pressure from a run's caller (a streaming response that is not being read): while `blocked`, the
 * call stops reading the replica's answer, so the replica's writes wait in its socket, not in the gateway.
 */
export interface CallFlow {
  readonly blocked: boolean;
  /** Calls `ready` once, when the caller takes more again (or is gone). */
  whenReady(ready: () => void): void;
}

/** A replica ready to be started, as prepared by the launcher (sandbox and runtime together). */
export interface LaunchPlan {
  /**
   * Starts the process (stdout and stderr piped); `kill` signals the replica itself, not its sandbox.
   * `socketPath` is the replica's socket as the host reaches it: under bwrap it is only known once the
   * sandbox has started (null when the process ended first).
   */
  spawn(): { child: ChildProcess; kill(signal?: NodeJS.Signals): boolean; socketPath: Promise<string | null> };
  sandboxed: boolean;
  /** True when the memory limit (cgroup) recorded an OOM kill; read after the process exited. */
  wasOomKilled(): Promise<boolean>;
  /** Removes what the launch made (cgroup, socket folder); called once the process has exited. */
  cleanup(): Promise<void>;
}

export type ReplicaState = 'starting' | 'ready' | 'stopping' | 'exited';

export interface ReplicaExit {
  code: number | null;
  signal: NodeJS.Signals | null;
  /** Why, in terms a user understands: `oom`, `crash`, `stopped`, `start-failed`. */
  reason: 'oom' | 'crash' | 'stopped' | 'start-failed';
  /** The last lines the process printed outside any run (for the error message and the app log). */
  tail: string[];
}

export interface ReplicaOptions {
  id: string;
  plan: LaunchPlan;
  /** Runs one replica takes at once; also the size of the connection pool. */
  concurrency: number;
  /** How long the process may take to accept on its socket. */
  startTimeoutMs: number;
  /** Receives each line the replica prints outside a run. */
  onOutput?: (stream: 'stdout' | 'stderr', line: string) => void;
}

const TAIL_LINES = 30;
const HEAP_OOM = /heap out of memory|Allocation failed|MemoryError|Cannot allocate memory/i;

/** A running replica. Create with {@link startReplica}. */
export class Replica extends EventEmitter<{ exit: [ReplicaExit] }> {
  readonly id: string;
  state: ReplicaState = 'starting';
  inflight = 0;
  lastUsed = Date.now();
  startedAt = Date.now();
  readyAt = 0;
  exitInfo: ReplicaExit | undefined;
  readonly exited: Promise<ReplicaExit>;

  private readonly child: ChildProcess;
  private readonly signal: (signal?: NodeJS.Signals) => boolean;
  private readonly plan: LaunchPlan;
  /** Made once the socket's path is known (before the replica is ready, so every call finds it). */
  private pool: Pool | undefined;
  private socketPath: string | undefined;
  private concurrency: number;
  /** A warm sandbox's load of its app (beginLoad), until waitReady has seen it end. */
  private loading: Promise<boolean> | undefined;
  private readonly tail: string[] = [];
  private stopRequested = false;
  private stopCause: string | undefined;

  constructor(options: ReplicaOptions) {
    super();
    this.id = options.id;
    this.plan = options.plan;
    const started = options.plan.spawn();
    this.child = started.child;
    this.signal = (signal) => started.kill(signal);
    for (const stream of ['stdout', 'stderr'] as const) {
      const source = this.child[stream];
      if (!source) continue;
      createInterface({ input: source, crlfDelay: Number.POSITIVE_INFINITY }).on('line', (line) => {
        this.tail.push(line);
        if (this.tail.length > TAIL_LINES) this.tail.shift();
        options.onOutput?.(stream, line);
      });
    }
    this.concurrency = options.concurrency;
    void started.socketPath.then((socketPath) => {
      if (socketPath === null || this.state === 'exited') return;
      this.socketPath = socketPath;
      this.pool = this.connectionPool(socketPath);
    });
    this.exited = new Promise((resolve) => {
      this.child.once('exit', (code, signal) => {
        void this.onExit(code, signal).then(resolve);
      });
      this.child.once('error', () => {
        // spawn failure (missing binary): 'exit' may not follow; report it the same way.
        if (this.child.exitCode === null && this.child.signalCode === null) void this.onExit(127, null).then(resolve);
      });
    });
  }

  private connectionPool(socketPath: string): Pool {
    return new Pool('http://replica', {
      socketPath,
      connections: this.concurrency,
      pipelining: 1,
      keepAliveTimeout: 60_000,
      keepAliveMaxTimeout: 600_000,
      headersTimeout: 0,
      bodyTimeout: 0,
    });
  }

  /**
   * A warm sandbox (warm-pool.ts), before any app: a health request and a call of `_warm` (the one function
   * a warm bootstrap has until its load) through the replica's own connection pool, so the bootstrap's
   * request and call paths have run once (Node compiles them lazily: tens of ms on a first request) and a
   * kept-alive connection is open for the load and the first run. Never rejects.
   */
  async warmUp(): Promise<void> {
    const pool = this.pool;
    if (!pool || this.state !== 'ready') return;
    for (const [method, path] of [
      ['GET', '/_ferry/health'],
      ['POST', '/_ferry/call/_warm'],
    ] as const) {
      try {
        const res = await pool.request({ method, path, body: method === 'POST' ? '{}' : null });
        await res.body.dump();
      } catch {
        // The first run connects anew; nothing is lost.
      }
    }
  }

  /**
   * A warm sandbox (warm-pool.ts) is given its app: `POST /_ferry/load` with the entry and the environment.
   * The replica is 'starting' again until waitReady has seen the load succeed; a failed load makes the
   * bootstrap exit (start-failed, with its reason in the tail). Called once, on a ready replica that has
   * served nothing, so its connection pool (made for no app) is remade for the app's concurrency.
   */
  beginLoad(body: string, concurrency: number): Promise<boolean> {
    const socketPath = this.socketPath;
    if (this.state !== 'ready' || this.loading || socketPath === undefined) {
      throw new Error(`replica ${this.id} cannot load an app (${this.state})`);
    }
    this.state = 'starting';
    this.readyAt = 0;
    this.startedAt = Date.now();
    const warmPool = this.pool;
    // On the connection warmUp left open: a new one costs the bootstrap an accept on the critical path.
    const loading = (async () => {
      let answer = warmPool ? await loadThrough(warmPool, body) : 'unsent';
      // The kept-alive connection was closed under the request before it was sent: once more, anew. (Had
      // the bootstrap received it, it answers 409 now and the start fails, as it should.)
      if (answer === 'unsent') answer = await postLoad(socketPath, body);
      const ok = answer === 200;
      if (ok && concurrency !== this.concurrency && this.state === 'starting') {
        this.concurrency = concurrency;
        this.pool = this.connectionPool(socketPath);
        void warmPool?.close().catch(() => {});
      }
      return ok;
    })();
    this.loading = loading;
    return loading;
  }

  private async waitLoaded(timeoutMs: number): Promise<void> {
    const loading = this.loading!;
    let timer: NodeJS.Timeout | undefined;
    const timedOut = new Promise<'timeout'>((resolve) => {
      timer = setTimeout(resolve, timeoutMs, 'timeout');
    });
    const outcome = await Promise.race([loading, timedOut]);
    clearTimeout(timer);
    if (outcome === true && this.state === 'starting') {
      this.state = 'ready';
      this.readyAt = Date.now();
      return;
    }
    if (outcome === 'timeout') {
      await this.kill();
      throw new FerryError('FERRY_REPLICA_START_FAILED', `The replica did not load its app within ${timeoutMs} ms`);
    }
    // The bootstrap exits after a failed load; one that does not is not left running.
    if (this.state === 'starting') {
      const exit = await Promise.race([this.exited, new Promise<undefined>((r) => setTimeout(r, 2000, undefined))]);
      if (!exit) await this.kill();
    }
    const exit = await this.exited;
    throw new FerryError('FERRY_REPLICA_START_FAILED', `The replica could not start: ${describeExit(exit)}`);
  }

  get pid(): number | undefined {
    return this.child.pid;
  }

  private async onExit(code: number | null, signal: NodeJS.Signals | null): Promise<ReplicaExit> {
    if (this.exitInfo) return this.exitInfo;
    const wasStarting = this.state === 'starting';
    this.state = 'exited';
    let reason: ReplicaExit['reason'];
    const oom = await this.plan.wasOomKilled().catch(() => false);
    if (oom || this.tail.some((l) => HEAP_OOM.test(l))) reason = 'oom';
    else if (this.stopRequested) reason = 'stopped';
    else if (wasStarting) reason = 'start-failed';
    else reason = 'crash';
    this.exitInfo = { code, signal, reason, tail: [...this.tail] };
    await this.pool?.destroy().catch(() => {});
    await this.plan.cleanup().catch(() => {});
    this.emit('exit', this.exitInfo);
    return this.exitInfo;
  }

  /** Resolves once the replica accepts connections; rejects with FERRY_REPLICA_START_FAILED otherwise. */
  async waitReady(timeoutMs: number): Promise<void> {
    if (this.loading) return this.waitLoaded(timeoutMs);
    const deadline = Date.now() + timeoutMs;
    let delay = 2;
    while (this.state === 'starting') {
      const socketPath = this.socketPath;
      if (socketPath !== undefined && fs.existsSync(socketPath) && (await canConnect(socketPath))) {
        this.state = 'ready';
        this.readyAt = Date.now();
        return;
      }
      if (Date.now() > deadline) {
        await this.kill();
        throw new FerryError('FERRY_REPLICA_START_FAILED', `The replica did not start within ${timeoutMs} ms`);
      }
      await new Promise((r) => setTimeout(r, delay));
      // Small steps: a cold start is mostly spent here, and each check is one stat (and a connect once it exists).
      delay = Math.min(delay * 2, 5);
    }
    if (this.state !== 'ready') {
      const exit = await this.exited;
      throw new FerryError('FERRY_REPLICA_START_FAILED', `The replica could not start: ${describeExit(exit)}`);
    }
  }

  /**
   * Calls a function and hands each protocol frame to `onFrame` as it arrives; resolves once the answer
   * has ended. Aborting `abort` closes the request, which makes the bootstrap stop a generator. A throw
   * from `onFrame` closes it too and rejects with what was thrown. Rejects with FERRY_FUNCTION_NOT_FOUND
   * for a 404, and with the coded error saying what happened to the replica when the transport fails.
   *
   * Built on undici's dispatch rather than `request`: a run's answer then goes from the socket to the run
   * without a body stream, an async iterator and an AbortSignal listener in between (issue 15).
   */
  callFrames(
    fn: string,
    runId: string,
    body: Buffer | string,
    abort: RunAbort,
    onFrame: (frame: Frame, bytes: number) => void,
    options?: { limits?: FrameLimits | undefined; flow?: CallFlow | undefined },
  ): Promise<void> {
    const pool = this.pool;
    if (!pool) return Promise.reject(new FerryError('FERRY_REPLICA_DIED', 'The replica is not serving'));
    return new Promise((resolve, reject) => {
      let controller: Dispatcher.DispatchController | undefined;
      let status = 0;
      let other = '';
      /** What onFrame threw: the call is closed, and this is the answer. */
      let thrown: { error: unknown } | undefined;
      const splitter = new FrameSplitter(onFrame, options?.limits);
      const flow = options?.flow;
      const stopFollowing = abort.onAbort(() => controller?.abort(abortError(abort.reason)));
      const settle = (err?: unknown) => {
        stopFollowing();
        if (err === undefined) resolve();
        else reject(err);
      };
      const handler: Dispatcher.DispatchHandler = {
        onRequestStart(c) {
          controller = c;
          if (abort.aborted) c.abort(abortError(abort.reason));
        },
        onResponseStart(_c, statusCode) {
          status = statusCode;
        },
        onResponseData(c, chunk) {
          if (status !== 200) {
            if (other.length < 200) other += chunk.toString('utf8');
            return;
          }
          if (thrown) return;
          try {
            splitter.push(chunk);
          } catch (err) {
            thrown = { error: err };
            c.abort(err instanceof Error ? err : new Error('frame handling failed'));
            return;
          }
          if (flow?.blocked && !c.paused) {
            // The caller is full: the replica's answer waits in its socket until the caller takes more.
            c.pause();
            flow.whenReady(() => {
              if (!c.aborted) c.resume();
            });
          }
        },
        onResponseEnd: () => {
          if (thrown) return settle(thrown.error);
          if (status === 404) {
            return settle(new FerryError('FERRY_FUNCTION_NOT_FOUND', `The app has no public function "${fn}"`));
          }
          if (status !== 200) {
            return settle(new FerryError('FERRY_INTERNAL', `replica answered ${status}: ${other.slice(0, 200)}`));
          }
          try {
            splitter.end();
          } catch (err) {
            return void this.failure(err, abort).then(settle);
          }
          settle();
        },
        onResponseError: (_c, err) => {
          if (thrown) return settle(thrown.error);
          void this.failure(err, abort).then(settle);
        },
      };
      pool.dispatch(
        {
          path: `/_ferry/call/${encodeURIComponent(fn)}`,
          method: 'POST',
          headers: ['content-type', 'application/json', 'x-ferry-run-id', runId],
          body,
        },
        handler,
      );
    });
  }

  /**
   * Custom runtime: sends one HTTP request to the user's server (through the replica's forwarder) and
   * resolves with its response head; the body streams as the server writes it.
   */
  async forward(request: {
    method: string;
    path: string;
    headers: Record<string, string | string[]>;
    body: Readable | Buffer | null;
    signal: AbortSignal;
  }): Promise<{ statusCode: number; headers: Record<string, string | string[] | undefined>; body: Readable }> {
    try {
      const res = await this.requirePool().request({
        method: request.method as Dispatcher.HttpMethod,
        path: request.path,
        headers: request.headers,
        body: request.body,
        signal: request.signal,
      });
      return { statusCode: res.statusCode, headers: res.headers, body: res.body };
    } catch (err) {
      throw await this.failure(err, request.signal);
    }
  }

  /**
   * Cortex runtimes: asks the bootstrap to tell the run's function it is cancelled (its AbortSignal fires;
   * an async Python function gets asyncio.CancelledError). On a connection of its own: the replica's pool
   * may be busy with the very run. Resolves whether the bootstrap found the run to tell; never rejects.
   */
  cancel(runId: string): Promise<boolean> {
    const socketPath = this.socketPath;
    if (socketPath === undefined || this.state !== 'ready') return Promise.resolve(false);
    return new Promise((resolve) => {
      const req = http.request(
        { socketPath, method: 'POST', path: `/_ferry/cancel/${encodeURIComponent(runId)}`, timeout: 5_000 },
        (res) => {
          let text = '';
          res.setEncoding('utf8');
          res.on('data', (d: string) => {
            if (text.length < 1024) text += d;
          });
          res.on('end', () => {
            try {
              resolve((JSON.parse(text) as { cancelled?: unknown }).cancelled === true);
            } catch {
              resolve(false);
            }
          });
          res.on('error', () => resolve(false));
        },
      );
      req.on('timeout', () => req.destroy());
      req.on('error', () => resolve(false));
      req.end();
    });
  }

  /** Custom runtime: a raw connection to the user's server (WebSocket upgrades are proxied over it). */
  connect(): net.Socket {
    const socketPath = this.socketPath;
    if (socketPath === undefined) throw new FerryError('FERRY_REPLICA_DIED', 'The replica has no socket');
    return net.connect(socketPath);
  }

  private requirePool(): Pool {
    if (!this.pool) throw new FerryError('FERRY_REPLICA_DIED', 'The replica is not serving');
    return this.pool;
  }

  /** Turns a transport error into the coded error that says what happened to the replica. */
  async failure(err: unknown, signal: { readonly aborted: boolean; readonly reason?: unknown }): Promise<unknown> {
    if (signal.aborted) return signal.reason ?? err;
    // The socket closes a moment before the exit status is known: wait briefly for it.
    const exit = await Promise.race([this.exited, new Promise<undefined>((r) => setTimeout(r, 2000, undefined))]);
    if (exit?.reason === 'oom') return new FerryError('FERRY_OUT_OF_MEMORY', undefined, { cause: err });
    if (exit?.reason === 'stopped' && this.stopCause) {
      return new FerryError('FERRY_REPLICA_DIED', `The replica was stopped during the run: ${this.stopCause}`, {
        cause: err,
      });
    }
    if (exit) {
      return new FerryError(
        'FERRY_REPLICA_DIED',
        `The replica running the function stopped during the run (${describeExit(exit)})`,
        { cause: err },
      );
    }
    return new FerryError('FERRY_REPLICA_DIED', 'The connection to the replica broke during the run', { cause: err });
  }

  /**
   * Stops the replica: SIGTERM to the process inside the sandbox (it finishes calls in flight), then
   * SIGKILL after `graceMs`. `cause` explains the stop to runs it cuts short.
   */
  async stop(graceMs: number, cause?: string): Promise<ReplicaExit> {
    if (this.state === 'exited') return this.exited;
    this.stopRequested = true;
    this.stopCause ??= cause;
    this.state = 'stopping';
    this.signal('SIGTERM');
    const timer = setTimeout(() => void this.kill(), graceMs);
    timer.unref();
    const exit = await this.exited;
    clearTimeout(timer);
    return exit;
  }

  /** SIGKILL at once (the sandbox takes its children with it). */
  async kill(): Promise<void> {
    this.stopRequested = true;
    if (this.child.exitCode === null && this.child.signalCode === null) this.signal('SIGKILL');
  }
}

export function describeExit(exit: ReplicaExit): string {
  const how = exit.signal ? `killed by ${exit.signal}` : `exit code ${exit.code}`;
  const last = exit.tail
    .filter((l) => l.trim() !== '')
    .slice(-3)
    .join(' | ');
  return last ? `${how}: ${last.slice(0, 500)}` : how;
}

/**
 * A warm sandbox's load request through the replica's connection pool: the answer's status, 'unsent' when
 * the connection failed before any answer, 0 when the answer broke off.
 */
async function loadThrough(pool: Pool, body: string): Promise<number | 'unsent'> {
  let res: Dispatcher.ResponseData;
  try {
    res = await pool.request({
      method: 'POST',
      path: '/_ferry/load',
      headers: { 'content-type': 'application/json' },
      body,
    });
  } catch {
    return 'unsent';
  }
  try {
    await res.body.dump();
    return res.statusCode;
  } catch {
    return 0;
  }
}

/** A warm sandbox's load request on a connection of its own: the answer's status, 0 without one. */
function postLoad(socketPath: string, body: string): Promise<number> {
  return new Promise((resolve) => {
    const req = http.request(
      {
        socketPath,
        method: 'POST',
        path: '/_ferry/load',
        headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) },
      },
      (res) => {
        res.resume();
        res.on('end', () => resolve(res.statusCode ?? 0));
        res.on('error', () => resolve(0));
      },
    );
    req.on('error', () => resolve(0));
    req.end(body);
  });
}

function canConnect(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect(socketPath);
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('error', () => resolve(false));
  });
}

/** What a run's request is closed with: its abort's reason when that is an Error (undici wants one). */
function abortError(reason: unknown): Error {
  return reason instanceof Error ? reason : new Error('the run was aborted');
}

/** Starts a replica process; use `waitReady` before calling it. */
export function startReplica(options: ReplicaOptions): Replica {
  return new Replica(options);
}
