/**
 * `/v2/projects/{project_id}/registries`: a project's registry logins (images/registry-logins.ts): set,
 * list, delete. No route answers a password: the response schemas hold the registry, the username and
 * timestamps only, so the serializer could not send one even if a handler returned it. The same token
 * checks as the secrets routes (the `manage` scope, the token's own project).
 */
import type { FastifyRequest } from 'fastify';
import { Type } from 'typebox';
import { FerryError } from '../../errors.js';
import { REGISTRY } from '../../images/reference.js';
import {
  MAX_REGISTRY_PASSWORD_CHARS,
  MAX_REGISTRY_USERNAME_CHARS,
  type RegistryLoginService,
} from '../../images/registry-logins.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { errors, ProjectParams } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const RegistryName = Type.String({
  pattern: REGISTRY.source,
  maxLength: 255,
  description:
    'The registry as an image reference names it: a host with a dot or a port (`ghcr.io`, `registry.example:5000`), `localhost[:port]`, or `docker.io` (its aliases `index.docker.io`, `registry-1.docker.io` are the same login)',
});

const RegistryParams = Type.Object({ project_id: ProjectParams.properties.project_id, registry: RegistryName });

const RegistryLogin = Type.Object(
  {
    registry: Type.String(),
    username: Type.String(),
    created_at: Type.String({ format: 'date-time' }),
    updated_at: Type.String({ format: 'date-time' }),
  },
  { description: 'A login without its password: passwords are never returned once set' },
);

const LoginBody = Type.Object(
  {
    username: Type.String({
      minLength: 1,
      maxLength: MAX_REGISTRY_USERNAME_CHARS,
      description: 'No ":" and no control characters',
    }),
    password: Type.String({
      minLength: 1,
      maxLength: MAX_REGISTRY_PASSWORD_CHARS,
      description: 'The password or access token; no NUL characters. Never returned.',
    }),
  },
  { additionalProperties: false },
);

/**
 * The server's Ajv coerces scalars (`coerceTypes`), which would send `42` as the password "42": a credential
 * is exactly the string given, so the raw body is checked before validation coerces it.
 */
async function rawMembersAreStrings(request: FastifyRequest): Promise<void> {
  const body = request.body as Record<string, unknown> | null | undefined;
  if (!body || typeof body !== 'object') return;
  for (const member of ['username', 'password']) {
    if (member in body && typeof body[member] !== 'string')
      throw new FerryError('FERRY_VALIDATION', `Invalid request: body/${member} must be a string`);
  }
}

export interface RegistryRouteDeps extends AuthDeps {
  registries: RegistryLoginService;
}

export function registerRegistryRoutes(app: TypedServer, services: RegistryRouteDeps): void {
  const manage = requireScope(services, 'manage');

  app.put(
    '/v2/projects/:project_id/registries/:registry',
    {
      onRequest: manage,
      preValidation: rawMembersAreStrings,
      schema: {
        summary: 'Log the project in to a registry',
        description:
          "Creates or replaces the project's credentials for a registry: its builds' pulls from there send them, and no other project's do. Encrypted at rest; the password is never returned. Not checked against the registry now: the next pull says whether it takes them (FERRY_IMAGE_REGISTRY_AUTH).",
        params: RegistryParams,
        body: LoginBody,
        response: { 200: RegistryLogin, ...errors(400, 401, 403, 404) },
      },
    },
    async (request) => {
      const { project_id, registry } = request.params;
      return services.registries.set(project_id, registry, request.body);
    },
  );

  app.get(
    '/v2/projects/:project_id/registries',
    {
      onRequest: manage,
      schema: {
        summary: "List the project's registry logins (never their passwords)",
        params: ProjectParams,
        response: { 200: Type.Object({ registries: Type.Array(RegistryLogin) }), ...errors(401, 403, 404) },
      },
    },
    async (request) => ({ registries: await services.registries.list(request.params.project_id) }),
  );

  app.delete(
    '/v2/projects/:project_id/registries/:registry',
    {
      onRequest: manage,
      schema: {
        summary: 'Log the project out of a registry',
        description:
          "The project's later pulls from that registry send no credentials (or the shared file's, for a registry of FERRY_SHARED_REGISTRIES). Builds already made keep running their image, from a node's cache or the image shelf.",
        params: RegistryParams,
        response: { 204: Type.Null({ description: 'Deleted' }), ...errors(400, 401, 403, 404) },
      },
    },
    async (request, reply) => {
      await services.registries.delete(request.params.project_id, request.params.registry);
      return reply.code(204).send(null);
    },
  );
}
