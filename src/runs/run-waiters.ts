/**
 * Callers waiting for runs to end (`GET .../runs/{run_id}?wait=N`), with no polling per caller: a waiter
 * is woken when the recorder here commits the run's final state, when another node says it did (the
 * cluster's `<cluster>.runs.finished` subject on NATS), and, for runs that end where no message reaches
 * this node (a fleet of processes on PostgreSQL alone), by one shared check of every waited run at a time
 * (a single query each `sweepMs`, only while someone waits).
 */
import type { Logger } from 'pino';
import type { Store } from '../store/index.js';
import { FINAL_RUN_STATES } from './lifecycle.js';

export interface RunWaiters {
  /** Resolves when the run is known to have ended here, after `ms`, or when `signal` aborts. */
  wait(runId: string, ms: number, signal?: AbortSignal): Promise<void>;
  /** These runs' final states are committed: wake whoever waits for them. */
  finished(runIds: readonly string[]): void;
  /** Runs waited for now (metrics, tests). */
  readonly waiting: number;
  close(): void;
}

export function createRunWaiters(deps: { store: Store; logger: Logger; sweepMs?: number }): RunWaiters {
  const sweepMs = deps.sweepMs ?? 1000;
  const waiters = new Map<string, Set<() => void>>();
  let timer: NodeJS.Timeout | undefined;
  let sweeping = false;

  function wake(runId: string): void {
    const set = waiters.get(runId);
    if (!set) return;
    waiters.delete(runId);
    for (const done of set) done();
  }

  async function sweep(): Promise<void> {
    if (sweeping || waiters.size === 0) return;
    sweeping = true;
    try {
      const ids = [...waiters.keys()].slice(0, 1000);
      const rows = await deps.store
        .selectFrom('runs')
        .select('id')
        .where('id', 'in', ids)
        .where('state', 'in', [...FINAL_RUN_STATES])
        .execute();
      for (const r of rows) wake(r.id);
    } catch (err) {
      deps.logger.warn({ err }, 'checking waited runs failed; trying again');
    } finally {
      sweeping = false;
      arm();
    }
  }

  function arm(): void {
    if (waiters.size === 0) {
      if (timer) clearTimeout(timer);
      timer = undefined;
      return;
    }
    if (!timer) {
      timer = setTimeout(() => {
        timer = undefined;
        void sweep();
      }, sweepMs);
      timer.unref();
    }
  }

  return {
    wait(runId, ms, signal) {
      return new Promise<void>((resolve) => {
        if (signal?.aborted || ms <= 0) return resolve();
        let set = waiters.get(runId);
        if (!set) {
          set = new Set();
          waiters.set(runId, set);
        }
        const done = () => {
          clearTimeout(deadline);
          signal?.removeEventListener('abort', done);
          const current = waiters.get(runId);
          current?.delete(done);
          if (current?.size === 0) waiters.delete(runId);
          resolve();
        };
        const deadline = setTimeout(done, ms);
        signal?.addEventListener('abort', done, { once: true });
        set.add(done);
        arm();
      });
    },
    finished(runIds) {
      if (waiters.size === 0) return;
      for (const id of runIds) wake(id);
    },
    get waiting() {
      return waiters.size;
    },
    close() {
      if (timer) clearTimeout(timer);
      timer = undefined;
      for (const id of [...waiters.keys()]) wake(id);
    },
  };
}
