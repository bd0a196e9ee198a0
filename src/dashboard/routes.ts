/** Placeholder: replaced by the dashboard routes. */

import type { TypedServer } from '../http/server.js';
import type { Services } from '../services.js';

export function registerDashboardRoutes(_app: TypedServer, _services: Services): void {}
