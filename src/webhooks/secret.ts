/**
 * The webhook signing secret (`X-Webhook-Secret` of the run call) at rest, in `runs.webhook_secret`.
 *
 * Encrypted with the same AES-256-GCM scheme as project secrets, under the same key
 * (`keys/secrets.key`), with the run id as authenticated data: a value copied to another run's row does
 * not decrypt. The deliverer erases it 7 days after the run's delivery ended (see deliverer.ts).
 */
import { decryptSecret, encryptSecret } from '../secrets/secrets.js';

// AAD `webhook/<run id>`: project secrets use `<project id>/<name>` and project ids start with `p-`,
// so a project secret can never be passed off as a webhook secret or the other way round.
const binding = (runId: string) => ({ projectId: 'webhook', name: runId });

export function encryptWebhookSecret(key: Uint8Array, runId: string, secret: string): string {
  return encryptSecret(key, secret, binding(runId));
}

/** Throws when the stored value was tampered with, belongs to another run, or the key was replaced. */
export function decryptWebhookSecret(key: Uint8Array, runId: string, stored: string): string {
  try {
    return decryptSecret(key, stored, binding(runId));
  } catch (err) {
    throw new Error(`the webhook secret of run ${runId} does not decrypt (tampered, or keys/secrets.key replaced)`, {
      cause: err,
    });
  }
}

/**
 * The run's X-Webhook-Secret header, encrypted for storage: only when the run has a webhook and the header
 * holds a non-empty value.
 */
export function webhookSecretOf(
  key: Uint8Array,
  runId: string,
  webhookUrl: string | undefined,
  header: string | string[] | undefined,
): string | undefined {
  return webhookUrl && typeof header === 'string' && header !== ''
    ? encryptWebhookSecret(key, runId, header)
    : undefined;
}
