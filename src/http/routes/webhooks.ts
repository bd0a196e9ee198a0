/** Placeholder: replaced by the webhook routes. */
import type { Services } from '../../services.js';
import type { TypedServer } from '../server.js';

export function registerWebhookRoutes(_app: TypedServer, _services: Services): void {}
