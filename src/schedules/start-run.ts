/**
 * How a schedule's tick becomes an async run: the run record is inserted durably (as for a 202), with the
 * tick's idempotency key, and handed to the run queue like any accepted async run; the app's backlog
 * limits apply as to a call.
 *
 * Cortex apps: the tick calls `function` with `args` as its JSON body. Custom apps: the tick is
 * `POST /<function>` (default `POST /run`) with `args` as a JSON body.
 */
import { uuidv7 } from '../ids.js';
import { newRunRow, type RunRow } from '../runs/recorder.js';
import type { AcceptedRun } from '../runs/run-queue.js';
import type { Schedule } from '../store/schema.js';
import type { ScheduleRunStarter } from './ticker.js';

export function createScheduleRunStarter(deps: {
  /** The recorder's durable insert: resolves with the id of the run holding the row's idempotency key. */
  insertNow(row: RunRow): Promise<string>;
  /** The run queue's owner for a new run of the app (this node, or null: free). */
  ownerFor(projectId: string, appId: string): string | null;
  /** Told once the run is committed. */
  accepted(run: AcceptedRun, owner: string | null): void;
  /** Whether the async backlog (node and project) has room for one more run now. */
  admit(projectId: string): Promise<boolean>;
  /** The runtime of a build (`custom` or `cortex`). */
  runtimeOf(buildId: string): Promise<'custom' | 'cortex'>;
}): ScheduleRunStarter {
  return {
    async startScheduled(schedule: Schedule, tick: string, key: string | null): Promise<string | 'busy'> {
      if (!(await deps.admit(schedule.project_id))) return 'busy';
      const custom = (await deps.runtimeOf(schedule.build_id)) === 'custom';
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
      const owner = deps.ownerFor(schedule.project_id, schedule.app_id);
      const row = newRunRow({
        id,
        build: { projectId: schedule.project_id, appId: schedule.app_id, buildId: schedule.build_id },
        fn,
        mode: 'async',
        input: schedule.args,
        httpRequest,
        webhookUrl: schedule.webhook_endpoint ?? undefined,
        idempotencyKey: key ?? undefined,
        owner,
        origin: { trigger: 'schedule', schedule: schedule.name, tick },
      });
      const holder = await deps.insertNow(row);
      if (holder === row.id) {
        deps.accepted(
          {
            id: holder,
            projectId: schedule.project_id,
            appId: schedule.app_id,
            call: {
              function_name: row.function_name,
              input: row.input,
              webhook_endpoint: row.webhook_endpoint,
              http_request: row.http_request,
            },
          },
          owner,
        );
      }
      return holder;
    },
  };
}
