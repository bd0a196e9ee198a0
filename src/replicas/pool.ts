/**
 * The replicas of one build of one app, and the runs waiting for them.
 *
 * A run takes a slot (a replica with fewer than `replica_concurrency` runs in flight, the least busy first).
 * When there is none, it waits in a bounded FIFO queue, and the pool starts replicas while runs wait and
 * fewer than `max_replicas` exist. Idle replicas above `min_replicas` stop after `cooldown` seconds. A
 * replica whose run timed out stops at once, cutting its other runs (a spinning function must not keep
 * its CPU for another grace period).
 *
 * A draining pool (its build was replaced, or its app deleted) takes no new runs, and its replicas stop once
 * their runs finish. A run already waiting in it is never left behind (issue 43): it goes to the pool of
 * the app's new build (`drain(successor)`), or, when there is none, is served here first, by a replica
 * started for it if none is left; a replica is stopped only when no run waits. The manager's `tend`, every
 * second, is the check behind that rule: runs waiting with no replica ready, starting or allowed to start
 * get one (or go to the app's current pool), and the log says so.
 */
import type { Logger } from 'pino';
import type { AppConfig } from '../apps/app-config.js';
import { FerryError } from '../errors.js';
import { describeExit, type Replica, type ReplicaExit } from './replica.js';

export interface PoolBuild {
  projectId: string;
  appId: string;
  buildId: string;
  /** The build's runtime (`builds.runtime`): `runtimeOf` (runtimes/) gives what differs between runtimes. */
  runtime: string | null;
  config: AppConfig;
}

export interface Slot {
  replica: Replica;
  /**
   * The build of the replica's pool: the one that runs the call. Not always the build the run asked for:
   * a run waiting when its app's build changed is served by the new build's pool.
   */
  build: PoolBuild;
  /** True when no replica was ready when the run asked: it waited for one to start. */
  coldStart: boolean;
  /**
   * Gives the slot back. `timedOut`: the run passed its deadline and may still be running in the replica,
   * so the replica takes no more runs and is stopped at once: SIGTERM, RUN_TIMEOUT_KILL_GRACE_MS, then
   * SIGKILL of its whole sandbox. Other runs in flight on it (replica_concurrency > 1) are cut too.
   */
  release(options?: { timedOut?: boolean; reason?: string }): void;
}

export interface PoolDeps {
  build: PoolBuild;
  /** Starts a replica process for this build (not yet ready). */
  startReplica(): Promise<Replica>;
  maxQueue: number;
  startTimeoutMs: number;
  logger: Logger;
  /** Told when replicas start, become ready and stop, for metrics. */
  onChange?: () => void;
  onColdStart?: (ms: number) => void;
  /** Receives what happened to a replica (exits, restarts), for the app's log. */
  onEvent?: (replicaId: string, line: string) => void;
  /**
   * Whether this node may start one more replica now (`FERRY_WORKER_MAX_REPLICAS`, over all apps); runs
   * wait in the app's queue while it says no, and the pool tries again when `rescale` is called.
   */
  mayStart?: () => boolean;
  /**
   * The replicas this node keeps for the app at least: `min_replicas`, or 0 on a worker of a cluster that
   * is not the app's home (min_replicas counts for the whole cluster: the home worker keeps them).
   */
  minReplicas?: () => number;
}

/**
 * How long a replica whose run timed out has between SIGTERM and SIGKILL: enough for a runtime to exit
 * cleanly, not enough for a spinning function to burn much more CPU (docs/functions.md says so).
 */
export const RUN_TIMEOUT_KILL_GRACE_MS = 3_000;

/** Restart back-off after a crash: 0.5 s, doubling per failure in a row, at most 30 s. */
const RESTART_BACKOFF_MS = { first: 500, max: 30_000 };
/** A replica that served this long before it crashed starts the back-off from the beginning again. */
const STABLE_AFTER_MS = 60_000;

interface Waiter {
  /** The pool whose queue holds it now (it moves with a hand-over). */
  pool: ReplicaPool;
  resolve(slot: Slot): void;
  reject(err: unknown): void;
  coldStart: boolean;
  signal: AbortSignal | undefined;
  onAbort: () => void;
}

export class ReplicaPool {
  private current: PoolBuild;
  readonly replicas = new Set<Replica>();
  private readonly waiters: Waiter[] = [];
  private draining = false;
  private readonly deps: PoolDeps;
  private startFailures = 0;
  private readonly retired = new Set<Replica>();
  /** Replicas being prepared (sandbox, environment) but not spawned yet: they count toward max_replicas. */
  private launching = 0;
  /** Crashes and failed starts in a row (reset by a replica that becomes ready and stays up). */
  private failuresInRow = 0;
  /** close() was called: nothing starts any more. */
  private closed = false;
  private restartTimer: NodeJS.Timeout | undefined;
  /** ensureMinimum() stopped short at the node's cap: rescale() tries again when another replica stops. */
  private minimumHeldByCap = false;

  constructor(deps: PoolDeps) {
    this.deps = deps;
    this.current = deps.build;
  }

  /** The build this pool runs, with the app's scaling in force (updated in place by `updateScaling`). */
  get build(): PoolBuild {
    return this.current;
  }

  /**
   * New scaling for the same build (`PATCH .../apps/{app}`), in force at once: replicas start up to a higher
   * min_replicas, waiting runs may start replicas up to a higher max_replicas, and idle replicas above a
   * lower max_replicas stop now (busy ones when their runs end, as after a cooldown). replica_concurrency
   * is not changed in place: a replica is started for its concurrency, so the manager replaces the pool.
   */
  updateScaling(scaling: PoolBuild['config']['scaling']): void {
    this.current = { ...this.current, config: { ...this.current.config, scaling } };
    if (this.draining) return;
    this.ensureMinimum();
    this.scale();
    let live = this.live();
    const idle = [...this.replicas]
      .filter((r) => r.state === 'ready' && r.inflight === 0)
      .sort((a, b) => a.lastUsed - b.lastUsed);
    for (const r of idle) {
      if (live <= scaling.max_replicas) break;
      live -= 1;
      this.deps.logger.info({ replica: r.id, app: this.build.appId }, 'replica above max_replicas; stopping');
      void this.stopReplica(r);
    }
    // Busy replicas above the new maximum take no new runs and stop once idle.
    for (const r of [...this.replicas].filter((x) => x.state === 'ready' && !this.retired.has(x))) {
      if (live <= scaling.max_replicas) break;
      if (r.inflight === 0) continue;
      live -= 1;
      this.retired.add(r);
    }
  }

  private get scaling() {
    return this.build.config.scaling;
  }

  private get minReplicas(): number {
    return this.deps.minReplicas ? this.deps.minReplicas() : this.scaling.min_replicas;
  }

  /** Replicas being launched, starting or ready (what counts toward max_replicas and the node's cap). */
  get liveReplicas(): number {
    return this.live();
  }

  /** Another pool started or stopped a replica (the node's cap may have room): the minimum, then waiting runs. */
  rescale(): void {
    if (this.minimumHeldByCap && !this.draining) this.ensureMinimum();
    if (this.waiters.length > 0) this.scale();
  }

  get queueDepth(): number {
    return this.waiters.length;
  }

  get isDraining(): boolean {
    return this.draining;
  }

  /** How many replicas count toward max_replicas: being launched, starting or ready (not stopping). */
  private live(): number {
    let n = this.launching;
    for (const r of this.replicas) if (r.state === 'starting' || r.state === 'ready') n++;
    return n;
  }

  private free(): Replica | undefined {
    let best: Replica | undefined;
    for (const r of this.replicas) {
      if (r.state !== 'ready' || this.retired.has(r) || r.inflight >= this.scaling.replica_concurrency) continue;
      if (!best || r.inflight < best.inflight) best = r;
    }
    return best;
  }

  private take(replica: Replica, coldStart: boolean): Slot {
    replica.inflight += 1;
    replica.lastUsed = Date.now();
    let released = false;
    return {
      replica,
      build: this.current,
      coldStart,
      release: (options) => {
        if (released) return;
        released = true;
        replica.inflight -= 1;
        replica.lastUsed = Date.now();
        if (options?.timedOut) this.killTimedOut(replica, options.reason);
        // A draining pool's replica serves the runs waiting here first; dispatch stops it when none is left.
        this.dispatch();
      },
    };
  }

  /**
   * Takes a free slot at once, without a Promise, when one is free and no run waits before this one;
   * undefined otherwise (then `acquire` waits for one). The hot path of a warm app.
   */
  tryAcquire(): Slot | undefined {
    if (this.draining || this.waiters.length > 0) return undefined;
    const replica = this.free();
    return replica ? this.take(replica, false) : undefined;
  }

  /** Takes a slot, waiting (and starting replicas) when none is free. */
  acquire(signal?: AbortSignal): Promise<Slot> {
    if (this.draining)
      return Promise.reject(new FerryError('FERRY_NO_READY_BUILD', 'The build is being replaced; retry'));
    const replica = this.free();
    if (replica && this.waiters.length === 0) return Promise.resolve(this.take(replica, false));
    // The queue bound is for runs beyond the app's capacity: runs that replicas now starting (or that may
    // still start) will serve do not count against it, so a cold app is not refused its first burst.
    let inflight = 0;
    for (const r of this.replicas) if (!this.retired.has(r)) inflight += r.inflight;
    const capacity = this.scaling.max_replicas * this.scaling.replica_concurrency;
    if (this.waiters.length >= this.deps.maxQueue + Math.max(0, capacity - inflight)) {
      return Promise.reject(
        new FerryError(
          'FERRY_QUEUE_FULL',
          `The app is running ${this.live()} replicas at capacity and ${this.waiters.length} runs are waiting; retry later`,
          { headers: { 'retry-after': '1' } },
        ),
      );
    }
    return new Promise<Slot>((resolve, reject) => {
      const coldStart = ![...this.replicas].some((r) => r.state === 'ready');
      const waiter: Waiter = {
        pool: this,
        resolve,
        reject,
        coldStart,
        signal,
        onAbort: () => {
          const { waiters } = waiter.pool;
          const i = waiters.indexOf(waiter);
          if (i >= 0) waiters.splice(i, 1);
          reject(signal?.reason ?? new Error('aborted'));
        },
      };
      signal?.addEventListener('abort', waiter.onAbort, { once: true });
      this.waiters.push(waiter);
      this.scale();
      this.dispatch();
    });
  }

  /** Hands free slots to waiting runs, in order. */
  private dispatch(): void {
    while (this.waiters.length > 0) {
      const replica = this.free();
      if (!replica) break;
      const waiter = this.waiters.shift()!;
      waiter.signal?.removeEventListener('abort', waiter.onAbort);
      waiter.resolve(this.take(replica, waiter.coldStart));
    }
    if (this.draining && this.waiters.length === 0) {
      for (const r of this.replicas) if (r.inflight === 0 && r.state === 'ready') void this.stopReplica(r);
    }
  }

  /** Starts replicas while runs wait for capacity that starting replicas will not provide. */
  private scale(): void {
    if (this.closed) return;
    // A draining pool grows no more: its waiting runs get a replica only when it has none left.
    if (this.draining && this.live() > 0) return;
    const starting = this.launching + [...this.replicas].filter((r) => r.state === 'starting').length;
    let capacityComing = starting * this.scaling.replica_concurrency;
    while (
      this.waiters.length > capacityComing &&
      this.live() < this.scaling.max_replicas &&
      (this.deps.mayStart?.() ?? true)
    ) {
      void this.addReplica();
      capacityComing += this.scaling.replica_concurrency;
    }
  }

  /** Keeps at least min_replicas running (called at activation and after a replica exits). */
  ensureMinimum(): void {
    if (this.draining) return;
    // The node's cap (FERRY_WORKER_MAX_REPLICAS) holds for the minimum too; rescale() tops it up once room
    // frees (and only then: a minimum waiting on its restart back-off is not hurried by other pools' changes).
    this.minimumHeldByCap = false;
    while (this.live() < this.minReplicas) {
      if (!(this.deps.mayStart?.() ?? true)) {
        this.minimumHeldByCap = true;
        break;
      }
      void this.addReplica();
    }
  }

  private async addReplica(): Promise<void> {
    const started = Date.now();
    let replica: Replica;
    // Counted from now, synchronously: scale() must see this replica before its launch resolves.
    this.launching += 1;
    try {
      replica = await this.deps.startReplica();
    } catch (err) {
      this.launching -= 1;
      this.failWaiters(err);
      return;
    }
    this.launching -= 1;
    this.replicas.add(replica);
    this.deps.onChange?.();
    replica.once('exit', (exit) => this.onReplicaExit(replica, exit));
    try {
      await replica.waitReady(this.deps.startTimeoutMs);
      this.startFailures = 0;
      this.deps.onEvent?.(replica.id, `replica ready after ${Date.now() - started} ms`);
      this.deps.onColdStart?.(Date.now() - started);
      this.deps.logger.info(
        { replica: replica.id, app: this.build.appId, build: this.build.buildId, ms: Date.now() - started },
        'replica ready',
      );
      this.deps.onChange?.();
      this.dispatch();
    } catch (err) {
      this.startFailures += 1;
      this.deps.logger.warn({ replica: replica.id, app: this.build.appId, err }, 'replica failed to start');
      // Runs waiting only on this start would wait forever: tell them why it failed.
      const stillStarting = [...this.replicas].some((r) => r !== replica && r.state === 'starting');
      if (!stillStarting && !this.free()) this.failWaiters(err);
    }
  }

  private failWaiters(err: unknown): void {
    for (const waiter of this.waiters.splice(0)) {
      waiter.signal?.removeEventListener('abort', waiter.onAbort);
      waiter.reject(err);
    }
  }

  private onReplicaExit(replica: Replica, exit: ReplicaExit): void {
    this.replicas.delete(replica);
    this.retired.delete(replica);
    this.deps.onChange?.();
    if (exit.reason === 'stopped') {
      this.deps.onEvent?.(replica.id, `replica stopped (${describeExit(exit)})`);
      // A replica stopped after a timed-out run: keep the minimum (not for a draining pool), and serve runs
      // that wait (a draining pool's too, until none is left).
      this.ensureMinimum();
      this.scale();
      return;
    }
    if (replica.readyAt > 0 && Date.now() - replica.readyAt >= STABLE_AFTER_MS) this.failuresInRow = 0;
    this.failuresInRow += 1;
    const delay = Math.min(RESTART_BACKOFF_MS.max, RESTART_BACKOFF_MS.first * 2 ** (this.failuresInRow - 1));
    const what = exit.reason === 'start-failed' ? 'failed to start' : `exited unexpectedly (${exit.reason})`;
    this.deps.logger.warn(
      { replica: replica.id, app: this.build.appId, reason: exit.reason, detail: describeExit(exit) },
      `replica ${what}; it will be replaced`,
    );
    // Runs waiting now get a replica at once (in a draining pool too, until none is left); the standing
    // minimum comes back after a growing back-off, so a server that keeps crashing is not restarted in a
    // tight loop.
    if (this.startFailures < 3) this.scale();
    if (this.draining) return;
    const live = this.live();
    const restart = live < this.minReplicas;
    this.deps.onEvent?.(
      replica.id,
      `replica ${what}: ${describeExit(exit)}${restart ? `; restarting in ${(delay / 1000).toFixed(1)} s` : ''}`,
    );
    if (restart && !this.restartTimer) {
      this.restartTimer = setTimeout(() => {
        this.restartTimer = undefined;
        this.ensureMinimum();
      }, delay);
      this.restartTimer.unref();
    }
  }

  /**
   * A run on `replica` timed out (or was cancelled and did not return): no more runs on it, and it is
   * stopped now, whatever else it is running.
   */
  private killTimedOut(replica: Replica, reason = 'a run timed out'): void {
    this.retired.add(replica);
    this.deps.onEvent?.(
      replica.id,
      `${reason}: stopping the replica (SIGTERM, then SIGKILL after ${RUN_TIMEOUT_KILL_GRACE_MS} ms)${replica.inflight > 0 ? `; ${replica.inflight} other run(s) on it are cut` : ''}`,
    );
    if (replica.state !== 'stopping' && replica.state !== 'exited') {
      void replica.stop(RUN_TIMEOUT_KILL_GRACE_MS, `another run on the same replica: ${reason}`);
    }
    this.scale();
  }

  private async stopReplica(replica: Replica): Promise<void> {
    if (replica.state === 'stopping' || replica.state === 'exited') return;
    await replica.stop(this.scaling.response_grace_period * 1000);
  }

  /** Stops idle replicas above min_replicas whose cooldown has passed. */
  reapIdle(now = Date.now()): void {
    if (this.draining) return;
    const cooldownMs = this.scaling.cooldown * 1000;
    let live = this.live();
    const idle = [...this.replicas]
      .filter((r) => r.state === 'ready' && r.inflight === 0 && now - r.lastUsed >= cooldownMs)
      .sort((a, b) => a.lastUsed - b.lastUsed);
    for (const r of idle) {
      if (live <= this.minReplicas) break;
      live -= 1;
      this.deps.logger.info({ replica: r.id, app: this.build.appId }, 'replica idle past cooldown; stopping');
      void this.stopReplica(r);
    }
    for (const r of this.retired) if (r.inflight === 0) void this.stopReplica(r);
  }

  /**
   * Takes no new runs; replicas stop when their runs are done. The runs waiting here go to `successor`
   * (the pool of the app's new build) now; with none, they are served here first, by a replica started for
   * them if none is left (the module comment says why).
   */
  drain(successor?: ReplicaPool): void {
    this.draining = true;
    clearTimeout(this.restartTimer);
    if (successor) this.handOver(successor);
    this.dispatch();
    this.scale();
  }

  /**
   * The manager's check (every second) that the runs waiting here are being served. A draining pool hands
   * them to `successor`, the app's current pool, when it has one now (a later call made it); any pool
   * starts a replica for runs that have none ready, starting or allowed to start (a start held by the
   * node's cap, or by the app's replicas on other workers, is tried again here). A run that waited with no
   * replica at all, none coming, is a missed wake-up: the log says so.
   */
  tend(successor?: ReplicaPool): void {
    if (this.waiters.length === 0 || this.closed) return;
    if (this.draining && successor && successor !== this && !successor.draining) {
      this.handOver(successor);
      return;
    }
    this.dispatch();
    if (this.waiters.length === 0) return;
    const none = this.live() === 0;
    this.scale();
    if (none && this.live() > 0) {
      this.deps.logger.warn(
        { app: this.build.appId, build: this.build.buildId, waiting: this.waiters.length },
        'runs waited with no replica starting for them; starting one',
      );
    }
  }

  /** Moves the runs waiting here to `to`, ahead of its own: they have waited longer. */
  private handOver(to: ReplicaPool): void {
    if (this.waiters.length === 0 || to === this || to.draining) return;
    const moved = this.waiters.splice(0);
    const cold = ![...to.replicas].some((r) => r.state === 'ready');
    for (const waiter of moved) {
      waiter.pool = to;
      waiter.coldStart ||= cold;
    }
    to.waiters.unshift(...moved);
    this.deps.logger.info(
      { app: this.build.appId, from: this.build.buildId, to: to.build.buildId, runs: moved.length },
      'runs waiting for the replaced build go to the new one',
    );
    to.scale();
    to.dispatch();
  }

  /** Stops every replica (server shutdown): runs in flight get the grace period. */
  async close(graceMs?: number): Promise<void> {
    this.draining = true;
    this.closed = true;
    clearTimeout(this.restartTimer);
    this.failWaiters(
      new FerryError('FERRY_NO_READY_BUILD', 'The server is stopping', { headers: { 'retry-after': '5' } }),
    );
    await Promise.all([...this.replicas].map((r) => r.stop(graceMs ?? this.scaling.response_grace_period * 1000)));
  }

  get stats(): { starting: number; ready: number; inflight: number; queued: number } {
    let starting = 0;
    let ready = 0;
    let inflight = 0;
    for (const r of this.replicas) {
      if (r.state === 'starting') starting++;
      if (r.state === 'ready') ready++;
      inflight += r.inflight;
    }
    return { starting, ready, inflight, queued: this.waiters.length };
  }
}
