/**
 * Resumable streams: the events of each streaming run, kept for a while so a client that reconnects with
 * `Last-Event-ID: <run_id>:<seq>` gets the rest of the same run instead of starting a new one.
 *
 * Every event of a run gets the next sequence number (from 1); the last one is always `end`. Kept events
 * (counted with a fixed overhead per event and per run) are bounded three ways: per run (past
 * `maxBytesPerRun` its oldest events are dropped), in total (past
 * `maxTotalBytes` finished runs are forgotten oldest first, then the growing run's oldest events are
 * dropped) and in time (a finished run is forgotten `keepMs` after its end). A running stream whose every
 * reader went away is stopped `graceMs` later unless a reader comes back.
 *
 * Kept in this process's memory: a reconnect must reach the same server. Scaling out moves this to shared
 * storage (docs/scaling-out.md).
 */
import type { FinalRunState } from './lifecycle.js';

/** One event as sent: `id` is `<run_id>:<seq>`; `event` is the SSE event name (none for the items). */
export interface StreamEvent {
  id: string;
  seq: number;
  event?: string | undefined;
  data: string;
}

/** One connection receiving a run's events. */
export interface StreamReader {
  send(event: StreamEvent): void;
  /** The run ended and this reader got every event up to `end`. */
  end(): void;
  /**
   * True while the reader's connection holds more unsent bytes than it may (a caller not reading): the run
   * stops reading its replica until the reader says so with {@link ReplayStream.readerReady}.
   */
  readonly blocked?: boolean;
}

/** The final state a stream's `end` event reports. */
export type StreamEndState = FinalRunState;

export interface ReplayStream {
  readonly runId: string;
  readonly projectId: string;
  readonly appId: string;
  readonly fn: string;
  /** Sequence number of the last event so far (0 before the first). */
  readonly lastSeq: number;
  /** Sequence number of the last item (an event with no name: not `error`, not `end`); 0 before the first. */
  readonly lastItemSeq: number;
  /** Sequence number of the oldest event still kept (`lastSeq + 1` when none is). */
  readonly firstSeq: number;
  readonly done: boolean;
  /** Appends one event and sends it to every reader. */
  push(data: string, event?: string): void;
  /** Appends the `end` event (`{"run_id","state"}`), sends it and ends every reader. */
  end(state: StreamEndState): void;
  /**
   * Sends `reader` every kept event after `afterSeq`, then the live ones (ending it at once when the run is
   * over). Events dropped by the size bounds are not sent: the caller compares with `firstSeq` first.
   */
  attach(reader: StreamReader, afterSeq: number): void;
  /** The reader's connection is gone; with no reader left the run is stopped after the grace period. */
  detach(reader: StreamReader): void;
  /** True while an attached reader is blocked (back-pressure): the run waits before reading more. */
  readonly blocked: boolean;
  /** Calls `ready` once no attached reader is blocked (soon after, when none is now). */
  whenReady(ready: () => void): void;
  /** A blocked reader's connection took its bytes: the run goes on once no reader is blocked. */
  readerReady(): void;
}

export interface StreamReplay {
  /** Starts keeping a run's events; `stop` ends the run (called when nobody reconnected in time). */
  open(run: { runId: string; projectId: string; appId: string; fn: string; stop: () => void }): ReplayStream;
  /** The kept stream of a run, or undefined when unknown, forgotten or never a stream here. */
  get(runId: string): ReplayStream | undefined;
  /** Bytes counted as kept now (event data and the fixed overheads), over every run. */
  readonly totalBytes: number;
  /** Stops every stream that waits for a reader and forgets everything (server shutdown). */
  close(): void;
}

/**
 * What an event costs beyond its data (the id, the object), and what a kept run costs by itself: counted
 * with the data, so a stream of tiny items and a flood of short runs are bounded too.
 */
export const EVENT_OVERHEAD_BYTES = 64;
export const STREAM_OVERHEAD_BYTES = 512;

function sizeOf(event: StreamEvent): number {
  return Buffer.byteLength(event.data) + event.id.length + (event.event?.length ?? 0) + EVENT_OVERHEAD_BYTES;
}

export interface StreamReplayOptions {
  keepMs: number;
  maxBytesPerRun: number;
  maxTotalBytes: number;
  graceMs: number;
}

interface Stream extends ReplayStream {
  bytes: number;
  events: StreamEvent[];
  /** Drops the oldest kept event; false when there is none. */
  dropOldest(): boolean;
  forget(): void;
  stopIfUnread(): void;
}

export function createStreamReplay(options: StreamReplayOptions): StreamReplay {
  const streams = new Map<string, Stream>();
  let totalBytes = 0;

  /** Over the total: finished runs go first (oldest first), then the oldest events of `growing`. */
  function enforceTotal(growing: Stream): void {
    if (totalBytes <= options.maxTotalBytes) return;
    for (const stream of streams.values()) {
      if (totalBytes <= options.maxTotalBytes) return;
      if (stream.done && stream !== growing) stream.forget();
    }
    while (totalBytes > options.maxTotalBytes && growing.dropOldest());
  }

  function open(run: { runId: string; projectId: string; appId: string; fn: string; stop: () => void }) {
    const readers = new Set<StreamReader>();
    let seq = 0;
    let lastItemSeq = 0;
    let done = false;
    let graceTimer: NodeJS.Timeout | undefined;
    let forgetTimer: NodeJS.Timeout | undefined;
    /** What waits for no reader to be blocked (the run's call to its replica, paused). */
    let waiting: (() => void)[] = [];
    const wake = () => {
      if (waiting.length === 0 || stream.blocked) return;
      const ready = waiting;
      waiting = [];
      for (const go of ready) go();
    };

    const stream: Stream = {
      runId: run.runId,
      projectId: run.projectId,
      appId: run.appId,
      fn: run.fn,
      bytes: STREAM_OVERHEAD_BYTES,
      events: [],
      get lastSeq() {
        return seq;
      },
      get lastItemSeq() {
        return lastItemSeq;
      },
      get done() {
        return done;
      },
      get firstSeq() {
        return stream.events[0]?.seq ?? seq + 1;
      },
      get blocked() {
        if (done) return false;
        for (const reader of readers) if (reader.blocked) return true;
        return false;
      },
      whenReady(ready) {
        waiting.push(ready);
        // Never at once: the caller is inside the replica's data callback.
        setImmediate(wake);
      },
      readerReady: wake,
      push(data, event) {
        if (done) return;
        seq += 1;
        if (!event) lastItemSeq = seq;
        const item: StreamEvent = { id: `${run.runId}:${seq}`, seq, event, data };
        // Once forgotten (shutdown), events still reach the readers but are no longer kept.
        if (streams.get(run.runId) === stream) {
          const size = sizeOf(item);
          stream.events.push(item);
          stream.bytes += size;
          totalBytes += size;
          while (stream.bytes > options.maxBytesPerRun && stream.dropOldest());
          enforceTotal(stream);
        }
        for (const reader of readers) reader.send(item);
      },
      end(state) {
        if (done) return;
        stream.push(JSON.stringify({ run_id: run.runId, state }), 'end');
        done = true;
        clearTimeout(graceTimer);
        for (const reader of readers) reader.end();
        readers.clear();
        wake();
        forgetTimer = setTimeout(() => stream.forget(), options.keepMs);
        forgetTimer.unref();
      },
      attach(reader, afterSeq) {
        for (const item of stream.events) if (item.seq > afterSeq) reader.send(item);
        if (done) reader.end();
        else {
          readers.add(reader);
          clearTimeout(graceTimer);
          graceTimer = undefined;
        }
      },
      detach(reader) {
        if (!readers.delete(reader) || done) return;
        wake();
        if (readers.size > 0) return;
        if (options.graceMs === 0) return run.stop();
        graceTimer = setTimeout(() => stream.stopIfUnread(), options.graceMs);
        graceTimer.unref();
      },
      dropOldest() {
        const oldest = stream.events.shift();
        if (!oldest) return false;
        const size = sizeOf(oldest);
        stream.bytes -= size;
        totalBytes -= size;
        return true;
      },
      forget() {
        clearTimeout(forgetTimer);
        if (streams.get(run.runId) !== stream) return;
        streams.delete(run.runId);
        totalBytes -= stream.bytes;
        stream.bytes = 0;
        stream.events = [];
      },
      stopIfUnread() {
        clearTimeout(graceTimer);
        graceTimer = undefined;
        if (!done && readers.size === 0) run.stop();
      },
    };
    streams.set(run.runId, stream);
    totalBytes += stream.bytes;
    enforceTotal(stream);
    return stream;
  }

  return {
    open,
    get: (runId) => streams.get(runId),
    get totalBytes() {
      return totalBytes;
    },
    close() {
      for (const stream of [...streams.values()]) {
        stream.stopIfUnread();
        stream.forget();
      }
    },
  };
}
