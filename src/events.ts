/**
 * One typed event bus per process: the parts tell what happened (`runs:finished`), the composition
 * subscribes whatever reacts (waiting callers, the NATS relay, the webhook deliverer), so no part is handed
 * a callback after it was built and no `let` stands for a part that does not exist yet. Events are
 * namespaced `<part>:<what>`, as graphile/worker's are. Handlers run synchronously, in subscription order;
 * one that throws is logged and the others still run.
 */
import type { Logger } from 'pino';

/** Every event of a Ferry process, with what it carries. */
export interface FerryEvents {
  /** The recorder committed these runs' final states (runs/recorder.ts). */
  'runs:finished': { runIds: string[] };
  /** The recorder committed webhook outbox entries: the deliverer has work. */
  'runs:outbox': Record<string, never>;
  /** Replicas started or stopped here (replicas/manager.ts): gateways should hear of it now. */
  'replicas:changed': Record<string, never>;
  /** The last replica running a build here stopped: its local copy may go if the build was deleted. */
  'replicas:drained': { buildId: string };
}

export type EventHandler<T> = (payload: T) => void;

export interface EventBus<E = FerryEvents> {
  on<K extends keyof E>(name: K, handler: EventHandler<E[K]>): () => void;
  emit<K extends keyof E>(name: K, payload: E[K]): void;
}

export function createEventBus<E = FerryEvents>(logger: Pick<Logger, 'error'>): EventBus<E> {
  const handlers = new Map<keyof E, Set<EventHandler<never>>>();
  return {
    on(name, handler) {
      let set = handlers.get(name);
      if (!set) {
        set = new Set();
        handlers.set(name, set);
      }
      set.add(handler as EventHandler<never>);
      return () => void set.delete(handler as EventHandler<never>);
    },
    emit(name, payload) {
      const set = handlers.get(name);
      if (!set) return;
      for (const handler of set) {
        try {
          (handler as EventHandler<typeof payload>)(payload);
        } catch (err) {
          logger.error({ err, event: String(name) }, 'an event handler failed');
        }
      }
    },
  };
}
