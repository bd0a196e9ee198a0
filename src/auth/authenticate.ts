/**
 * The check every authenticated request goes through: bearer token → signature and expiry → not revoked
 * (looked up by token id, so revocation is immediate) → the path's project is the token's → the scope.
 * A sign-in session's token (auth/sessions.ts) is looked up by its account instead: it holds while that
 * account does (not revoked, not expired, the scopes it has), so revoking the account ends its sessions.
 */
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import { hashToken, type Scope, type TokenClaims, verifyToken } from './tokens.js';

export interface Principal extends TokenClaims {}

export interface Authenticator {
  /** Resolves the principal for a request to `projectId` that needs `scope`, or throws a coded 401/403/404. */
  authenticate(authorization: string | undefined, projectId: string, scope: Scope): Promise<Principal>;
  /**
   * The principal when this token's check is cached and still good for this project and scope, without a
   * Promise; undefined otherwise (then `authenticate`, which also says what is wrong).
   */
  peek(authorization: string | undefined, projectId: string, scope: Scope): Principal | undefined;
  /** Forgets every cached check (called when an account is revoked, so revocation is immediate here). */
  invalidate(): void;
}

/**
 * A token that passed every check is trusted again, without the signature check and the store lookup,
 * for this long. It bounds how late another server of a cluster sees a revocation; the server that
 * revokes forgets at once.
 */
export const AUTH_CACHE_MS = 1000;
const AUTH_CACHE_SIZE = 10_000;

const LAST_USED_EVERY_MS = 60_000;

export function createAuthenticator(deps: { store: Store; key: Uint8Array }): Authenticator {
  const { store, key } = deps;
  // last_used_at is a hint for people, not an audit log: write it at most once a minute per account.
  const lastUsedWritten = new Map<string, number>();
  const verified = new Map<string, { claims: TokenClaims; until: number }>();

  function authorize(claims: TokenClaims, projectId: string, scope: Scope): Principal | undefined {
    if (claims.projectId !== projectId) return undefined;
    if (!claims.scopes.includes(scope)) {
      throw new FerryError('FERRY_MISSING_SCOPE', `The token lacks the "${scope}" scope this request needs`);
    }
    return claims;
  }

  return {
    invalidate() {
      verified.clear();
    },
    peek(authorization, projectId, scope) {
      const match = authorization === undefined ? null : BEARER.exec(authorization);
      const cached = match?.[1] === undefined ? undefined : verified.get(match[1]);
      if (!cached) return undefined;
      const now = Date.now();
      if (cached.until <= now || cached.claims.expiresAt.getTime() <= now) return undefined;
      const { claims } = cached;
      return claims.projectId === projectId && claims.scopes.includes(scope) ? claims : undefined;
    },
    async authenticate(authorization, projectId, scope) {
      const token = bearerToken(authorization);
      const now = Date.now();
      const cached = verified.get(token);
      if (cached && cached.until > now && cached.claims.expiresAt.getTime() > now) {
        const principal = authorize(cached.claims, projectId, scope);
        if (principal) return principal;
      }
      const claims = await verifyToken(key, token);
      const account = await store
        .selectFrom('service_accounts')
        .select(['id', 'project_id', 'scopes', 'revoked_at', 'expires_at', 'token_hash'])
        .where(claims.session ? 'id' : 'token_id', '=', claims.session ? claims.serviceAccountId : claims.tokenId)
        .executeTakeFirst();
      const genuine =
        account !== undefined &&
        account.id === claims.serviceAccountId &&
        (claims.session
          ? account.project_id === claims.projectId && claims.scopes.every((s) => account.scopes.split(' ').includes(s))
          : account.token_hash === hashToken(token));
      if (!account || !genuine) throw new FerryError('FERRY_TOKEN_INVALID');
      if (account.revoked_at !== null) throw new FerryError('FERRY_TOKEN_REVOKED');
      if (Date.parse(account.expires_at) <= Date.now()) throw new FerryError('FERRY_TOKEN_EXPIRED');
      if (claims.projectId !== projectId) {
        const exists = await store.selectFrom('projects').select('id').where('id', '=', projectId).executeTakeFirst();
        throw new FerryError(exists ? 'FERRY_FORBIDDEN_PROJECT' : 'FERRY_PROJECT_NOT_FOUND');
      }
      if (verified.size >= AUTH_CACHE_SIZE) verified.clear();
      verified.set(token, { claims, until: now + AUTH_CACHE_MS });
      authorize(claims, projectId, scope);
      if ((lastUsedWritten.get(account.id) ?? 0) + LAST_USED_EVERY_MS < now) {
        lastUsedWritten.set(account.id, now);
        // Not awaited: a hint must not hold a request up while the store is busy (or fail it with a 503).
        void store
          .updateTable('service_accounts')
          .set({ last_used_at: new Date(now).toISOString() })
          .where('id', '=', account.id)
          .execute()
          .catch(() => lastUsedWritten.delete(account.id));
      }
      return claims;
    },
  };
}

/** Extracts the token from `Authorization: Bearer <token>`. */
const BEARER = /^Bearer\s+(\S+)\s*$/i;

export function bearerToken(authorization: string | undefined): string {
  if (!authorization) throw new FerryError('FERRY_UNAUTHENTICATED');
  const match = BEARER.exec(authorization);
  if (!match?.[1]) throw new FerryError('FERRY_TOKEN_INVALID', 'The Authorization header must be "Bearer <token>"');
  return match[1];
}
