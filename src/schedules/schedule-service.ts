/**
 * Schedules as the routes use them (`/v2/projects/{p}/apps/{a}/schedules`): list an app's, pause, resume,
 * and trigger one run now. The timing and the ticks are ticker.ts's; the rows are schedules.ts's.
 */
import { findApp } from '../apps/apps.js';
import type { DiskSpace } from '../disk-space.js';
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import { findSchedule, listSchedules, type ScheduleView, setPaused } from './schedules.js';
import type { ScheduleTicker } from './ticker.js';

export interface ScheduleService {
  list(projectId: string, appId: string): Promise<ScheduleView[]>;
  /** Pauses (`paused` true) or resumes a schedule; resolves with it as it is now. */
  setPaused(projectId: string, appId: string, name: string, paused: boolean): Promise<ScheduleView>;
  /**
   * Starts one run of the schedule now; resolves with its id. FERRY_ASYNC_BACKLOG_FULL when the backlog
   * cannot take it, FERRY_STORAGE_FULL while the data folder is low on space.
   */
  trigger(projectId: string, appId: string, name: string): Promise<string>;
}

export function createScheduleService(deps: {
  store: Store;
  ticker: Pick<ScheduleTicker, 'trigger'>;
  /** The data folder's free space: a run is not started while it is `low` (disk-space.ts). */
  space?: Pick<DiskSpace, 'low' | 'intakeRefused'>;
}): ScheduleService {
  const { store } = deps;

  async function one(projectId: string, appId: string, name: string): Promise<ScheduleView> {
    const found = (await listSchedules(store, { projectId, appId })).find((s) => s.name === name);
    if (!found) throw new FerryError('FERRY_SCHEDULE_NOT_FOUND', `The app has no schedule "${name}"`);
    return found;
  }

  return {
    async list(projectId, appId) {
      await findApp(store, projectId, appId);
      return listSchedules(store, { projectId, appId });
    },
    async setPaused(projectId, appId, name, paused) {
      await findApp(store, projectId, appId);
      await setPaused(store, { projectId, appId }, name, paused);
      return one(projectId, appId, name);
    },
    async trigger(projectId, appId, name) {
      await findApp(store, projectId, appId);
      const row = await findSchedule(store, { projectId, appId }, name);
      // Said as it is: the ticker skips a tick refused for space as it skips one for a full backlog.
      if (deps.space?.low) throw deps.space.intakeRefused();
      const id = await deps.ticker.trigger(row);
      if (id === 'busy')
        throw new FerryError('FERRY_ASYNC_BACKLOG_FULL', undefined, { headers: { 'retry-after': '5' } });
      return id;
    },
  };
}
