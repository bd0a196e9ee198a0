/**
 * The run endpoint, `POST /v4/{project_id}/{app_name}/{function}` (the spec's `.../run` calls `run`).
 *
 * Every response, errors included, carries `X-Request-Id`, equal to the run id. Authentication uses the
 * `run` scope unless the app's active build has `disable_auth = true`. The body is a JSON object whose
 * members are the function's arguments; it is forwarded to the replica as the caller sent it.
 */
import type { FastifyInstance } from 'fastify';
import { Type } from 'typebox';
import type { AppConfig } from '../../apps/app-config.js';
import { FerryError } from '../../errors.js';
import { uuidv7 } from '../../ids.js';
import type { PoolBuild } from '../../replicas/pool.js';
import type { Services } from '../../services.js';
import type { TypedServer } from '../server.js';

declare module 'fastify' {
  interface FastifyRequest {
    runId?: string;
    runTarget?: RunTarget;
  }
}

/** The app and build a run call resolved to. */
export interface RunTarget {
  build: PoolBuild;
  /** Public function names known from the build, or undefined when the builder could not tell. */
  functions: string[] | undefined;
}

interface RawJson {
  raw: Buffer;
}

const RunParams = Type.Object({
  project_id: Type.String({ maxLength: 64 }),
  app_name: Type.String({ maxLength: 64 }),
  function: Type.String({ maxLength: 128 }),
});

/** Checks the body is one JSON object and keeps its bytes. */
function parseRunBody(raw: Buffer): RawJson {
  if (raw.length === 0) return { raw: Buffer.from('{}') };
  let value: unknown;
  try {
    value = JSON.parse(raw.toString('utf8'));
  } catch {
    throw new FerryError('FERRY_INVALID_JSON');
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value))
    throw new FerryError('FERRY_BODY_NOT_OBJECT');
  return { raw };
}

/** Finds the app's active build, authenticating unless the build turns auth off. */
async function resolveTarget(
  services: Services,
  projectId: string,
  appName: string,
  authorization: string | undefined,
): Promise<RunTarget> {
  const found = await services.store
    .selectFrom('apps')
    .leftJoin('builds', 'builds.id', 'apps.active_build_id')
    .select(['apps.id', 'builds.id as build_id', 'builds.config_json', 'builds.functions'])
    .where('apps.project_id', '=', projectId)
    .where('apps.id', '=', appName)
    .executeTakeFirst();
  const config = found?.config_json ? (JSON.parse(found.config_json) as AppConfig) : undefined;
  if (!config?.app.disable_auth) await services.auth.authenticate(authorization, projectId, 'run');
  if (!found) throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${appName}" in this project`);
  if (!config || !found.build_id)
    throw new FerryError('FERRY_NO_READY_BUILD', undefined, { headers: { 'retry-after': '5' } });
  return {
    build: { projectId, appId: found.id, buildId: found.build_id, config },
    functions: found.functions ? (JSON.parse(found.functions) as string[]) : undefined,
  };
}

export function registerRunRoutes(app: TypedServer, services: Services): void {
  // Its own scope, so the raw-body JSON parser applies to the run endpoint only.
  void app.register(async function runEndpoint(scope: FastifyInstance) {
    scope.addContentTypeParser(
      'application/json',
      { parseAs: 'buffer', bodyLimit: services.config.maxBodyBytes },
      (_req, body, done) => {
        try {
          done(null, parseRunBody(body as Buffer));
        } catch (err) {
          done(err as Error, undefined);
        }
      },
    );

    scope.post(
      '/v4/:project_id/:app_name/:function',
      {
        schema: { params: RunParams },
        onRequest: async (request, reply) => {
          request.runId = uuidv7();
          void reply.header('x-request-id', request.runId);
          const { project_id, app_name } = request.params as { project_id: string; app_name: string };
          request.runTarget = await resolveTarget(services, project_id, app_name, request.headers.authorization);
        },
      },
      async (request, reply) => {
        const target = request.runTarget!;
        const runId = request.runId!;
        const fn = (request.params as { function: string }).function;
        if (fn.startsWith('_') || (target.functions && !target.functions.includes(fn))) {
          throw new FerryError('FERRY_FUNCTION_NOT_FOUND', `The app has no public function "${fn}"`);
        }
        const body = (request.body as RawJson | undefined)?.raw ?? Buffer.from('{}');

        // The caller going away ends the run (its generator is stopped, its slot freed).
        const gone = new AbortController();
        reply.raw.on('close', () => {
          if (!reply.raw.writableFinished) gone.abort(new Error('client disconnected'));
        });
        const outcome = await services.invoker.invoke({
          runId,
          build: target.build,
          fn,
          body,
          mode: 'sync',
          signal: gone.signal,
        });
        return reply
          .type('application/json; charset=utf-8')
          .send({ run_id: runId, result: outcome.result, run_time_ms: outcome.runTimeMs });
      },
    );
  });
}
