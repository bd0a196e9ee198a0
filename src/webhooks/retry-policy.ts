/**
 * The webhook retry table (spec section 6, issue 4 item 13), in one place:
 *
 * | Outcome of an attempt                                        | Verdict                  |
 * |--------------------------------------------------------------|--------------------------|
 * | 2xx                                                          | delivered                |
 * | network error: refused, reset, DNS failure, timeout, TLS     | retried                  |
 * | 404                                                          | retried                  |
 * | any other 4xx                                                | failed, not retried      |
 * | any 5xx                                                      | failed, not retried      |
 * | any other status (1xx, 3xx: redirects are never followed)    | retried                  |
 * | target refused by the address guard, URL Ferry cannot send to| failed, not retried      |
 *
 * 5xx is not retried on purpose: the receiver may have acted before failing, and a retry would repeat
 * the side effect. At most 3 attempts per delivery; the waits before attempts 2 and 3 are at most 5 s.
 */

export type Verdict = 'delivered' | 'retry' | 'permanent';

/** Attempts per delivery (and per redelivery), spec section 8. */
export const MAX_ATTEMPTS = 3;
/** The longest wait between two attempts, spec section 8. */
export const MAX_RETRY_DELAY_MS = 5_000;
/** Waits before attempt 2 and attempt 3. */
export const DEFAULT_RETRY_DELAYS_MS: readonly [number, number] = [1_000, 3_000];

export function classifyStatus(status: number): Verdict {
  if (status >= 200 && status <= 299) return 'delivered';
  if (status === 404) return 'retry';
  if (status >= 400 && status <= 599) return 'permanent';
  return 'retry';
}

/** An attempt that must not be repeated although no response came (the address guard, a bad URL). */
export class PermanentDeliveryError extends Error {
  override readonly name: string = 'PermanentDeliveryError';
}

/** Every error without a response is a network error and retried, except the ones Ferry itself refused. */
export function classifyError(err: unknown): Verdict {
  return findCause(err, (e) => e instanceof PermanentDeliveryError) ? 'permanent' : 'retry';
}

/** Looks through `cause` chains: undici wraps connector errors in its own. */
export function findCause(err: unknown, test: (e: unknown) => boolean): unknown {
  let current: unknown = err;
  for (let depth = 0; depth < 8 && current !== undefined && current !== null; depth++) {
    if (test(current)) return current;
    current = (current as { cause?: unknown }).cause;
  }
  return undefined;
}

/** Validates and clamps configured delays: exactly two values, each from 0 to 5,000 ms. */
export function resolveRetryDelays(delays?: readonly number[]): readonly [number, number] {
  if (!delays) return DEFAULT_RETRY_DELAYS_MS;
  const clamp = (ms: number | undefined) =>
    Number.isFinite(ms) ? Math.min(MAX_RETRY_DELAY_MS, Math.max(0, Math.round(ms as number))) : MAX_RETRY_DELAY_MS;
  return [clamp(delays[0]), clamp(delays[1] ?? delays[0])];
}

export type NextStep = { state: 'delivered' } | { state: 'failed' } | { state: 'pending'; delayMs: number };

/**
 * What happens to a delivery after an attempt. `attemptsInBudget` counts the attempts made since the
 * delivery (or its last redelivery) began, this one included.
 */
export function nextStep(verdict: Verdict, attemptsInBudget: number, delays: readonly [number, number]): NextStep {
  if (verdict === 'delivered') return { state: 'delivered' };
  if (verdict === 'permanent' || attemptsInBudget >= MAX_ATTEMPTS) return { state: 'failed' };
  return { state: 'pending', delayMs: delays[Math.min(attemptsInBudget, delays.length) - 1] ?? MAX_RETRY_DELAY_MS };
}
