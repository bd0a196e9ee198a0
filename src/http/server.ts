/**
 * The HTTP servers. The public one: one Fastify instance and one port for the management API (`/v2`), the
 * run endpoint (`/v4`), the dashboard, `/healthz`, `/readyz` and `/metrics`. The run listener
 * (FERRY_RUN_PORT): the run endpoint, `/healthz` and `/readyz` only, so that tenants' apps can answer on
 * an origin where no dashboard runs (docs/operations.md, "Two origins"). `buildServer` does not listen,
 * so tests can inject requests or listen on port 0 themselves.
 */
import { createServer, type IncomingMessage, type Server } from 'node:http';
import type { Socket } from 'node:net';
import swagger from '@fastify/swagger';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import Fastify, { type FastifyBaseLogger, LogController } from 'fastify';
import type { Logger } from 'pino';
import type { ServerConfig } from '../config.js';
import { FerryError } from '../errors.js';
import type { Metrics } from '../metrics.js';
import { parseJsonBody, useJsonBodies } from './body-parsers.js';
import { clientErrorHandler, errorHandler } from './errors.js';
import { swaggerOptions } from './openapi.js';
import { type AppRouteDeps, registerAppRoutes } from './routes/apps.js';
import { type BuildRouteDeps, registerBuildRoutes } from './routes/builds.js';
import { type ClusterRouteDeps, registerClusterRoutes } from './routes/cluster.js';
import { type DashboardRouteDeps, registerDashboardRoutes } from './routes/dashboard.js';
import { type RegistryRouteDeps, registerRegistryRoutes } from './routes/registries.js';
import { type RunRouteDeps, registerRunRoutes } from './routes/run.js';
import { type RunsRouteDeps, registerRunsRoutes } from './routes/runs.js';
import { registerScheduleRoutes, type ScheduleRouteDeps } from './routes/schedules.js';
import { registerSecretRoutes, type SecretRouteDeps } from './routes/secrets.js';
import { type AccountRouteDeps, registerServiceAccountRoutes } from './routes/service-accounts.js';
import { registerHealthRoute, registerSystemRoutes, type SystemRouteDeps } from './routes/system.js';
import { registerVolumeRoutes, type VolumeRouteDeps } from './routes/volumes.js';
import { registerWebhookRoutes, type WebhookRouteDeps } from './routes/webhooks.js';
import { createRunAddress, type RunAddress } from './run-address.js';
import { createRunFastPath, type RunFastPath, type RunFastPathDeps } from './run-fast-path.js';
import { sharedCompilers } from './schema-compilers.js';
import type { TypedServer } from './typed-server.js';
import { assertFiniteNumbers, formatValidationErrors } from './validation.js';

export type FerryServer = TypedServer;
export type { TypedServer } from './typed-server.js';

/**
 * What the HTTP layer is given: each route module's own dependencies (its `...RouteDeps`), nothing more.
 * The composition (services.ts) passes its parts; a test may pass its own.
 */
export type HttpDeps = AppRouteDeps &
  BuildRouteDeps &
  ClusterRouteDeps &
  DashboardRouteDeps &
  RunRouteDeps &
  RunsRouteDeps &
  ScheduleRouteDeps &
  SecretRouteDeps &
  RegistryRouteDeps &
  AccountRouteDeps &
  SystemRouteDeps &
  VolumeRouteDeps &
  WebhookRouteDeps &
  RunFastPathDeps & {
    logger: Logger;
    config: Pick<ServerConfig, 'maxBodyBytes' | 'host' | 'runPort' | 'runUrl'>;
    metrics: Pick<Metrics, 'httpRequests' | 'httpDuration'>;
  };

/** Which server `buildServer` makes. */
export interface ServerOptions {
  /**
   * `public` (default): every route, on the port that also serves the dashboard, so what a custom app
   * answers is sandboxed (custom-proxy.ts `APP_SANDBOX_CSP`). `run`: the run listener of FERRY_RUN_PORT,
   * the run endpoint, `/healthz` and `/readyz` only, where apps answer as they are.
   */
  surface?: 'public' | 'run';
  /** Where the run endpoint is, as `GET /v2/projects/{project_id}` tells (default: from `config`). */
  runAddress?: RunAddress;
}

/**
 * The connections of `server` that never carried a request: closed when the server closes. Node's own
 * `closeIdleConnections` (Fastify's `forceCloseConnections: 'idle'`) closes the kept-alive connections
 * between requests, but leaves out a connection that was opened and never sent one (seen after a caller
 * aborted a call: a second connection of the client's pool, which held every close for the whole
 * keep-alive timeout, 60 to 72 s). Requests in flight, and upgraded sockets (WebSocket sessions, which their
 * tunnels end), are left to finish. The request handler calls `used` with each request's socket: a Set's
 * delete, no listener or closure per request on the run path.
 */
function trackUnusedConnections(server: Server): { used(socket: Socket): void; closeUnused(): void } {
  const unused = new Set<Socket>();
  server.on('connection', (socket: Socket) => {
    unused.add(socket);
    socket.once('close', () => unused.delete(socket));
  });
  server.prependListener('upgrade', (req: IncomingMessage) => unused.delete(req.socket));
  return {
    used(socket) {
      if (unused.size > 0) unused.delete(socket);
    },
    closeUnused() {
      for (const socket of unused) socket.destroy();
    },
  };
}

function createFastify(services: HttpDeps): TypedServer {
  let fastPath: RunFastPath | undefined;
  let connections: ReturnType<typeof trackUnusedConnections> | undefined;
  const app = Fastify({
    // Node's server as Fastify would make it, with the run endpoint's hot case served before Fastify.
    serverFactory: (handler) => {
      const path = createRunFastPath(services, handler);
      fastPath = path;
      const server = createServer((req, res) => {
        connections?.used(req.socket);
        if (!path.handle(req, res)) handler(req, res);
      });
      connections = trackUnusedConnections(server);
      // Fastify's own defaults, which it applies only to a server it makes itself.
      server.keepAliveTimeout = 72_000;
      server.requestTimeout = 0;
      server.setTimeout(0);
      return server;
    },
    loggerInstance: services.logger as FastifyBaseLogger,
    // Per-request lines would drown the log at run-endpoint rates; metrics count requests instead.
    logController: new LogController({ disableRequestLogging: true, requestIdLogLabel: 'req' }),
    bodyLimit: services.config.maxBodyBytes,
    // Secret names may be 128 characters; Fastify's default of 100 would answer its own 414 first.
    routerOptions: { maxParamLength: 256 },
    ajv: { customOptions: { removeAdditional: false, coerceTypes: 'array', allErrors: false } },
    // Compiled once per process, whatever the number of servers it builds (http/schema-compilers.ts).
    // No route has a headers schema, the one part Fastify treats differently under custom compilers.
    schemaController: { compilersFactory: sharedCompilers },
    schemaErrorFormatter: formatValidationErrors,
    // Fastify answers a URL it cannot decode itself, in its own shape, unless told otherwise.
    frameworkErrors: (err, request, reply) => errorHandler(err, request, reply),
    clientErrorHandler,
    return503OnClosing: true,
    forceCloseConnections: 'idle',
  }).withTypeProvider<TypeBoxTypeProvider>();
  // Closing: every request goes through Fastify, which answers 503; connections that never carried one are
  // closed here, the idle kept-alive ones by Fastify (forceCloseConnections).
  app.addHook('preClose', async () => {
    fastPath?.close();
    connections?.closeUnused();
  });
  return app;
}

export async function buildServer(services: HttpDeps, options: ServerOptions = {}): Promise<FerryServer> {
  const surface = options.surface ?? 'public';
  const app = createFastify(services);

  // The OpenAPI document is served by the public server only; the run listener has no use for it.
  if (surface === 'public') await app.register(swagger, swaggerOptions);

  app.setErrorHandler(errorHandler);
  app.setNotFoundHandler((request, reply) => {
    errorHandler(
      new FerryError('FERRY_ROUTE_NOT_FOUND', `No route ${request.method} ${request.url.split('?')[0]}`),
      request,
      reply,
    );
  });

  useJsonBodies(app, parseJsonBody, services.config.maxBodyBytes);
  // After validation, before any handler (a route's own preHandler hooks run after this one).
  app.addHook('preHandler', async (request) => assertFiniteNumbers(request));

  const { httpRequests, httpDuration } = services.metrics;
  app.addHook('onResponse', async (request, reply) => {
    const route = request.routeOptions.url ?? 'unmatched';
    httpRequests.inc({ method: request.method, route, status: String(reply.statusCode) });
    httpDuration.observe({ method: request.method, route }, reply.elapsedTime / 1000);
  });

  if (surface === 'run') {
    registerHealthRoute(app, services);
    registerRunRoutes(app, services, { sandboxApps: false });
    return app;
  }
  registerSystemRoutes(app, services);
  registerClusterRoutes(app, services);
  registerServiceAccountRoutes(app, services, options.runAddress ?? createRunAddress(services.config));
  registerAppRoutes(app, services);
  registerBuildRoutes(app, services);
  registerSecretRoutes(app, services);
  registerRegistryRoutes(app, services);
  registerScheduleRoutes(app, services);
  registerVolumeRoutes(app, services);
  registerRunsRoutes(app, services);
  registerWebhookRoutes(app, services);
  // This port serves the dashboard: an app's pages must never run with its origin.
  registerRunRoutes(app, services, { sandboxApps: true });
  registerDashboardRoutes(app, services);
  return app;
}
