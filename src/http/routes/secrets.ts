/**
 * `/v2/projects/{project_id}/secrets`: set, list, show metadata, delete. No route ever answers with a
 * value; the response schemas only have name and timestamps, so the serializer could not leak one
 * even if a handler returned it.
 */
import type { FastifyRequest } from 'fastify';
import { Type } from 'typebox';
import { FerryError } from '../../errors.js';
import type { SecretService } from '../../secrets/secret-service.js';
import {
  MAX_SECRET_VALUE_BYTES,
  RESERVED_SECRET_NAMES,
  RESERVED_SECRET_PREFIX,
  SECRET_NAME_PATTERN,
} from '../../secrets/secrets.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { errors, ProjectParams } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const SecretName = Type.String({
  pattern: SECRET_NAME_PATTERN,
  description: `Environment variable name. Names starting with ${RESERVED_SECRET_PREFIX} and ${RESERVED_SECRET_NAMES.join(', ')} are reserved.`,
});

const SecretParams = Type.Object({ project_id: ProjectParams.properties.project_id, name: SecretName });

const Secret = Type.Object(
  {
    name: Type.String(),
    created_at: Type.String({ format: 'date-time' }),
    updated_at: Type.String({ format: 'date-time' }),
  },
  { description: 'A secret without its value: values are never returned once set' },
);

const SetBody = Type.Object(
  {
    value: Type.String({
      // Characters here; the limit in UTF-8 bytes is checked when the secret is stored.
      maxLength: MAX_SECRET_VALUE_BYTES,
      description: `At most ${MAX_SECRET_VALUE_BYTES} bytes of UTF-8, no NUL characters`,
    }),
  },
  { additionalProperties: false },
);

/**
 * The server's Ajv coerces scalars (`coerceTypes`), which would store `42` as "42" and `null` as "";
 * a secret is exactly the string sent, so the raw body is checked before validation coerces it.
 */
async function rawValueIsString(request: FastifyRequest): Promise<void> {
  const body = request.body as { value?: unknown } | null | undefined;
  if (body && typeof body === 'object' && 'value' in body && typeof body.value !== 'string') {
    throw new FerryError('FERRY_VALIDATION', 'Invalid request: body/value must be a string');
  }
}

export interface SecretRouteDeps extends AuthDeps {
  secrets: SecretService;
}

export function registerSecretRoutes(app: TypedServer, services: SecretRouteDeps): void {
  const manage = requireScope(services, 'manage');

  app.put(
    '/v2/projects/:project_id/secrets/:name',
    {
      onRequest: manage,
      preValidation: rawValueIsString,
      schema: {
        summary: 'Create or replace a secret',
        description:
          'Encrypted at rest; the value is never returned. New replicas get it as an environment variable; running replicas keep the environment they started with.',
        params: SecretParams,
        body: SetBody,
        response: { 200: Secret, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, name } = request.params;
      return services.secrets.set(project_id, name, request.body.value);
    },
  );

  app.get(
    '/v2/projects/:project_id/secrets',
    {
      onRequest: manage,
      schema: {
        summary: 'List secrets (names and timestamps, never values)',
        params: ProjectParams,
        response: { 200: Type.Object({ secrets: Type.Array(Secret) }), ...errors(401, 403, 404) },
      },
    },
    async (request) => ({ secrets: await services.secrets.list(request.params.project_id) }),
  );

  app.get(
    '/v2/projects/:project_id/secrets/:name',
    {
      onRequest: manage,
      schema: {
        summary: 'Get a secret’s metadata (never its value)',
        params: SecretParams,
        response: { 200: Secret, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => services.secrets.get(request.params.project_id, request.params.name),
  );

  app.delete(
    '/v2/projects/:project_id/secrets/:name',
    {
      onRequest: manage,
      schema: {
        summary: 'Delete a secret',
        description: 'New replicas start without it; running replicas keep the environment they started with.',
        params: SecretParams,
        response: { 204: Type.Null({ description: 'Deleted' }), ...errors(400, 401, 403, 404) },
      },
    },
    async (request, reply) => {
      await services.secrets.delete(request.params.project_id, request.params.name);
      return reply.code(204).send(null);
    },
  );
}
