/**
 * `/healthz`, `/readyz`, `/metrics` and the OpenAPI document (the run listener serves `/healthz` and
 * `/readyz` only).
 */
import type { DiskSpace } from '../../disk-space.js';
import type { Metrics } from '../../metrics.js';
import type { StoreHealth } from '../../store/index.js';
import type { TypedServer } from '../typed-server.js';

/** How long `/healthz` waits for the store before it answers 503 store-busy. */
const HEALTH_PROBE_MS = 1000;

export interface SystemRouteDeps {
  /** Whether the store answers within `timeoutMs`. */
  storeHealth(timeoutMs: number): Promise<StoreHealth>;
  /** The data folder's free space: `low` under FERRY_MIN_FREE_MIB (`/readyz` then says `storage`). */
  space: Pick<DiskSpace, 'low'>;
  /** Brings the gauges up to date before /metrics is rendered. */
  refreshGauges(): void;
  metrics: Pick<Metrics, 'registry'>;
}

export function registerSystemRoutes(app: TypedServer, services: SystemRouteDeps): void {
  registerHealthRoute(app, services);

  app.get('/metrics', async (_request, reply) => {
    services.refreshGauges();
    const text = await services.metrics.registry.metrics();
    return reply.type(services.metrics.registry.contentType).send(text);
  });

  app.get('/v2/openapi.json', async () => app.swagger());
}

/**
 * `/healthz` and `/readyz`: the public server's, and the run listener's (FERRY_RUN_PORT) for its load
 * balancer. Neither needs a token, as load balancers and orchestrators call them, and neither tells more
 * than a reason's name.
 */
export function registerHealthRoute(app: TypedServer, services: Pick<SystemRouteDeps, 'storeHealth' | 'space'>): void {
  // For load balancers and orchestrators (docs/operations.md, "Health"). A store write-locked by another
  // process is not a reason to take this process out of rotation or restart it: it still serves reads and
  // runs, and writes wait or answer 503 FERRY_STORE_BUSY themselves. So that is 200 with `store: busy`;
  // 503 only when the store does not answer within HEALTH_PROBE_MS, or fails.
  app.get('/healthz', async (_request, reply) => {
    try {
      const store = await services.storeHealth(HEALTH_PROBE_MS);
      if (store === 'ok') return { status: 'ok' };
      if (store === 'busy') return { status: 'ok', store: 'busy' };
      return reply.code(503).send({ status: 'unavailable', reason: 'store-busy' });
    } catch {
      return reply.code(503).send({ status: 'unavailable', reason: 'store' });
    }
  });

  // Whether to send this process new work: what /healthz checks, and the data folder's free space. Under
  // FERRY_MIN_FREE_MIB new runs and uploads answer 507 here (disk-space.ts) while reads and the runs
  // accepted go on: a load balancer should send new work elsewhere, but nothing should restart the process
  // (/healthz stays 200). The flag is the last look (at most a second old), so this costs no statfs.
  app.get('/readyz', async (_request, reply) => {
    const store = await services.storeHealth(HEALTH_PROBE_MS).catch(() => 'down' as const);
    if (store === 'down') return reply.code(503).send({ status: 'unavailable', reason: 'store' });
    if (store === 'unresponsive') return reply.code(503).send({ status: 'unavailable', reason: 'store-busy' });
    if (services.space.low) return reply.code(503).send({ status: 'unavailable', reason: 'storage' });
    return { status: 'ready' };
  });
}
