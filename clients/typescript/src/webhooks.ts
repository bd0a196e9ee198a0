/**
 * Verifying Ferry's webhook deliveries (interface spec, section 5), for receivers, with Node's crypto
 * alone: `X-Service-Webhook-Signature: v1,<hex>`, the lowercase hex HMAC-SHA256, keyed by the secret the
 * caller sent as `X-Webhook-Secret`, of `<X-Request-Id>.<X-Service-Webhook-Timestamp>.<raw body>`. The same
 * rules as Ferry's own `ferry/webhooks`: a timestamp more than `toleranceSeconds` (300) from now is
 * refused, several space-separated signatures are accepted (secret rotation), any doubt is `false`.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';

type Bytes = string | Uint8Array;
/** Headers as `Headers` (fetch) or a plain object (node:http's `IncomingHttpHeaders`, any capitalization). */
export type WebhookHeaders = { get(name: string): string | null } | Record<string, string | string[] | undefined>;

export const DEFAULT_TOLERANCE_SECONDS = 300;

function read(headers: WebhookHeaders, name: string): string | undefined {
  if (typeof (headers as { get?: unknown }).get === 'function') {
    return (headers as { get(name: string): string | null }).get(name) ?? undefined;
  }
  for (const [key, value] of Object.entries(headers as Record<string, string | string[] | undefined>)) {
    if (key.toLowerCase() === name) return Array.isArray(value) ? value[0] : value;
  }
  return undefined;
}

function mac(secret: Bytes, requestId: string, timestamp: string, body: Bytes): string {
  return createHmac('sha256', secret).update(`${requestId}.${timestamp}.`).update(body).digest('hex');
}

/** The signature header value Ferry sends for one delivery (for tests of a receiver). */
export function signWebhook(secret: Bytes, requestId: string, timestamp: number, body: Bytes): string {
  return `v1,${mac(secret, requestId, String(timestamp), body)}`;
}

/**
 * True when the delivery carries a valid signature for `secret` over `body` (the raw bytes as received,
 * before any JSON parsing) and its timestamp is within `toleranceSeconds` of `now` (Unix ms). Never throws.
 */
export function verifyWebhook(
  secret: Bytes,
  headers: WebhookHeaders,
  body: Bytes,
  options: { toleranceSeconds?: number; now?: number } = {},
): boolean {
  try {
    const requestId = read(headers, 'x-request-id');
    const timestamp = read(headers, 'x-service-webhook-timestamp')?.trim() ?? '';
    const signature = read(headers, 'x-service-webhook-signature');
    if (!requestId || !signature || !/^\d{1,15}$/.test(timestamp)) return false;
    const now = (options.now ?? Date.now()) / 1000;
    if (!(Math.abs(now - Number(timestamp)) <= (options.toleranceSeconds ?? DEFAULT_TOLERANCE_SECONDS))) return false;
    const expected = Buffer.from(mac(secret, requestId, timestamp, body));
    return signature
      .trim()
      .split(/\s+/)
      .some((part) => {
        if (!part.startsWith('v1,')) return false;
        const given = Buffer.from(part.slice(3).toLowerCase());
        return given.length === expected.length && timingSafeEqual(given, expected);
      });
  } catch {
    return false;
  }
}
