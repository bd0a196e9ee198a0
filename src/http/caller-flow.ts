/**
 * Back-pressure from a caller's connection (issue 30): a caller that does not read must not make the
 * gateway hold what a function writes for it. A response is `blocked` while it holds more unsent bytes
 * than it may (the run stops reading its replica meanwhile), and a caller that stays blocked for the stall
 * limit (FERRY_CALLER_STALL_SECONDS) is cut: its connection closes, and the run handles that as a caller
 * gone away. Used by streaming runs (SSE) and proxied WebSockets; custom apps' HTTP responses wait for
 * `drain` the same way in runs/invoke.ts.
 */
import type { EventEmitter } from 'node:events';

export interface CallerFlow {
  /** True while the caller's connection holds more than it may. */
  readonly blocked: boolean;
  /** Call after each write to the connection. */
  wrote(): void;
  /** Stops watching (the connection closed). */
  stop(): void;
}

export function watchCaller(options: {
  /** True while the connection holds more unsent bytes than it may. */
  full: () => boolean;
  /** What emits `drain` as the connection takes its bytes (the response, a compressor in front of it). */
  drains: EventEmitter[];
  stallMs: number;
  /** The caller stayed blocked for `stallMs`: cut its connection. */
  onStalled: () => void;
  /** The caller took its bytes: what waited may go on. */
  onReady?: () => void;
}): CallerFlow {
  let blocked = false;
  let stall: NodeJS.Timeout | undefined;
  const drained = () => {
    if (!blocked || options.full()) return;
    blocked = false;
    clearTimeout(stall);
    stall = undefined;
    options.onReady?.();
  };
  for (const emitter of options.drains) emitter.on('drain', drained);
  return {
    get blocked() {
      return blocked;
    },
    wrote() {
      if (blocked || !options.full()) return;
      blocked = true;
      stall = setTimeout(() => {
        stall = undefined;
        if (blocked) options.onStalled();
      }, options.stallMs);
      stall.unref();
    },
    stop() {
      clearTimeout(stall);
      stall = undefined;
      for (const emitter of options.drains) emitter.removeListener('drain', drained);
      if (blocked) {
        blocked = false;
        options.onReady?.();
      }
    },
  };
}
