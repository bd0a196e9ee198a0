/**
 * The timers of retention on a process that keeps builds (not a gateway): a bounded pass soon after start
 * (a process restarted more often than the interval still prunes) and then every interval (a pass still
 * going when the next is due is not joined by another; closing stops it between two batches), and between
 * passes a look every LOG_BUDGET_CHECK_MS at whether the runs logged enough to hold the projects to their
 * log budget now (a tenant printing fast would otherwise pass it by what its runs print in a whole
 * interval). An interval of 0 leaves passes to another process of the fleet (or to none).
 */
import type { Logger } from 'pino';
import type { Metrics } from '../metrics.js';
import type { Housekeeping } from './housekeeping.js';

/** Seconds after start of the first retention pass (or the interval, when shorter). */
export const RETENTION_FIRST_SECONDS = 15;
/**
 * How often a process that runs retention passes looks whether its runs logged enough since its last look
 * (a quarter of FERRY_PROJECT_LOG_BYTES, at most 64 MiB) to hold the projects to their log budget now,
 * rather than at the next pass only.
 */
export const LOG_BUDGET_CHECK_MS = 5000;

export interface RetentionSettings {
  keepBuilds: number;
  runRetentionDays: number;
  projectLogBytes: number;
  retentionIntervalSeconds: number;
}

export interface RetentionTimers {
  /** Runs one retention pass now. */
  retention(): Promise<void>;
  close(): void;
}

export function startRetentionTimers(deps: {
  housekeeping: Pick<Housekeeping, 'retain' | 'trimLogs'>;
  /** Bytes the runs of this process logged so far (runs/recorder.ts `loggedBytes`). */
  loggedBytes: () => number;
  metrics: Pick<Metrics, 'retentionPasses' | 'buildsDeleted' | 'runsDeleted' | 'bytesFreed'>;
  settings: RetentionSettings;
  /** False on a gateway: passes are run, when asked, but no timer is started. */
  timers: boolean;
  logger: Logger;
}): RetentionTimers {
  const { housekeeping, metrics, settings, logger } = deps;
  /** Stops a pass in progress between two of its batches when the process closes. */
  const closing = new AbortController();
  const retention = async (): Promise<void> => {
    metrics.retentionPasses.inc();
    const removed = await housekeeping.retain({
      keepBuilds: settings.keepBuilds,
      runRetentionDays: settings.runRetentionDays,
      projectLogBytes: settings.projectLogBytes,
      signal: closing.signal,
      // Counted batch by batch: a pass over a large backlog takes a while.
      onRuns: (count) => metrics.runsDeleted.inc({ reason: 'retention' }, count),
    });
    if (removed.builds > 0) metrics.buildsDeleted.inc({ reason: 'retention' }, removed.builds);
    if (removed.bytes > 0) metrics.bytesFreed.inc({ reason: 'retention' }, removed.bytes);
  };
  // A pass still going when the next one is due (a large backlog of expired runs) is not joined by another.
  let passing = false;
  const retentionPass = () => {
    if (passing) return;
    passing = true;
    void retention()
      .catch((err: unknown) => logger.warn({ err }, 'a retention pass failed'))
      .finally(() => {
        passing = false;
      });
  };
  let retentionTimer: NodeJS.Timeout | undefined;
  if (deps.timers && settings.retentionIntervalSeconds > 0) {
    retentionTimer = setTimeout(() => {
      retentionPass();
      retentionTimer = setInterval(retentionPass, settings.retentionIntervalSeconds * 1000);
      retentionTimer.unref();
    }, Math.min(settings.retentionIntervalSeconds, RETENTION_FIRST_SECONDS) * 1000);
    retentionTimer.unref();
  }
  let logBudgetTimer: NodeJS.Timeout | undefined;
  if (deps.timers && settings.retentionIntervalSeconds > 0 && settings.projectLogBytes > 0) {
    const step = Math.max(1, Math.min(64 * 1024 * 1024, Math.floor(settings.projectLogBytes / 4)));
    let mark = 0;
    let trimming = false;
    logBudgetTimer = setInterval(() => {
      const logged = deps.loggedBytes();
      if (trimming || logged - mark < step) return;
      mark = logged;
      trimming = true;
      housekeeping
        .trimLogs(settings.projectLogBytes)
        .catch((err: unknown) => logger.warn({ err }, 'holding the projects to their log budget failed'))
        .finally(() => {
          trimming = false;
        });
    }, LOG_BUDGET_CHECK_MS);
    logBudgetTimer.unref();
  }
  return {
    retention,
    close() {
      closing.abort();
      clearTimeout(retentionTimer); // the first pass's timeout, or the interval after it
      clearInterval(logBudgetTimer);
    },
  };
}
