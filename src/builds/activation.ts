/**
 * The one writer of `apps.active_build_id`: which build an app's calls run. Two ways a build becomes active,
 * both here and both under the app's row lock (store/active-build.ts), so an activation and a delete of the
 * same build never interleave:
 *
 * - a build becoming ready (the pipeline, inside the transaction that records it ready) is made active
 *   unless a newer build already is: build ids are time-ordered, and an older build finishing late never
 *   replaces a newer active one;
 * - an activation through the API (a rollback to an earlier ready build, builds/build-service.ts).
 *
 * Activation also makes the build's `[[schedules]]` the app's (schedules/schedules.ts), in the same
 * transaction, after checking the server's limits on them under the project's lock (schedules/limits.ts):
 * a build that would pass one is not made active (a rollback is refused; the pipeline fails a new build).
 *
 * Only a build that did become active is announced (`build.activated` on the change feed): every process,
 * this one at once, forgets the app's run target and switches its replicas to it.
 */
import type { Kysely } from 'kysely';
import type { AppConfig } from '../apps/app-config.js';
import type { ChangeFeed } from '../cluster/change-feed.js';
import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import { checkScheduleLimits, type ScheduleLimits } from '../schedules/limits.js';
import { replaceSchedules } from '../schedules/schedules.js';
import { lockApp } from '../store/active-build.js';
import type { Store } from '../store/index.js';
import type { Build, Database } from '../store/schema.js';
import { findBuild } from './builds.js';

export interface BuildActivation {
  /**
   * Inside the transaction that records `build` ready: makes it the app's active build unless a newer one
   * already is. Returns whether it did (then `announce` it once the transaction has committed).
   */
  promoteReady(trx: Kysely<Database>, build: Pick<Build, 'id' | 'project_id' | 'app_id'>): Promise<boolean>;
  /** Tells every process that `build` is now its app's active build (after the commit that made it so). */
  announce(build: Pick<Build, 'id' | 'project_id' | 'app_id'>): Promise<void>;
  /**
   * Makes an earlier ready build the app's active build (rollback) and announces it; resolves once this
   * process has switched, so a call sent after the answer runs the activated build. FERRY_BUILD_NOT_READY
   * for a build that is not ready.
   */
  activate(projectId: string, appId: string, buildId: string): Promise<Build>;
}

export interface BuildActivationDeps {
  store: Store;
  changes: Pick<ChangeFeed, 'publish'>;
  /** Switches this process's replicas of the app to its active build (replicas/manager.ts `activate`). */
  switchHere: (projectId: string, appId: string) => Promise<void>;
  /** FERRY_MAX_SCHEDULES_PER_APP and _PER_PROJECT; without them no limit is checked (tests). */
  scheduleLimits?: ScheduleLimits;
}

async function setActive(
  trx: Kysely<Database>,
  projectId: string,
  appId: string,
  buildId: string,
  limits: ScheduleLimits | undefined,
): Promise<void> {
  await trx
    .updateTable('apps')
    .set({ active_build_id: buildId, updated_at: nowIso() })
    .where('project_id', '=', projectId)
    .where('id', '=', appId)
    .execute();
  // The active build's [[schedules]] are the app's, from this commit on (a rollback restores its own).
  const row = await trx.selectFrom('builds').select('config_json').where('id', '=', buildId).executeTakeFirst();
  let schedules: AppConfig['schedules'] = [];
  try {
    schedules = (row ? (JSON.parse(row.config_json) as Partial<AppConfig>).schedules : undefined) ?? [];
  } catch {
    // A build's config is stored as validated JSON; one that does not parse has no schedules.
  }
  // Throws inside the transaction, so the app keeps its active build and its schedules.
  if (limits) await checkScheduleLimits(trx, { projectId, appId }, schedules.length, limits, { lock: true });
  await replaceSchedules(trx, { projectId, appId }, buildId, schedules);
}

export function createBuildActivation(deps: BuildActivationDeps): BuildActivation {
  const { store, changes } = deps;

  async function announce(build: Pick<Build, 'id' | 'project_id' | 'app_id'>): Promise<void> {
    await changes.publish({
      type: 'build.activated',
      projectId: build.project_id,
      appId: build.app_id,
      buildId: build.id,
    });
  }

  return {
    async promoteReady(trx, build) {
      const app = await lockApp(trx, build.project_id, build.app_id);
      // Build ids are time-ordered: never let an older build replace a newer active one.
      if (!app || (app.active_build_id && app.active_build_id >= build.id)) return false;
      await setActive(trx, build.project_id, build.app_id, build.id, deps.scheduleLimits);
      return true;
    },

    announce,

    async activate(projectId, appId, buildId) {
      // Under the app's row lock, as a delete of the build takes it: the build is checked and made active
      // with no delete in between.
      const build = await store.transaction().execute(async (trx) => {
        if (!(await lockApp(trx, projectId, appId))) {
          throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${appId}" in this project`);
        }
        const found = await findBuild(trx, projectId, appId, buildId);
        if (found.state !== 'ready') {
          throw new FerryError(
            'FERRY_BUILD_NOT_READY',
            `Build ${buildId} is ${found.state}: only a ready build can be activated`,
          );
        }
        await setActive(trx, projectId, appId, found.id, deps.scheduleLimits);
        return found;
      });
      // Every process (this one before the answer) forgets the app's run target and switches its replicas.
      await announce(build);
      // This process has switched before it answers: a call sent after the answer runs the activated build.
      await deps.switchHere(projectId, appId);
      return build;
    },
  };
}
