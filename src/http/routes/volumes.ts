/**
 * `/v2/projects/{project_id}/volumes`: create, list, show (with its use), delete; and the files in a volume:
 * list a folder, download and upload a file (both streamed), delete a file or folder.
 *
 * Thin: the rules are in `volumes/` (the size and the total, the mounts, who mounts a volume) and the file
 * operations, which never follow a link or `..` out of the volume, in `volumes/volume-files.ts`.
 */
import type { Readable } from 'node:stream';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import { Type } from 'typebox';
import { FerryError } from '../../errors.js';
import { listFolder, openFileForRead, removePath, splitVolumePath, writeFile } from '../../volumes/volume-files.js';
import type { Volumes } from '../../volumes/volumes.js';
import { type AuthDeps, requireScope } from '../auth.js';
import {
  CreateVolumeBody,
  errors,
  ProjectParams,
  Volume,
  VolumeDetail,
  VolumeListing,
  VolumeParams,
  VolumePathQuery,
} from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

export interface VolumeRouteDeps extends AuthDeps {
  volumes: Volumes;
}

export function registerVolumeRoutes(app: TypedServer, services: VolumeRouteDeps): void {
  const manage = requireScope(services, 'manage');
  const { volumes } = services;

  app.post(
    '/v2/projects/:project_id/volumes',
    {
      onRequest: manage,
      schema: {
        summary: 'Create a volume',
        description:
          'A filesystem of size_mib, shared by every replica of the apps of the project that mount it ([[volumes]] in ferry.toml). Refused with 503 FERRY_VOLUMES_UNAVAILABLE on a server that cannot bound its size.',
        params: ProjectParams,
        body: CreateVolumeBody,
        response: { 201: Volume, ...errors(400, 401, 403, 404, 409, 503, 507) },
      },
    },
    async (request, reply) => {
      const volume = await volumes.create(request.params.project_id, request.body.name, request.body.size_mib);
      return reply.code(201).send(volume);
    },
  );

  app.get(
    '/v2/projects/:project_id/volumes',
    {
      onRequest: manage,
      schema: {
        summary: 'List the project’s volumes',
        params: ProjectParams,
        response: { 200: Type.Object({ volumes: Type.Array(Volume) }), ...errors(401, 403, 404) },
      },
    },
    async (request) => ({ volumes: await volumes.list(request.params.project_id) }),
  );

  app.get(
    '/v2/projects/:project_id/volumes/:name',
    {
      onRequest: manage,
      schema: {
        summary: 'Get a volume, with the bytes it uses',
        params: VolumeParams,
        response: { 200: VolumeDetail, ...errors(400, 401, 403, 404, 503) },
      },
    },
    async (request) => volumes.get(request.params.project_id, request.params.name),
  );

  app.delete(
    '/v2/projects/:project_id/volumes/:name',
    {
      onRequest: manage,
      schema: {
        summary: 'Delete a volume and its files',
        description:
          'Frees its space. Refused with 409 FERRY_VOLUME_IN_USE while the active build of an app mounts it, unless force=true (then the replicas that mount it are stopped, and new ones fail to start). Deleting an app never deletes volumes.',
        params: VolumeParams,
        querystring: Type.Object({ force: Type.Optional(Type.Boolean({ default: false })) }),
        response: { 204: Type.Null({ description: 'Deleted' }), ...errors(400, 401, 403, 404, 409, 503) },
      },
    },
    async (request, reply) => {
      await volumes.remove(request.params.project_id, request.params.name, request.query.force ?? false);
      return reply.code(204).send(null);
    },
  );

  app.get(
    '/v2/projects/:project_id/volumes/:name/files',
    {
      onRequest: manage,
      schema: {
        summary: 'List a folder of a volume',
        params: VolumeParams,
        querystring: VolumePathQuery,
        response: { 200: VolumeListing, ...errors(400, 401, 403, 404, 409, 422, 503) },
      },
    },
    async (request) => {
      const parts = splitVolumePath(request.query.path ?? '');
      const listing = await volumes.withRoot(request.params.project_id, request.params.name, (fd) =>
        listFolder(fd, parts),
      );
      return { path: `/${parts.join('/')}`, ...listing };
    },
  );

  app.get(
    '/v2/projects/:project_id/volumes/:name/file',
    {
      onRequest: manage,
      schema: {
        summary: 'Download a file of a volume (streamed)',
        description:
          'application/octet-stream with Content-Length. Only regular files with one link are read: a link, FIFO, device, socket or hard-linked file is refused with 422 FERRY_VOLUME_FILE_REFUSED.',
        params: VolumeParams,
        querystring: VolumePathQuery,
        response: {
          200: Type.String({ description: 'The file’s bytes' }),
          ...errors(400, 401, 403, 404, 409, 422, 503),
        },
      },
    },
    async (request, reply) => {
      const parts = splitVolumePath(request.query.path ?? '');
      const { handle, size } = await volumes.withRoot(request.params.project_id, request.params.name, (fd) =>
        openFileForRead(fd, parts),
      );
      // The stream owns the descriptor now and closes it when done or when the caller goes away.
      const stream = handle.createReadStream({ highWaterMark: 1024 * 1024 });
      return (
        reply
          .header('content-type', 'application/octet-stream')
          .header('content-length', String(size))
          // A stream is piped as it is, never serialized; the schema documents the bytes.
          .send(stream as unknown as string)
      );
    },
  );

  // Its own scope: an upload is the file's bytes as they are, streamed to disk, of any Content-Type.
  void app.register(async function volumeUploadScope(plain) {
    const scope = plain.withTypeProvider<TypeBoxTypeProvider>();
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser('*', (_request, payload, done) => done(null, payload));
    scope.put(
      '/v2/projects/:project_id/volumes/:name/file',
      {
        onRequest: manage,
        // No cap but the volume's own size (its filesystem says ENOSPC).
        bodyLimit: Number.MAX_SAFE_INTEGER,
        schema: {
          summary: 'Upload a file to a volume (streamed)',
          description:
            'The body is the file’s bytes (any Content-Type). Folders on the way are made. The file is written under a temporary name and renamed into place once complete, replacing what was there (a link is replaced, never written through). Past the volume’s room: 413 FERRY_VOLUME_FULL, and nothing is left behind.',
          params: VolumeParams,
          querystring: VolumePathQuery,
          response: {
            201: Type.Object({ path: Type.String(), bytes: Type.Integer() }),
            ...errors(400, 401, 403, 404, 409, 413, 422, 503),
          },
        },
      },
      async (request, reply) => {
        const parts = splitVolumePath(request.query.path ?? '');
        const body = request.body as Readable | undefined;
        if (!body || typeof body.pipe !== 'function') throw new FerryError('FERRY_VALIDATION', 'The body is the file');
        const declared = Number(request.headers['content-length'] ?? Number.NaN);
        const { bytes } = await volumes.withRoot(request.params.project_id, request.params.name, async (fd, usage) => {
          if (Number.isFinite(declared)) {
            const { free_bytes } = await usage();
            if (declared > free_bytes) {
              throw new FerryError(
                'FERRY_VOLUME_FULL',
                `The file (${declared} bytes) is larger than the room left in volume ${request.params.name} (${free_bytes} bytes)`,
              );
            }
          }
          return writeFile(fd, parts, body);
        });
        return reply.code(201).send({ path: `/${parts.join('/')}`, bytes });
      },
    );
  });

  app.delete(
    '/v2/projects/:project_id/volumes/:name/file',
    {
      onRequest: manage,
      schema: {
        summary: 'Delete a file, link or folder of a volume',
        description: 'A folder that is not empty needs recursive=true. Links are removed, never followed.',
        params: VolumeParams,
        querystring: Type.Object({
          path: VolumePathQuery.properties.path,
          recursive: Type.Optional(Type.Boolean({ default: false })),
        }),
        response: { 204: Type.Null({ description: 'Deleted' }), ...errors(400, 401, 403, 404, 409, 503) },
      },
    },
    async (request, reply) => {
      const parts = splitVolumePath(request.query.path ?? '');
      await volumes.withRoot(request.params.project_id, request.params.name, (fd) =>
        removePath(fd, parts, request.query.recursive ?? false),
      );
      return reply.code(204).send(null);
    },
  );
}
