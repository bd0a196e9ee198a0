/**
 * `/v2/projects/{project_id}/apps/{app_id}/builds`: deploy (upload a ZIP), list, get, log, cancel, and the
 * archive listing of spec section 4.1 (`.../builds/{build_id}/zip-contents`).
 */
import type { Readable } from 'node:stream';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import { Type } from 'typebox';
import type { BuildService } from '../../builds/build-service.js';
import { FINAL_BUILD_STATES } from '../../builds/builds.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { bodyTooLarge, unsupportedMediaType } from '../body-parsers.js';
import { AppParams, Build, BuildParams, errors, ZipContents } from '../schemas.js';
import { formatEvent, startEventStream, wantsEventStream } from '../sse.js';
import type { TypedServer } from '../typed-server.js';

const ZIP = 'application/zip';
const LogLine = Type.Object({ seq: Type.Integer(), at: Type.String(), line: Type.String() });

export interface BuildRouteDeps extends AuthDeps {
  builds: BuildService;
  config: { maxUploadBytes: number };
}

export function registerBuildRoutes(app: TypedServer, services: BuildRouteDeps): void {
  const manage = requireScope(services, 'manage');
  const { builds } = services;

  // Its own scope: deploys read the archive as a stream of application/zip, and refuse any other body unread.
  void app.register(async function deployScope(plain) {
    const scope = plain.withTypeProvider<TypeBoxTypeProvider>();
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser(['application/zip', 'application/x-zip-compressed'], (_request, payload, done) =>
      done(null, payload),
    );
    scope.addContentTypeParser('*', (request, _payload, done) =>
      done(unsupportedMediaType(request.headers['content-type'], ZIP)),
    );
    scope.post(
      '/v2/projects/:project_id/apps/:app_id/builds',
      {
        onRequest: manage,
        bodyLimit: services.config.maxUploadBytes,
        config: { accepts: ZIP },
        schema: {
          summary: 'Deploy: upload a ZIP of the app folder as a new build',
          description:
            'The body is the ZIP archive itself (Content-Type: application/zip). It must hold ferry.toml at its root, whose [app].name equals app_id. The app is created by its first deploy. The archive is checked before anything is extracted; each refusal is a 400 with its own code. More [[schedules]] than the server allows: 400 FERRY_CONFIG_INVALID for the app (FERRY_MAX_SCHEDULES_PER_APP), 409 FERRY_PROJECT_SCHEDULES_FULL for the project (FERRY_MAX_SCHEDULES_PER_PROJECT).',
          params: AppParams,
          response: { 201: Build, ...errors(400, 401, 403, 404, 409, 413, 415, 503) },
        },
      },
      async (request, reply) => {
        const declared = Number(request.headers['content-length'] ?? Number.NaN);
        if (declared > services.config.maxUploadBytes) {
          throw bodyTooLarge(services.config.maxUploadBytes, 'The archive');
        }
        const body = request.body as Readable | undefined;
        if (!body || typeof (body as Readable).pipe !== 'function') {
          throw unsupportedMediaType(request.headers['content-type'], ZIP);
        }
        const { build, view } = await builds.deploy(request.params.project_id, request.params.app_id, body);
        request.log.info({ buildId: build.id, app: build.app_id, bytes: build.archive_bytes }, 'build received');
        return reply.code(201).send(view);
      },
    );
  });

  app.get(
    '/v2/projects/:project_id/apps/:app_id/builds',
    {
      onRequest: manage,
      schema: {
        summary: 'List builds, newest first',
        params: AppParams,
        querystring: Type.Object({
          limit: Type.Optional(Type.Integer({ minimum: 1, maximum: 200, default: 50 })),
          before: Type.Optional(Type.String({ description: 'Only builds older than this build id (paging)' })),
        }),
        response: {
          200: Type.Object({ builds: Type.Array(Build), next_before: Type.Union([Type.String(), Type.Null()]) }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request) => {
      const limit = request.query.limit ?? 50;
      const found = await builds.list(request.params.project_id, request.params.app_id, {
        limit,
        before: request.query.before,
      });
      return {
        builds: found,
        next_before: found.length === limit ? (found.at(-1)?.id ?? null) : null,
      };
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id',
    {
      onRequest: manage,
      schema: { summary: 'Get a build', params: BuildParams, response: { 200: Build, ...errors(401, 403, 404) } },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      return builds.get(project_id, app_id, build_id);
    },
  );

  app.delete(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Delete a build and its files',
        description:
          'Not the active build (409 FERRY_BUILD_ACTIVE) nor one still being made (409 FERRY_BUILD_IN_PROGRESS: ' +
          'cancel it first). Its row, log, archive and build output go; runs that ran it keep their records.',
        params: BuildParams,
        response: {
          200: Type.Object({ build_id: Type.String(), deleted: Type.Literal(true) }),
          ...errors(401, 403, 404, 409),
        },
      },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      await builds.delete(project_id, app_id, build_id);
      return { build_id, deleted: true as const };
    },
  );

  app.post(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id/activate',
    {
      onRequest: manage,
      schema: {
        summary: 'Activate a build (roll back): make an earlier ready build the one calls run',
        description:
          'The build must be ready (else 409 FERRY_BUILD_NOT_READY), and its [[schedules]] within the server’s ' +
          'limits (else 400 FERRY_CONFIG_INVALID or 409 FERRY_PROJECT_SCHEDULES_FULL). Replicas switch as they do after a deploy: ' +
          'the old build’s replicas take no new runs and stop once their runs are done, new runs go to the ' +
          'activated build, on every node within a second. A later deploy that becomes ready is active in turn.',
        params: BuildParams,
        response: { 200: Build, ...errors(400, 401, 403, 404, 409) },
      },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      const build = await builds.activate(project_id, app_id, build_id);
      request.log.info({ app: app_id, build: build.id }, 'build activated');
      return build;
    },
  );

  app.post(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id/cancel',
    {
      onRequest: manage,
      schema: {
        summary: 'Cancel a pending or running build',
        params: BuildParams,
        response: { 200: Build, ...errors(401, 403, 404, 409) },
      },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      return builds.cancel(project_id, app_id, build_id);
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id/logs',
    {
      onRequest: manage,
      schema: {
        summary: "A build's log",
        description:
          'JSON by default. With `Accept: text/event-stream` (or `?follow=true`) the log is streamed as server-sent events: each line as `data: {"seq","at","line"}`, live while the build runs, then one `event: end` whose data is `{"state"}`.',
        params: BuildParams,
        querystring: Type.Object({
          after: Type.Optional(Type.Integer({ minimum: 0, default: 0, description: 'Only lines after this seq' })),
          follow: Type.Optional(Type.Boolean()),
        }),
        response: {
          200: Type.Object({ build_id: Type.String(), state: Type.String(), lines: Type.Array(LogLine) }),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request, reply) => {
      const { project_id, app_id, build_id } = request.params;
      const build = await builds.find(project_id, app_id, build_id);
      const after = request.query.after ?? 0;
      if (!(request.query.follow || wantsEventStream(request.headers.accept))) {
        const lines = await builds.readLog(build_id, after);
        return { build_id, state: build.state, lines };
      }
      reply.hijack();
      const res = reply.raw;
      startEventStream(res);
      const gone = new AbortController();
      res.on('close', () => gone.abort());
      let seq = after;
      try {
        while (!gone.signal.aborted) {
          // Read the state before the lines: a build that is final now has all its lines written.
          const state = await builds.state(build_id);
          const lines = await builds.readLog(build_id, seq);
          for (const line of lines) {
            res.write(formatEvent(JSON.stringify(line), undefined, line.seq));
            seq = line.seq;
          }
          if (!state || FINAL_BUILD_STATES.includes(state)) {
            res.write(formatEvent(JSON.stringify({ state: state ?? 'unknown' }), 'end'));
            break;
          }
          await builds.waitForLog(build_id, 500, gone.signal);
        }
      } catch (err) {
        request.log.warn({ err, buildId: build_id }, 'build log stream failed');
      } finally {
        res.end();
      }
    },
  );

  app.get(
    '/v2/projects/:project_id/apps/:app_id/builds/:build_id/zip-contents',
    {
      onRequest: manage,
      schema: {
        summary: "List the files in the build's uploaded ZIP archive",
        description: 'Every file of the archive as uploaded, in archive order; directory entries are not listed.',
        params: BuildParams,
        response: { 200: ZipContents, ...errors(401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      const files = await builds.archive(project_id, app_id, build_id);
      return { build_id, count: files.length, total_size: files.reduce((n, f) => n + f.size, 0), files };
    },
  );
}
