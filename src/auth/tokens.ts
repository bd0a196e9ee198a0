/**
 * Service-account tokens: JWTs (HS256) signed with the key in `<data-dir>/keys/jwt.key`.
 *
 * Claims: `sub` service account id, `prj` project id, `scp` scopes, `jti` token id, `iat`, `exp`, `iss`.
 * Only the `jti` and a SHA-256 of the token are stored, so a leaked database does not leak tokens.
 * A sign-in link's token (auth/sessions.ts) adds `ses: true`: a short-lived session of the account `sub`,
 * not its one token; nothing of it is stored.
 */
import { createHash } from 'node:crypto';
import { errors as joseErrors, jwtVerify, SignJWT } from 'jose';
import { FerryError } from '../errors.js';

export type Scope = 'manage' | 'run';
const ISSUER = 'ferry';
const FOREIGN =
  "The token is not valid: it was signed by another server's key (made on another data directory), or altered";

export interface TokenClaims {
  serviceAccountId: string;
  projectId: string;
  scopes: Scope[];
  tokenId: string;
  expiresAt: Date;
  /** A sign-in session of the account (auth/sessions.ts), not the account's own token. */
  session?: boolean;
}

/** Signs a token for a service account. */
export async function signToken(key: Uint8Array, claims: TokenClaims): Promise<string> {
  return new SignJWT({ prj: claims.projectId, scp: claims.scopes, ...(claims.session ? { ses: true } : {}) })
    .setProtectedHeader({ alg: 'HS256', typ: 'JWT' })
    .setIssuer(ISSUER)
    .setSubject(claims.serviceAccountId)
    .setJti(claims.tokenId)
    .setIssuedAt()
    .setExpirationTime(Math.floor(claims.expiresAt.getTime() / 1000))
    .sign(key);
}

/**
 * Checks a token's signature, issuer and expiry and returns its claims.
 * Throws FERRY_TOKEN_EXPIRED or FERRY_TOKEN_INVALID; revocation is checked by the caller against the store.
 */
export async function verifyToken(key: Uint8Array, token: string): Promise<TokenClaims> {
  let payload: Awaited<ReturnType<typeof jwtVerify>>['payload'];
  try {
    ({ payload } = await jwtVerify(token, key, { issuer: ISSUER, algorithms: ['HS256'] }));
  } catch (err) {
    if (err instanceof joseErrors.JWTExpired) throw new FerryError('FERRY_TOKEN_EXPIRED');
    // A well-formed token whose signature does not check is nearly always one made on another data directory
    // (another server, or a `ferry admin bootstrap --data-dir` elsewhere): say so, without saying more.
    if (err instanceof joseErrors.JWSSignatureVerificationFailed) throw new FerryError('FERRY_TOKEN_INVALID', FOREIGN);
    throw new FerryError('FERRY_TOKEN_INVALID');
  }
  const { sub, prj, scp, jti, exp, ses } = payload;
  if (
    typeof sub !== 'string' ||
    typeof prj !== 'string' ||
    typeof jti !== 'string' ||
    typeof exp !== 'number' ||
    !Array.isArray(scp) ||
    !scp.every((s) => s === 'manage' || s === 'run')
  ) {
    throw new FerryError('FERRY_TOKEN_INVALID');
  }
  return {
    serviceAccountId: sub,
    projectId: prj,
    scopes: scp as Scope[],
    tokenId: jti,
    expiresAt: new Date(exp * 1000),
    ...(ses === true ? { session: true } : {}),
  };
}

/** The stored fingerprint of a token. */
export function hashToken(token: string): string {
  return createHash('sha256').update(token).digest('hex');
}
