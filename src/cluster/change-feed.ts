/**
 * The change feed: how a change made through one Ferry process (a token revoked, a project's secrets
 * changed, a build activated, an app's scaling changed) reaches every process sharing its store, so each drops what it cached.
 *
 * A seam with one shape for every transport: events are plain JSON-serialisable objects; `publish`
 * tells this process's own subscribers at once (before it returns, so the process that made a change
 * acts on it as soon as it answers) and then the other processes. Implementations:
 *   - in-process (this file): the embedded default, one process, nothing to send;
 *   - PostgreSQL LISTEN/NOTIFY (pg-change-feed.ts): chosen in services.ts with a PostgreSQL store;
 *   - NATS (next): the same interface.
 * A transport that may have missed events (a broken connection) says so with a `resync` event: every
 * subscriber then treats everything as changed.
 */
import type { Logger } from 'pino';

/** A service account was revoked (or otherwise changed): its token must be checked afresh everywhere. */
export interface ServiceAccountChanged {
  type: 'service-account.changed';
  projectId: string;
  serviceAccountId: string;
}

/** A secret of the project was set or deleted. */
export interface SecretsChanged {
  type: 'secrets.changed';
  projectId: string;
}

/** A build of the app became ready, so it is the app's active build unless a newer one already is. */
export interface BuildActivated {
  type: 'build.activated';
  projectId: string;
  appId: string;
  buildId: string;
}

/** A gateway received an archive and left its build free: a process that builds claims it now. */
export interface BuildQueued {
  type: 'build.queued';
  projectId: string;
  appId: string;
  buildId: string;
}

/** The app's settings changed (its scaling, through the API): every process reloads what it holds of it. */
export interface AppChanged {
  type: 'app.changed';
  projectId: string;
  appId: string;
}

/** A run was cancelled through the API: the process performing it (if any) stops it. */
export interface RunCancel {
  type: 'run.cancel';
  projectId: string;
  appId: string;
  runId: string;
}

/** The app was deleted: every process refuses its calls, stops its replicas and drops its local copies. */
export interface AppDeleted {
  type: 'app.deleted';
  projectId: string;
  appId: string;
}

/** A build was deleted (by hand or by retention): processes drop their local copy. */
export interface BuildDeleted {
  type: 'build.deleted';
  projectId: string;
  appId: string;
  buildId: string;
}

/**
 * A volume was deleted with `force=true` while active builds mounted it: every process stops the replicas
 * of the project's apps that mount it (their next replica fails to start, naming the volume).
 */
export interface VolumeDeleted {
  type: 'volume.deleted';
  projectId: string;
  volume: string;
}

/** What a process announces. */
export type ChangeEvent =
  | VolumeDeleted
  | ServiceAccountChanged
  | SecretsChanged
  | BuildActivated
  | BuildQueued
  | AppChanged
  | AppDeleted
  | BuildDeleted
  | RunCancel;

/** Told by the transport only, never published: events may have been lost; treat everything as changed. */
export interface Resync {
  type: 'resync';
  reason: string;
}

/** What subscribers receive. */
export type FeedEvent = ChangeEvent | Resync;

export type FeedHandler = (event: FeedEvent) => void;

export interface ChangeFeed {
  /**
   * Tells this process's subscribers (synchronously, before the first await) and then every other
   * process. Never rejects: the change itself is already committed when it is announced, so a transport
   * failure is logged (other processes' caches still expire within a second) rather than failing the
   * request that made the change.
   */
  publish(event: ChangeEvent): Promise<void>;
  /** Calls `handler` for every event from now on; returns the function that stops it. */
  subscribe(handler: FeedHandler): () => void;
  close(): Promise<void>;
}

/**
 * The subscribers of one process and how an event reaches them: each handler on its own, so one that
 * throws neither stops the others nor the publisher.
 */
export function createFanOut(logger: Logger): {
  subscribe(handler: FeedHandler): () => void;
  deliver(event: FeedEvent): void;
  clear(): void;
} {
  const handlers = new Set<FeedHandler>();
  return {
    subscribe(handler) {
      // A wrapper per subscription, so the same function subscribed twice is two subscriptions.
      const entry: FeedHandler = (event) => handler(event);
      handlers.add(entry);
      return () => handlers.delete(entry);
    },
    deliver(event) {
      for (const handler of [...handlers]) {
        try {
          handler(event);
        } catch (err) {
          logger.error({ err, event: event.type }, 'a change-feed subscriber failed');
        }
      }
    },
    clear() {
      handlers.clear();
    },
  };
}

/** The embedded default: one process, so publishing is telling its own subscribers. */
export function createLocalChangeFeed(deps: { logger: Logger }): ChangeFeed {
  const fanOut = createFanOut(deps.logger);
  let closed = false;
  return {
    async publish(event) {
      if (!closed) fanOut.deliver(event);
    },
    subscribe: (handler) => fanOut.subscribe(handler),
    async close() {
      closed = true;
      fanOut.clear();
    },
  };
}

const ID = /^[A-Za-z0-9_.:-]{1,200}$/;

/**
 * The event in `value` when it is one this version knows, with exactly its fields; undefined otherwise.
 * For events that arrive from other processes (another version, or anyone able to write to the channel).
 */
export function parseChangeEvent(value: unknown): ChangeEvent | undefined {
  if (typeof value !== 'object' || value === null) return undefined;
  const v = value as Record<string, unknown>;
  const id = (key: string): string | undefined => {
    const field = v[key];
    return typeof field === 'string' && ID.test(field) ? field : undefined;
  };
  const projectId = id('projectId');
  if (!projectId) return undefined;
  switch (v.type) {
    case 'service-account.changed': {
      const serviceAccountId = id('serviceAccountId');
      return serviceAccountId ? { type: v.type, projectId, serviceAccountId } : undefined;
    }
    case 'secrets.changed':
      return { type: v.type, projectId };
    case 'app.deleted':
    case 'app.changed': {
      const appId = id('appId');
      return appId ? { type: v.type, projectId, appId } : undefined;
    }
    case 'run.cancel': {
      const appId = id('appId');
      const runId = id('runId');
      return appId && runId ? { type: v.type, projectId, appId, runId } : undefined;
    }
    case 'volume.deleted': {
      const volume = id('volume');
      return volume ? { type: v.type, projectId, volume } : undefined;
    }
    case 'build.queued':
    case 'build.deleted':
    case 'build.activated': {
      const appId = id('appId');
      const buildId = id('buildId');
      return appId && buildId ? { type: v.type, projectId, appId, buildId } : undefined;
    }
    default:
      return undefined;
  }
}
