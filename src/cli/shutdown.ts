/**
 * How `ferry serve` stops, bounded (issue 43: a server with 300 s runs in flight did not stop 30 s after
 * SIGTERM). `cli/serve.ts` handles the signals and calls `shutDown` once; a second signal exits at once.
 *
 * 1. Intake stops at once: the listeners take no new connection and answer 503 on kept-alive ones
 *    (Fastify's `return503OnClosing`), schedule ticks stop, and the async worker starts no more runs (the
 *    ones queued here are let go for any node).
 * 2. Runs in flight get up to the grace (FERRY_SHUTDOWN_GRACE_SECONDS) to end: sync and stream calls, custom
 *    apps' requests and sessions, async runs.
 * 3. At the grace's end what is left is interrupted (`Services.interrupt`): each run is recorded by this
 *    node as recovery records a run whose node stopped (runs/lifecycle.ts `interruption`: an async run
 *    queued again by `retry_interrupted` or its retry policy, any other `failure`, reason `interrupted`,
 *    with its webhook), its caller answered 502, the replicas stopped. Connections still open
 *    ANSWER_MS later (long polls, log follows, callers that did not take their answer) are closed.
 * 4. The rest closes (`Services.close`: builds stopped, to run again; the recorder's last flush; the store).
 *    Replicas still stopping at the grace's end (a server that ignores SIGTERM) are cut short as in 3.
 *
 * Should the close still be going FORCE_EXIT_AFTER_MS past the grace (a store that no longer answers),
 * the process exits 1 all the same: what it still held is recovered by the next start on the data
 * directory, or by another node once its lease runs out, as for a process that died.
 */
import type { Logger } from 'pino';
import type { Services } from '../services.js';

/** After interrupting, how long callers have to take their answers before their connections are closed. */
export const ANSWER_MS = 2000;
/** How long past the grace the close may go on before the process exits anyway (the recorder retries 15 s). */
export const FORCE_EXIT_AFTER_MS = 20_000;

export interface ShutdownDeps {
  /** Stops the listeners (no new connections); resolves when the requests in flight are answered. */
  closeListeners(): Promise<void>;
  /** Closes every connection the listeners still have. */
  cutConnections(): void;
  services: Pick<Services, 'drain' | 'interrupt' | 'close'>;
  logger: Logger;
  /** FERRY_SHUTDOWN_GRACE_SECONDS, in ms. */
  graceMs: number;
  /** Ends the process (the backstop: FORCE_EXIT_AFTER_MS past the grace). */
  exit(code: number): void;
}

/** Stops a server within its grace (see the module comment); rejects with what `Services.close` threw. */
export async function shutDown(deps: ShutdownDeps): Promise<void> {
  const { services, logger, graceMs } = deps;
  const deadline = Date.now() + graceMs;
  const backstop = setTimeout(() => {
    logger.error(`the shutdown is still going ${FORCE_EXIT_AFTER_MS / 1000} s past its grace: exiting now`);
    deps.exit(1);
  }, graceMs + FORCE_EXIT_AFTER_MS);
  let interrupted = false;
  const interrupt = (why: string) => {
    if (interrupted) return;
    interrupted = true;
    const runs = services.interrupt();
    logger.warn({ runs, graceSeconds: graceMs / 1000 }, `${why}: interrupting ${runs} run(s) still in progress`);
  };
  try {
    const listenersClosed = settled(deps.closeListeners(), logger, 'closing the listeners failed');
    const drained = Promise.all([listenersClosed, settled(services.drain(), logger, 'stopping the async runs failed')]);
    if (!(await within(drained, deadline - Date.now()))) {
      interrupt(`the shutdown grace of ${graceMs / 1000} s is over`);
      if (!(await within(listenersClosed, ANSWER_MS))) {
        logger.info('closing the connections still open');
        deps.cutConnections();
      }
      await drained;
    }
    const closing = services.close();
    if (!(await within(closing, deadline - Date.now()))) {
      interrupt(`the shutdown grace of ${graceMs / 1000} s is over while closing`);
    }
    await closing;
  } finally {
    clearTimeout(backstop);
  }
}

/** Whether `promise` settles within `ms` (0 or less: only if it already has, after one turn). */
async function within(promise: Promise<unknown>, ms: number): Promise<boolean> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<false>((resolve) => {
    timer = setTimeout(() => resolve(false), Math.max(0, ms));
  });
  try {
    return await Promise.race([
      promise.then(
        () => true,
        () => true,
      ),
      late,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** `promise`, never rejecting: a failure is logged (a shutdown goes on whatever one part says). */
function settled(promise: Promise<unknown>, logger: Logger, what: string): Promise<void> {
  return promise.then(
    () => undefined,
    (err: unknown) => logger.error({ err }, what),
  );
}
