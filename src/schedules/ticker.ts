/**
 * The schedule ticker: every node that accepts runs looks, about once a second, for schedules whose next
 * tick is due, and starts one async run per tick.
 *
 * Exactly one run per tick across a cluster, with no lease to hand over: a tick's run carries an
 * idempotency key that names the tick (`schedule <name> <tick>`, a space, which no `Idempotency-Key`
 * header may hold), so two nodes inserting it get one run, and the schedule's next tick is advanced by a
 * compare-and-set on the tick it was read at. A node killed between the insert and the advance leaves the
 * tick due: the next look (by any node) inserts it again, gets the run already there, and advances. A tick
 * is never lost while one node still looks, unless the backlog refuses it (below); it is never doubled,
 * whatever dies when.
 *
 * A tick found late by at most LATE_GRACE_MS (spec.ts: every node busy or stalled for a few seconds) still
 * gets its own run. After longer downtime one catch-up run starts (the latest due tick); the ticks passed
 * over are logged and counted (`ferry_schedule_ticks_skipped_total{reason="downtime"}`). With `overlap = "skip"`, a tick due
 * while the schedule's last run is unfinished starts nothing and is counted (`reason="overlap"`).
 *
 * A tick the async backlog refuses (the project's FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT, or this process's
 * FERRY_MAX_ASYNC_BACKLOG, as it refuses a call) is skipped and counted (`reason="backlog"`), and the
 * schedule moves on, by the same compare-and-set: a tick left due would be tried at every look, the
 * project's schedules would pile up as the oldest due rows, and those of every other project wait behind
 * them (issue 43). Before skipping, the tick's run is looked for by its key, so a tick whose run a node
 * inserted before dying is not counted as skipped. A run another node inserts at the very instant a refused
 * node skips the same tick is still the tick's one run (that node's advance then fails); only the counts
 * say "skipped" for it.
 *
 * Fair across projects: each look takes every project's oldest due schedule before any project's second
 * (row_number() per project, on both stores), so no project's due schedules, however many and however
 * stuck, keep another project's from its look. Warnings are at most one a minute per kind and project
 * (warn-limit.ts).
 */
import type { Kysely } from 'kysely';
import type { Logger } from 'pino';
import { isoTime } from '../ids.js';
import type { Metrics } from '../metrics.js';
import { isFinalState } from '../runs/lifecycle.js';
import type { Database, Schedule } from '../store/schema.js';
import { dueTicks, parseTiming } from './spec.js';
import { createWarnLimit } from './warn-limit.js';

/** How often a node looks for due ticks, ms. */
export const TICK_INTERVAL_MS = 1000;
/**
 * The most due schedules one look handles (the rest wait for the next look): every project's oldest first,
 * then every project's second, and so on.
 */
const BATCH = 100;
/** The most ticks of one schedule one look runs (a schedule a few ticks late catches up over a few looks). */
const TICKS_PER_LOOK = 10;

/**
 * What one tick of a schedule came to: `started` (its run, or the run a node had inserted for it before
 * dying), `skipped` (overlap or backlog: the schedule moved on), or `none` (not due, or another node moved
 * it first). `next`: the schedule's tick after this one.
 */
interface Fired {
  outcome: 'started' | 'skipped' | 'none';
  next: Date | null;
}

/** What the ticker asks of the run service: start a schedule's run. */
export interface ScheduleRunStarter {
  /**
   * Inserts (durably, as for a 202) the async run of `schedule` for `tick` with idempotency key `key`, and
   * hands it to the run queue; resolves with the run's id, the existing run's id when the key is taken, or
   * `'busy'` when the backlog refuses it now (the ticker skips the tick).
   */
  startScheduled(schedule: Schedule, tick: string, key: string | null): Promise<string | 'busy'>;
}

export interface ScheduleTicker {
  /** One look now (tests, and `start`'s loop). Resolves with the runs started. */
  tickOnce(now?: number): Promise<number>;
  /** `ferry schedules trigger`: one run of the schedule now, whatever its timing; resolves with its id. */
  trigger(schedule: Schedule, now?: number): Promise<string | 'busy'>;
  start(): void;
  close(): Promise<void>;
}

/** The idempotency key of a tick's run. */
export function tickKey(name: string, tick: string): string {
  return `schedule ${name} ${tick}`;
}

export function createScheduleTicker(deps: {
  db: Kysely<Database>;
  starter: ScheduleRunStarter;
  log: Logger;
  metrics: Metrics;
  intervalMs?: number;
  now?: () => number;
}): ScheduleTicker {
  const { db, starter, log, metrics } = deps;
  const clock = deps.now ?? Date.now;
  const intervalMs = deps.intervalMs ?? TICK_INTERVAL_MS;
  let timer: NodeJS.Timeout | undefined;
  let running: Promise<number> | undefined;
  let closed = false;
  const warnings = createWarnLimit();

  /** Whether the schedule's last run is unfinished (for `overlap = "skip"`). */
  async function lastRunUnfinished(row: Schedule): Promise<boolean> {
    if (!row.last_run_id) return false;
    const run = await db.selectFrom('runs').select('state').where('id', '=', row.last_run_id).executeTakeFirst();
    return run !== undefined && !isFinalState(run.state);
  }

  /** Advances the schedule from the tick it was read at; false when another node advanced it first. */
  async function advance(
    row: Schedule,
    fields: { next: string; lastTick?: string; lastRun?: string; skipped: number },
    now: number,
  ): Promise<boolean> {
    const result = await db
      .updateTable('schedules')
      .set((eb) => ({
        next_tick_at: fields.next,
        ...(fields.lastTick ? { last_tick_at: fields.lastTick } : {}),
        ...(fields.lastRun ? { last_run_id: fields.lastRun } : {}),
        ticks_skipped: eb('ticks_skipped', '+', fields.skipped),
        updated_at: isoTime(now),
      }))
      .where('project_id', '=', row.project_id)
      .where('app_id', '=', row.app_id)
      .where('name', '=', row.name)
      .where('next_tick_at', '=', row.next_tick_at)
      .where('paused', '=', 0)
      .executeTakeFirst();
    return Number(result.numUpdatedRows) === 1;
  }

  /** The run already holding the tick's key, if a node inserted it (and died before advancing). */
  async function tickRun(row: Schedule, key: string): Promise<string | undefined> {
    const run = await db
      .selectFrom('runs')
      .select('id')
      .where('project_id', '=', row.project_id)
      .where('app_id', '=', row.app_id)
      .where('idempotency_key', '=', key)
      .executeTakeFirst();
    return run?.id;
  }

  /** One tick of the schedule. */
  async function fire(row: Schedule, now: number): Promise<Fired> {
    const timing = parseTiming(row.cron, row.timezone);
    const due = dueTicks(timing, new Date(row.next_tick_at), new Date(now));
    if (!due.tick) return { outcome: 'none', next: due.next };
    const tick = due.tick.toISOString();
    const next = due.next ? due.next.toISOString() : '9999-12-31T23:59:59.999Z';
    const where = { project: row.project_id, app: row.app_id, schedule: row.name, tick };
    const skip = async (reason: 'overlap' | 'backlog'): Promise<Fired> => {
      if (!(await advance(row, { next, skipped: due.skipped + 1 }, now))) return { outcome: 'none', next: due.next };
      metrics.scheduleTicksSkipped.inc({ reason }, 1);
      if (due.skipped > 0) metrics.scheduleTicksSkipped.inc({ reason: 'downtime' }, due.skipped);
      return { outcome: 'skipped', next: due.next };
    };
    if (row.overlap === 'skip' && (await lastRunUnfinished(row))) {
      const skipped = await skip('overlap');
      if (skipped.outcome === 'skipped')
        log.info({ ...where, lastRun: row.last_run_id }, 'schedule tick skipped: its last run is unfinished');
      return skipped;
    }
    const key = tickKey(row.name, tick);
    let runId = await starter.startScheduled(row, tick, key);
    if (runId === 'busy') {
      const inserted = await tickRun(row, key);
      if (inserted === undefined) {
        const skipped = await skip('backlog');
        if (skipped.outcome === 'skipped') {
          const suppressed = warnings.take(`backlog ${row.project_id}`, now);
          if (suppressed !== undefined)
            log.warn(
              { ...where, suppressed },
              'schedule tick skipped: the async backlog is full (logged once a minute per project; suppressed: the ticks skipped since)',
            );
          else log.debug(where, 'schedule tick skipped: the async backlog is full');
        }
        return skipped;
      }
      runId = inserted;
    }
    if (!(await advance(row, { next, lastTick: tick, lastRun: runId, skipped: due.skipped }, now)))
      return { outcome: 'none', next: due.next };
    metrics.scheduleRuns.inc({ via: 'tick' });
    if (due.skipped > 0) {
      metrics.scheduleTicksSkipped.inc({ reason: 'downtime' }, due.skipped);
      const suppressed = warnings.take(`downtime ${row.project_id}`, now);
      if (suppressed !== undefined)
        log.warn(
          { ...where, skipped: due.skipped, skippedAtLeast: due.skippedAtLeast, suppressed },
          'schedule ticks passed over while no node ran them: one catch-up run started (logged once a minute per project)',
        );
    }
    log.info({ ...where, runId }, 'schedule tick started a run');
    return { outcome: 'started', next: due.next };
  }

  /**
   * The due schedules of one look: every project's oldest due first, then every project's second, and so on,
   * at most BATCH (row_number() over each project's due rows, which SQLite and PostgreSQL both have).
   */
  function dueSchedules(now: number): Promise<Schedule[]> {
    const ranked = db
      .selectFrom('schedules')
      .selectAll()
      .select((eb) =>
        eb.fn
          .agg<number>('row_number')
          .over((over) => over.partitionBy('project_id').orderBy('next_tick_at'))
          .as('turn'),
      )
      .where('paused', '=', 0)
      .where('next_tick_at', '<=', isoTime(now));
    return db.selectFrom(ranked.as('due')).selectAll().orderBy('turn').orderBy('next_tick_at').limit(BATCH).execute();
  }

  async function look(now: number): Promise<number> {
    const due = await dueSchedules(now);
    let started = 0;
    for (const first of due) {
      // A schedule late by several ticks (within LATE_GRACE_MS: a look that came late) runs them one after
      // the other, a few per look, each from the row as the last one left it.
      let row: Schedule | undefined = first;
      for (let n = 0; row && n < TICKS_PER_LOOK && !closed; n++) {
        let fired: Fired;
        try {
          fired = await fire(row, now);
        } catch (err) {
          // The store or the run queue failed: the tick stays due and the next look tries again.
          const suppressed = warnings.take(`failed ${row.project_id}`, now);
          if (suppressed !== undefined)
            log.warn(
              { err, app: row.app_id, schedule: row.name, suppressed },
              'schedule tick failed; retrying at the next look (logged once a minute per project)',
            );
          break;
        }
        if (fired.outcome === 'started') started += 1;
        // Nothing more of this schedule is due in this look: no need to read it again.
        if (fired.outcome === 'none' || !fired.next || fired.next.getTime() > now) break;
        row = await db
          .selectFrom('schedules')
          .selectAll()
          .where('project_id', '=', row.project_id)
          .where('app_id', '=', row.app_id)
          .where('name', '=', row.name)
          .where('paused', '=', 0)
          .where('next_tick_at', '<=', isoTime(now))
          .executeTakeFirst();
      }
    }
    return started;
  }

  function tickOnce(now = clock()): Promise<number> {
    // One look at a time: the loop and a test's call never overlap.
    const previous = running ?? Promise.resolve(0);
    const next = previous.then(
      () => look(now),
      () => look(now),
    );
    running = next.catch(() => 0);
    return next;
  }

  /**
   * The next look, `intervalMs` (and a little jitter, so that nodes started together do not look at the same
   * instant) after the start of the last one (`lastStart`), not after its end: a long look (a project's
   * hundred refused ticks, a slow store) does not push every later tick back by its length. Never sooner
   * than a quarter interval after the last look's end, so looks that take longer than the interval still
   * leave the store some rest.
   */
  function schedule(lastStart?: number): void {
    if (closed) return;
    const jitter = Math.floor(Math.random() * Math.min(250, intervalMs / 4));
    const since = lastStart === undefined ? 0 : clock() - lastStart;
    timer = setTimeout(
      () => {
        const start = clock();
        tickOnce(start)
          .catch((err: unknown) => {
            const suppressed = warnings.take('look', clock());
            if (suppressed !== undefined)
              log.warn({ err, suppressed }, 'schedule look failed; retrying (logged once a minute)');
          })
          .finally(() => schedule(start));
      },
      Math.max(intervalMs / 4, intervalMs + jitter - since),
    );
    timer.unref();
  }

  return {
    tickOnce,
    async trigger(row, now = clock()) {
      const id = await starter.startScheduled(row, isoTime(now), null);
      if (id !== 'busy') {
        metrics.scheduleRuns.inc({ via: 'trigger' });
        await db
          .updateTable('schedules')
          .set({ last_run_id: id, updated_at: isoTime(now) })
          .where('project_id', '=', row.project_id)
          .where('app_id', '=', row.app_id)
          .where('name', '=', row.name)
          .execute();
      }
      return id;
    },
    start() {
      if (!timer && !closed) schedule();
    },
    async close() {
      closed = true;
      if (timer) clearTimeout(timer);
      await running;
    },
  };
}
