/**
 * How a schedule's tick becomes an async run: through the run service, like a call (runs/run-service.ts
 * `admitAsync` and `commitAsync`: the same backlog limits, the same durable insert before anything else,
 * the same hand-over to the run queue), with the tick's idempotency key, so two nodes that see the same
 * tick get one run.
 *
 * Cortex apps: the tick calls `function` with `args` as its JSON body. Custom apps: the tick is
 * `POST /<function>` (default `POST /run`) with `args` as a JSON body.
 */
import { FerryError } from '../errors.js';
import { uuidv7 } from '../ids.js';
import type { RunService } from '../runs/run-service.js';
import type { Schedule } from '../store/schema.js';
import type { ScheduleRunStarter } from './ticker.js';

export function createScheduleRunStarter(deps: {
  runs: Pick<RunService, 'admitAsync' | 'commitAsync'>;
  /** The runtime of a build (`custom` or `cortex`). */
  runtimeOf(projectId: string, appId: string, buildId: string): Promise<'custom' | 'cortex'>;
}): ScheduleRunStarter {
  return {
    async startScheduled(schedule: Schedule, tick: string, key: string | null): Promise<string | 'busy'> {
      try {
        await deps.runs.admitAsync(schedule.project_id);
      } catch (err) {
        // A full backlog skips the tick (counted by the ticker), as it refuses a call; so does a data
        // folder low on space (disk-space.ts).
        if (
          err instanceof FerryError &&
          (err.code === 'FERRY_ASYNC_BACKLOG_FULL' ||
            err.code === 'FERRY_PROJECT_BACKLOG_FULL' ||
            err.code === 'FERRY_STORAGE_FULL')
        )
          return 'busy';
        throw err;
      }
      const custom = (await deps.runtimeOf(schedule.project_id, schedule.app_id, schedule.build_id)) === 'custom';
      const fn = custom ? `POST /${schedule.function_name}` : schedule.function_name;
      const id = uuidv7();
      const httpRequest = custom
        ? JSON.stringify({
            method: 'POST',
            path: `/${schedule.function_name}`,
            headers: { 'content-type': 'application/json', 'x-request-id': id, 'x-ferry-schedule': schedule.name },
            body_base64: Buffer.from(schedule.args).toString('base64'),
          })
        : undefined;
      return deps.runs.commitAsync({
        id,
        build: { projectId: schedule.project_id, appId: schedule.app_id, buildId: schedule.build_id },
        fn,
        input: schedule.args,
        httpRequest,
        webhookUrl: schedule.webhook_endpoint ?? undefined,
        idempotencyKey: key ?? undefined,
        origin: { trigger: 'schedule', schedule: schedule.name, tick },
      });
    },
  };
}
