/**
 * Tells the other nodes of a cluster which runs this node finished, and hears theirs: callers waiting for
 * a run (`GET .../runs/{run_id}?wait=N`, a cancel) on any node are woken at once, not at the waiters'
 * shared check (runs/run-waiters.ts), which still finds what a lost message misses.
 */
import type { Logger } from 'pino';
import type { NatsLink } from './nats.js';

export interface FinishedRelay {
  /** Publishes the ids of runs this node finished (best effort: dropped while NATS is away). */
  publish(runIds: string[]): void;
}

export function createFinishedRelay(deps: {
  nats: NatsLink;
  subject: string;
  /** Told of the runs other nodes (and this one, through NATS) finished. */
  heard: (runIds: string[]) => void;
  logger: Logger;
}): FinishedRelay {
  const { nats, subject, logger } = deps;
  void nats
    .ready()
    .then((nc) =>
      nc.subscribe(subject, {
        callback(err, msg) {
          if (err) return;
          try {
            const ids = JSON.parse(msg.string()) as unknown;
            if (Array.isArray(ids)) deps.heard(ids.filter((id): id is string => typeof id === 'string'));
          } catch {
            // not ours: ignore
          }
        },
      }),
    )
    .catch(() => undefined);
  return {
    publish(runIds) {
      const nc = nats.connected ? nats.current() : undefined;
      if (!nc) return;
      try {
        nc.publish(subject, JSON.stringify(runIds));
      } catch (err) {
        logger.debug({ err }, 'telling other nodes of finished runs failed (their shared check finds them)');
      }
    },
  };
}
