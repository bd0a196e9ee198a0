/**
 * `/v2/projects/{project_id}/apps/{app_id}/schedules`: an app's schedules (the `[[schedules]]` of its active
 * build), paused, resumed, or triggered once now. Thin: the rules are in `schedules/`.
 */
import { Type } from 'typebox';
import type { ScheduleService } from '../../schedules/schedule-service.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { AppParams, errors, Nullable } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

export interface ScheduleRouteDeps extends AuthDeps {
  schedules: ScheduleService;
}

const Schedule = Type.Object(
  {
    name: Type.String(),
    cron: Type.String({ description: 'A 5-field cron expression, a nickname (@daily) or @every <duration>' }),
    timezone: Type.String({ description: 'IANA time zone the cron expression is read in' }),
    function: Type.String({ description: 'The function each tick runs (custom apps: POST /<function>)' }),
    args: Type.Unknown({ description: 'The JSON body of each run' }),
    webhook: Nullable(Type.String()),
    overlap: Type.Union([Type.Literal('skip'), Type.Literal('allow')]),
    paused: Type.Boolean(),
    next_tick_at: Nullable(Type.String({ format: 'date-time', description: 'Null while paused' })),
    last_tick_at: Nullable(Type.String({ format: 'date-time' })),
    last_run: Nullable(Type.Object({ id: Type.String(), state: Type.String() })),
    ticks_skipped: Type.Integer({
      description:
        'Due ticks that started no run: after downtime (one catch-up run instead), overlap = "skip", or a full async backlog',
    }),
    build_id: Type.String({ description: 'The build whose ferry.toml defines it' }),
  },
  { description: 'A schedule of the app’s active build, with its state' },
);

const ScheduleParams = Type.Object({
  project_id: AppParams.properties.project_id,
  app_id: AppParams.properties.app_id,
  name: Type.String({ pattern: '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$' }),
});

export function registerScheduleRoutes(app: TypedServer, services: ScheduleRouteDeps): void {
  const manage = requireScope(services, 'manage');

  app.get(
    '/v2/projects/:project_id/apps/:app_id/schedules',
    {
      onRequest: manage,
      schema: {
        summary: 'List the app’s schedules',
        params: AppParams,
        response: { 200: Type.Object({ schedules: Type.Array(Schedule) }), ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => ({
      schedules: await services.schedules.list(request.params.project_id, request.params.app_id),
    }),
  );

  for (const [action, paused] of [
    ['pause', true],
    ['resume', false],
  ] as const) {
    app.post(
      `/v2/projects/:project_id/apps/:app_id/schedules/:name/${action}`,
      {
        onRequest: manage,
        schema: {
          summary: paused ? 'Pause a schedule' : 'Resume a schedule',
          description: paused
            ? 'No tick starts a run until it is resumed; a new deploy keeps it paused.'
            : 'It goes on from its next tick after now: the ticks it missed while paused do not run.',
          params: ScheduleParams,
          response: { 200: Schedule, ...errors(400, 401, 403, 404) },
        },
      },
      async (request) => {
        const { project_id, app_id, name } = request.params;
        return services.schedules.setPaused(project_id, app_id, name, paused);
      },
    );
  }

  app.post(
    '/v2/projects/:project_id/apps/:app_id/schedules/:name/trigger',
    {
      onRequest: manage,
      schema: {
        summary: 'Run a schedule once now',
        description:
          'Starts one async run as the schedule’s tick would (trigger "schedule", the tick time now), whatever its timing and even while paused.',
        params: ScheduleParams,
        response: { 202: Type.Object({ run_id: Type.String() }), ...errors(400, 401, 403, 404, 429) },
      },
    },
    async (request, reply) => {
      const { project_id, app_id, name } = request.params;
      const runId = await services.schedules.trigger(project_id, app_id, name);
      return reply.code(202).send({ run_id: runId });
    },
  );
}
