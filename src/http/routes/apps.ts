/** `/v2/projects/{project_id}/apps`: list and get apps. Apps are created by their first deploy. */
import { Type } from 'typebox';
import { getApp, listApps } from '../../apps/apps.js';
import { NODE_NAME } from '../../cluster/node-name.js';
import type { Services } from '../../services.js';
import { requireScope } from '../auth.js';
import { App, AppParams, errors, ProjectParams } from '../schemas.js';
import type { TypedServer } from '../server.js';

export function registerAppRoutes(app: TypedServer, services: Services): void {
  const manage = requireScope(services, 'manage');

  app.get(
    '/v2/projects/:project_id/apps',
    {
      onRequest: manage,
      schema: {
        summary: 'List apps',
        params: ProjectParams,
        response: { 200: Type.Object({ apps: Type.Array(App) }), ...errors(401, 403, 404) },
      },
    },
    async (request) => ({ apps: await listApps(services.store, request.params.project_id) }),
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id',
    {
      onRequest: manage,
      schema: { summary: 'Get an app', params: AppParams, response: { 200: App, ...errors(401, 403, 404) } },
    },
    async (request) => getApp(services.store, request.params.project_id, request.params.app_id),
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
      await getApp(services.store, project_id, app_id);
      const { after = 0, limit = 1000 } = request.query;
      return { app_id, node: NODE_NAME, lines: services.appLog.read(project_id, app_id, after, limit) };
    },
  );
}
