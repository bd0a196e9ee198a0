/**
 * The replica protocol's frame reader (src/replicas/frames.ts): linear in the answer's size (issue 30:
 * re-joining the unfinished line for every chunk made a 40 MB result cost 13.5 s of gateway CPU), and
 * holding results, stream items and log lines to their limits while they arrive.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { FerryError } from '../src/errors.js';
import { DEFAULT_FRAME_LIMITS, type Frame, FrameSplitter } from '../src/replicas/frames.js';

/** Counts the bytes Buffer.concat and Buffer.from(buffer) copy while `fn` runs. */
function copiedBytes(fn: () => void): number {
  const concat = Buffer.concat;
  const from = Buffer.from;
  let copied = 0;
  Buffer.concat = ((list: readonly Uint8Array[], total?: number) => {
    const out = concat(list, total);
    copied += out.length;
    return out;
  }) as typeof Buffer.concat;
  Buffer.from = ((...args: unknown[]) => {
    const out = (from as (...a: unknown[]) => Buffer)(...args);
    if (args[0] instanceof Uint8Array) copied += out.length;
    return out;
  }) as typeof Buffer.from;
  try {
    fn();
  } finally {
    Buffer.concat = concat;
    Buffer.from = from;
  }
  return copied;
}

function chunked(text: string, size: number): Buffer[] {
  const bytes = Buffer.from(text);
  const out: Buffer[] = [];
  for (let i = 0; i < bytes.length; i += size) out.push(bytes.subarray(i, i + size));
  return out;
}

describe('FrameSplitter', () => {
  it('copies a long line a bounded number of times, however many chunks it comes in', () => {
    const value = 'x'.repeat(8 * 1024 * 1024);
    const line = `{"type":"result","data":"${value}"}\n`;
    const chunks = chunked(line, 16 * 1024); // 513 chunks
    const frames: Frame[] = [];
    const splitter = new FrameSplitter((f) => frames.push(f));
    const copied = copiedBytes(() => {
      for (const chunk of chunks) splitter.push(chunk);
      splitter.end();
    });
    assert.equal(frames.length, 1);
    assert.equal(frames[0]!.type, 'result');
    assert.equal((frames[0] as { data: string }).data.length, value.length);
    // Each piece kept once, joined once: about twice the line. Re-joining per chunk copied ~256 times it.
    assert.ok(copied <= 3 * line.length, `copied ${copied} bytes for a line of ${line.length}`);
  });

  it('reads a 40 MB result in 64 KiB chunks at all (in generous time)', () => {
    const value = 'y'.repeat(40 * 1000 * 1000);
    const chunks = chunked(`{"type":"result","data":"${value}"}\n`, 64 * 1024);
    let got = 0;
    const splitter = new FrameSplitter(
      (f) => {
        got = (f as { data: string }).data.length;
      },
      { ...DEFAULT_FRAME_LIMITS, resultBytes: 64 * 1024 * 1024 },
    );
    const began = Date.now();
    for (const chunk of chunks) splitter.push(chunk);
    assert.equal(got, value.length);
    // Linear: well under a second unloaded; quadratic took 13.5 s. The bound is for a loaded machine.
    assert.ok(Date.now() - began < 6_000, `took ${Date.now() - began} ms`);
  });

  it('splits lines on bytes: many frames per chunk, a frame over many chunks, a character split in two', () => {
    const lines = [
      '{"type":"log","stream":"stdout","line":"héllo wörld ✓"}',
      '{"type":"item","data":{"n":1}}',
      '{"type":"item","data":"ünïcode"}',
      '{"type":"end"}',
    ];
    const text = `${lines.join('\n')}\n`;
    for (const size of [1, 2, 3, 7, 1000]) {
      const frames: Frame[] = [];
      const splitter = new FrameSplitter((f) => frames.push(f));
      for (const chunk of chunked(text, size)) splitter.push(chunk);
      splitter.end();
      assert.deepEqual(
        frames,
        lines.map((l) => JSON.parse(l)),
        `chunks of ${size}`,
      );
    }
  });

  it('refuses a result over its limit as it arrives, before its end', () => {
    const splitter = new FrameSplitter(() => {}, { ...DEFAULT_FRAME_LIMITS, resultBytes: 100_000 });
    const chunks = chunked(`{"type":"result","data":"${'z'.repeat(1_000_000)}"}\n`, 10_000);
    let pushed = 0;
    assert.throws(
      () => {
        for (const chunk of chunks) {
          splitter.push(chunk);
          pushed += 1;
        }
      },
      (err: unknown) => err instanceof FerryError && err.code === 'FERRY_RESULT_TOO_LARGE',
    );
    assert.ok(pushed <= 11, `refused after ${pushed} chunks`);
  });

  it('refuses a stream item over its limit, whole in one chunk or not', () => {
    const line = `{"type":"item","data":"${'i'.repeat(5000)}"}\n`;
    for (const size of [line.length, 100]) {
      const splitter = new FrameSplitter(() => {}, { ...DEFAULT_FRAME_LIMITS, itemBytes: 2048, logLineBytes: 1024 });
      assert.throws(
        () => {
          for (const chunk of chunked(line, size)) splitter.push(chunk);
        },
        (err: unknown) => err instanceof FerryError && err.code === 'FERRY_STREAM_ITEM_TOO_LARGE',
      );
    }
  });

  it('keeps the beginning of a log line over its limit and says how much was dropped', () => {
    const long = `${'é'.repeat(3000)}`;
    const line = `{"type":"log","stream":"stderr","line":${JSON.stringify(long)}}\n{"type":"end"}\n`;
    for (const size of [line.length, 333]) {
      const frames: Frame[] = [];
      const splitter = new FrameSplitter((f) => frames.push(f), { ...DEFAULT_FRAME_LIMITS, logLineBytes: 1000 });
      for (const chunk of chunked(line, size)) splitter.push(chunk);
      splitter.end();
      assert.equal(frames.length, 2);
      const log = frames[0] as { type: string; stream: string; line: string };
      assert.equal(log.type, 'log');
      assert.equal(log.stream, 'stderr');
      assert.match(log.line, /^é{400,}… \[\d+ more bytes of this line dropped/);
      assert.ok(Buffer.byteLength(log.line) < 1200);
      assert.deepEqual(frames[1], { type: 'end' });
    }
  });
});
