/**
 * An app's retry policy for async and scheduled runs (`[retries]` in ferry.toml): which endings are
 * tried again, how many attempts in all, and the delay before each next attempt (exponential backoff,
 * capped). Sync and stream callers retry themselves; their runs are never retried by Ferry.
 *
 * Pure: the run lifecycle asks it, with the attempt that just ended, whether and when the run goes on.
 */

/** The endings a policy can retry. `interrupted`: the process performing the attempt died. */
export type RetryableEnding = 'failure' | 'timeout' | 'interrupted';
export const RETRYABLE_ENDINGS: readonly RetryableEnding[] = ['failure', 'timeout', 'interrupted'];

/** The most attempts a run may have (`max_attempts` is 1 to this). */
export const MAX_ATTEMPTS_LIMIT = 20;

export interface RetryPolicy {
  /** Attempts in all, 1 (no retry) to 20. */
  max_attempts: number;
  /** Seconds before the second attempt. */
  initial_delay: number;
  /** Multiplier of the delay after each further attempt. */
  backoff: number;
  /** Seconds the delay never exceeds. */
  max_delay: number;
  /** The endings that are retried. */
  on: RetryableEnding[];
}

/** `[retries]` when ferry.toml says nothing: one attempt. */
export const NO_RETRIES: RetryPolicy = {
  max_attempts: 1,
  initial_delay: 1,
  backoff: 2,
  max_delay: 300,
  on: ['failure', 'timeout', 'interrupted'],
};

/**
 * Milliseconds to wait after attempt `attempt` (1-based) ended before the next one starts:
 * `initial_delay × backoff^(attempt-1)`, at most `max_delay`.
 */
export function retryDelayMs(policy: RetryPolicy, attempt: number): number {
  const seconds = policy.initial_delay * policy.backoff ** Math.max(0, attempt - 1);
  return Math.round(Math.min(seconds, policy.max_delay) * 1000);
}

/**
 * Whether a run whose attempt `attempt` (1-based) ended with `ending` gets another attempt, and after how
 * long. `dead` marks the run that ends for good after exhausting its attempts on a retryable ending.
 */
export function nextAttempt(
  policy: RetryPolicy,
  attempt: number,
  ending: string,
): { retry: true; delayMs: number } | { retry: false; dead: boolean } {
  const retryable = (policy.on as string[]).includes(ending);
  if (!retryable) return { retry: false, dead: false };
  if (attempt < policy.max_attempts) return { retry: true, delayMs: retryDelayMs(policy, attempt) };
  return { retry: false, dead: policy.max_attempts > 1 };
}
