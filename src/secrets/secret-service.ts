/**
 * The secret service: the secrets routes' one dependency. Each change is told to every process
 * (`secrets.changed`); replicas read the project's secrets when they start, so nothing else reacts.
 */
import type { ChangeFeed } from '../cluster/change-feed.js';
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import { deleteSecret, getSecret, listSecrets, type SecretMetadata, setSecret } from './secrets.js';

export interface SecretService {
  set(projectId: string, name: string, value: string): Promise<SecretMetadata>;
  list(projectId: string): Promise<SecretMetadata[]>;
  /** FERRY_SECRET_NOT_FOUND when there is none of that name. */
  get(projectId: string, name: string): Promise<SecretMetadata>;
  delete(projectId: string, name: string): Promise<void>;
}

export function createSecretService(deps: {
  store: Store;
  secretsKey: Uint8Array;
  changes: Pick<ChangeFeed, 'publish'>;
}): SecretService {
  const { store, secretsKey, changes } = deps;
  return {
    async set(projectId, name, value) {
      const secret = await setSecret(store, secretsKey, projectId, name, value);
      await changes.publish({ type: 'secrets.changed', projectId });
      return secret;
    },
    list: (projectId) => listSecrets(store, projectId),
    async get(projectId, name) {
      const secret = await getSecret(store, projectId, name);
      if (!secret) throw new FerryError('FERRY_SECRET_NOT_FOUND', `No secret named ${name}`);
      return secret;
    },
    async delete(projectId, name) {
      await deleteSecret(store, projectId, name);
      await changes.publish({ type: 'secrets.changed', projectId });
    },
  };
}
