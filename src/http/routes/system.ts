/** `/healthz`, `/metrics` and the OpenAPI document. */
import { sql } from 'kysely';
import type { Services } from '../../services.js';
import type { TypedServer } from '../server.js';

export function registerSystemRoutes(app: TypedServer, services: Services): void {
  app.get('/healthz', async (_request, reply) => {
    try {
      await sql`select 1`.execute(services.store);
      return { status: 'ok' };
    } catch {
      return reply.code(503).send({ status: 'unavailable', reason: 'store' });
    }
  });

  app.get('/metrics', async (_request, reply) => {
    services.refreshGauges();
    const text = await services.metrics.registry.metrics();
    return reply.type(services.metrics.registry.contentType).send(text);
  });

  app.get('/v2/openapi.json', async () => app.swagger());
}
