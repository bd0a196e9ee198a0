/** `/v2/projects/{project_id}/apps`: list and get apps. Apps are created by their first deploy. */
import { Type } from 'typebox';
import type { AppService } from '../../apps/app-service.js';
import { NODE_NAME } from '../../cluster/node-name.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { APP_NAME_PATTERN, App, AppParams, errors, Nullable, ProjectParams } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

export interface AppRouteDeps extends AuthDeps {
  apps: AppService;
}

export function registerAppRoutes(app: TypedServer, services: AppRouteDeps): void {
  const manage = requireScope(services, 'manage');
  const { apps } = services;

  app.get(
    '/v2/projects/:project_id/apps',
    {
      onRequest: manage,
      schema: {
        summary: 'List apps, by name',
        description:
          'Every app of the project, or with `limit` one page of them: the next page with `after` = `next_after`.',
        params: ProjectParams,
        querystring: Type.Object({
          limit: Type.Optional(
            Type.Integer({ minimum: 1, maximum: 1000, description: 'Apps per page (default: all)' }),
          ),
          after: Type.Optional(
            Type.String({
              pattern: APP_NAME_PATTERN,
              description: 'Only apps whose name sorts after this one (paging)',
            }),
          ),
        }),
        response: {
          200: Type.Object({
            apps: Type.Array(App),
            next_after: Nullable(
              Type.String({ description: 'With `limit`: `after` of the next page; null: the last' }),
            ),
          }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { limit, after } = request.query;
      const found = await apps.list(request.params.project_id, { limit, after });
      return {
        apps: found,
        next_after: limit !== undefined && found.length === limit ? (found.at(-1)?.id ?? null) : null,
      };
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id',
    {
      onRequest: manage,
      schema: { summary: 'Get an app', params: AppParams, response: { 200: App, ...errors(401, 403, 404) } },
    },
    async (request) => apps.get(request.params.project_id, request.params.app_id),
  );

  app.delete(
    '/v2/projects/:project_id/apps/:app_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Delete an app, its builds and its run history',
        description:
          'Calls to the app are refused with 404 at once, on every node within a second. Its queued async runs ' +
          'end `cancelled` (their webhooks are sent); runs in flight finish (within the response grace period) ' +
          'while its replicas stop. Its builds, their archives and build outputs are deleted, and so are the ' +
          'records of its finished runs with their logs; runs still in flight are recorded when they end and ' +
          'removed by retention (FERRY_RUN_RETENTION_DAYS). An app of the same name can be deployed again: it ' +
          'starts afresh.',
        params: AppParams,
        response: {
          200: Type.Object({
            app_id: Type.String(),
            deleted: Type.Literal(true),
            builds_deleted: Type.Integer(),
            runs_cancelled: Type.Integer({ description: 'Queued async runs that ended cancelled' }),
            runs_deleted: Type.Integer({ description: 'Records of finished runs deleted' }),
          }),
          ...errors(401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      const done = await apps.delete(project_id, app_id);
      return {
        app_id,
        deleted: true as const,
        builds_deleted: done.builds,
        runs_cancelled: done.cancelledRuns,
        runs_deleted: done.deletedRuns,
      };
    },
  );

  app.patch(
    '/v2/projects/:project_id/apps/:app_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Change an app’s settings without a build: its scaling',
        description:
          '`{"scaling": {...}}` sets any keys of `[scaling]` (min_replicas, max_replicas, replica_concurrency, ' +
          'cooldown, response_grace_period), checked as in ferry.toml; they are merged into the keys set before ' +
          'and override every build’s ferry.toml, later deploys included, until `{"scaling": null}` clears them. ' +
          'In force at once on every node: replicas start up to a higher min_replicas, idle replicas above a ' +
          'lower max_replicas stop, and a new replica_concurrency replaces the replicas as a deploy does.',
        params: AppParams,
        body: Type.Object(
          {
            scaling: Type.Union([Type.Null(), Type.Object({}, { additionalProperties: true })], {
              description: 'Keys of [scaling] to set, or null to clear the override',
            }),
          },
          { additionalProperties: false },
        ),
        response: { 200: App, ...errors(400, 401, 403, 404, 415) },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      const { app: changed, override } = await apps.scale(project_id, app_id, request.body.scaling);
      request.log.info({ app: app_id, scaling: override }, 'app scaling changed');
      return changed;
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/logs',
    {
      onRequest: manage,
      schema: {
        summary: 'The app log: what its replicas printed outside runs, and their starts, crashes and restarts',
        description:
          'Kept in memory by the server process that ran the replicas (the newest FERRY_APP_LOG_LINES lines per app): ' +
          'with several processes sharing a store, this shows what the answering process (`node`) saw, not the others. ' +
          'Page with `after` = the last `seq` seen.',
        params: AppParams,
        querystring: Type.Object({
          after: Type.Optional(Type.Integer({ minimum: 0, default: 0 })),
          limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 5000, default: 1000 })),
        }),
        response: {
          200: Type.Object({
            app_id: Type.String(),
            node: Type.String({ description: 'The process that answered (hostname:pid); the log is its own' }),
            lines: Type.Array(
              Type.Object({
                seq: Type.Integer(),
                at: Type.String(),
                replica: Type.String(),
                stream: Type.Union([Type.Literal('stdout'), Type.Literal('stderr'), Type.Literal('system')]),
                line: Type.String(),
              }),
            ),
          }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const { project_id, app_id } = request.params;
      const { after = 0, limit = 1000 } = request.query;
      return { app_id, node: NODE_NAME, lines: await apps.log(project_id, app_id, after, limit) };
    },
  );
}
