/**
 * Identifiers. Projects and service accounts get short prefixed ids people can read out loud
 * (`p-7f3a9c21`); builds and runs get UUIDv7 (RFC 9562): standard, unique across machines, and sorted
 * by creation time, so "newest first" is an index scan on the id. A run id is also its `X-Request-Id`.
 */
import { randomBytes } from 'node:crypto';

export function newProjectId(): string {
  return `p-${randomBytes(4).toString('hex')}`;
}

export function newServiceAccountId(): string {
  return `sa-${randomBytes(6).toString('hex')}`;
}

// Random bytes drawn in blocks: one getrandom call per 256 ids instead of one per id (hot on the run path).
let pool = Buffer.alloc(0);
let offset = 0;
function randomChunk(n: number): Buffer {
  if (offset + n > pool.length) {
    pool = randomBytes(4096);
    offset = 0;
  }
  offset += n;
  return pool.subarray(offset - n, offset);
}

let lastMs = 0;
let seq = 0;

/** A UUIDv7: 48-bit Unix milliseconds, then a 12-bit counter (monotonic within one process) and random bits. */
export function uuidv7(now: number = Date.now()): string {
  if (now <= lastMs) {
    seq = (seq + 1) & 0xfff;
    if (seq === 0) lastMs += 1; // counter wrapped: borrow the next millisecond to stay monotonic
    now = lastMs;
  } else {
    lastMs = now;
    seq = randomChunk(2).readUInt16BE(0) & 0x3ff; // random start leaves room to count up
  }
  const bytes = Buffer.from(randomChunk(16));
  bytes.writeUIntBE(now, 0, 6);
  bytes[6] = 0x70 | (seq >> 8);
  bytes[7] = seq & 0xff;
  bytes[8] = 0x80 | ((bytes[8] ?? 0) & 0x3f);
  const hex = bytes.toString('hex');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

const MAX_ISO_MS = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
let isoSecond = Number.NaN;
let isoPrefix = '';

/**
 * `new Date(ms).toISOString()`, reusing the text up to the second: a run stamps three times and each of
 * its log lines once, and a Date with its formatting costs most of a microsecond every time. Only for
 * whole milliseconds from 1970 to 9999; any other value goes to Date as it is.
 */
export function isoTime(ms: number): string {
  if (!Number.isInteger(ms) || ms < 0 || ms > MAX_ISO_MS) return new Date(ms).toISOString();
  const second = Math.floor(ms / 1000);
  if (second !== isoSecond) {
    isoPrefix = new Date(second * 1000).toISOString().slice(0, 20);
    isoSecond = second;
  }
  const milli = ms - second * 1000;
  return `${isoPrefix}${milli < 10 ? '00' : milli < 100 ? '0' : ''}${milli}Z`;
}

/** The current time as Ferry stores it: ISO-8601 UTC with milliseconds. */
export function nowIso(clock: () => number = Date.now): string {
  return new Date(clock()).toISOString();
}

/** `bytes` random bytes as lowercase hex (node ids, database names in tests). */
export function randomHex(bytes: number): string {
  return randomBytes(bytes).toString('hex');
}
