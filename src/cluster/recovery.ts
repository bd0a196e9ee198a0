/**
 * Recovery by lease expiry: takes over the work of nodes whose lease ran out (cluster/node.ts), and only
 * theirs. Nothing is reset because a process started: a second process joining the store leaves the first
 * one's work alone.
 *
 * What a dead node held, and what becomes of it:
 *   async run, claimed but not started   → queued again, free for any node (it never started)
 *   async run, running                   → `failure`, reason `interrupted` (its webhook says so); or, when
 *                                          the app has `retry_interrupted = true` and the run has started
 *                                          fewer than MAX_RUN_STARTS times, queued again (runs/lifecycle.ts
 *                                          `interruption` decides, `endRun` says what is written)
 *   sync or stream run, unfinished       → `failure`, reason `interrupted` (its caller is gone)
 *   webhook attempt in flight (sending)  → pending again (that attempt did not count; the receiver may see
 *                                          the payload twice: spec section 6 rule 9)
 *   build, building or pending           → pending and free: another node builds it from the start
 *
 * Work held by no node in a state that needs one (left by a Ferry before leases) is treated the same way.
 * Every change is conditional on the row still being the dead node's, so two nodes sweeping at once
 * change each row once.
 *
 * Two invariants close the gaps around it:
 * - Once a run is settled nothing rewrites it (ARCHITECTURE invariant 7). A node judged dead may only be
 *   frozen: when it comes back, its recorder's writes are fenced (store/run-updates.ts) by the run being
 *   unfinished and, for an async run, `running` in the start the node made (`attempts`); a run ended here,
 *   or queued again and started anew, changes no more. The late node counts what it discarded
 *   (`ferry_late_results_discarded_total`).
 * - Every accepted run ends, whatever fails in between. This sweep sees dead nodes only and the relay
 *   sees runs nobody holds, so a live node's own runs are its own to end: it keeps a run in hand through
 *   store errors, and its held-runs sweep (runs/async-worker.ts) lets go of, or ends with
 *   `endUnfinished` below, the runs the store says it holds but it never heard of (a claim or start
 *   committed while the connection broke).
 */
import type { Logger } from 'pino';
import type { AppConfig } from '../apps/app-config.js';
import { endRun, interruption, type RetryContext, type RunEnding, withRetries } from '../runs/lifecycle.js';
import { NO_RETRIES } from '../runs/retries.js';
import type { Store } from '../store/index.js';
import type { Run } from '../store/schema.js';
import { unfinishedRun } from '../store/unfinished.js';
import { LEASE_ENDED, type NodeLease } from './node.js';

export interface RecoveryResult {
  /** Runs ended `failure`, reason `interrupted`. */
  interrupted: number;
  /** Runs queued again for any node (claimed but never started, or retried by policy). */
  requeued: number;
  /** Webhook deliveries whose attempt was cut short, pending again. */
  deliveries: number;
  /** Builds pending again for any node. */
  builds: number;
}

export interface Recovery {
  /**
   * One pass over every dead node, begun after the call (after the pass under way, if any); resolves with
   * what that pass took over.
   */
  sweep(): Promise<RecoveryResult>;
  /** Sweeps every `intervalMs` until closed. */
  start(): void;
  close(): Promise<void>;
}

export function createRecovery(deps: {
  store: Store;
  node: NodeLease;
  logger: Logger;
  intervalMs?: number;
  clock?: () => number;
  /** Told after a sweep that took anything over (wakes the webhook deliverer and the async worker). */
  onRecovered?: (result: RecoveryResult) => void;
  /** Told after every periodic sweep (the build pipeline looks for free builds then). */
  onSwept?: () => void;
}): Recovery {
  const { store, node, logger } = deps;
  const clock = deps.clock ?? Date.now;
  const intervalMs = deps.intervalMs ?? Math.max(500, Math.floor(node.ttlMs / 3));
  let timer: NodeJS.Timeout | undefined;
  let sweeping: Promise<RecoveryResult> | undefined;
  /** The pass asked for while `sweeping` was under way. */
  let next: Promise<RecoveryResult> | undefined;
  let closed = false;
  let orphansDone = false;

  /** Takes over what `owner` (a dead node, or null for work no node holds) left unfinished. */
  async function takeOver(owner: string | null): Promise<RecoveryResult> {
    const result: RecoveryResult = { interrupted: 0, requeued: 0, deliveries: 0, builds: 0 };
    const nowMs = clock();
    const now = new Date(nowMs).toISOString();
    await store.transaction().execute(async (trx) => {
      // Claimed but never started: free again (never counts as an attempt).
      if (owner !== null) {
        const freed = await trx
          .updateTable('runs')
          // published_at: its message was acknowledged (or dropped) by whoever fetched it: the relay
          // publishes it again at once (--nats-url).
          .set({ owner: null, published_at: null })
          .where('owner', '=', owner)
          .where('state', '=', 'queued')
          .where('mode', '=', 'async')
          .where(unfinishedRun())
          .executeTakeFirst();
        result.requeued += Number(freed.numUpdatedRows);
      }
      const unfinished = await trx
        .selectFrom('runs')
        .leftJoin('builds', 'builds.id', 'runs.build_id')
        .select(UNFINISHED_COLUMNS)
        .where((eb) => (owner === null ? eb('runs.owner', 'is', null) : eb('runs.owner', '=', owner)))
        .where((eb) =>
          eb.or([
            eb('runs.state', '=', 'running'),
            eb.and([eb('runs.mode', '!=', 'async'), eb('runs.state', '=', 'queued')]),
          ]),
        )
        .where(unfinishedRun('runs.state'))
        .execute();
      const ended = await endUnfinished(trx, owner, unfinished, nowMs);
      result.interrupted += ended.interrupted;
      result.requeued += ended.requeued;
      const deliveries = await trx
        .updateTable('webhook_deliveries')
        .set({ state: 'pending', owner: null, next_attempt_at: now, updated_at: now })
        .where((eb) => (owner === null ? eb('owner', 'is', null) : eb('owner', '=', owner)))
        .where('state', '=', 'sending')
        .executeTakeFirst();
      result.deliveries += Number(deliveries.numUpdatedRows);
      const builds = await trx
        .updateTable('builds')
        .set({ state: 'pending', owner: null, started_at: null })
        .where((eb) => (owner === null ? eb('owner', 'is', null) : eb('owner', '=', owner)))
        .where('state', owner === null ? '=' : 'in', owner === null ? 'building' : ['pending', 'building'])
        .executeTakeFirst();
      result.builds += Number(builds.numUpdatedRows);
      if (owner !== null) {
        await trx.deleteFrom('nodes').where('id', '=', owner).where('lease_until', '<', now).execute();
      }
    });
    return result;
  }

  async function sweepOnce(): Promise<RecoveryResult> {
    const total: RecoveryResult = { interrupted: 0, requeued: 0, deliveries: 0, builds: 0 };
    const now = new Date(clock()).toISOString();
    // A lease ended on purpose (a node that stopped, or the last process of this data directory) is over
    // for sure; one that ran out is judged only by a node whose own renewals have been steady (node.ts).
    const dead = await store
      .selectFrom('nodes')
      .select('id')
      .where((eb) => (node.canJudge() ? eb('lease_until', '<', now) : eb('lease_until', '=', LEASE_ENDED)))
      .where('id', '!=', node.id)
      .execute();
    // Work held by no node in a state that needs one exists only in a store written before leases (or by
    // hand): looked for once, at the first sweep.
    const owners = orphansDone ? dead.map((d) => d.id) : [null, ...dead.map((d) => d.id)];
    orphansDone = true;
    for (const owner of owners) {
      const r = await takeOver(owner);
      total.interrupted += r.interrupted;
      total.requeued += r.requeued;
      total.deliveries += r.deliveries;
      total.builds += r.builds;
      if (owner !== null) logger.info({ node: owner, ...r }, 'took over the work of a node whose lease ran out');
    }
    if (total.interrupted + total.requeued + total.deliveries + total.builds > 0) deps.onRecovered?.(total);
    return total;
  }

  /**
   * A pass that begins now, or after the one under way: that one may have read the leases before the
   * caller's change (a node that just stopped), so a caller never gets that pass's result. Callers that
   * ask while a pass is under way share the one that follows it.
   */
  function sweep(): Promise<RecoveryResult> {
    if (!sweeping) {
      sweeping = sweepOnce().finally(() => {
        sweeping = undefined;
      });
      return sweeping;
    }
    next ??= sweeping
      .catch(() => undefined)
      .then(() => {
        next = undefined;
        return sweep();
      });
    return next;
  }

  return {
    sweep,
    start() {
      timer = setInterval(() => {
        // A tick during a pass (a slow store) waits for the next tick rather than queueing another pass.
        if (closed || sweeping) return;
        sweep().then(
          () => deps.onSwept?.(),
          (err: unknown) => logger.warn({ err }, 'recovery sweep failed; retrying'),
        );
      }, intervalMs);
      timer.unref();
    },
    async close() {
      closed = true;
      if (timer) clearInterval(timer);
      await next?.catch(() => undefined);
      await sweeping?.catch(() => undefined);
    },
  };
}

function configOf(configJson: string | null): AppConfig | undefined {
  if (!configJson) return undefined;
  try {
    return JSON.parse(configJson) as AppConfig;
  } catch {
    return undefined;
  }
}

/** How an unfinished run ends: `retry_interrupted`'s start again, else its retry policy's, else interrupted. */
function endingOf(run: UnfinishedRun, nowMs: number): { ending: RunEnding; retries: RetryContext | undefined } {
  const config = configOf(run.config_json ?? null);
  const ending = interruption(run, config?.app.retry_interrupted === true, nowMs);
  const policy = config?.retries;
  const retries =
    run.mode === 'async' && ((policy && policy.max_attempts > 1) || run.attempt_log)
      ? {
          policy: policy && policy.max_attempts > 1 ? policy : NO_RETRIES,
          log: run.attempt_log,
          attempt: run.attempts,
          startedAt: run.started_at,
        }
      : undefined;
  // A run that never started (still queued when its node stopped) is no attempt of its own.
  if (!retries || run.state !== 'running' || ending.kind !== 'interrupted') return { ending, retries: undefined };
  return { ending: withRetries(ending, retries), retries };
}

const UNFINISHED_COLUMNS = [
  'runs.id',
  'runs.mode',
  'runs.state',
  'runs.attempts',
  'runs.started_at',
  'runs.webhook_endpoint',
  'runs.attempt_log',
  'builds.config_json',
] as const;

/** A run whose node stopped running it, as `endUnfinished` needs it. */
export interface UnfinishedRun {
  id: string;
  mode: Run['mode'];
  state: Run['state'];
  attempts: number;
  started_at: string | null;
  webhook_endpoint: string | null;
  attempt_log: string | null;
  config_json: string | null;
}

/**
 * Ends runs `owner` held and no longer runs, in the caller's transaction, as runs/lifecycle.ts says: an
 * async run queued again when its app retries interrupted runs and it has starts left, any other
 * `failure`, reason `interrupted`, with its webhook. Each change is fenced by the run still being
 * `owner`'s in the state it was read in.
 */
export async function endUnfinished(
  trx: Store,
  owner: string | null,
  runs: readonly UnfinishedRun[],
  nowMs: number,
): Promise<{ interrupted: number; requeued: number }> {
  const result = { interrupted: 0, requeued: 0 };
  const now = new Date(nowMs).toISOString();
  for (const run of runs) {
    const { ending, retries } = endingOf(run, nowMs);
    const end = endRun({ id: run.id, webhookUrl: run.webhook_endpoint, retries }, ending, nowMs);
    const changed = await trx
      .updateTable('runs')
      .set(end.changes)
      .where('id', '=', run.id)
      .where((eb) => (owner === null ? eb('owner', 'is', null) : eb('owner', '=', owner)))
      .where('state', '=', run.state)
      .executeTakeFirst();
    if (!end.final) {
      result.requeued += Number(changed.numUpdatedRows);
      continue;
    }
    if (Number(changed.numUpdatedRows) === 0) continue;
    result.interrupted += 1;
    if (end.outbox) {
      await trx
        .insertInto('webhook_deliveries')
        .values({
          run_id: end.runId,
          url: end.outbox.url,
          payload: end.outbox.payload,
          state: 'pending',
          attempts: 0,
          next_attempt_at: now,
          created_at: now,
          updated_at: now,
        })
        .onConflict((oc) => oc.doNothing())
        .execute();
    }
  }
  return result;
}

/**
 * The async runs `owner` (a live node: this one) holds in the store but no longer has in hand, read for
 * `endUnfinished` or to be let go (queued ones): what a lost answer of the store leaves behind (a claim or
 * a start committed whose commit the node never heard of, or a run the node dropped on a store error).
 */
export async function heldAsyncRuns(store: Store, owner: string): Promise<UnfinishedRun[]> {
  return store
    .selectFrom('runs')
    .leftJoin('builds', 'builds.id', 'runs.build_id')
    .select(UNFINISHED_COLUMNS)
    .where('runs.owner', '=', owner)
    .where('runs.mode', '=', 'async')
    .where(unfinishedRun('runs.state'))
    .execute();
}
