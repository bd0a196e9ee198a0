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
 * Which addresses a delivery may reach is the server's setting (`FERRY_WEBHOOK_ALLOW`), which the CLI
 * cannot know: the server passes its check in (`blocked`, address-guard.ts `blockedReason`), and then a URL
 * whose host is a literal address in a blocked range is refused here, at intake, like any other bad URL,
 * rather than taken with a 202 and failed at delivery (issue 43). A host name is still checked only at
 * connect time (`address-guard.ts`), on what it resolves to then: resolving it here would prove nothing
 * about delivery (DNS rebinding) and would make intake wait on DNS. This module imports nothing, so any
 * layer may use it.
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

export interface WebhookUrlOptions {
  /**
   * The server's address rule: why a delivery may not reach this IP address (the kind of range it is in),
   * or undefined when it may. Given, a URL whose host is a literal address is checked with it.
   */
  blocked?: ((address: string) => string | undefined) | undefined;
}

/**
 * Checks a webhook URL and returns it normalized (as `URL` writes it, which is what is stored and
 * delivered to); throws a `WebhookUrlError` saying what is wrong.
 *
 * @example parseWebhookUrl('https://example.com/hook') // 'https://example.com/hook'
 * @example parseWebhookUrl('https://user:secret@example.com/hook') // throws: no user name or password
 * @example parseWebhookUrl('http://127.0.0.1:9/', { blocked }) // throws: in a blocked range (loopback)
 */
export function parseWebhookUrl(value: unknown, options: WebhookUrlOptions = {}): string {
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
  const address = literalAddress(url.hostname);
  const why = address !== undefined ? options.blocked?.(address) : undefined;
  if (why !== undefined) {
    throw new WebhookUrlError(
      `must not be an address in a blocked range: ${address} is ${why}; the server's operator can allow it with FERRY_WEBHOOK_ALLOW`,
    );
  }
  const normalized = url.toString();
  // Percent-encoding can lengthen a URL: the limit holds for what is stored too.
  if (normalized.length > MAX_WEBHOOK_URL_LENGTH) {
    throw new WebhookUrlError(`must be at most ${MAX_WEBHOOK_URL_LENGTH} characters`);
  }
  return normalized;
}

/**
 * The IP address a URL's host is, or undefined for a name. `URL` has already written every IPv4 form
 * (`0x7f.1`, `2130706433`) as four decimal numbers and an IPv6 address in brackets.
 */
function literalAddress(hostname: string): string | undefined {
  if (hostname.startsWith('[') && hostname.endsWith(']')) return hostname.slice(1, -1);
  return /^\d{1,3}(\.\d{1,3}){3}$/.test(hostname) ? hostname : undefined;
}
