/**
 * The run endpoint, `POST /v4/{project_id}/{app_name}/{function}` (the spec's `.../run` calls `run`).
 *
 * Every response carries `X-Request-Id`, equal to the run id. Authentication uses the `run` scope unless
 * the app's active build has `disable_auth = true`. Executing functions arrives with the replica pool;
 * until then an app with a ready build answers FERRY_RUNS_NOT_AVAILABLE.
 */
import { Type } from 'typebox';
import type { AppConfig } from '../../apps/app-config.js';
import { FerryError } from '../../errors.js';
import { uuidv7 } from '../../ids.js';
import type { Services } from '../../services.js';
import type { TypedServer } from '../server.js';

declare module 'fastify' {
  interface FastifyRequest {
    runId?: string;
  }
}

const RunParams = Type.Object({
  project_id: Type.String({ maxLength: 64 }),
  app_name: Type.String({ maxLength: 64 }),
  function: Type.String({ maxLength: 128 }),
});

export function registerRunRoutes(app: TypedServer, services: Services): void {
  const { store } = services;

  app.post(
    '/v4/:project_id/:app_name/:function',
    {
      onRequest: async (request, reply) => {
        request.runId = uuidv7();
        void reply.header('x-request-id', request.runId);
        const { project_id, app_name } = request.params as { project_id: string; app_name: string };
        const found = await store
          .selectFrom('apps')
          .leftJoin('builds', 'builds.id', 'apps.active_build_id')
          .select(['apps.id', 'builds.config_json'])
          .where('apps.project_id', '=', project_id)
          .where('apps.id', '=', app_name)
          .executeTakeFirst();
        const config = found?.config_json ? (JSON.parse(found.config_json) as AppConfig) : undefined;
        if (!config?.app.disable_auth) {
          request.principal = await services.auth.authenticate(request.headers.authorization, project_id, 'run');
        }
        if (!found) throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${app_name}" in this project`);
        if (!config) throw new FerryError('FERRY_NO_READY_BUILD', undefined, { headers: { 'retry-after': '5' } });
      },
      schema: { params: RunParams },
    },
    async (request) => {
      const body = request.body;
      if (body === null || typeof body !== 'object' || Array.isArray(body))
        throw new FerryError('FERRY_BODY_NOT_OBJECT');
      throw new FerryError('FERRY_RUNS_NOT_AVAILABLE', undefined, { headers: { 'retry-after': '30' } });
    },
  );
}
