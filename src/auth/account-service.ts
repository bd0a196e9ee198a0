/**
 * The account service: projects and their service accounts as the routes ask for them. A revoked account
 * is told to every process (`service-account.changed`), which forget their cached token checks.
 */
import type { ChangeFeed } from '../cluster/change-feed.js';
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { Project } from '../store/schema.js';
import {
  type CreateServiceAccountInput,
  createServiceAccount,
  getProject,
  listServiceAccounts,
  revokeServiceAccount,
  type ServiceAccountView,
} from './service-accounts.js';

export interface AccountService {
  /** FERRY_PROJECT_NOT_FOUND when there is none. */
  project(projectId: string): Promise<Project>;
  create(input: CreateServiceAccountInput): Promise<{ account: ServiceAccountView; token: string }>;
  list(projectId: string): Promise<ServiceAccountView[]>;
  /** Revokes the account and its token; every process (this one before it resolves) stops taking it. */
  revoke(projectId: string, id: string): Promise<ServiceAccountView>;
}

export function createAccountService(deps: {
  store: Store;
  jwtKey: Uint8Array;
  changes: Pick<ChangeFeed, 'publish'>;
}): AccountService {
  const { store } = deps;
  return {
    async project(projectId) {
      const project = await getProject(store, projectId);
      if (!project) throw new FerryError('FERRY_PROJECT_NOT_FOUND');
      return project;
    },
    create: (input) => createServiceAccount(store, deps.jwtKey, input),
    list: (projectId) => listServiceAccounts(store, projectId),
    async revoke(projectId, id) {
      const account = await revokeServiceAccount(store, projectId, id);
      // Every process forgets its cached token checks (this one before answering).
      await deps.changes.publish({
        type: 'service-account.changed',
        projectId: account.project_id,
        serviceAccountId: account.id,
      });
      return account;
    },
  };
}
