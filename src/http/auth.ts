/**
 * The per-route authentication hook: `preHandler: requireScope(services, 'manage')`.
 * The project is taken from the `project_id` path parameter, so a token only ever opens its own project.
 * Routes about the server rather than a project (`/v2/cluster`) take `requireAnyProjectScope`: a token of
 * any project with the scope, checked in full (signature, expiry, revocation) like any other.
 */
import type { FastifyReply, FastifyRequest } from 'fastify';
import { type Authenticator, bearerToken, type Principal } from '../auth/authenticate.js';
import { type Scope, verifyToken } from '../auth/tokens.js';

declare module 'fastify' {
  interface FastifyRequest {
    principal?: Principal;
  }
}

/** What the authentication hooks use: the token checks and the key tokens are signed with. */
export interface AuthDeps {
  auth: Pick<Authenticator, 'authenticate'>;
  jwtKey: Uint8Array;
}

export function requireScope(services: AuthDeps, scope: Scope) {
  return async function authenticateRequest(request: FastifyRequest, _reply: FastifyReply): Promise<void> {
    const projectId = (request.params as { project_id?: string }).project_id ?? '';
    request.principal = await services.auth.authenticate(request.headers.authorization, projectId, scope);
  };
}

export function requireAnyProjectScope(services: AuthDeps, scope: Scope) {
  return async function authenticateRequest(request: FastifyRequest, _reply: FastifyReply): Promise<void> {
    // The token's own project, read from the verified token: the check below is then the usual one.
    const claims = await verifyToken(services.jwtKey, bearerToken(request.headers.authorization));
    request.principal = await services.auth.authenticate(request.headers.authorization, claims.projectId, scope);
  };
}
