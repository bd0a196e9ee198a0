/**
 * The schedule ticker: every node that accepts runs looks, about once a second, for schedules whose next
 * tick is due, and starts one async run per tick.
 *
 * Exactly one run per tick across a cluster, with no lease to hand over: a tick's run carries an
 * idempotency key that names the tick (`schedule <name> <tick>`, a space, which no `Idempotency-Key`
 * header may hold), so two nodes inserting it get one run, and the schedule's next tick is advanced by a
 * compare-and-set on the tick it was read at. A node killed between the insert and the advance leaves the
 * tick due: the next look (by any node) inserts it again, gets the run already there, and advances. A tick
 * is never lost while one node still looks; it is never doubled, whatever dies when.
 *
 * A tick found late by at most LATE_GRACE_MS (spec.ts: every node busy or stalled for a few seconds) still
 * gets its own run. After longer downtime one catch-up run starts (the latest due tick); the ticks passed
 * over are logged and counted (`ferry_schedule_ticks_skipped_total{reason="downtime"}`). With `overlap = "skip"`, a tick due
 * while the schedule's last run is unfinished starts nothing and is counted (`reason="overlap"`).
 */
import type { Kysely } from 'kysely';
import type { Logger } from 'pino';
import { isoTime } from '../ids.js';
import type { Metrics } from '../metrics.js';
import { isFinalState } from '../runs/lifecycle.js';
import type { Database, Schedule } from '../store/schema.js';
import { dueTicks, parseTiming } from './spec.js';

/** How often a node looks for due ticks, ms. */
export const TICK_INTERVAL_MS = 1000;
/** The most due schedules one look handles (the rest wait for the next look). */
const BATCH = 100;
/** The most ticks of one schedule one look runs (a schedule a few ticks late catches up over a few looks). */
const TICKS_PER_LOOK = 10;

/** What the ticker asks of the run service: start a schedule's run. */
export interface ScheduleRunStarter {
  /**
   * Inserts (durably, as for a 202) the async run of `schedule` for `tick` with idempotency key `key`, and
   * hands it to the run queue; resolves with the run's id, the existing run's id when the key is taken, or
   * `'busy'` when the backlog refuses it now (the tick stays due and is tried again at the next look).
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

  async function fire(row: Schedule, now: number): Promise<boolean> {
    const timing = parseTiming(row.cron, row.timezone);
    const due = dueTicks(timing, new Date(row.next_tick_at), new Date(now));
    if (!due.tick) return false;
    const tick = due.tick.toISOString();
    const next = due.next ? due.next.toISOString() : '9999-12-31T23:59:59.999Z';
    const where = { project: row.project_id, app: row.app_id, schedule: row.name, tick };
    if (row.overlap === 'skip' && (await lastRunUnfinished(row))) {
      if (await advance(row, { next, skipped: due.skipped + 1 }, now)) {
        metrics.scheduleTicksSkipped.inc({ reason: 'overlap' }, 1);
        if (due.skipped > 0) metrics.scheduleTicksSkipped.inc({ reason: 'downtime' }, due.skipped);
        log.info({ ...where, lastRun: row.last_run_id }, 'schedule tick skipped: its last run is unfinished');
      }
      return false;
    }
    const runId = await starter.startScheduled(row, tick, tickKey(row.name, tick));
    if (runId === 'busy') {
      log.warn(where, 'schedule tick waits: the async backlog is full');
      return false;
    }
    if (!(await advance(row, { next, lastTick: tick, lastRun: runId, skipped: due.skipped }, now))) return false;
    metrics.scheduleRuns.inc({ via: 'tick' });
    if (due.skipped > 0) {
      metrics.scheduleTicksSkipped.inc({ reason: 'downtime' }, due.skipped);
      log.warn(
        { ...where, skipped: due.skipped, skippedAtLeast: due.skippedAtLeast },
        'schedule ticks passed over while no node ran them: one catch-up run started',
      );
    }
    log.info({ ...where, runId }, 'schedule tick started a run');
    return true;
  }

  async function look(now: number): Promise<number> {
    const due = await db
      .selectFrom('schedules')
      .selectAll()
      .where('paused', '=', 0)
      .where('next_tick_at', '<=', isoTime(now))
      .orderBy('next_tick_at')
      .limit(BATCH)
      .execute();
    let started = 0;
    for (const first of due) {
      // A schedule late by several ticks (within LATE_GRACE_MS: a look that came late) runs them one after
      // the other, a few per look, each from the row as the last one left it.
      let row: Schedule | undefined = first;
      for (let n = 0; row && n < TICKS_PER_LOOK && !closed; n++) {
        try {
          if (!(await fire(row, now))) break;
          started += 1;
        } catch (err) {
          // The store or the run queue failed: the tick stays due and the next look tries again.
          log.warn({ err, app: row.app_id, schedule: row.name }, 'schedule tick failed; retrying at the next look');
          break;
        }
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

  function schedule(): void {
    if (closed) return;
    // A little jitter, so that nodes started together do not look at the same instant.
    timer = setTimeout(
      () => {
        tickOnce()
          .catch((err: unknown) => log.warn({ err }, 'schedule look failed; retrying'))
          .finally(schedule);
      },
      intervalMs + Math.floor(Math.random() * Math.min(250, intervalMs / 4)),
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
