/**
 * A schedule's timing: when its ticks fall, from `ferry.toml`'s `[[schedules]]` `cron` and `timezone`.
 *
 * Cron expressions (5 fields, and the nicknames `@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`)
 * are parsed and stepped by croner, which knows IANA time zones and daylight saving time: a tick that
 * falls in a spring-forward gap runs at the first time after the gap, and a time that occurs twice in
 * the autumn runs once. `@every <duration>` (`30s`, `10m`, `1h30m`) is Ferry's own: its ticks are the
 * multiples of the duration since the Unix epoch, so that every node computes the same tick times and a
 * tick's time can name its run (runs/schedules derive the run's idempotency from it).
 *
 * Pure: no clock is read here; callers pass `now`.
 */

import { Cron } from 'croner';

/** The shortest `@every` interval: one second. */
export const MIN_EVERY_MS = 1000;
/** The longest `@every` interval: 366 days. */
export const MAX_EVERY_MS = 366 * 24 * 3600 * 1000;
/** How many missed ticks are counted one by one before the count is reported as at least this many. */
export const MAX_COUNTED_TICKS = 10_000;

const NICKNAMES = new Set(['@yearly', '@annually', '@monthly', '@weekly', '@daily', '@midnight', '@hourly']);

/** Thrown for an invalid `cron` or `timezone`; `key` is the field (`cron` or `timezone`). */
export class ScheduleSpecError extends Error {
  readonly key: 'cron' | 'timezone';
  constructor(key: 'cron' | 'timezone', message: string) {
    super(message);
    this.name = 'ScheduleSpecError';
    this.key = key;
  }
}

/** When a schedule's ticks fall. */
export interface ScheduleTiming {
  /** The expression as written (`0 3 * * *`, `@every 10m`). */
  readonly expression: string;
  readonly timezone: string;
  /** The first tick strictly after `after`, or null when there is none (a cron that never matches again). */
  next(after: Date): Date | null;
}

const UNIT_MS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** `10m`, `1h30m`, `45s` → milliseconds; undefined when it is not such a duration. */
export function parseDuration(text: string): number | undefined {
  if (!/^(\d+(ms|s|m|h|d))+$/.test(text)) return undefined;
  let total = 0;
  for (const part of text.matchAll(/(\d+)(ms|s|m|h|d)/g)) total += Number(part[1]) * UNIT_MS[part[2]!]!;
  return total;
}

/** Whether `zone` is an IANA time zone name this Node knows. */
export function isTimeZone(zone: string): boolean {
  if (zone.length === 0 || zone.length > 64) return false;
  try {
    new Intl.DateTimeFormat('en-US', { timeZone: zone });
    return true;
  } catch {
    return false;
  }
}

/**
 * Parses `cron` (in `timezone`, default UTC) into its timing. Throws ScheduleSpecError naming the field.
 *
 * @example
 *   parseTiming('0 3 * * *', 'Europe/Berlin').next(new Date('2026-03-28T12:00:00Z')); // 2026-03-29T01:00:00Z
 *   parseTiming('@every 10m').next(new Date('2026-01-01T00:04:00Z'));                  // 2026-01-01T00:10:00Z
 */
export function parseTiming(cron: string, timezone = 'UTC'): ScheduleTiming {
  if (!isTimeZone(timezone)) {
    throw new ScheduleSpecError(
      'timezone',
      `"${timezone}" is not a known IANA time zone (for example "Europe/Berlin")`,
    );
  }
  const expression = cron.trim();
  if (expression.startsWith('@every')) {
    const text = expression.slice('@every'.length).trim();
    const ms = parseDuration(text);
    if (ms === undefined) {
      throw new ScheduleSpecError('cron', `"${cron}": @every takes a duration such as 30s, 10m or 1h30m`);
    }
    if (ms < MIN_EVERY_MS || ms > MAX_EVERY_MS) {
      throw new ScheduleSpecError('cron', `"${cron}": the interval must be between 1s and 366d`);
    }
    return {
      expression,
      timezone,
      next: (after) => new Date((Math.floor(after.getTime() / ms) + 1) * ms),
    };
  }
  if (expression.startsWith('@') && !NICKNAMES.has(expression)) {
    throw new ScheduleSpecError(
      'cron',
      `"${cron}" is not a known nickname (use @hourly, @daily, @weekly, @monthly, @yearly or @every <duration>)`,
    );
  }
  if (!expression.startsWith('@') && expression.split(/\s+/).length !== 5) {
    throw new ScheduleSpecError(
      'cron',
      `"${cron}" must have 5 fields (minute hour day-of-month month day-of-week), or be @hourly, @daily, @every 10m, ...`,
    );
  }
  let job: Cron;
  try {
    job = new Cron(expression, { timezone, paused: true, mode: '5-part' });
  } catch (err) {
    const reason = err instanceof Error ? err.message.replace(/^CronPattern: /, '') : String(err);
    throw new ScheduleSpecError('cron', `"${cron}" is not a valid cron expression: ${reason}`);
  }
  return {
    expression,
    timezone,
    next: (after) => job.nextRun(after),
  };
}

/** What a node does about a schedule at `now`. */
export interface DueTicks {
  /** The tick to run now (the latest one due), or null when none is due yet. */
  tick: Date | null;
  /** Due ticks passed over in favour of `tick` (downtime): logged and counted, never run one by one. */
  skipped: number;
  /** Whether `skipped` stopped counting at MAX_COUNTED_TICKS. */
  skippedAtLeast: boolean;
  /** The tick after `tick` (or the stored one when none is due): the schedule's next due time. */
  next: Date | null;
}

/**
 * How late a tick may be and still get a run of its own: a look that came late (every node busy, or the
 * one looking stalled for a few seconds) runs each tick it finds due within this window, one after the
 * other. Ticks due longer ago than this count as downtime: only the latest of them runs (the catch-up).
 */
export const LATE_GRACE_MS = 30_000;

/**
 * The tick to run at `now` for a schedule whose next tick was stored as `nextDue`: the earliest due tick
 * late by at most LATE_GRACE_MS (its `next` may be due as well: the ticker runs it next); or, when every due
 * tick is older than that (downtime), the latest due one, the catch-up. Ticks passed over are counted as
 * skipped.
 */
export function dueTicks(timing: ScheduleTiming, nextDue: Date, now: Date): DueTicks {
  if (nextDue.getTime() > now.getTime()) return { tick: null, skipped: 0, skippedAtLeast: false, next: nextDue };
  const cutoff = now.getTime() - LATE_GRACE_MS;
  let tick = nextDue;
  let skipped = 0;
  for (;;) {
    const after = timing.next(tick);
    if (tick.getTime() >= cutoff) return { tick, skipped, skippedAtLeast: false, next: after };
    if (after === null || after.getTime() > now.getTime()) return { tick, skipped, skippedAtLeast: false, next: after };
    skipped += 1;
    tick = after;
    if (skipped >= MAX_COUNTED_TICKS) {
      // Downtime long enough to count this many ticks: jump to the latest due tick without counting.
      const latest = latestTickAtOrBefore(timing, tick, now);
      return { tick: latest, skipped, skippedAtLeast: true, next: timing.next(latest) };
    }
  }
}

/** The latest tick at or before `now`, at or after `from` (itself a tick), found by doubling steps. */
function latestTickAtOrBefore(timing: ScheduleTiming, from: Date, now: Date): Date {
  let tick = from;
  // Binary search on time: find the last t in [from, now] such that timing.next(t - 1ms) <= now.
  let low = from.getTime();
  let high = now.getTime();
  while (high - low > 1000) {
    const mid = Math.floor((low + high) / 2);
    const candidate = timing.next(new Date(mid));
    if (candidate !== null && candidate.getTime() <= now.getTime()) {
      tick = candidate;
      low = candidate.getTime();
    } else {
      high = mid;
    }
  }
  for (;;) {
    const after = timing.next(tick);
    if (after === null || after.getTime() > now.getTime()) return tick;
    tick = after;
  }
}
