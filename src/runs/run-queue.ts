/**
 * The run queue: how an accepted async run reaches a node that performs it. One seam, two implementations,
 * chosen once in services.ts:
 * - the store queue (the embedded default, and PostgreSQL without NATS): a run accepted by a node with room
 *   is held by it from its insert; free queued runs are claimed from the store by polling (async-worker.ts);
 * - the JetStream queue (`--nats-url`, jetstream-queue.ts): every accepted run is published to the runs
 *   work-queue stream after its insert; consuming nodes fetch, claim in the store and perform it.
 * Either way the store is the truth: a run is committed before its 202, and claimed with an owner before it
 * runs.
 */
import type { AsyncWorker, RunCall } from './async-worker.js';

export interface AcceptedRun {
  id: string;
  projectId: string;
  appId: string;
  /** The call as it was committed (the store queue performs a run it holds from it, without reading it back). */
  call?: RunCall;
}

/**
 * A committed run row as the queue takes it: a run this node holds is performed from its call, not read
 * back (the recorder keeps the row until the run ends anyway, so this holds no more memory).
 */
export function acceptedRun(row: {
  id: string;
  project_id: string;
  app_id: string;
  function_name: string;
  input: string | null;
  webhook_endpoint: string | null;
  http_request: string | null;
}): AcceptedRun {
  const { function_name, input, webhook_endpoint, http_request } = row;
  return {
    id: row.id,
    projectId: row.project_id,
    appId: row.app_id,
    call: { function_name, input, webhook_endpoint, http_request },
  };
}

export interface RunQueue {
  /** The owner to insert an accepted async run with: this node, or null (free). */
  ownerFor(projectId: string, appId: string): string | null;
  /** Told once the run's row is committed with `owner` (before its 202 is sent); never waits. */
  accepted(run: AcceptedRun, owner: string | null): void;
  /** Free queued runs may be waiting (recovery freed some): look now. */
  wake(): void;
  /** The app was deleted: drop what the queue keeps for it (JetStream: its consumer and messages). */
  forgetApp?(projectId: string, appId: string): Promise<void>;
  /**
   * This node's recorder committed these runs' final states (any mode; most are not the queue's): a queue
   * lets go at once of what it holds for them (JetStream: acknowledges their messages).
   */
  finished?(runIds: readonly string[]): void;
  /** Async runs this node holds and has not finished (queued here or running). */
  readonly backlog: number;
  start(): Promise<void>;
  /** Stops; runs in flight finish, runs held and not started are let go for any node to take. */
  close(): Promise<void>;
}

/** The store queue: the async worker as it always was. */
export function createStoreRunQueue(worker: AsyncWorker): RunQueue {
  return {
    ownerFor: (projectId, appId) => worker.ownerFor(projectId, appId),
    accepted(run, owner) {
      if (owner) worker.enqueue(run);
      else worker.wake();
    },
    wake: () => worker.wake(),
    get backlog() {
      return worker.backlog;
    },
    start: () => worker.start(),
    close: () => worker.close(),
  };
}
