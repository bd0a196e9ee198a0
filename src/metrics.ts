/**
 * Prometheus metrics, served at `/metrics`. One registry per server so tests can run several servers in
 * one process. Later parts (runs, replicas, webhooks) add their metrics to the same registry.
 */
import { Counter, collectDefaultMetrics, Histogram, Registry } from 'prom-client';

export interface Metrics {
  registry: Registry;
  httpRequests: Counter<'method' | 'route' | 'status'>;
  httpDuration: Histogram<'method' | 'route'>;
  builds: Counter<'state'>;
  buildDuration: Histogram<'state'>;
}

export function createMetrics(): Metrics {
  const registry = new Registry();
  collectDefaultMetrics({ register: registry, prefix: 'ferry_' });
  return {
    registry,
    httpRequests: new Counter({
      name: 'ferry_http_requests_total',
      help: 'HTTP requests answered, by route and status',
      labelNames: ['method', 'route', 'status'],
      registers: [registry],
    }),
    httpDuration: new Histogram({
      name: 'ferry_http_request_duration_seconds',
      help: 'Time to answer HTTP requests',
      labelNames: ['method', 'route'],
      buckets: [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30],
      registers: [registry],
    }),
    builds: new Counter({
      name: 'ferry_builds_total',
      help: 'Builds that reached a final state',
      labelNames: ['state'],
      registers: [registry],
    }),
    buildDuration: new Histogram({
      name: 'ferry_build_duration_seconds',
      help: 'Time from a build starting to its final state',
      labelNames: ['state'],
      buckets: [0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600],
      registers: [registry],
    }),
  };
}
