/**
 * Schedules in the store: the `[[schedules]]` of each app's active build, with their state (paused, next
 * tick, last run). Written when a build becomes active (a new build's schedules replace the old ones; a
 * rollback restores the rolled-back build's), read by the ticker (ticker.ts), the API and the CLI.
 *
 * A schedule kept across builds (same name, same `cron` and `timezone`) keeps its next tick, its paused
 * state and its last run; one whose timing changed starts from its next tick after the activation.
 */
import type { Kysely } from 'kysely';
import type { ScheduleConfig } from '../apps/app-config.js';
import { FerryError } from '../errors.js';
import { isoTime } from '../ids.js';
import type { Database, Schedule } from '../store/schema.js';
import { parseTiming } from './spec.js';

/** An app: schedules belong to one (app names are unique in a project only). */
export interface AppRef {
  projectId: string;
  appId: string;
}

/** A schedule as the API and the CLI show it. */
export interface ScheduleView {
  name: string;
  cron: string;
  timezone: string;
  function: string;
  args: unknown;
  webhook: string | null;
  overlap: 'skip' | 'allow';
  paused: boolean;
  /** The next tick due, or null when paused or the expression never matches again. */
  next_tick_at: string | null;
  last_tick_at: string | null;
  last_run: { id: string; state: string } | null;
  /** Due ticks that started no run (downtime, `overlap = "skip"` while the last run was unfinished, a full backlog). */
  ticks_skipped: number;
  build_id: string;
}

/** A time far in the future: the next tick of an expression that never matches again. */
const NEVER = '9999-12-31T23:59:59.999Z';

/** The next tick of `cron` in `timezone` strictly after `now`, as stored (NEVER when there is none). */
export function nextTickAfter(cron: string, timezone: string, now: number): string {
  const next = parseTiming(cron, timezone).next(new Date(now));
  return next ? next.toISOString() : NEVER;
}

/**
 * Makes the app's schedules those of `schedules` (the config of build `buildId`, now active). Call inside
 * the transaction that activates the build.
 */
export async function replaceSchedules(
  db: Kysely<Database>,
  app: AppRef,
  buildId: string,
  schedules: readonly ScheduleConfig[],
  now = Date.now(),
): Promise<void> {
  const existing = await db
    .selectFrom('schedules')
    .selectAll()
    .where('project_id', '=', app.projectId)
    .where('app_id', '=', app.appId)
    .execute();
  const byName = new Map(existing.map((s) => [s.name, s]));
  const keep = new Set(schedules.map((s) => s.name));
  const gone = existing.filter((s) => !keep.has(s.name)).map((s) => s.name);
  if (gone.length > 0) {
    await db
      .deleteFrom('schedules')
      .where('project_id', '=', app.projectId)
      .where('app_id', '=', app.appId)
      .where('name', 'in', gone)
      .execute();
  }
  const at = isoTime(now);
  for (const s of schedules) {
    const fields = {
      project_id: app.projectId,
      build_id: buildId,
      cron: s.cron,
      timezone: s.timezone,
      function_name: s.function,
      args: JSON.stringify(s.args),
      webhook_endpoint: s.webhook,
      overlap: s.overlap,
      updated_at: at,
    };
    const old = byName.get(s.name);
    if (!old) {
      await db
        .insertInto('schedules')
        .values({
          app_id: app.appId,
          name: s.name,
          ...fields,
          next_tick_at: nextTickAfter(s.cron, s.timezone, now),
          created_at: at,
        })
        .execute();
      continue;
    }
    const sameTiming = old.cron === s.cron && old.timezone === s.timezone;
    await db
      .updateTable('schedules')
      .set(sameTiming ? fields : { ...fields, next_tick_at: nextTickAfter(s.cron, s.timezone, now) })
      .where('project_id', '=', app.projectId)
      .where('app_id', '=', app.appId)
      .where('name', '=', s.name)
      .execute();
  }
}

/** Removes every schedule of the app (the app is deleted). */
export async function removeSchedules(db: Kysely<Database>, app: AppRef): Promise<void> {
  await db.deleteFrom('schedules').where('project_id', '=', app.projectId).where('app_id', '=', app.appId).execute();
}

/** The app's schedules, by name, with the state of each one's last run. */
export async function listSchedules(db: Kysely<Database>, app: AppRef): Promise<ScheduleView[]> {
  const rows = await db
    .selectFrom('schedules')
    .leftJoin('runs', 'runs.id', 'schedules.last_run_id')
    .selectAll('schedules')
    .select('runs.state as last_run_state')
    .where('schedules.project_id', '=', app.projectId)
    .where('schedules.app_id', '=', app.appId)
    .orderBy('schedules.name')
    .execute();
  return rows.map((r) => viewSchedule(r, r.last_run_state ?? null));
}

/** One schedule of the app, or FERRY_SCHEDULE_NOT_FOUND. */
export async function findSchedule(db: Kysely<Database>, app: AppRef, name: string): Promise<Schedule> {
  const row = await db
    .selectFrom('schedules')
    .selectAll()
    .where('project_id', '=', app.projectId)
    .where('app_id', '=', app.appId)
    .where('name', '=', name)
    .executeTakeFirst();
  if (!row) throw new FerryError('FERRY_SCHEDULE_NOT_FOUND', `The app has no schedule "${name}"`);
  return row;
}

/**
 * Pauses or resumes a schedule. A resumed schedule starts from its next tick after now: the ticks it
 * missed while paused are not run.
 */
export async function setPaused(
  db: Kysely<Database>,
  app: AppRef,
  name: string,
  paused: boolean,
  now = Date.now(),
): Promise<void> {
  const row = await findSchedule(db, app, name);
  if (Boolean(row.paused) === paused) return;
  await db
    .updateTable('schedules')
    .set({
      paused: paused ? 1 : 0,
      updated_at: isoTime(now),
      ...(paused ? {} : { next_tick_at: nextTickAfter(row.cron, row.timezone, now) }),
    })
    .where('project_id', '=', app.projectId)
    .where('app_id', '=', app.appId)
    .where('name', '=', name)
    .execute();
}

export function viewSchedule(row: Schedule, lastRunState: string | null): ScheduleView {
  let args: unknown = {};
  try {
    args = JSON.parse(row.args);
  } catch {
    // Written by replaceSchedules from JSON data: cannot happen short of a hand-edited row.
  }
  return {
    name: row.name,
    cron: row.cron,
    timezone: row.timezone,
    function: row.function_name,
    args,
    webhook: row.webhook_endpoint,
    overlap: row.overlap === 'allow' ? 'allow' : 'skip',
    paused: Boolean(row.paused),
    next_tick_at: row.paused || row.next_tick_at === NEVER ? null : row.next_tick_at,
    last_tick_at: row.last_tick_at,
    last_run: row.last_run_id && lastRunState ? { id: row.last_run_id, state: lastRunState } : null,
    ticks_skipped: Number(row.ticks_skipped),
    build_id: row.build_id,
  };
}
