/**
 * `/v2/projects/{project_id}/apps/{app_id}/builds`: deploy (upload a ZIP), list, get, log, cancel, and the
 * archive listing of spec section 4.1 (`.../builds/{build_id}/zip-contents`).
 */
import type { Readable } from 'node:stream';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import { Type } from 'typebox';
import { findApp } from '../../apps/apps.js';
import { findBuild, listBuilds, viewBuild } from '../../builds/builds.js';
import { FINAL_BUILD_STATES } from '../../builds/pipeline.js';
import { receiveBuild } from '../../builds/upload.js';
import { listZip } from '../../builds/zip-archive.js';
import { FerryError } from '../../errors.js';
import type { Services } from '../../services.js';
import { lockApp } from '../../store/active-build.js';
import { requireScope } from '../auth.js';
import { bodyTooLarge, unsupportedMediaType } from '../body-parsers.js';
import { AppParams, Build, BuildParams, errors, ZipContents } from '../schemas.js';
import type { TypedServer } from '../server.js';
import { formatEvent, startEventStream, wantsEventStream } from '../sse.js';

const ZIP = 'application/zip';
const LogLine = Type.Object({ seq: Type.Integer(), at: Type.String(), line: Type.String() });

export function registerBuildRoutes(app: TypedServer, services: Services): void {
  const manage = requireScope(services, 'manage');
  const { store } = services;

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
            'The body is the ZIP archive itself (Content-Type: application/zip). It must hold ferry.toml at its root, whose [app].name equals app_id. The app is created by its first deploy. The archive is checked before anything is extracted; each refusal is a 400 with its own code.',
          params: AppParams,
          response: { 201: Build, ...errors(400, 401, 403, 404, 413, 415, 503) },
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
        const build = await receiveBuild(
          {
            store,
            artifacts: services.artifacts,
            tmpDir: services.dataDir.tmp,
            buildsDir: services.dataDir.builds,
            maxUploadBytes: services.config.maxUploadBytes,
            zipLimits: services.config.zipLimits,
            checkVolumes: (projectId, config) => services.volumes.checkMounts(projectId, config),
            // A gateway builds nothing: the build stays free for a worker to claim.
            ...(services.role === 'gateway' ? {} : { owner: services.node.id }),
          },
          request.params.project_id,
          request.params.app_id,
          body,
        );
        services.pipeline.enqueue(build);
        request.log.info({ buildId: build.id, app: build.app_id, bytes: build.archive_bytes }, 'build received');
        return reply.code(201).send(viewBuild(build, false, null));
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
      const found = await findApp(store, request.params.project_id, request.params.app_id);
      const limit = request.query.limit ?? 50;
      const builds = await listBuilds(store, request.params.project_id, request.params.app_id, {
        limit,
        before: request.query.before,
      });
      return {
        builds: builds.map((b) => viewBuild(b, false, found.active_build_id)),
        next_before: builds.length === limit ? (builds.at(-1)?.id ?? null) : null,
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
      const found = await findApp(store, project_id, app_id);
      return viewBuild(await findBuild(store, project_id, app_id, build_id), true, found.active_build_id);
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
      await services.housekeeping.deleteBuild(project_id, app_id, build_id);
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
          'The build must be ready (else 409 FERRY_BUILD_NOT_READY). Replicas switch as they do after a deploy: ' +
          'the old build’s replicas take no new runs and stop once their runs are done, new runs go to the ' +
          'activated build, on every node within a second. A later deploy that becomes ready is active in turn.',
        params: BuildParams,
        response: { 200: Build, ...errors(401, 403, 404, 409) },
      },
    },
    async (request) => {
      const { project_id, app_id, build_id } = request.params;
      await findApp(store, project_id, app_id);
      // Under the app's row lock, as a delete of the build takes it: the build is checked and made active
      // with no delete in between (src/store/active-build.ts).
      const build = await store.transaction().execute(async (trx) => {
        if (!(await lockApp(trx, project_id, app_id))) {
          throw new FerryError('FERRY_APP_NOT_FOUND', `No app "${app_id}" in this project`);
        }
        const found = await findBuild(trx, project_id, app_id, build_id);
        if (found.state !== 'ready') {
          throw new FerryError(
            'FERRY_BUILD_NOT_READY',
            `Build ${build_id} is ${found.state}: only a ready build can be activated`,
          );
        }
        await trx
          .updateTable('apps')
          .set({ active_build_id: found.id, updated_at: new Date().toISOString() })
          .where('project_id', '=', project_id)
          .where('id', '=', app_id)
          .execute();
        return found;
      });
      // Every process (this one before the answer) forgets the app's run target and switches its replicas.
      await services.changes.publish({
        type: 'build.activated',
        projectId: project_id,
        appId: app_id,
        buildId: build.id,
      });
      // This process has switched before it answers: a call sent after the answer runs the activated build.
      await services.replicas.activate(project_id, app_id);
      request.log.info({ app: app_id, build: build.id }, 'build activated');
      return viewBuild(build, false, build.id);
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
      return viewBuild(await services.pipeline.cancel(project_id, app_id, build_id), false, null);
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
      const build = await findBuild(store, project_id, app_id, build_id);
      const after = request.query.after ?? 0;
      if (!(request.query.follow || wantsEventStream(request.headers.accept))) {
        const lines = await services.buildLog.read(build_id, after);
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
          const state = (await store.selectFrom('builds').select('state').where('id', '=', build_id).executeTakeFirst())
            ?.state;
          const lines = await services.buildLog.read(build_id, seq);
          for (const line of lines) {
            res.write(formatEvent(JSON.stringify(line), undefined, line.seq));
            seq = line.seq;
          }
          if (!state || FINAL_BUILD_STATES.includes(state)) {
            res.write(formatEvent(JSON.stringify({ state: state ?? 'unknown' }), 'end'));
            break;
          }
          await services.buildLog.waitForLines(build_id, 500, gone.signal);
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
      await findBuild(store, project_id, app_id, build_id);
      const file = await services.artifacts.localPath(build_id);
      if (!file) throw new FerryError('FERRY_BUILD_NOT_FOUND', `The archive of build ${build_id} is no longer stored`);
      const files = await listZip(file);
      return { build_id, count: files.length, total_size: files.reduce((n, f) => n + f.size, 0), files };
    },
  );
}
