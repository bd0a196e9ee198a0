/**
 * The per-route authentication hook: `preHandler: requireScope(services, 'manage')`.
 * The project is taken from the `project_id` path parameter, so a token only ever opens its own project.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { Principal } from '../auth/authenticate.js';
import type { Scope } from '../auth/tokens.js';
import type { Services } from '../services.js';

declare module 'fastify' {
  interface FastifyRequest {
    principal?: Principal;
  }
}

export function requireScope(services: Services, scope: Scope) {
  return async function authenticateRequest(request: FastifyRequest, _reply: FastifyReply): Promise<void> {
    const projectId = (request.params as { project_id?: string }).project_id ?? '';
    request.principal = await services.auth.authenticate(request.headers.authorization, projectId, scope);
  };
}
