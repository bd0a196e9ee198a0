/** `/v2/projects/{project_id}/apps/{app_id}/runs`: list runs, get one, read its logs. */
import { Type } from 'typebox';
import type { RunService } from '../../runs/run-service.js';
import { WebhookViewSchema } from '../../webhooks/view.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { AppId, AppParams, errors, Nullable, ProjectId } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const RunState = Type.Union([
  Type.Literal('queued'),
  Type.Literal('running'),
  Type.Literal('success'),
  Type.Literal('failure'),
  Type.Literal('timeout'),
  Type.Literal('cancelled'),
]);
/** The longest `?wait=` on GET .../runs/{run_id}. */
const MAX_WAIT_SECONDS = 60;

const RunMode = Type.Union([Type.Literal('sync'), Type.Literal('async'), Type.Literal('stream')]);

const Run = Type.Object({
  run_id: Type.String({ description: 'The run id; also the X-Request-Id of the run call' }),
  project_id: Type.String(),
  app_id: Type.String(),
  build_id: Nullable(Type.String()),
  function: Type.String(),
  mode: RunMode,
  state: RunState,
  status_code: Nullable(Type.Integer()),
  cold_start: Type.Boolean({
    description: 'The run (in any of its attempts) waited for a replica to start; its log says how long',
  }),
  created_at: Type.String({ format: 'date-time' }),
  started_at: Nullable(Type.String({ format: 'date-time' })),
  finished_at: Nullable(Type.String({ format: 'date-time' })),
  run_time_ms: Nullable(Type.Integer()),
  error: Nullable(Type.Object({ code: Type.String(), message: Type.String() })),
  reason: Nullable(
    Type.String({
      description:
        'Why it ended as it did: `interrupted` when the server running it stopped mid-run (see retry_interrupted)',
    }),
  ),
  attempts: Type.Integer({
    description:
      'How many times the run was started: 1 for a run that ran once; more when an interrupted async run of an app with retry_interrupted ran again; 0 while queued',
  }),
  trigger: Type.Union([Type.Literal('call'), Type.Literal('schedule'), Type.Literal('retry')], {
    description: 'What started the run: a call of the run endpoint, a schedule’s tick, or `runs retry`',
  }),
  schedule: Nullable(
    Type.Object(
      { name: Type.String(), tick: Type.String({ format: 'date-time' }) },
      { description: 'A schedule’s run: the schedule and the tick it was started for' },
    ),
  ),
  retry_of: Nullable(Type.String({ description: 'A `runs retry` run: the run it repeats' })),
  attempt_history: Type.Array(
    Type.Object({
      attempt: Type.Integer(),
      started_at: Nullable(Type.String({ format: 'date-time' })),
      ended_at: Type.String({ format: 'date-time' }),
      state: RunState,
      status_code: Nullable(Type.Integer()),
      error_code: Nullable(Type.String()),
    }),
    { description: 'Runs of an app with [retries]: each attempt that ended, oldest first (empty otherwise)' },
  ),
  next_attempt_at: Nullable(
    Type.String({ format: 'date-time', description: 'A run waiting for its next attempt: not started before this' }),
  ),
  dead: Type.Boolean({ description: 'The run ended after exhausting its [retries] attempts' }),
  input: Type.Optional(Type.Unknown({ description: 'The arguments (when at most 64 KiB; async runs: always)' })),
  result: Type.Optional(Type.Unknown({ description: 'The result (when at most 256 KiB)' })),
  webhook: Type.Optional(Type.Union([WebhookViewSchema, Type.Null()])),
});

const RunParams = Type.Object({
  project_id: ProjectId,
  app_id: AppId,
  run_id: Type.String({ pattern: '^[0-9a-f-]{36}$' }),
});

export interface RunsRouteDeps extends AuthDeps {
  runs: RunService;
}

export function registerRunsRoutes(app: TypedServer, services: RunsRouteDeps): void {
  const manage = requireScope(services, 'manage');
  const { runs } = services;

  app.get(
    '/v2/projects/:project_id/apps/:app_id/runs',
    {
      onRequest: manage,
      schema: {
        summary: 'List runs, newest first',
        params: AppParams,
        querystring: Type.Object({
          limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 500, default: 50 })),
          before: Type.Optional(
            Type.String({ pattern: '^[0-9a-f-]{36}$', description: 'Only runs older than this run id' }),
          ),
          state: Type.Optional(RunState),
          mode: Type.Optional(RunMode),
          dead: Type.Optional(
            Type.Boolean({ description: 'Only runs that ended after exhausting their [retries] attempts' }),
          ),
        }),
        response: {
          200: Type.Object({ runs: Type.Array(Run), next_before: Nullable(Type.String()) }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      const limit = request.query.limit ?? 50;
      const found = await runs.list(project_id, app_id, { ...request.query, limit });
      return {
        runs: found,
        next_before: found.length === limit ? (found.at(-1)?.run_id ?? null) : null,
      };
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Get a run, with its input and result',
        description:
          'With `wait=N` (seconds, 1 to 60) the answer waits until the run has ended (success, failure, ' +
          'timeout or cancelled) or N seconds have passed, whichever is first, and then shows the run as it ' +
          'is: a run still queued or running after N seconds is answered as such (poll again). The wait is ' +
          'woken by the run’s end on whichever node runs it; nothing polls per waiting caller.',
        params: RunParams,
        querystring: Type.Object({
          wait: Type.Optional(
            Type.Integer({
              minimum: 0,
              maximum: MAX_WAIT_SECONDS,
              description: 'Seconds to wait for the run to end before answering (0 to 60; default 0)',
            }),
          ),
        }),
        response: { 200: Run, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, app_id, run_id } = request.params;
      const waitMs = (request.query.wait ?? 0) * 1000;
      if (waitMs === 0) return runs.get(project_id, app_id, run_id);
      // The caller hanging up ends the wait.
      const gone = new AbortController();
      const onClose = () => gone.abort();
      request.raw.once('close', onClose);
      try {
        return await runs.get(project_id, app_id, run_id, { ms: waitMs, signal: gone.signal });
      } finally {
        request.raw.off('close', onClose);
      }
    },
  );

  app.post(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id/cancel',
    {
      onRequest: manage,
      schema: {
        summary: 'Cancel a run',
        description:
          'A queued async run ends `cancelled` and never starts. A running run is stopped on whichever node runs ' +
          'it: a TypeScript/JavaScript function’s `context.signal` aborts, an async Python function gets ' +
          '`asyncio.CancelledError`, and the replica is stopped if the function has not returned within ' +
          '`FERRY_CANCEL_GRACE_SECONDS` (5); a custom app’s request is closed. A run waiting for a replica ends at ' +
          'once. The answer comes once the run has ended (200), or after the grace and 10 s more with the run as ' +
          'it is then (202: the cancel is under way). A run that has already finished: 409 FERRY_RUN_FINISHED. ' +
          'Its webhook, if any, carries `"state": "cancelled"` and the error FERRY_RUN_CANCELLED.',
        params: RunParams,
        response: { 200: Run, 202: Run, ...errors(400, 401, 403, 404, 409) },
      },
    },
    async (request, reply) => {
      const { project_id, app_id, run_id } = request.params;
      const gone = new AbortController();
      const onClose = () => gone.abort();
      request.raw.once('close', onClose);
      try {
        const { run, ended } = await runs.cancel(project_id, app_id, run_id, gone.signal, () =>
          request.log.info({ app: app_id, runId: run_id }, 'run cancel requested'),
        );
        return reply.code(ended ? 200 : 202).send(run);
      } finally {
        request.raw.off('close', onClose);
      }
    },
  );

  app.post(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id/retry',
    {
      onRequest: manage,
      schema: {
        summary: 'Run a finished run again',
        description:
          'Starts a new async run of the app’s active build with the finished run’s stored input (a custom app: its ' +
          'stored request) and webhook, `trigger: "retry"` and `retry_of` naming the old run; answers 202 with the new ' +
          'run’s id. 409 FERRY_RUN_NOT_FINISHED for a queued or running run, 409 FERRY_RUN_INPUT_NOT_KEPT when its input ' +
          'was not stored (a sync or stream call’s input over 64 KiB; a custom app’s synchronous request).',
        params: RunParams,
        response: { 202: Type.Object({ run_id: Type.String() }), ...errors(400, 401, 403, 404, 409, 429, 503) },
      },
    },
    async (request, reply) => {
      const { project_id, app_id, run_id } = request.params;
      const id = await runs.retry(project_id, app_id, run_id);
      return reply.code(202).header('x-request-id', id).send({ run_id: id });
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id/logs',
    {
      onRequest: manage,
      schema: {
        summary: "A run's logs: what the function printed during the run, and Ferry's notes (stream `system`)",
        params: RunParams,
        querystring: Type.Object({ after: Type.Optional(Type.Integer({ minimum: 0, default: 0 })) }),
        response: {
          200: Type.Object({
            run_id: Type.String(),
            lines: Type.Array(
              Type.Object({ seq: Type.Integer(), at: Type.String(), stream: Type.String(), line: Type.String() }),
            ),
            dropped_lines: Type.Integer({
              description:
                'Lines of the run not kept: past the per-run bound (FERRY_RUN_LOG_BYTES, 10,000 lines), or removed with the rest of its log by the project log budget (FERRY_PROJECT_LOG_BYTES). The log then ends with a `system` line saying so.',
            }),
            dropped_bytes: Type.Integer({ description: 'The UTF-8 bytes of those lines' }),
          }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id, run_id } = request.params;
      return runs.logs(project_id, app_id, run_id, request.query.after ?? 0);
    },
  );
}
