/**
 * Why a run stops early: its caller went away, its deadline passed, or it was cancelled.
 *
 * An AbortController would do, but making its AbortSignal costs several microseconds (an EventTarget with
 * weak-listener bookkeeping, measured at ~5 µs each on Node 20), and a run needed two of them plus the
 * replica call's listener: a tenth of the gateway's CPU per sync call. A run's abort has one reason and a
 * few listeners, so this holds just that. `signal` makes a real AbortSignal on first use, for the APIs that
 * take one (waiting for a replica slot, custom apps' proxied requests, WebSocket sessions).
 */
export class RunAbort {
  aborted = false;
  reason: unknown = undefined;
  private listeners: Array<() => void> | undefined;
  private controller: AbortController | undefined;

  /** Aborts with `reason` (the first abort wins) and calls the listeners, each once. */
  abort(reason: unknown): void {
    if (this.aborted) return;
    this.aborted = true;
    this.reason = reason;
    this.controller?.abort(reason);
    const listeners = this.listeners;
    this.listeners = undefined;
    if (listeners) for (const listener of listeners) listener();
  }

  /** Calls `listener` once when aborted (at once when it already is); returns what takes it back. */
  onAbort(listener: () => void): () => void {
    if (this.aborted) {
      listener();
      return noop;
    }
    if (this.listeners) this.listeners.push(listener);
    else this.listeners = [listener];
    return () => {
      const i = this.listeners?.indexOf(listener) ?? -1;
      if (i >= 0) this.listeners!.splice(i, 1);
    };
  }

  /** Aborts when `signal` does, with its reason; returns what stops following it. */
  follow(signal: AbortSignal): () => void {
    if (signal.aborted) {
      this.abort(signal.reason);
      return noop;
    }
    const forward = () => this.abort(signal.reason);
    signal.addEventListener('abort', forward, { once: true });
    return () => signal.removeEventListener('abort', forward);
  }

  /** An AbortSignal that follows this abort, made on first use. */
  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.aborted) this.controller.abort(this.reason);
    }
    return this.controller.signal;
  }
}

function noop(): void {}
