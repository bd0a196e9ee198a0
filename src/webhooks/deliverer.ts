/**
 * The webhook deliverer: drains the durable outbox (`webhook_deliveries`) by POSTing each payload to
 * its URL, following the retry table of retry-policy.ts.
 *
 * Everything a delivery needs lives in the store, so deliveries survive restarts (invariant 2): the run
 * recorder writes the outbox row in the transaction that finishes the run, and this loop only moves
 * rows between states:
 *
 *   pending ──claim──▶ sending ──attempt──▶ delivered | failed | pending (retry at next_attempt_at)
 *
 * A row is `sending`, owned by this node (cluster/node.ts), while it has an attempt in flight; that state
 * is what keeps one delivery from being sent twice at once, by this process or any other sharing the
 * store. Rows are claimed in one statement (store/claims.ts) and their outcome is written only while this
 * node still owns them. Rows a dead node left `sending` go back to `pending` once its lease has run out
 * (cluster/recovery.ts), so such a delivery may reach its receiver twice (spec section 6 rule 9:
 * receivers are idempotent). The attempt that was cut short is not recorded and does not count towards
 * the 3 attempts.
 *
 * A live node can hold a row it is not sending, too: a claim that committed while the store went away
 * before its answer came back (issue 43). Recovery leaves a live node's rows alone, so the node's own
 * held-deliveries sweep finds them: a row the store says this node is sending, with no attempt in flight
 * here and no claim of this node under way, at two sweeps in a row (`heldSweepMs` apart, 5 s by default),
 * is let go (pending again, due now, its attempts unchanged) and the loop claims it again. A delivery held
 * that way waits at most two sweeps once the store answers again (docs/operations.md).
 *
 * Throughput: due rows are claimed in batches (one transaction), sent concurrently (up to
 * `concurrency`), and the outcomes of every attempt that finished since the last write are written in
 * one transaction. Connections to a receiver are kept alive between deliveries.
 *
 * The run's signing secret (`runs.webhook_secret`, encrypted) is erased 7 days after its delivery ended;
 * redelivery is refused from then on, so a delivery that was signed is never re-sent unsigned.
 */
import { performance } from 'node:perf_hooks';
import type { Logger } from 'pino';
import { type Dispatcher, request } from 'undici';
import { FerryError } from '../errors.js';
import { nowIso, randomHex } from '../ids.js';
import { findRun } from '../runs/runs.js';
import { claimDueDeliveries, type HeldDelivery, heldDeliveries, releaseHeldDeliveries } from '../store/claims.js';
import type { Store } from '../store/index.js';
import { type AllowList, createGuardedAgent, parseAllowList } from './address-guard.js';
import {
  classifyError,
  classifyStatus,
  findCause,
  MAX_ATTEMPTS,
  nextStep,
  PermanentDeliveryError,
  resolveRetryDelays,
  type Verdict,
} from './retry-policy.js';
import { decryptWebhookSecret } from './secret.js';
import { signWebhook } from './signature.js';

export type DeliveryState = 'pending' | 'sending' | 'delivered' | 'failed';

/** How long the signing secret is kept after a delivery ended, and so how long redelivery is possible. */
export const SECRET_RETENTION_MS = 7 * 24 * 3600 * 1000;
export const DEFAULT_ATTEMPT_TIMEOUT_MS = 10_000;
export const DEFAULT_CONCURRENCY = 64;
/** The most response body bytes read (and thrown away) so the connection can be reused. */
const MAX_RESPONSE_BYTES = 64 * 1024;
const USER_AGENT = 'Ferry-Webhooks/1';

export interface WebhookDelivererOptions {
  store: Store;
  logger: Logger;
  /** The key of `keys/secrets.key`; webhook secrets are encrypted under it. */
  secretsKey: Uint8Array;
  /** `FERRY_WEBHOOK_ALLOW`: the CIDRs a webhook may reach although they are internal. */
  allow: string | AllowList;
  /** `FERRY_WEBHOOK_TIMEOUT_MS`: one attempt, from connecting to the end of the response. Default 10 s. */
  attemptTimeoutMs?: number;
  /** Waits before attempts 2 and 3; each is clamped to 0..5,000 ms. Default [1000, 3000]. */
  retryDelaysMs?: readonly number[];
  /** Unix milliseconds now; tests move it. */
  clock?: () => number;
  /** Attempts in flight at once. Default 64. */
  concurrency?: number;
  /** The safety-net poll of the outbox, for rows written without `wake()`. Default 1 s. */
  pollIntervalMs?: number;
  /**
   * How often the held-deliveries sweep looks for rows this node holds `sending` with no attempt in flight
   * (the module comment says why). Default 5 s.
   */
  heldSweepMs?: number;
  /** How often the secret purge runs. Default 1 hour. */
  purgeIntervalMs?: number;
  /** How long `close()` lets attempts in flight finish before cutting them short. Default 1 s. */
  closeGraceMs?: number;
  /** Told about every recorded attempt, and the delivery's final state when it has one (metrics). */
  onAttempt?: (verdict: Verdict, final: 'delivered' | 'failed' | undefined) => void;
  /** This node's id (cluster/node.ts): the owner of the rows it sends. Default: a random one. */
  owner?: string;
  /** For tests of the address guard: the resolver used instead of the system's. */
  lookup?: (hostname: string) => Promise<Array<{ address: string; family: number }>>;
}

export interface WebhookDeliverer {
  /** Starts the loop (deliveries a dead node left `sending` are recovered by cluster/recovery.ts). */
  start(): void;
  /** New outbox rows are committed: look now rather than at the next poll. */
  wake(): void;
  /**
   * Sends the run's delivery again with a fresh budget of 3 attempts, whatever its state. Throws
   * FERRY_RUN_NOT_FOUND, FERRY_NO_WEBHOOK (no delivery to send) or FERRY_WEBHOOK_EXPIRED.
   */
  redeliver(projectId: string, appId: string, runId: string): Promise<void>;
  /** Erases the signing secrets of deliveries that ended more than 7 days ago; returns how many. */
  purgeSecrets(): Promise<number>;
  /** Stops the loop; attempts still in flight after the grace period are cut short and left `pending`. */
  close(): Promise<void>;
}

interface Job {
  run_id: string;
  url: string;
  payload: string;
  /** Attempts made in the current budget. */
  attempts: number;
  webhook_secret: string | null;
  last_attempt: number | null;
}

interface Outcome {
  job: Job;
  /** The attempt's number for the run, counting across redeliveries. */
  number: number;
  at: string;
  status: number | null;
  error: string | null;
  durationMs: number;
  verdict: Verdict;
  /** Cut short by close(): not recorded, the row goes back to pending. */
  interrupted: boolean;
}

interface InFlight {
  controller: AbortController;
  done: Promise<void>;
  /** redeliver() was asked while this attempt ran: start a fresh budget once it ends. */
  reset: boolean;
}

export function createWebhookDeliverer(options: WebhookDelivererOptions): WebhookDeliverer {
  const { store, logger, secretsKey } = options;
  const allow = typeof options.allow === 'string' ? parseAllowList(options.allow) : options.allow;
  const clock = options.clock ?? Date.now;
  const timeoutMs = options.attemptTimeoutMs ?? DEFAULT_ATTEMPT_TIMEOUT_MS;
  const delays = resolveRetryDelays(options.retryDelaysMs);
  const concurrency = Math.max(1, options.concurrency ?? DEFAULT_CONCURRENCY);
  const pollMs = options.pollIntervalMs ?? 1_000;
  const purgeMs = options.purgeIntervalMs ?? 3600 * 1000;
  const heldSweepMs = options.heldSweepMs ?? 5_000;
  const graceMs = options.closeGraceMs ?? 1_000;
  const owner = options.owner ?? `deliverer-${randomHex(6)}`;
  const agent: Dispatcher = createGuardedAgent({ allow, connectTimeoutMs: timeoutMs, lookup: options.lookup });

  const inFlight = new Map<string, InFlight>();
  let outcomes: Outcome[] = [];
  let started = false;
  let closed = false;
  let ticking: Promise<void> | undefined;
  let again = false;
  let kickScheduled = false;
  let timer: NodeJS.Timeout | undefined;
  let purgeTimer: NodeJS.Timeout | undefined;
  let sweepTimer: NodeJS.Timeout | undefined;
  /**
   * Claims under way, by the `updated_at` they stamp on the rows they take: those rows are this node's and
   * not in flight yet, so the held-deliveries sweep leaves them alone.
   */
  const claimsUnderWay = new Map<string, number>();

  function kick(): void {
    if (!started || closed || kickScheduled) return;
    kickScheduled = true;
    setImmediate(() => {
      kickScheduled = false;
      void tick();
    });
  }

  function arm(ms: number): void {
    if (closed) return;
    if (timer) clearTimeout(timer);
    timer = setTimeout(kick, Math.max(0, ms));
    timer.unref();
  }

  /** One pass at a time; a kick during a pass makes it go round once more. */
  function tick(): Promise<void> {
    if (ticking) {
      again = true;
      return ticking;
    }
    ticking = (async () => {
      try {
        do {
          again = false;
          await step();
        } while (again && !closed);
      } catch (err) {
        logger.error({ err }, 'the webhook outbox could not be read or written; retrying');
        arm(pollMs);
      } finally {
        ticking = undefined;
      }
    })();
    return ticking;
  }

  async function step(): Promise<void> {
    await writeOutcomes();
    if (closed) return;
    const free = concurrency - inFlight.size;
    // Full: the next finished attempt kicks the loop.
    if (free <= 0) return;
    const stamp = nowIso(clock);
    claimsUnderWay.set(stamp, (claimsUnderWay.get(stamp) ?? 0) + 1);
    let jobs: Job[];
    try {
      jobs = await claim(free, stamp);
      for (const job of jobs) launch(job);
    } finally {
      const n = claimsUnderWay.get(stamp) ?? 1;
      if (n <= 1) claimsUnderWay.delete(stamp);
      else claimsUnderWay.set(stamp, n - 1);
    }
    if (jobs.length === free) {
      again = true;
      return;
    }
    const next = await store
      .selectFrom('webhook_deliveries')
      .select((eb) => eb.fn.min('next_attempt_at').as('next'))
      .where('state', '=', 'pending')
      .executeTakeFirst();
    const due = next?.next ? Date.parse(next.next) - clock() : pollMs;
    arm(Math.min(pollMs, due));
  }

  async function claim(limit: number, now: string): Promise<Job[]> {
    const claimed = await claimDueDeliveries(store, owner, now, limit);
    if (claimed.length === 0) return [];
    const ids = claimed.map((c) => c.run_id);
    const [secrets, last] = await Promise.all([
      store.selectFrom('runs').select(['id', 'webhook_secret']).where('id', 'in', ids).execute(),
      store
        .selectFrom('webhook_attempts')
        .select((eb) => ['run_id', eb.fn.max('attempt').as('m')])
        .where('run_id', 'in', ids)
        .groupBy('run_id')
        .execute(),
    ]);
    const secretOf = new Map(secrets.map((r) => [r.id, r.webhook_secret]));
    const lastOf = new Map(last.map((r) => [r.run_id, Number(r.m)]));
    return claimed.map((c) => ({
      ...c,
      webhook_secret: secretOf.get(c.run_id) ?? null,
      last_attempt: lastOf.get(c.run_id) ?? null,
    }));
  }

  function launch(job: Job): void {
    const controller = new AbortController();
    const entry: InFlight = { controller, reset: false, done: Promise.resolve() };
    inFlight.set(job.run_id, entry);
    entry.done = attempt(job, controller.signal).then(
      (outcome) => {
        outcomes.push(outcome);
        kick();
      },
      (err: unknown) => logger.error({ err, runId: job.run_id }, 'webhook attempt crashed'),
    );
  }

  async function attempt(job: Job, closeSignal: AbortSignal): Promise<Outcome> {
    const number = (job.last_attempt ?? 0) + 1;
    const startedAt = clock();
    const t0 = performance.now();
    const done = (fields: Pick<Outcome, 'status' | 'error' | 'verdict'>, interrupted = false): Outcome => ({
      job,
      number,
      at: new Date(startedAt).toISOString(),
      durationMs: Math.round(performance.now() - t0),
      interrupted,
      ...fields,
    });

    const body = Buffer.from(job.payload, 'utf8');
    const headers: Record<string, string> = {
      'Content-Type': 'application/json',
      'User-Agent': USER_AGENT,
      'X-Request-Id': job.run_id,
    };
    if (job.webhook_secret !== null) {
      let secret: string;
      try {
        secret = decryptWebhookSecret(secretsKey, job.run_id, job.webhook_secret);
      } catch (err) {
        // Sending unsigned would make a verifying receiver reject it anyway, and hide the cause.
        return done({ status: null, error: (err as Error).message, verdict: 'permanent' });
      }
      // Signed when this attempt is sent, over exactly the bytes sent, so every attempt is fresh.
      const timestamp = Math.floor(clock() / 1000);
      headers['X-Service-Webhook-Timestamp'] = String(timestamp);
      headers['X-Service-Webhook-Signature'] = signWebhook(secret, job.run_id, timestamp, body);
    }

    let url: URL;
    try {
      url = new URL(job.url);
      if (url.protocol !== 'http:' && url.protocol !== 'https:') throw new Error(`${url.protocol} is not http(s)`);
    } catch (err) {
      return done({
        status: null,
        error: `not a URL Ferry can send to: ${(err as Error).message}`,
        verdict: 'permanent',
      });
    }

    // One deadline for the whole attempt: resolving, connecting, sending and reading the response.
    const deadline = AbortSignal.timeout(timeoutMs);
    const signal = AbortSignal.any([deadline, closeSignal]);
    try {
      const response = await request(url, { method: 'POST', headers, body, dispatcher: agent, signal });
      // Read (a bounded part of) the body so the connection can carry the next delivery.
      await response.body.dump({ limit: MAX_RESPONSE_BYTES, signal }).catch(() => undefined);
      const status = response.statusCode;
      const note = status >= 300 && status <= 399 ? 'redirect not followed' : null;
      return done({ status, error: note, verdict: classifyStatus(status) });
    } catch (err) {
      if (closeSignal.aborted && !deadline.aborted) {
        return done({ status: null, error: 'interrupted: Ferry stopped', verdict: 'retry' }, true);
      }
      if (deadline.aborted) {
        return done({ status: null, error: `timed out after ${timeoutMs} ms`, verdict: 'retry' });
      }
      return done({ status: null, error: describeError(err), verdict: classifyError(err) });
    }
  }

  async function writeOutcomes(): Promise<void> {
    if (outcomes.length === 0) return;
    const batch = outcomes;
    outcomes = [];
    const now = nowIso(clock);
    const failed: Outcome[] = [];
    const resetDone = new Set<string>();
    const attemptRows = batch
      .filter((o) => !o.interrupted)
      .map((o) => ({
        run_id: o.job.run_id,
        attempt: o.number,
        at: o.at,
        status_code: o.status,
        error: o.error,
        duration_ms: o.durationMs,
      }));
    try {
      await store.transaction().execute(async (trx) => {
        if (attemptRows.length > 0) {
          await trx
            .insertInto('webhook_attempts')
            .values(attemptRows)
            .onConflict((oc) => oc.doNothing())
            .execute();
        }
        for (const o of batch) {
          const reset = inFlight.get(o.job.run_id)?.reset === true;
          if (reset) resetDone.add(o.job.run_id);
          let set: {
            state: DeliveryState;
            attempts: number;
            next_attempt_at: string | null;
            updated_at: string;
            owner: null;
          };
          if (reset) {
            set = { state: 'pending', attempts: 0, next_attempt_at: now, updated_at: now, owner: null };
          } else if (o.interrupted) {
            set = { state: 'pending', attempts: o.job.attempts, next_attempt_at: now, updated_at: now, owner: null };
          } else {
            const made = o.job.attempts + 1;
            const next = nextStep(o.verdict, made, delays);
            if (next.state === 'failed') failed.push(o);
            options.onAttempt?.(o.verdict, next.state === 'pending' ? undefined : next.state);
            set =
              next.state === 'pending'
                ? {
                    state: 'pending',
                    attempts: made,
                    next_attempt_at: nowIso(() => clock() + next.delayMs),
                    updated_at: now,
                    owner: null,
                  }
                : { state: next.state, attempts: made, next_attempt_at: null, updated_at: now, owner: null };
          }
          await trx
            .updateTable('webhook_deliveries')
            .set(set)
            .where('run_id', '=', o.job.run_id)
            .where('state', '=', 'sending')
            // Only while this node still holds it: after a lost lease another node sends it.
            .where('owner', '=', owner)
            .execute();
        }
      });
    } catch (err) {
      // Not written (the transaction rolled back): the rows stay `sending` and in flight here, so
      // nothing sends them again meanwhile, and the outcomes are written at the next pass.
      outcomes = batch.concat(outcomes);
      throw err;
    }
    // A redelivery asked while this transaction ran found the attempt still in flight and only set its
    // flag, after the flag was read: start its fresh budget now.
    const lateResets = batch.filter((o) => inFlight.get(o.job.run_id)?.reset === true && !resetDone.has(o.job.run_id));
    for (const o of batch) inFlight.delete(o.job.run_id);
    for (const o of lateResets) {
      await store
        .updateTable('webhook_deliveries')
        .set({ state: 'pending', attempts: 0, next_attempt_at: now, updated_at: now, owner: null })
        .where('run_id', '=', o.job.run_id)
        .where('state', '!=', 'sending')
        .execute();
    }
    if (lateResets.length > 0) again = true;
    for (const o of failed) {
      logger.warn(
        {
          runId: o.job.run_id,
          target: safeOrigin(o.job.url),
          attempts: o.job.attempts + 1,
          status: o.status,
          error: o.error,
        },
        o.verdict === 'permanent'
          ? 'webhook delivery failed permanently'
          : `webhook delivery failed after ${MAX_ATTEMPTS} attempts`,
      );
    }
  }

  /** Rows not in flight at the previous sweep, with the `updated_at` they had then. */
  let suspects = new Map<string, string>();
  let sweeping = false;

  /** The held-deliveries sweep (see the module comment): rows this node holds `sending` and is not sending. */
  async function sweepHeld(): Promise<void> {
    if (sweeping || closed) return;
    sweeping = true;
    try {
      const loose = (await heldDeliveries(store, owner)).filter(
        (d) => !inFlight.has(d.run_id) && !claimsUnderWay.has(d.updated_at),
      );
      const confirmed = loose.filter((d) => suspects.get(d.run_id) === d.updated_at);
      suspects = new Map(loose.map((d) => [d.run_id, d.updated_at]));
      // Checked again right before: a row taken in flight since the read is left alone.
      const release: HeldDelivery[] = confirmed.filter(
        (d) => !inFlight.has(d.run_id) && !claimsUnderWay.has(d.updated_at),
      );
      if (release.length === 0 || closed) return;
      const released = await releaseHeldDeliveries(store, owner, release, nowIso(clock));
      for (const d of release) suspects.delete(d.run_id);
      if (released === 0) return;
      logger.warn(
        { released, runs: release.map((d) => d.run_id).slice(0, 20) },
        'webhook deliveries this node held in the store but not in flight (an answer of the store was lost): let go',
      );
      kick();
    } catch (err) {
      logger.debug({ err }, 'the held-deliveries sweep failed; trying again');
    } finally {
      sweeping = false;
    }
  }

  async function purgeSecrets(): Promise<number> {
    const cutoff = nowIso(() => clock() - SECRET_RETENTION_MS);
    const ended = await store
      .updateTable('runs')
      .set({ webhook_secret: null })
      .where('webhook_secret', 'is not', null)
      .where('id', 'in', (eb) =>
        eb
          .selectFrom('webhook_deliveries')
          .select('run_id')
          .where('state', 'in', ['delivered', 'failed'])
          .where('updated_at', '<=', cutoff),
      )
      .executeTakeFirst();
    // Runs that ended without a delivery (interrupted before the outbox row was written) need no secret.
    const orphans = await store
      .updateTable('runs')
      .set({ webhook_secret: null })
      .where('webhook_secret', 'is not', null)
      .where('finished_at', '<=', cutoff)
      .where(({ not, exists, selectFrom }) =>
        not(exists(selectFrom('webhook_deliveries as d').select('d.run_id').whereRef('d.run_id', '=', 'runs.id'))),
      )
      .executeTakeFirst();
    return Number(ended.numUpdatedRows) + Number(orphans.numUpdatedRows);
  }

  function runPurge(): void {
    purgeSecrets().then(
      (n) => {
        if (n > 0) logger.info({ runs: n }, 'erased webhook secrets of deliveries that ended over 7 days ago');
      },
      (err: unknown) => logger.error({ err }, 'erasing old webhook secrets failed'),
    );
  }

  return {
    start() {
      if (started || closed) return;
      started = true;
      runPurge();
      purgeTimer = setInterval(runPurge, purgeMs);
      purgeTimer.unref();
      sweepTimer = setInterval(() => void sweepHeld(), heldSweepMs);
      sweepTimer.unref();
      void tick();
    },

    wake: kick,

    async redeliver(projectId, appId, runId) {
      const run = await findRun(store, projectId, appId, runId);
      const delivery = await store
        .selectFrom('webhook_deliveries')
        .select(['state', 'updated_at'])
        .where('run_id', '=', runId)
        .executeTakeFirst();
      if (!delivery) {
        throw new FerryError(
          'FERRY_NO_WEBHOOK',
          run.webhook_endpoint === null
            ? `Run ${runId} was not called with a webhookEndpoint`
            : `Run ${runId} has not finished yet; its webhook is sent when it does`,
        );
      }
      const ended = delivery.state === 'delivered' || delivery.state === 'failed';
      if (ended && Date.parse(delivery.updated_at) <= clock() - SECRET_RETENTION_MS) {
        throw new FerryError(
          'FERRY_WEBHOOK_EXPIRED',
          `The webhook of run ${runId} ended on ${delivery.updated_at}, more than 7 days ago; it can no longer be redelivered`,
        );
      }
      const mine = inFlight.get(runId);
      if (mine) {
        // The attempt in flight decides nothing: its outcome is recorded and a fresh budget starts.
        mine.reset = true;
        return;
      }
      const now = nowIso(clock);
      const changed = await store
        .updateTable('webhook_deliveries')
        .set({ state: 'pending', attempts: 0, next_attempt_at: now, updated_at: now, owner: null })
        .where('run_id', '=', runId)
        .where((eb) => eb.or([eb('state', '!=', 'sending'), eb('owner', 'is', null)]))
        .executeTakeFirst();
      if (Number(changed.numUpdatedRows) === 0) throw new FerryError('FERRY_WEBHOOK_IN_FLIGHT');
      kick();
    },

    purgeSecrets,

    async close() {
      if (closed) return;
      closed = true;
      if (timer) clearTimeout(timer);
      if (purgeTimer) clearInterval(purgeTimer);
      if (sweepTimer) clearInterval(sweepTimer);
      await ticking;
      const all = () => Promise.all([...inFlight.values()].map((f) => f.done));
      let graceTimer: NodeJS.Timeout | undefined;
      await Promise.race([all(), new Promise((r) => (graceTimer = setTimeout(r, graceMs)))]);
      clearTimeout(graceTimer);
      for (const f of inFlight.values()) f.controller.abort();
      await all();
      await writeOutcomes();
      await agent.destroy();
    },
  };
}

/** A short, readable cause for an attempt that got no response (it is shown to users on the run). */
export function describeError(err: unknown): string {
  const permanent = findCause(err, (e) => e instanceof PermanentDeliveryError) as Error | undefined;
  if (permanent) return permanent.message;
  const coded = findCause(err, (e) => typeof (e as { code?: unknown })?.code === 'string') as
    | (Error & { code: string; hostname?: string })
    | undefined;
  const code = coded?.code;
  switch (code) {
    case 'ECONNREFUSED':
      return 'connection refused (ECONNREFUSED)';
    case 'ECONNRESET':
      return 'connection reset (ECONNRESET)';
    case 'ENOTFOUND':
      return `host not found (ENOTFOUND${coded?.hostname ? ` ${coded.hostname}` : ''})`;
    case 'EAI_AGAIN':
      return 'DNS lookup failed (EAI_AGAIN)';
    case 'UND_ERR_SOCKET':
      return `connection closed before a response (${coded?.message ?? 'socket error'})`;
    case 'UND_ERR_CONNECT_TIMEOUT':
      return 'connect timed out';
    case 'UND_ERR_HEADERS_TIMEOUT':
    case 'UND_ERR_BODY_TIMEOUT':
      return 'timed out waiting for the response';
  }
  const message = coded?.message ?? (err instanceof Error ? err.message : String(err));
  return code ? `${message} (${code})` : message;
}

function safeOrigin(url: string): string {
  try {
    return new URL(url).origin;
  } catch {
    return '(invalid URL)';
  }
}
