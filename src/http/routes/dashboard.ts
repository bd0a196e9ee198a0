/**
 * The dashboard's routes: its files (dashboard/assets.ts) at `/` and under `/dashboard/`, on the API's own
 * port, with headers that let the page load and call only its own origin; and the stats route its charts
 * read, with the replica sampler behind it.
 */
import { createHash } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import type { FastifyReply, FastifyRequest } from 'fastify';
import type { Logger } from 'pino';
import { CONTENT_TYPES, DASHBOARD_HEADERS, dashboardAssets } from '../../dashboard/assets.js';
import { createReplicaHistory } from '../../dashboard/replica-history.js';
import { FerryError } from '../../errors.js';
import type { ReplicaManager } from '../../replicas/manager.js';
import type { TypedServer } from '../typed-server.js';
import { registerStatsRoutes, type StatsRouteDeps } from './stats.js';

export interface DashboardRouteDeps extends StatsRouteDeps {
  logger: Pick<Logger, 'warn'>;
  replicas: Pick<ReplicaManager, 'pools'>;
}

async function sendFile(request: FastifyRequest, reply: FastifyReply, file: string | undefined): Promise<unknown> {
  if (!file) throw new FerryError('FERRY_ROUTE_NOT_FOUND', `No dashboard file ${request.url.split('?')[0]}`);
  const body = await fs.promises.readFile(file);
  // no-cache means "revalidate": the ETag lets the browser keep its copy while the file is unchanged.
  const etag = `"${createHash('sha256').update(body).digest('base64url').slice(0, 27)}"`;
  reply.header('etag', etag);
  reply.type(CONTENT_TYPES[path.extname(file)] ?? 'application/octet-stream');
  if (request.headers['if-none-match'] === etag) return reply.code(304).send();
  return reply.send(body);
}

export function registerDashboardRoutes(app: TypedServer, deps: DashboardRouteDeps): void {
  const history = createReplicaHistory({ pools: () => deps.replicas.pools() });
  history.start();
  app.addHook('onClose', async () => history.stop());
  registerStatsRoutes(app, deps, history);

  const assets = dashboardAssets(deps.logger);
  const headers = async (_request: FastifyRequest, reply: FastifyReply) => {
    reply.headers(DASHBOARD_HEADERS);
  };
  const index = (request: FastifyRequest, reply: FastifyReply) => sendFile(request, reply, assets.get('index.html'));

  app.get('/', { onRequest: headers }, index);
  app.get('/dashboard', { onRequest: headers }, index);
  app.get<{ Params: { '*': string } }>('/dashboard/*', { onRequest: headers }, async (request, reply) => {
    const rel = request.params['*'];
    if (rel === '' || rel === 'index.html') return index(request, reply);
    return sendFile(request, reply, assets.get(rel));
  });
}
