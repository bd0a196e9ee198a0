/**
 * Service accounts: a named, expiring credential of one project, with scopes. Each has exactly one
 * token, shown once at creation. Revoking the account revokes the token.
 */
import { randomUUID } from 'node:crypto';
import { FerryError } from '../errors.js';
import { newProjectId, newServiceAccountId, nowIso } from '../ids.js';
import type { Store } from '../store/index.js';
import type { Project, ServiceAccount } from '../store/schema.js';
import { hashToken, type Scope, signToken } from './tokens.js';

export const DEFAULT_EXPIRY_DAYS = 30;
export const MAX_EXPIRY_DAYS = 3650;
const DAY_MS = 86_400_000;

/** What the API shows of a service account: never the token or its hash. */
export interface ServiceAccountView {
  id: string;
  project_id: string;
  name: string;
  scopes: Scope[];
  created_at: string;
  expires_at: string;
  revoked_at: string | null;
  last_used_at: string | null;
  expired: boolean;
}

export function viewServiceAccount(sa: ServiceAccount, now = Date.now()): ServiceAccountView {
  return {
    id: sa.id,
    project_id: sa.project_id,
    name: sa.name,
    scopes: sa.scopes.split(' ').filter(Boolean) as Scope[],
    created_at: sa.created_at,
    expires_at: sa.expires_at,
    revoked_at: sa.revoked_at,
    last_used_at: sa.last_used_at,
    expired: Date.parse(sa.expires_at) <= now,
  };
}

export interface CreateServiceAccountInput {
  projectId: string;
  name: string;
  scopes: Scope[];
  expiresAt: Date;
}

/** Creates a service account and returns it with its token (the only time the token exists in clear). */
export async function createServiceAccount(
  store: Store,
  key: Uint8Array,
  input: CreateServiceAccountInput,
): Promise<{ account: ServiceAccountView; token: string }> {
  const now = Date.now();
  if (input.expiresAt.getTime() <= now) throw new FerryError('FERRY_VALIDATION', 'expires_at must be in the future');
  if (input.expiresAt.getTime() > now + MAX_EXPIRY_DAYS * DAY_MS) {
    throw new FerryError('FERRY_VALIDATION', `expires_at must be at most ${MAX_EXPIRY_DAYS} days away`);
  }
  const scopes = [...new Set(input.scopes)].sort() as Scope[];
  if (scopes.length === 0) throw new FerryError('FERRY_VALIDATION', 'scopes must name at least one of manage, run');
  const id = newServiceAccountId();
  const tokenId = randomUUID();
  const token = await signToken(key, {
    serviceAccountId: id,
    projectId: input.projectId,
    scopes,
    tokenId,
    expiresAt: input.expiresAt,
  });
  const row: ServiceAccount = {
    id,
    project_id: input.projectId,
    name: input.name,
    scopes: scopes.join(' '),
    token_id: tokenId,
    token_hash: hashToken(token),
    created_at: new Date(now).toISOString(),
    expires_at: input.expiresAt.toISOString(),
    revoked_at: null,
    last_used_at: null,
  };
  await store.insertInto('service_accounts').values(row).execute();
  return { account: viewServiceAccount(row, now), token };
}

export async function listServiceAccounts(store: Store, projectId: string): Promise<ServiceAccountView[]> {
  const rows = await store
    .selectFrom('service_accounts')
    .selectAll()
    .where('project_id', '=', projectId)
    .orderBy('created_at', 'desc')
    .orderBy('id')
    .execute();
  const now = Date.now();
  return rows.map((r) => viewServiceAccount(r, now));
}

/** Revokes a service account; revoking twice keeps the first revocation time. */
export async function revokeServiceAccount(store: Store, projectId: string, id: string): Promise<ServiceAccountView> {
  const at = nowIso();
  await store
    .updateTable('service_accounts')
    .set({ revoked_at: at })
    .where('project_id', '=', projectId)
    .where('id', '=', id)
    .where('revoked_at', 'is', null)
    .execute();
  const row = await store
    .selectFrom('service_accounts')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('id', '=', id)
    .executeTakeFirst();
  if (!row) throw new FerryError('FERRY_SERVICE_ACCOUNT_NOT_FOUND');
  return viewServiceAccount(row);
}

export async function getProject(store: Store, projectId: string): Promise<Project | undefined> {
  return store.selectFrom('projects').selectAll().where('id', '=', projectId).executeTakeFirst();
}

/**
 * `ferry admin bootstrap`: finds the project by name (creating it when missing) and makes a new owner
 * service account with both scopes.
 */
export async function bootstrapProject(
  store: Store,
  key: Uint8Array,
  options: { projectName: string; expiresInDays?: number; accountName?: string },
): Promise<{ project: Project; created: boolean; account: ServiceAccountView; token: string }> {
  let project = await store
    .selectFrom('projects')
    .selectAll()
    .where('name', '=', options.projectName)
    .executeTakeFirst();
  let created = false;
  if (!project) {
    project = { id: newProjectId(), name: options.projectName, created_at: nowIso() };
    await store.insertInto('projects').values(project).execute();
    created = true;
  }
  const days = options.expiresInDays ?? 365;
  const { account, token } = await createServiceAccount(store, key, {
    projectId: project.id,
    name: options.accountName ?? 'owner',
    scopes: ['manage', 'run'],
    expiresAt: new Date(Date.now() + days * DAY_MS),
  });
  return { project, created, account, token };
}
