/**
 * The one rule for a webhook URL, wherever one comes in: the run endpoint's `webhookEndpoint` (Cortex
 * calls and the custom proxy) and a schedule's `webhook` in ferry.toml, which the server checks at upload
 * and `ferry deploy` before it packs anything. Before this module the schedule's was a regex of its own
 * and took URLs with credentials that the run endpoint refused (issue 43).
 *
 * A URL with a user name or password is refused, not stripped: Ferry would otherwise keep a secret in
 * plain text in the run record, the schedule list and the logs. A receiver authenticates deliveries by
 * their signature (`X-Webhook-Secret` on a run call) instead.
 *
 * Which addresses a delivery may reach is not decided here: that is the server's setting
 * (`FERRY_WEBHOOK_ALLOW`), checked at connect time by `address-guard.ts`, and the CLI cannot know it.
 * This module imports nothing, so any layer may use it.
 */

/** The longest webhook URL taken, as given and as stored. */
export const MAX_WEBHOOK_URL_LENGTH = 2048;

/** A webhook URL refused; `message` says why without repeating the URL (it may hold a password). */
export class WebhookUrlError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'WebhookUrlError';
  }
}

/**
 * Checks a webhook URL and returns it normalized (as `URL` writes it, which is what is stored and
 * delivered to); throws a `WebhookUrlError` saying what is wrong.
 *
 * @example parseWebhookUrl('https://example.com/hook') // 'https://example.com/hook'
 * @example parseWebhookUrl('https://user:secret@example.com/hook') // throws: no user name or password
 */
export function parseWebhookUrl(value: unknown): string {
  const absolute = 'must be an absolute http:// or https:// URL';
  if (typeof value !== 'string' || value === '') throw new WebhookUrlError(absolute);
  if (value.length > MAX_WEBHOOK_URL_LENGTH) {
    throw new WebhookUrlError(`must be at most ${MAX_WEBHOOK_URL_LENGTH} characters`);
  }
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new WebhookUrlError(absolute);
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') throw new WebhookUrlError(absolute);
  if (url.username !== '' || url.password !== '') {
    throw new WebhookUrlError('must not carry a user name or password');
  }
  const normalized = url.toString();
  // Percent-encoding can lengthen a URL: the limit holds for what is stored too.
  if (normalized.length > MAX_WEBHOOK_URL_LENGTH) {
    throw new WebhookUrlError(`must be at most ${MAX_WEBHOOK_URL_LENGTH} characters`);
  }
  return normalized;
}
