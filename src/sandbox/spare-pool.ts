/**
 * Sandbox networks set up ahead of need, so a cold start does not wait for `ip`, `nft`, `unshare` or
 * slirp4netns. Taking one schedules the refill a moment later rather than at once: on a small machine the
 * set-up processes would compete with the sandbox that is starting.
 */
import type { Logger } from 'pino';

export interface SparePool<T> {
  /** A spare, or null when none is ready (or setting it up failed): the caller then makes its own. */
  take(): Promise<T | null>;
  /** Puts a spare made by the caller in the pool (the first one, made at start to prove it works). */
  add(item: T): void;
  /** Sets up spares until the pool is full. */
  fill(): void;
  /** Stops refilling and waits for the spares being set up. They stay the provider's to release. */
  close(): Promise<void>;
}

export function createSparePool<T>(
  make: () => Promise<T>,
  logger: Logger,
  options: { size?: number; refillDelayMs?: number } = {},
): SparePool<T> {
  const size = options.size ?? 2;
  const refillDelayMs = options.refillDelayMs ?? 250;
  const spares: Array<Promise<T | null>> = [];
  let closed = false;
  let refillTimer: NodeJS.Timeout | undefined;
  const fill = () => {
    while (!closed && spares.length < size) {
      spares.push(
        make().catch((err: unknown) => {
          if (!closed) logger.warn({ err }, 'setting up a spare sandbox network failed');
          return null;
        }),
      );
    }
  };
  return {
    async take() {
      const spare = spares.shift();
      refillTimer ??= setTimeout(() => {
        refillTimer = undefined;
        fill();
      }, refillDelayMs);
      return spare ? await spare : null;
    },
    add(item) {
      spares.push(Promise.resolve(item));
    },
    fill,
    async close() {
      closed = true;
      clearTimeout(refillTimer);
      await Promise.all(spares.splice(0));
    },
  };
}
