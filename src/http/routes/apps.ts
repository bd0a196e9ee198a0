/** `/v2/projects/{project_id}/apps`: list and get apps. Apps are created by their first deploy. */
import { Type } from 'typebox';
import { getApp, listApps } from '../../apps/apps.js';
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
}
