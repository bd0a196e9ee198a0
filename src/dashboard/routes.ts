/**
 * The dashboard: a small single-page app of hand-written HTML, CSS and ES modules, served by `ferry serve`
 * at `/` on the API's own port (no build step, no bundler, no CDN). The page signs in with a service-account
 * token and then uses the same `/v2` API as the CLI with that token: the server gives the dashboard no
 * privileges of its own. Also registers the stats route its charts read, and the replica sampler behind it.
 *
 * Files come from `src/dashboard/static` (the TypeScript build does not copy them), found relative to this
 * module both when it runs compiled (`dist/src/dashboard/routes.js`) and from source; uPlot comes from
 * `node_modules/uplot/dist` and is served under `/dashboard/vendor/`.
 */
import { createHash } from 'node:crypto';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type { FastifyReply, FastifyRequest } from 'fastify';
import { FerryError } from '../errors.js';
import { registerStatsRoutes } from '../http/routes/stats.js';
import type { TypedServer } from '../http/server.js';
import type { Services } from '../services.js';
import { createReplicaHistory } from './replica-history.js';

/** Sent with every dashboard response: the page may load and call only its own origin. */
export const DASHBOARD_HEADERS: Readonly<Record<string, string>> = {
  'cache-control': 'no-cache',
  'content-security-policy':
    "default-src 'self'; connect-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'",
  'x-content-type-options': 'nosniff',
  'referrer-policy': 'no-referrer',
};

const CONTENT_TYPES: Readonly<Record<string, string>> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.svg': 'image/svg+xml',
  '.png': 'image/png',
  '.ico': 'image/x-icon',
};

/** The folder of the static files: next to this module from source, or in the repository from dist/. */
export function staticRoot(): string | undefined {
  const candidates = [
    new URL('./static/', import.meta.url),
    new URL('../../../src/dashboard/static/', import.meta.url),
  ];
  for (const candidate of candidates) {
    const dir = fileURLToPath(candidate);
    if (fs.existsSync(path.join(dir, 'index.html'))) return dir;
  }
  return undefined;
}

/** URL path (under /dashboard/) to file, for every file the dashboard serves; nothing else is reachable. */
function assetTable(services: Services): Map<string, string> {
  const assets = new Map<string, string>();
  const root = staticRoot();
  if (root) {
    for (const name of fs.readdirSync(root, { recursive: true, encoding: 'utf8' })) {
      const file = path.join(root, name);
      if (!(path.extname(name) in CONTENT_TYPES) || !fs.statSync(file).isFile()) continue;
      assets.set(name.split(path.sep).join('/'), file);
    }
  } else {
    services.logger.warn('the dashboard files (src/dashboard/static) are missing; the dashboard is not served');
  }
  try {
    const require = createRequire(import.meta.url);
    assets.set('vendor/uPlot.esm.js', require.resolve('uplot/dist/uPlot.esm.js'));
    assets.set('vendor/uPlot.min.css', require.resolve('uplot/dist/uPlot.min.css'));
  } catch {
    services.logger.warn('uplot is not installed; the dashboard charts will not load');
  }
  return assets;
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

export function registerDashboardRoutes(app: TypedServer, services: Services): void {
  const history = createReplicaHistory({ pools: () => services.replicas.pools() });
  history.start();
  app.addHook('onClose', async () => history.stop());
  registerStatsRoutes(app, services, history);

  const assets = assetTable(services);
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
