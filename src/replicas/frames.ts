/**
 * The replica protocol's frames (docs/replica-protocol.md): one JSON object per line of a call's answer.
 *
 * Parsed from the answer's Buffers as they arrive, line by line, with no stream or async iterator between
 * the socket and the run. A result frame is written by both bootstraps as `{"type":"result","data":<json>}`:
 * its `<json>` is kept as text (`json`), checked by parsing it, so the gateway answers and records those
 * bytes instead of turning the value into JSON again.
 */

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

/**
 * Splits an answer's bytes into frames as they arrive. `push` hands each complete line's frame to
 * `onFrame`; `end` the last one (an answer need not end with a newline). Lines are cut on bytes, so a
 * character split between two chunks is decoded whole.
 */
export class FrameSplitter {
  private partial: Buffer | undefined;

  constructor(private readonly onFrame: (frame: Frame) => void) {}

  push(chunk: Buffer): void {
    let data = chunk;
    let start = 0;
    let newline = data.indexOf(NEWLINE);
    if (newline === -1) {
      // Copied: a chunk's memory is the transport's, and a partial line outlives the callback.
      this.partial = this.partial ? Buffer.concat([this.partial, data]) : Buffer.from(data);
      return;
    }
    if (this.partial) {
      data = Buffer.concat([this.partial, data]);
      this.partial = undefined;
      newline = data.indexOf(NEWLINE);
    }
    while (newline !== -1) {
      if (newline > start) this.onFrame(parseFrame(data.toString('utf8', start, newline)));
      start = newline + 1;
      newline = data.indexOf(NEWLINE, start);
    }
    if (start < data.length) this.partial = Buffer.from(data.subarray(start));
  }

  end(): void {
    const rest = this.partial;
    this.partial = undefined;
    if (rest === undefined) return;
    const line = rest.toString('utf8');
    if (line.trim().length > 0) this.onFrame(parseFrame(line));
  }
}
