/**
 * The check every authenticated request goes through: bearer token → signature and expiry → not revoked
 * (looked up by token id, so revocation is immediate) → the path's project is the token's → the scope.
 */
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import { hashToken, type Scope, type TokenClaims, verifyToken } from './tokens.js';

export interface Principal extends TokenClaims {}

export interface Authenticator {
  /** Resolves the principal for a request to `projectId` that needs `scope`, or throws a coded 401/403/404. */
  authenticate(authorization: string | undefined, projectId: string, scope: Scope): Promise<Principal>;
}

const LAST_USED_EVERY_MS = 60_000;

export function createAuthenticator(deps: { store: Store; key: Uint8Array }): Authenticator {
  const { store, key } = deps;
  // last_used_at is a hint for people, not an audit log: write it at most once a minute per account.
  const lastUsedWritten = new Map<string, number>();

  return {
    async authenticate(authorization, projectId, scope) {
      const token = bearerToken(authorization);
      const claims = await verifyToken(key, token);
      const account = await store
        .selectFrom('service_accounts')
        .select(['id', 'project_id', 'revoked_at', 'expires_at', 'token_hash'])
        .where('token_id', '=', claims.tokenId)
        .executeTakeFirst();
      if (!account || account.id !== claims.serviceAccountId || account.token_hash !== hashToken(token)) {
        throw new FerryError('FERRY_TOKEN_INVALID');
      }
      if (account.revoked_at !== null) throw new FerryError('FERRY_TOKEN_REVOKED');
      if (Date.parse(account.expires_at) <= Date.now()) throw new FerryError('FERRY_TOKEN_EXPIRED');
      if (claims.projectId !== projectId) {
        const exists = await store.selectFrom('projects').select('id').where('id', '=', projectId).executeTakeFirst();
        throw new FerryError(exists ? 'FERRY_FORBIDDEN_PROJECT' : 'FERRY_PROJECT_NOT_FOUND');
      }
      if (!claims.scopes.includes(scope)) {
        throw new FerryError('FERRY_MISSING_SCOPE', `The token lacks the "${scope}" scope this request needs`);
      }
      const now = Date.now();
      if ((lastUsedWritten.get(account.id) ?? 0) + LAST_USED_EVERY_MS < now) {
        lastUsedWritten.set(account.id, now);
        await store
          .updateTable('service_accounts')
          .set({ last_used_at: new Date(now).toISOString() })
          .where('id', '=', account.id)
          .execute();
      }
      return claims;
    },
  };
}

/** Extracts the token from `Authorization: Bearer <token>`. */
export function bearerToken(authorization: string | undefined): string {
  if (!authorization) throw new FerryError('FERRY_UNAUTHENTICATED');
  const match = /^Bearer\s+(\S+)\s*$/i.exec(authorization);
  if (!match?.[1]) throw new FerryError('FERRY_TOKEN_INVALID', 'The Authorization header must be "Bearer <token>"');
  return match[1];
}
