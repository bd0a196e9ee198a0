/**
 * Webhook signatures (spec section 5): `X-Service-Webhook-Signature: v1,<hex>` where `<hex>` is the
 * lowercase hexadecimal HMAC-SHA256, keyed by the caller's `X-Webhook-Secret`, of
 * `<X-Request-Id>.<X-Service-Webhook-Timestamp>.<raw body>`.
 *
 * Ferry signs with `signWebhook`; receivers verify with `verifyWebhook`. This module is published to
 * users as `ferry/webhooks`, so it imports nothing but Node built-ins: a receiver installs Ferry for
 * this one function and must not pull in the server.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';

/** The headers Ferry sends with every webhook delivery (lowercase, as Node presents them). */
export const WEBHOOK_HEADERS = {
  requestId: 'x-request-id',
  timestamp: 'x-service-webhook-timestamp',
  signature: 'x-service-webhook-signature',
} as const;

/** The scheme prefix of the signature header value. */
export const SIGNATURE_VERSION = 'v1';

/** Receivers refuse deliveries whose timestamp is further than this from their clock, by default. */
export const DEFAULT_TOLERANCE_SECONDS = 300;

type Bytes = string | Uint8Array;

function toBuffer(value: Bytes): Buffer {
  return typeof value === 'string'
    ? Buffer.from(value, 'utf8')
    : Buffer.from(value.buffer, value.byteOffset, value.length);
}

function hexHmac(secret: Bytes, requestId: string, timestamp: string, rawBody: Bytes): string {
  // The prefix and the body are fed separately so the body's bytes are hashed exactly as received,
  // never re-encoded through a string (a body that is not valid UTF-8 must still verify).
  return createHmac('sha256', toBuffer(secret))
    .update(`${requestId}.${timestamp}.`, 'utf8')
    .update(toBuffer(rawBody))
    .digest('hex');
}

/**
 * The `X-Service-Webhook-Signature` value for one delivery: `v1,<lowercase hex>`. `timestamp` is Unix
 * seconds; `rawBody` must be exactly the bytes that are sent (a string is taken as UTF-8).
 */
export function signWebhook(secret: Bytes, requestId: string, timestamp: number, rawBody: Bytes): string {
  if (!Number.isSafeInteger(timestamp) || timestamp < 0) {
    throw new TypeError(`The webhook timestamp must be whole Unix seconds, not ${timestamp}`);
  }
  return `${SIGNATURE_VERSION},${hexHmac(secret, requestId, String(timestamp), rawBody)}`;
}

/** Request headers as a `Headers` (fetch, undici) or a plain object (node:http `IncomingHttpHeaders`). */
export type WebhookHeaders =
  | Headers
  | { get(name: string): string | null }
  | Record<string, string | string[] | undefined>;

export interface VerifyOptions {
  /** Largest accepted distance, either way, between the timestamp and `now`. Default 300 s. */
  toleranceSeconds?: number;
  /** The receiver's current time, Unix milliseconds (`Date.now()`) or a Date. Default: now. */
  now?: number | Date;
}

function header(headers: WebhookHeaders, name: string): string | undefined {
  if (typeof (headers as { get?: unknown }).get === 'function') {
    return (headers as { get(name: string): string | null }).get(name) ?? undefined;
  }
  const record = headers as Record<string, string | string[] | undefined>;
  // Plain objects may come from frameworks that keep the sender's capitalization.
  for (const key of Object.keys(record)) {
    if (key.toLowerCase() !== name) continue;
    const value = record[key];
    return Array.isArray(value) ? value[0] : value;
  }
  return undefined;
}

/**
 * True when the delivery carries a valid Ferry signature for `secret` over `rawBody` and its timestamp
 * is within the tolerance. Pass the body exactly as received (before any JSON parsing): re-serialized
 * JSON rarely has the same bytes. Never throws for bad input; any doubt is `false`.
 */
export function verifyWebhook(
  secret: Bytes,
  headers: WebhookHeaders,
  rawBody: Bytes,
  options: VerifyOptions = {},
): boolean {
  const requestId = header(headers, WEBHOOK_HEADERS.requestId);
  const timestamp = header(headers, WEBHOOK_HEADERS.timestamp)?.trim();
  const signature = header(headers, WEBHOOK_HEADERS.signature);
  if (!requestId || !timestamp || !signature) return false;
  if (!/^\d{1,15}$/.test(timestamp)) return false;

  const tolerance = options.toleranceSeconds ?? DEFAULT_TOLERANCE_SECONDS;
  const nowMs = options.now === undefined ? Date.now() : Number(options.now);
  // A stale timestamp means a captured delivery replayed later; a future one, a forged or skewed sender.
  if (!(Math.abs(nowMs / 1000 - Number(timestamp)) <= tolerance)) return false;

  const expected = Buffer.from(hexHmac(secret, requestId, timestamp, rawBody), 'utf8');
  // Several space-separated values are accepted so a sender could list signatures under two secrets
  // (rotation) without breaking receivers that know only one.
  let ok = false;
  for (const part of signature.trim().split(/\s+/)) {
    if (!part.startsWith(`${SIGNATURE_VERSION},`)) continue;
    const given = Buffer.from(part.slice(SIGNATURE_VERSION.length + 1).toLowerCase(), 'utf8');
    // timingSafeEqual throws on unequal lengths; the length of a hex SHA-256 is public anyway.
    if (given.length === expected.length && timingSafeEqual(given, expected)) ok = true;
  }
  return ok;
}
