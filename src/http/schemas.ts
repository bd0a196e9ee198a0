/**
 * Shared route schemas. Each route declares its schemas once: Fastify validates requests with them and
 * @fastify/swagger writes the OpenAPI document from them.
 */
import { Type } from 'typebox';

export const ErrorBody = Type.Object(
  {
    run_id: Type.Optional(
      Type.String({
        description:
          'The run endpoint: the run the call became (equal to X-Request-Id); absent when the call was refused before any run existed',
      }),
    ),
    error: Type.Object({ code: Type.String(), message: Type.String() }),
  },
  { description: 'Every error answered by Ferry; the codes are listed in docs/errors.md' },
);

export const ProjectId = Type.String({ pattern: '^p-[0-9a-f]{8}$', description: 'Project id, like p-7f3a9c21' });
/** What an app's name (its id) may be. */
export const APP_NAME_PATTERN = '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$';
export const AppId = Type.String({
  pattern: APP_NAME_PATTERN,
  description: "The app's id, which is its name from ferry.toml",
});
export const BuildId = Type.String({ pattern: '^[0-9a-f-]{36}$', description: 'Build id (a UUIDv7)' });

export const ProjectParams = Type.Object({ project_id: ProjectId });
export const AppParams = Type.Object({ project_id: ProjectId, app_id: AppId });
export const BuildParams = Type.Object({ project_id: ProjectId, app_id: AppId, build_id: BuildId });

/** `T | null` as a schema. */
export const Nullable = <T extends Parameters<typeof Type.Union>[0][number]>(t: T) => Type.Union([t, Type.Null()]);

export const Build = Type.Object({
  id: Type.String(),
  project_id: Type.String(),
  app_id: Type.String(),
  state: Type.Union([
    Type.Literal('pending'),
    Type.Literal('building'),
    Type.Literal('ready'),
    Type.Literal('failed'),
    Type.Literal('cancelled'),
  ]),
  runtime: Nullable(Type.String()),
  archive_bytes: Type.Integer(),
  file_count: Type.Integer(),
  error: Nullable(Type.String()),
  created_at: Type.String({ format: 'date-time' }),
  started_at: Nullable(Type.String({ format: 'date-time' })),
  finished_at: Nullable(Type.String({ format: 'date-time' })),
  duration_ms: Nullable(Type.Integer()),
  functions: Nullable(
    Type.Array(Type.String(), {
      description:
        'Public functions of the entry, as the build found them; null when unknown (not ready, custom runtime, or a Python module whose public names only loading it can tell)',
    }),
  ),
  image: Nullable(
    Type.Object(
      {
        reference: Type.String({ description: 'The base image, pinned by digest (`registry/repository@sha256:…`)' }),
        digest: Type.String({ description: 'The manifest digest of the image replicas run on' }),
      },
      { description: 'With `[image]` in ferry.toml: the image the build runs on; null for the host runtime' },
    ),
  ),
  config_toml: Type.Optional(
    Type.String({ description: 'The ferry.toml the build was made with (single build only)' }),
  ),
  active: Type.Boolean({
    description:
      "Whether this is the app's active build (the one calls run): the newest ready build, or the one activated since",
  }),
});

export const App = Type.Object({
  id: Type.String(),
  name: Type.String(),
  project_id: Type.String(),
  state: Type.Union([
    Type.Literal('active'),
    Type.Literal('building'),
    Type.Literal('failed'),
    Type.Literal('pending'),
    Type.Literal('cancelled'),
  ]),
  active_build_id: Nullable(Type.String()),
  latest_build_id: Nullable(Type.String()),
  latest_build_state: Nullable(Type.String()),
  scaling_override: Nullable(
    Type.Record(Type.String(), Type.Integer(), {
      description:
        'Keys of [scaling] set through `PATCH .../apps/{app_id}`; they override every build’s ferry.toml until cleared',
    }),
  ),
  scaling: Type.Optional(
    Nullable(
      Type.Object(
        {
          min_replicas: Type.Integer(),
          max_replicas: Type.Integer(),
          replica_concurrency: Type.Integer(),
          cooldown: Type.Integer(),
          response_grace_period: Type.Integer(),
        },
        {
          description:
            'Single app only: the scaling in force (the active build’s [scaling] with the override over it); null without a ready build',
        },
      ),
    ),
  ),
  created_at: Type.String({ format: 'date-time' }),
  updated_at: Type.String({ format: 'date-time' }),
});

export const ServiceAccount = Type.Object({
  id: Type.String(),
  project_id: Type.String(),
  name: Type.String(),
  scopes: Type.Array(Type.Union([Type.Literal('manage'), Type.Literal('run')])),
  created_at: Type.String({ format: 'date-time' }),
  expires_at: Type.String({ format: 'date-time' }),
  revoked_at: Nullable(Type.String({ format: 'date-time' })),
  last_used_at: Nullable(Type.String({ format: 'date-time' })),
  expired: Type.Boolean(),
});

export const ZipContents = Type.Object({
  build_id: Type.String(),
  count: Type.Integer({ description: 'Number of files (directory entries are not listed)' }),
  total_size: Type.Integer({ description: 'Sum of the uncompressed sizes, bytes' }),
  files: Type.Array(
    Type.Object({
      path: Type.String({ description: 'Path inside the archive, forward slashes' }),
      size: Type.Integer({ description: 'Uncompressed size, bytes' }),
      compressed_size: Type.Integer(),
      crc32: Type.String({ description: 'CRC-32, 8 lowercase hex digits' }),
      modified: Type.String({ format: 'date-time' }),
    }),
    { description: 'Every file of the uploaded archive, in archive order' },
  ),
});

/** The error responses a route can give, as OpenAPI response entries. */
export function errors(...statuses: number[]): Record<number, typeof ErrorBody> {
  return Object.fromEntries(statuses.map((s) => [s, ErrorBody]));
}

// ---- volumes ----

export const VolumeName = Type.String({
  pattern: '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$',
  description: 'Volume name (same rule as app names), unique in the project',
});
export const VolumeParams = Type.Object({ project_id: ProjectId, name: VolumeName });

export const Volume = Type.Object({
  name: Type.String(),
  size_mib: Type.Integer({ description: 'The size of its filesystem: writes past it fail with ENOSPC' }),
  created_at: Type.String({ format: 'date-time' }),
});

export const VolumeDetail = Type.Object({
  name: Type.String(),
  size_mib: Type.Integer(),
  created_at: Type.String({ format: 'date-time' }),
  used_bytes: Type.Integer({
    description: 'Bytes in use in its filesystem (files, folders and the filesystem’s own metadata)',
  }),
  free_bytes: Type.Integer({ description: 'Bytes that can still be written' }),
  mounted_by: Type.Array(Type.String(), { description: 'Apps of the project whose active build mounts it' }),
});

export const CreateVolumeBody = Type.Object(
  {
    name: VolumeName,
    size_mib: Type.Integer({ minimum: 16, description: 'Size in MiB; at most FERRY_VOLUME_MAX_MIB' }),
  },
  { additionalProperties: false },
);

export const VolumePathQuery = Type.Object({
  path: Type.String({
    maxLength: 4096,
    default: '',
    description: 'A path inside the volume ("" or "/" is its root); ".." is refused, links are never followed',
  }),
});

export const VolumeEntry = Type.Object({
  name: Type.String(),
  type: Type.Union([Type.Literal('file'), Type.Literal('folder'), Type.Literal('link'), Type.Literal('other')], {
    description: 'link: a symbolic link (listed, never followed); other: a FIFO, socket or device node',
  }),
  size: Type.Integer({ description: 'Bytes, for files (0 otherwise)' }),
  modified_at: Type.String({ format: 'date-time' }),
});

export const VolumeListing = Type.Object({
  path: Type.String(),
  entries: Type.Array(VolumeEntry),
  truncated: Type.Boolean({ description: 'true when the folder has more than 10,000 entries (the first are listed)' }),
});
