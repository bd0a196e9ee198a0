/** Placeholder: replaced by the dashboard routes. */
import type { Services } from '../services.js';
import type { TypedServer } from '../http/server.js';

export function registerDashboardRoutes(_app: TypedServer, _services: Services): void {}
