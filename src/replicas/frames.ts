/**
 * The replica protocol's frames (docs/replica-protocol.md): one JSON object per line of a call's answer.
 *
 * Parsed from the answer's Buffers as they arrive, line by line, with no stream or async iterator between
 * the socket and the run. A result frame is written by both bootstraps as `{"type":"result","data":<json>}`:
 * its `<json>` is kept as text (`json`), checked by parsing it, so the gateway answers and records those
 * bytes instead of turning the value into JSON again.
 */
import { FerryError } from '../errors.js';

/** A frame of the replica protocol. */
export type Frame =
  | { type: 'log'; stream: 'stdout' | 'stderr'; line: string }
  | { type: 'item'; data: unknown }
  /** `json`: the result as the replica wrote it (one JSON value), when the frame had the bootstraps' form. */
  | { type: 'result'; data: unknown; json?: string }
  | { type: 'end' }
  | { type: 'error'; error: { type: string; message: string; stack?: string } };

const RESULT_PREFIX = '{"type":"result","data":';
const NEWLINE = 0x0a;

/** One line of the answer as a frame; throws on anything that is not JSON. */
export function parseFrame(line: string): Frame {
  if (line.startsWith(RESULT_PREFIX) && line.endsWith('}')) {
    const json = line.slice(RESULT_PREFIX.length, -1);
    // Parsing checks the text is one JSON value, and nothing else hides in the frame.
    return { type: 'result', data: JSON.parse(json), json };
  }
  return JSON.parse(line) as Frame;
}

/** The size limits a call's frames are held to (FERRY_MAX_RESULT_BYTES and the like, docs/config.md). */
export interface FrameLimits {
  /** A result's JSON, bytes: past it the call fails with FERRY_RESULT_TOO_LARGE. */
  resultBytes: number;
  /** One stream item's JSON, bytes: past it the call fails with FERRY_STREAM_ITEM_TOO_LARGE. */
  itemBytes: number;
  /** One log line's frame, bytes: past it the rest of the line is dropped (and the log says how much). */
  logLineBytes: number;
}

export const DEFAULT_FRAME_LIMITS: FrameLimits = {
  resultBytes: 10 * 1024 * 1024,
  itemBytes: 4 * 1024 * 1024,
  logLineBytes: 64 * 1024,
};

/** A frame's bytes around its data (`{"type":"result","data":` and the closing brace), with room to spare. */
const FRAME_OVERHEAD = 64;
/** Bytes of a line enough to tell its kind (the bootstraps' prefixes). */
const KIND_BYTES = 24;
const ITEM_PREFIX = '{"type":"item"';
const LOG_PREFIX = '{"type":"log"';
const RESULT_START = '{"type":"result"';
const LOG_LINE_PREFIX = /^\{"type":"log","stream":"(stdout|stderr)","line":"/;

type LineKind = 'result' | 'item' | 'log' | 'other';

/**
 * Splits an answer's bytes into frames as they arrive. `push` hands each complete line's frame to
 * `onFrame`; `end` the last one (an answer need not end with a newline). Lines are cut on bytes, so a
 * character split between two chunks is decoded whole.
 *
 * Linear in the answer's size: the pieces of an unfinished line are kept in a list and joined once, when
 * its newline arrives (joining them again for every chunk made a 40 MB result cost seconds of CPU). A line
 * is held to `limits` while it arrives, by its kind (told from its first bytes): a result or an item over
 * its limit throws a coded error at once, without waiting for the rest; a log line over its limit keeps
 * its beginning and drops the rest.
 */
export class FrameSplitter {
  /** The unfinished line's pieces (copies: a chunk's memory is the transport's). */
  private parts: Buffer[] = [];
  private bytes = 0;
  private kind: LineKind | undefined;
  /** Bytes of an over-long log line dropped so far. */
  private dropped = 0;
  /** Lines up to this long are within every limit. */
  private readonly within: number;

  constructor(
    /** Each frame, with its line's length in bytes. */
    private readonly onFrame: (frame: Frame, bytes: number) => void,
    private readonly limits: FrameLimits = DEFAULT_FRAME_LIMITS,
  ) {
    this.within = Math.min(limits.resultBytes, limits.itemBytes, limits.logLineBytes);
  }

  push(chunk: Buffer): void {
    let start = 0;
    while (start < chunk.length) {
      const newline = chunk.indexOf(NEWLINE, start);
      if (newline === -1) {
        this.hold(chunk, start, chunk.length);
        return;
      }
      if (this.bytes === 0 && this.dropped === 0 && newline - start <= this.within) {
        // A whole line within the chunk, within every limit: parsed from the chunk itself, nothing copied.
        if (newline > start) this.onFrame(parseFrame(chunk.toString('utf8', start, newline)), newline - start);
      } else {
        this.hold(chunk, start, newline);
        this.finishLine();
      }
      start = newline + 1;
    }
  }

  end(): void {
    if (this.bytes > 0 || this.dropped > 0) this.finishLine();
  }

  /** Keeps `chunk[start, end)` as part of the unfinished line, within the line's limit. */
  private hold(chunk: Buffer, start: number, end: number): void {
    if (end <= start) return;
    if (this.dropped > 0) {
      this.dropped += end - start;
      return;
    }
    const room = this.room(chunk, start, end);
    const take = Math.min(end - start, room);
    if (take > 0) {
      this.parts.push(Buffer.from(chunk.subarray(start, start + take)));
      this.bytes += take;
    }
    if (take < end - start) this.dropped += end - start - take;
  }

  /** How many more bytes the line may have; throws when a result or an item is over its limit. */
  private room(chunk: Buffer, start: number, end: number): number {
    if (this.kind === undefined) {
      // Nothing held yet is KIND_BYTES long (the kind is told as soon as it is).
      const head = Buffer.concat([...this.parts, chunk.subarray(start, Math.min(end, start + KIND_BYTES))]).toString(
        'latin1',
      );
      // Too short to tell (a line split after a few bytes): held, and told with the next piece.
      if (head.length < KIND_BYTES && !head.includes('}')) return end - start;
      this.kind = head.startsWith(RESULT_START)
        ? 'result'
        : head.startsWith(ITEM_PREFIX)
          ? 'item'
          : head.startsWith(LOG_PREFIX)
            ? 'log'
            : 'other';
    }
    const { resultBytes, itemBytes, logLineBytes } = this.limits;
    const total = this.bytes + (end - start);
    switch (this.kind) {
      case 'result':
        if (total > resultBytes + FRAME_OVERHEAD) this.tooLarge('FERRY_RESULT_TOO_LARGE', 'result', resultBytes);
        return end - start;
      case 'item':
        if (total > itemBytes + FRAME_OVERHEAD) this.tooLarge('FERRY_STREAM_ITEM_TOO_LARGE', 'stream item', itemBytes);
        return end - start;
      case 'log':
        return Math.max(0, logLineBytes + FRAME_OVERHEAD - this.bytes);
      default:
        // An error frame (or anything else): held to the largest of the limits.
        if (total > Math.max(resultBytes, itemBytes) + FRAME_OVERHEAD) {
          this.tooLarge('FERRY_RESULT_TOO_LARGE', 'frame', Math.max(resultBytes, itemBytes));
        }
        return end - start;
    }
  }

  private tooLarge(code: 'FERRY_RESULT_TOO_LARGE' | 'FERRY_STREAM_ITEM_TOO_LARGE', what: string, limit: number): never {
    this.parts = [];
    this.bytes = 0;
    throw new FerryError(code, `The function's ${what} is larger than the limit of ${limit} bytes (${mib(limit)})`);
  }

  /** The held line is complete: joined once and parsed. */
  private finishLine(): void {
    const parts = this.parts;
    const dropped = this.dropped;
    const bytes = this.bytes;
    this.parts = [];
    this.bytes = 0;
    this.kind = undefined;
    this.dropped = 0;
    const text = (parts.length === 1 ? parts[0]! : Buffer.concat(parts)).toString('utf8');
    if (dropped > 0) {
      this.onFrame(cutLogFrame(text, dropped), bytes);
      return;
    }
    if (text.trim().length > 0) this.onFrame(parseFrame(text), bytes);
  }
}

/** The kept beginning of an over-long log frame as a log frame whose line says what was dropped. */
function cutLogFrame(text: string, dropped: number): Frame {
  const match = LOG_LINE_PREFIX.exec(text);
  const note = `… [${dropped} more bytes of this line dropped: over the log line limit]`;
  if (!match) return { type: 'log', stream: 'stderr', line: note };
  let body = text.slice(match[0].length);
  // The cut may fall inside an escape (`\u00e9`): shortened until the JSON string is whole.
  for (let i = 0; i < 8; i++) {
    try {
      return { type: 'log', stream: match[1] as 'stdout' | 'stderr', line: `${JSON.parse(`"${body}"`)}${note}` };
    } catch {
      body = body.slice(0, -1);
    }
  }
  return { type: 'log', stream: match[1] as 'stdout' | 'stderr', line: note };
}

function mib(bytes: number): string {
  return `${Math.round((bytes / 1024 / 1024) * 10) / 10} MiB`;
}
