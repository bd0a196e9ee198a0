/** `/v2/projects/{project_id}/apps/{app_id}/runs`: list runs, get one, read its logs. */
import { Type } from 'typebox';
import { findApp } from '../../apps/apps.js';
import { findRun, listRuns, runLogs, viewRun } from '../../runs/runs.js';
import type { Services } from '../../services.js';
import { WebhookViewSchema, webhookView } from '../../webhooks/view.js';
import { requireScope } from '../auth.js';
import { AppId, AppParams, errors, Nullable, ProjectId } from '../schemas.js';
import type { TypedServer } from '../server.js';

const RunState = Type.Union([
  Type.Literal('queued'),
  Type.Literal('running'),
  Type.Literal('success'),
  Type.Literal('failure'),
  Type.Literal('timeout'),
  Type.Literal('cancelled'),
]);
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
  cold_start: Type.Boolean({ description: 'The run waited for a replica to start' }),
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
  input: Type.Optional(Type.Unknown({ description: 'The arguments (when at most 64 KiB; async runs: always)' })),
  result: Type.Optional(Type.Unknown({ description: 'The result (when at most 256 KiB)' })),
  webhook: Type.Optional(Type.Union([WebhookViewSchema, Type.Null()])),
});

const RunParams = Type.Object({
  project_id: ProjectId,
  app_id: AppId,
  run_id: Type.String({ pattern: '^[0-9a-f-]{36}$' }),
});

export function registerRunsRoutes(app: TypedServer, services: Services): void {
  const manage = requireScope(services, 'manage');
  const { store } = services;

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
        }),
        response: {
          200: Type.Object({ runs: Type.Array(Run), next_before: Nullable(Type.String()) }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      await findApp(store, project_id, app_id);
      await services.recorder.flush();
      const limit = request.query.limit ?? 50;
      const runs = await listRuns(store, project_id, app_id, { ...request.query, limit });
      return {
        runs: runs.map((r) => viewRun(r)),
        next_before: runs.length === limit ? (runs.at(-1)?.id ?? null) : null,
      };
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Get a run, with its input and result',
        params: RunParams,
        response: { 200: Run, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, app_id, run_id } = request.params;
      await services.recorder.flush();
      const run = viewRun(await findRun(store, project_id, app_id, run_id), true);
      return { ...run, webhook: await webhookView(store, run_id) };
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
          }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id, run_id } = request.params;
      await services.recorder.flush();
      await findRun(store, project_id, app_id, run_id);
      return { run_id, lines: await runLogs(store, run_id, request.query.after ?? 0) };
    },
  );
}
