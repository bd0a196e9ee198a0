/**
 * How many schedules an app and a project may have (FERRY_MAX_SCHEDULES_PER_APP, FERRY_MAX_SCHEDULES_PER_PROJECT):
 * the bound on what one tenant asks of the ticker (ticker.ts), which every node shares with every project.
 *
 * Checked twice. At upload (builds/upload.ts), so a deploy that would pass a limit is refused with its code
 * before anything is built. And where schedules change, when a build becomes the app's active one
 * (builds/activation.ts: a deploy's build becoming ready, or a rollback), under a per-project lock, since
 * the upload's check alone lets several apps deployed at once each count the project without the others'
 * schedules, which only exist once their builds are active.
 *
 * A change that does not add schedules to its app is never refused for the project's limit, so a project
 * over a lowered limit can still deploy (and take schedules away).
 */
import type { Kysely } from 'kysely';
import { FerryError } from '../errors.js';
import { lockProjectBudget } from '../store/budget-lock.js';
import type { Database } from '../store/schema.js';
import type { AppRef } from './schedules.js';

export interface ScheduleLimits {
  /** FERRY_MAX_SCHEDULES_PER_APP. */
  perApp: number;
  /** FERRY_MAX_SCHEDULES_PER_PROJECT. */
  perProject: number;
}

/**
 * The refusal of a change of schedules that would pass a limit: FERRY_CONFIG_INVALID for the app's,
 * FERRY_PROJECT_SCHEDULES_FULL for the project's. Its own class, so that the build pipeline tells it from a
 * store failure inside the same transaction.
 */
export class ScheduleLimitError extends FerryError {}

/**
 * Refuses (ScheduleLimitError) giving `app` `count` schedules when that passes a limit. `lock`: inside the
 * transaction that then writes the schedules, hold the project's lock until it ends (PostgreSQL; SQLite
 * has one writer at a time), so two such transactions never both pass on a count holding neither.
 */
export async function checkScheduleLimits(
  db: Kysely<Database>,
  app: AppRef,
  count: number,
  limits: ScheduleLimits,
  options: { lock: boolean },
): Promise<void> {
  if (count > limits.perApp) {
    throw new ScheduleLimitError(
      'FERRY_CONFIG_INVALID',
      `ferry.toml: schedules: ${count} schedules; this server allows at most ${limits.perApp} per app (FERRY_MAX_SCHEDULES_PER_APP)`,
    );
  }
  if (count === 0) return;
  if (options.lock) await lockProjectBudget(db, 'schedules', app.projectId);
  const rows = await db
    .selectFrom('schedules')
    .select(['app_id', (eb) => eb.fn.countAll().as('n')])
    .where('project_id', '=', app.projectId)
    .groupBy('app_id')
    .execute();
  let others = 0;
  let own = 0;
  // PostgreSQL answers COUNT as a bigint (a string through most drivers).
  for (const r of rows) {
    if (r.app_id === app.appId) own = Number(r.n);
    else others += Number(r.n);
  }
  if (count <= own || others + count <= limits.perProject) return;
  throw new ScheduleLimitError(
    'FERRY_PROJECT_SCHEDULES_FULL',
    `The project's other apps have ${others} schedules and this one would have ${count}: this server allows at most ${limits.perProject} per project (FERRY_MAX_SCHEDULES_PER_PROJECT)`,
  );
}
