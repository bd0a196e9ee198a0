/**
 * A run's webhook as the management API shows it: where it goes, where it stands, and every attempt
 * (across redeliveries). Meant as the `webhook` member of `GET .../runs/{run_id}`.
 */
import { Type } from 'typebox';
import type { Store } from '../store/index.js';
import type { DeliveryState } from './deliverer.js';

export interface WebhookAttemptView {
  /** 1, 2, 3, then 4… after a redelivery: attempt numbers keep counting up. */
  attempt: number;
  /** When the attempt started, ISO 8601 UTC. */
  at: string;
  /** The receiver's status, or null when no response came (see `error`). */
  status_code: number | null;
  /** Why the attempt got no response (network error, timeout, blocked address), or a note on a 3xx. */
  error: string | null;
  duration_ms: number;
}

export interface WebhookView {
  url: string;
  /** `pending` (waiting for its next attempt), `sending`, `delivered` or `failed` (gave up). */
  state: DeliveryState;
  /** When the next attempt is due, for a pending delivery. */
  next_attempt_at: string | null;
  attempts: WebhookAttemptView[];
}

const Nullable = <T extends Parameters<typeof Type.Union>[0][number]>(t: T) => Type.Union([t, Type.Null()]);

/** The route schema of `WebhookView`, for the run route's response. */
export const WebhookViewSchema = Type.Object(
  {
    url: Type.String(),
    state: Type.Union([
      Type.Literal('pending'),
      Type.Literal('sending'),
      Type.Literal('delivered'),
      Type.Literal('failed'),
    ]),
    next_attempt_at: Nullable(Type.String({ format: 'date-time' })),
    attempts: Type.Array(
      Type.Object({
        attempt: Type.Integer(),
        at: Type.String({ format: 'date-time' }),
        status_code: Nullable(Type.Integer()),
        error: Nullable(Type.String()),
        duration_ms: Type.Integer(),
      }),
    ),
  },
  { description: 'The webhook delivery of a run called with webhookEndpoint (see docs/webhooks.md)' },
);

/** The run's webhook, or null when the run has no delivery (no webhookEndpoint, or not finished yet). */
export async function webhookView(store: Store, runId: string): Promise<WebhookView | null> {
  const delivery = await store
    .selectFrom('webhook_deliveries')
    .select(['url', 'state', 'next_attempt_at'])
    .where('run_id', '=', runId)
    .executeTakeFirst();
  if (!delivery) return null;
  const attempts = await store
    .selectFrom('webhook_attempts')
    .select(['attempt', 'at', 'status_code', 'error', 'duration_ms'])
    .where('run_id', '=', runId)
    .orderBy('attempt')
    .execute();
  return {
    url: delivery.url,
    state: delivery.state as DeliveryState,
    next_attempt_at: delivery.state === 'pending' ? delivery.next_attempt_at : null,
    attempts,
  };
}
