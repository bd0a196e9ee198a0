/**
 * The async worker: performs the internal synchronous call of every accepted async run (spec 4.3).
 *
 * Runs are shared work: every Ferry process on the store may run any queued async run, and a run is
 * performed by the node that holds it (its `owner`, cluster/node.ts):
 * - A run accepted here is held by this node from its insert when this node has room for it (`ownerFor`),
 *   and queued here at once; otherwise it is inserted free.
 * - Free queued runs (inserted free, or freed by recovery after their node died) are claimed in batches by
 *   one statement (store/claims.ts), oldest first, leaving out apps this node already holds enough of, so
 *   one app's backlog does not fill a node while other apps wait.
 * - A held run is marked `running` (one more start) only once a replica slot is taken (`claim` in
 *   runs/invoke.ts): from then on a crash of this node makes it `interrupted` (cluster/recovery.ts), never
 *   a silent second run.
 *
 * Each app gets at most as many runs in flight here as its replicas can take (max_replicas ×
 * replica_concurrency), so a burst waits in the store or in this node's queue instead of overflowing the
 * app's in-memory queue. Nothing is reset at start: work of a node that died is recovered by lease expiry.
 *
 * Every accepted run ends, whatever fails in between (ARCHITECTURE invariant 7's other half). A store
 * error while a run is in hand (reading its call or its app, marking it started, failing it) keeps it in
 * hand and tries again later; and what a lost answer of the store leaves behind is found by the held-runs
 * sweep: a run the store says this node holds, unfinished, that this node has not had in hand (nor the
 * recorder unwritten) at two sweeps in a row is a claim or start it never heard of. A queued one is let go
 * (owner cleared: any node claims it, and the relay publishes it again with --nats-url); a running one is
 * ended as recovery ends a dead node's (cluster/recovery.ts: interrupted, or queued again by policy).
 */
import type { Logger } from 'pino';
import { endUnfinished, heldAsyncRuns } from '../cluster/recovery.js';
import { FerryError } from '../errors.js';
import type { PoolBuild } from '../replicas/pool.js';
import { runtimeOf } from '../runtimes/index.js';
import { claimQueuedRuns, releaseQueuedRuns } from '../store/claims.js';
import type { Store } from '../store/index.js';
import { type Invoker, RunInterruptedError, RunNotClaimedError, RunStartError } from './invoke.js';
import { endRun } from './lifecycle.js';
import type { RunRecorder } from './recorder.js';
import { NO_RETRIES, type RetryPolicy } from './retries.js';
import type { RunTargets } from './targets.js';

export interface AsyncWorker {
  /**
   * The owner to insert an async run of this app with, when it is accepted here: this node when it has room
   * to queue it now (then `enqueue` it), or null to leave it free for whichever node has room first.
   */
  ownerFor(projectId: string, appId: string): string | null;
  /** Queues a committed async run this node holds (with its call when it was accepted here). */
  enqueue(run: { id: string; projectId: string; appId: string; call?: RunCall | undefined }): void;
  /** Looks for free queued runs now (a run was accepted free, or recovery freed some). */
  wake(): void;
  /** Async runs this node holds and has not finished (queued here or running). */
  readonly backlog: number;
  /**
   * How many more runs of this app this node would hold now (`app`), and of any app (`total`): what the
   * JetStream queue fetches at most (the same limits as `ownerFor`).
   */
  room(projectId: string, appId: string): { app: number; total: number };
  /** Starts claiming free queued runs (now, then every poll interval and whenever woken). */
  start(): Promise<void>;
  /**
   * Stops; runs in flight finish (or are interrupted: invoke.ts), runs queued here, or interrupted before
   * they started, are let go for any node to take.
   */
  close(): Promise<void>;
}

/** What the worker reads of a run record to perform it. */
export interface RunCall {
  function_name: string;
  input: string | null;
  webhook_endpoint: string | null;
  http_request: string | null;
  /** The attempts of a run under a retry policy that ended before (runs/lifecycle.ts); absent: none. */
  attempt_log?: string | null;
}

interface Queued {
  id: string;
  projectId: string;
  appId: string;
  /**
   * The run's call, known when the run was accepted on this node: no read of its record before it is
   * performed (whether it is still queued and this node's is checked when it is started, see `claim`).
   */
  call?: RunCall | undefined;
}

/**
 * The retry policy an attempt runs under: the build's `[retries]` when it allows more than one attempt,
 * or the attempts so far of a run that had one when it was accepted (a later build dropped it).
 */
function retriesOf(build: PoolBuild, run: RunCall): { policy: RetryPolicy; log: string | null } | undefined {
  const policy = build.config.retries;
  if (policy && policy.max_attempts > 1) return { policy, log: run.attempt_log ?? null };
  if (run.attempt_log) return { policy: NO_RETRIES, log: run.attempt_log };
  return undefined;
}

/** Runs this node holds queued, in all: past it, new runs are left free for other nodes. */
const MAX_HELD = 1000;
/** Runs per app this node holds queued, in units of the app's capacity (and at least MIN_HELD_PER_APP). */
const HELD_PER_CAPACITY = 2;
const MIN_HELD_PER_APP = 16;
const CLAIM_BATCH = 100;

export function createAsyncWorker(deps: {
  store: Store;
  targets: RunTargets;
  invoker: Invoker;
  recorder: RunRecorder;
  logger: Logger;
  /** This node's id (cluster/node.ts). */
  owner: string;
  /** When a run finds its app at capacity, how long before it is tried again. */
  retryDelayMs?: number;
  /** How often free queued runs are looked for when nothing wakes the worker. Default 1 s. */
  pollIntervalMs?: number;
  /**
   * Whether free queued runs are claimed from the store (default true: the embedded default's queue). The
   * JetStream queue (runs/jetstream-queue.ts) turns it off and hands the worker the runs it claimed.
   */
  claimFromStore?: boolean;
  /** Told when a held run leaves this node's hands: performed, failed, or found not to be its to run. */
  onSettled?: (runId: string) => void;
  /** Told at close of the queued runs let go (after the store was told). */
  onReleased?: (runIds: string[]) => void;
  /** Told when room was made (a run ended): more may be taken. */
  onRoom?: () => void;
  /** Told when a held run's start is written (a replica slot taken, the run marked running here). */
  onStarted?: (runId: string) => void;
  /** How often the held-runs sweep looks for runs this node holds in the store but not in hand. Default 10 s. */
  heldSweepMs?: number;
}): AsyncWorker {
  const { store, invoker, recorder, logger, owner } = deps;
  const pollMs = deps.pollIntervalMs ?? 1000;
  const queues = new Map<string, Queued[]>();
  const inflight = new Map<string, number>();
  /** Apps' capacity (max_replicas × replica_concurrency) as last seen, for how many runs to hold. */
  const capacities = new Map<string, number>();
  const running = new Set<Promise<void>>();
  let held = 0;
  let backlog = 0;
  let started = false;
  let closed = false;
  let pollTimer: NodeJS.Timeout | undefined;
  let sweepTimer: NodeJS.Timeout | undefined;
  /** Runs in hand here: queued here or being performed (a run held twice is counted by its entries). */
  const inHand = new Map<string, number>();
  let pulling: Promise<void> | undefined;
  let pullAgain = false;

  const keyOf = (q: { projectId: string; appId: string }) => `${q.projectId}/${q.appId}`;
  const heldLimit = (key: string) =>
    Math.max(MIN_HELD_PER_APP, HELD_PER_CAPACITY * (capacities.get(key) ?? MIN_HELD_PER_APP));

  async function target(q: Queued): Promise<PoolBuild | undefined> {
    const found = await deps.targets.get(q.projectId, q.appId);
    if (!found?.buildId || !found.config) return undefined;
    return {
      projectId: q.projectId,
      appId: q.appId,
      buildId: found.buildId,
      runtime: found.runtime,
      config: found.config,
    };
  }

  /** The run's call from its record, or undefined when it is no longer this node's queued run. */
  async function readCall(id: string): Promise<RunCall | undefined> {
    const run = await store
      .selectFrom('runs')
      .select(['input', 'function_name', 'webhook_endpoint', 'state', 'owner', 'http_request', 'attempt_log'])
      .where('id', '=', id)
      .executeTakeFirst();
    return run?.state === 'queued' && run.owner === owner ? run : undefined;
  }

  /** Runs interrupted before they started (a server stopping past its grace): let go at close. */
  const interrupted: string[] = [];

  async function execute(q: Queued, build: PoolBuild): Promise<'done' | 'retry' | 'let go'> {
    let run: RunCall | undefined;
    try {
      run = q.call ?? (await readCall(q.id));
    } catch (err) {
      logger.warn({ err, runId: q.id }, 'could not read an async run; trying again');
      return 'retry';
    }
    if (!run) return 'done';
    const common = {
      runId: q.id,
      build,
      fn: run.function_name,
      mode: 'async' as const,
      recorded: true,
      webhookUrl: run.webhook_endpoint ?? undefined,
      claim: deps.onStarted ? () => startTold(q.id) : () => start(q.id),
      retries: retriesOf(build, run),
    };
    try {
      if (run.http_request) {
        // A custom app's request, as the caller sent it (its target server may have changed runtime since:
        // the call is still forwarded, and a cortex build answers it with a clear error).
        const stored = JSON.parse(run.http_request) as {
          method: string;
          path: string;
          headers: Record<string, string | string[]>;
          body_base64: string;
        };
        if (runtimeOf(build).calls !== 'http') {
          return await failRunOrRetry(
            q,
            'FERRY_CORTEX_CALL',
            'The app was redeployed as a cortex app before this HTTP request ran',
          );
        }
        const body = Buffer.from(stored.body_base64, 'base64');
        await invoker.invokeHttp({
          ...common,
          http: { method: stored.method, path: stored.path, headers: stored.headers, body: body.length ? body : null },
        });
      } else if (runtimeOf(build).calls === 'http') {
        return await failRunOrRetry(
          q,
          'FERRY_CORTEX_CALL',
          'The app was redeployed as a custom app before this function call ran',
        );
      } else {
        await invoker.invoke({ ...common, body: Buffer.from(run.input ?? '{}') });
      }
    } catch (err) {
      // The app is at capacity (its other callers filled it), or the store would not take the start: wait
      // here rather than fail an accepted run.
      if (err instanceof FerryError && err.code === 'FERRY_QUEUE_FULL') return 'retry';
      if (err instanceof RunStartError) {
        logger.warn({ err, runId: q.id }, 'could not mark an async run started; trying again');
        return 'retry';
      }
      // Cancelled, or taken over by another node: not ours to run.
      if (err instanceof RunNotClaimedError) return 'done';
      if (err instanceof RunInterruptedError) return 'let go';
      // Every other outcome is already recorded on the run by the invoker.
    }
    return 'done';
  }

  /**
   * Marks a run started. The runs that take a replica slot in one turn of the event loop share one UPDATE
   * (one write per run would cost the run endpoint a fifth of its async throughput), and that UPDATE
   * shares its commit with the async runs accepted meanwhile (recorder.startNow).
   */
  function start(id: string): Promise<number | undefined> {
    return recorder.startNow(id, owner);
  }

  /** start, then onStarted when the run was this node's to start. */
  async function startTold(id: string): Promise<number | undefined> {
    const attempt = await recorder.startNow(id, owner);
    if (attempt !== undefined) deps.onStarted?.(id);
    return attempt;
  }

  const pumping = new Set<string>();
  const again = new Set<string>();

  function pump(): void {
    if (closed) return;
    for (const key of queues.keys()) pumpApp(key);
  }

  /** One dispatch loop per app at a time: two loops could otherwise take the same queued run. */
  function pumpApp(key: string): void {
    if (pumping.has(key)) {
      again.add(key);
      return;
    }
    pumping.add(key);
    void dispatch(key)
      .catch((err: unknown) => {
        // The store failed (reading the app's build, or failing a run): the runs stay queued here, and the
        // app is tried again in a second (not sooner: one warning a second per app while the store is down).
        logger.warn({ err, app: key }, 'async dispatch failed; trying again');
        setTimeout(() => pumpApp(key), Math.max(1000, deps.retryDelayMs ?? 200)).unref();
      })
      .finally(() => {
        pumping.delete(key);
        if (again.delete(key)) pumpApp(key);
      });
  }

  async function dispatch(key: string): Promise<void> {
    const queue = queues.get(key);
    if (!queue) return;
    while (queue.length > 0 && !closed) {
      const head = queue[0]!;
      const build = await target(head);
      // Closed meanwhile: the head was let go with the rest (close), it is not started here.
      if (closed) return;
      if (!build) {
        // Failed first: should the store fail, the run stays queued here and is tried again.
        await failRun(head, 'FERRY_NO_READY_BUILD', 'The app has no ready build (it was removed or never built)');
        queue.shift();
        held -= 1;
        backlog -= 1;
        outOfHand(head.id);
        deps.onSettled?.(head.id);
        continue;
      }
      const capacity = build.config.scaling.max_replicas * build.config.scaling.replica_concurrency;
      capacities.set(key, capacity);
      if ((inflight.get(key) ?? 0) >= capacity) return;
      queue.shift();
      held -= 1;
      inflight.set(key, (inflight.get(key) ?? 0) + 1);
      const task: Promise<void> = execute(head, build)
        .then(async (outcome) => {
          if (outcome === 'retry') {
            queue.unshift(head);
            held += 1;
            await new Promise<void>((r) => setTimeout(r, deps.retryDelayMs ?? 200));
            return;
          }
          backlog -= 1;
          outOfHand(head.id);
          // Not settled: still queued, let go with the others at close (its message nak'd, not acked).
          if (outcome === 'let go') interrupted.push(head.id);
          else deps.onSettled?.(head.id);
        })
        .catch((err: unknown) => {
          backlog -= 1;
          outOfHand(head.id);
          logger.error({ err, runId: head.id }, 'async run failed unexpectedly');
          deps.onSettled?.(head.id);
        })
        .finally(() => {
          inflight.set(key, (inflight.get(key) ?? 1) - 1);
          running.delete(task);
          pumpApp(key);
          // Room was made: other nodes' free runs may be waiting.
          if (held < MAX_HELD / 2) schedulePull();
          deps.onRoom?.();
        });
      running.add(task);
    }
    if (queue.length === 0 && (inflight.get(key) ?? 0) === 0) queues.delete(key);
  }

  /** failRun, or 'retry' when the store fails (the run stays in hand). */
  async function failRunOrRetry(
    q: Queued,
    code: 'FERRY_NO_READY_BUILD' | 'FERRY_CORTEX_CALL',
    message: string,
  ): Promise<'done' | 'retry'> {
    try {
      await failRun(q, code, message);
      return 'done';
    } catch (err) {
      logger.warn({ err, runId: q.id }, 'could not fail an async run; trying again');
      return 'retry';
    }
  }

  /** Ends a held run the worker cannot perform (runs/lifecycle.ts), with its webhook (if any) told why. */
  async function failRun(
    q: Queued,
    code: 'FERRY_NO_READY_BUILD' | 'FERRY_CORTEX_CALL',
    message: string,
  ): Promise<void> {
    const run =
      q.call ?? (await store.selectFrom('runs').select('webhook_endpoint').where('id', '=', q.id).executeTakeFirst());
    recorder.finish(
      endRun({ id: q.id, webhookUrl: run?.webhook_endpoint }, { kind: 'not-performed', error: { code, message } }),
    );
  }

  function hold(run: Queued): void {
    held += 1;
    backlog += 1;
    inHand.set(run.id, (inHand.get(run.id) ?? 0) + 1);
    const key = keyOf(run);
    const queue = queues.get(key);
    if (queue) queue.push(run);
    else queues.set(key, [run]);
  }

  /** Claims free queued runs while this node has room; one pass at a time. */
  function pull(): Promise<void> {
    if (!started || closed || deps.claimFromStore === false) return Promise.resolve();
    if (pulling) {
      pullAgain = true;
      return pulling;
    }
    pulling = (async () => {
      // Never finish synchronously: the `finally` below must run after `pulling` is assigned, or a pass that
      // found no room (MAX_HELD reached) would leave `pulling` set for good and this node would stop claiming.
      await null;
      try {
        do {
          pullAgain = false;
          const room = Math.min(CLAIM_BATCH, MAX_HELD - held);
          if (room <= 0) break;
          const full = [...queues.entries()]
            .filter(([key, queue]) => queue.length >= heldLimit(key))
            .map(([key]) => {
              const [projectId = '', appId = ''] = key.split('/');
              return { projectId, appId };
            });
          const claimed = await claimQueuedRuns(store, owner, room, full);
          for (const run of claimed) hold({ id: run.id, projectId: run.project_id, appId: run.app_id });
          if (claimed.length > 0) pump();
          if (claimed.length === room) pullAgain = true;
        } while (pullAgain && !closed);
      } catch (err) {
        logger.warn({ err }, 'claiming queued async runs failed; retrying');
      } finally {
        pulling = undefined;
      }
    })();
    return pulling;
  }

  function outOfHand(id: string): void {
    const n = inHand.get(id) ?? 0;
    if (n <= 1) inHand.delete(id);
    else inHand.set(id, n - 1);
  }

  /** Runs not in hand at the previous sweep (see the module comment). */
  let suspects = new Set<string>();
  let sweeping = false;

  /** The held-runs sweep: runs the store says this node holds, unfinished, and this node does not. */
  async function sweepHeld(): Promise<void> {
    if (sweeping || closed) return;
    sweeping = true;
    try {
      const rows = await heldAsyncRuns(store, owner);
      const loose = rows.filter((r) => !inHand.has(r.id) && !recorder.holds(r.id));
      const confirmed = loose.filter((r) => suspects.has(r.id));
      suspects = new Set(loose.filter((r) => !suspects.has(r.id)).map((r) => r.id));
      if (confirmed.length === 0 || closed) return;
      // Checked again right before: a run taken in hand since the read is left alone.
      const queued = confirmed.filter((r) => r.state === 'queued' && !inHand.has(r.id)).map((r) => r.id);
      const running = confirmed.filter((r) => r.state === 'running' && !inHand.has(r.id) && !recorder.holds(r.id));
      await releaseQueuedRuns(store, owner, queued);
      const ended =
        running.length > 0
          ? await store.transaction().execute((trx) => endUnfinished(trx, owner, running, Date.now()))
          : { interrupted: 0, requeued: 0 };
      logger.warn(
        { released: queued.length, ...ended, runs: [...queued, ...running.map((r) => r.id)].slice(0, 20) },
        'async runs this node held in the store but not in hand (an answer of the store was lost): let go or ended',
      );
      if (queued.length > 0) deps.onReleased?.(queued);
      void pull();
    } catch (err) {
      logger.debug({ err }, 'the held-runs sweep failed; trying again');
    } finally {
      sweeping = false;
    }
  }

  let pullScheduled = false;
  function schedulePull(): void {
    if (pullScheduled || !started || closed) return;
    pullScheduled = true;
    setTimeout(() => {
      pullScheduled = false;
      void pull();
    }, 50).unref();
  }

  return {
    ownerFor(projectId, appId) {
      if (closed || held >= MAX_HELD) return null;
      const key = `${projectId}/${appId}`;
      return (queues.get(key)?.length ?? 0) < heldLimit(key) ? owner : null;
    },
    enqueue(run) {
      hold(run);
      pump();
    },
    wake() {
      void pull();
    },
    get backlog() {
      return backlog;
    },
    room(projectId, appId) {
      if (closed) return { app: 0, total: 0 };
      const key = `${projectId}/${appId}`;
      const total = Math.max(0, MAX_HELD - held);
      return { app: Math.min(total, Math.max(0, heldLimit(key) - (queues.get(key)?.length ?? 0))), total };
    },
    async start() {
      started = true;
      sweepTimer = setInterval(() => void sweepHeld(), deps.heldSweepMs ?? 10_000);
      sweepTimer.unref();
      if (deps.claimFromStore === false) return;
      pollTimer = setInterval(() => void pull(), pollMs);
      pollTimer.unref();
      await pull();
    },
    async close() {
      closed = true;
      if (pollTimer) clearInterval(pollTimer);
      if (sweepTimer) clearInterval(sweepTimer);
      await pulling;
      // Runs queued here and not started: any node (or this one's next start) may take them.
      const left = [...queues.values()].flat().map((q) => q.id);
      queues.clear();
      await releaseQueuedRuns(store, owner, left).catch((err: unknown) =>
        logger.warn({ err, runs: left.length }, 'could not let go of queued runs; they are freed when the lease ends'),
      );
      deps.onReleased?.(left);
      // Runs in flight finish (their replicas get the grace period), or are interrupted (invoke.ts).
      await Promise.allSettled([...running]);
      const unstarted = interrupted.splice(0);
      if (unstarted.length === 0) return;
      await releaseQueuedRuns(store, owner, unstarted).catch((err: unknown) =>
        logger.warn(
          { err, runs: unstarted.length },
          'could not let go of interrupted runs; they are freed when the lease ends',
        ),
      );
      deps.onReleased?.(unstarted);
    },
  };
}
