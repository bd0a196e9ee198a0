/**
 * Sign-in links (`ferry admin login-link`): a short-lived session of an existing service account, not an
 * account of its own. Before, each link made a service account ("sign-in link") that stayed on the API keys
 * page and in `ferry tokens list` forever, one more per link (issue 43).
 *
 * A session is a token signed like any other (auth/tokens.ts) whose `sub` is the account it belongs to,
 * marked `ses`, with the `manage` scope only and an expiry of its own (minutes to a day). Nothing of it is
 * stored: the authenticator (authenticate.ts) checks it against its account's row, so it ends at its
 * expiry, or sooner when its account is revoked or expires, and leaves nothing behind. The account it
 * belongs to is the project's active `manage` account that expires last (an owner made by `ferry admin
 * bootstrap`, usually).
 */
import { randomUUID } from 'node:crypto';
import type { Store } from '../store/index.js';
import { listServiceAccounts, type ServiceAccountView } from './service-accounts.js';
import { signToken } from './tokens.js';

/** What `createSignInSession` made: the token, the account it belongs to, and when it ends. */
export interface SignInSession {
  token: string;
  account: ServiceAccountView;
  /** ISO time: the session's own expiry, or its account's when that comes first. */
  expiresAt: string;
}

/**
 * Signs a sign-in session of the project's active `manage` account that expires last, ending at `until` or
 * at that account's expiry, whichever comes first. Undefined when the project has no such account.
 *
 * @example
 *   const session = await createSignInSession(store, key, { projectId, until: new Date(Date.now() + 3_600_000) });
 */
export async function createSignInSession(
  store: Store,
  key: Uint8Array,
  options: { projectId: string; until: Date },
): Promise<SignInSession | undefined> {
  const account = (await listServiceAccounts(store, options.projectId))
    .filter((a) => a.revoked_at === null && !a.expired && a.scopes.includes('manage'))
    .sort((a, b) => Date.parse(b.expires_at) - Date.parse(a.expires_at))[0];
  if (!account) return undefined;
  const expiresAt = new Date(Math.min(options.until.getTime(), Date.parse(account.expires_at)));
  const token = await signToken(key, {
    serviceAccountId: account.id,
    projectId: options.projectId,
    scopes: ['manage'],
    tokenId: randomUUID(),
    expiresAt,
    session: true,
  });
  // The JWT's expiry is in whole seconds: tell the one it carries.
  return { token, account, expiresAt: new Date(Math.floor(expiresAt.getTime() / 1000) * 1000).toISOString() };
}
