/**
 * Warnings of the schedule ticker, at most one line per kind and project a minute: what goes wrong with a
 * tick tends to go wrong with every tick of every schedule of the project at once (a full backlog, a
 * failing store), and one project's hundred schedules a second must not bury the log. A line stands for
 * the like events before it: `suppressed` says how many were left out since the last line. The metrics
 * count every one.
 */

/** The shortest time between two lines of one kind and project. */
export const WARN_EVERY_MS = 60_000;
/** Keys kept before the ones quiet for a whole period are swept (one per kind and project that warned). */
const SWEEP_AT = 10_000;

export interface WarnLimit {
  /**
   * Whether the event of `key` at `now` gets its line: the number of like events left out since the last
   * line (0 for the first), or undefined when it is one of them.
   */
  take(key: string, now: number): number | undefined;
}

export function createWarnLimit(everyMs = WARN_EVERY_MS): WarnLimit {
  const keys = new Map<string, { at: number; suppressed: number }>();
  return {
    take(key, now) {
      const last = keys.get(key);
      if (last && now - last.at < everyMs) {
        last.suppressed += 1;
        return undefined;
      }
      if (!last && keys.size >= SWEEP_AT) {
        for (const [k, e] of keys) if (now - e.at >= everyMs) keys.delete(k);
      }
      keys.set(key, { at: now, suppressed: 0 });
      return last?.suppressed ?? 0;
    },
  };
}
