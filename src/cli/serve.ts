/**
 * `ferry serve`: runs everything in one process on the embedded default.
 *
 * Signals are handled here and only here: the first SIGTERM or SIGINT stops intake, gives runs in flight
 * up to FERRY_SHUTDOWN_GRACE_SECONDS to end, interrupts the rest, stops builds (they run again at the next
 * start) and closes the store (cli/shutdown.ts); a second signal exits at once.
 *
 * With `--run-port` a gateway or `all` listens twice: the public server on `--port`, and the run endpoint
 * alone on the run port (http/server.ts, surface `run`), an origin where tenants' apps answer apart from
 * the dashboard.
 */

import { createWorkerBuilds } from '../cluster/worker-builds.js';
import { resolveServerConfig } from '../config.js';
import { DataDirLockedError, lockDataDir, prepareDataDir, recordServer } from '../data-dir.js';
import { createRunAddress } from '../http/run-address.js';
import { buildServer } from '../http/server.js';
import { createWorkerApi } from '../http/worker-api.js';
import { createLogger } from '../logger.js';
import { createServices } from '../services.js';
import { CliError } from './client.js';
import { sandboxWarnings } from './doctor.js';
import { shutDown } from './shutdown.js';

export interface ServeOptions {
  host?: string;
  port?: string;
  runPort?: string;
  runUrl?: string;
  dataDir?: string;
  databaseUrl?: string;
  keysDir?: string;
  artifactsDir?: string;
  natsUrl?: string;
  clusterName?: string;
  role?: string;
  advertiseUrl?: string;
  webhookAllow?: string;
  egressAllow?: string;
  egressDeny?: string;
}

export async function serveCommand(options: ServeOptions): Promise<void> {
  let config: ReturnType<typeof resolveServerConfig>;
  try {
    config = resolveServerConfig(options);
  } catch (err) {
    throw new CliError((err as Error).message, 2);
  }
  const logger = createLogger({ level: config.logLevel });
  const dataDir = prepareDataDir(config.dataDir);
  let unlock: () => void;
  try {
    unlock = lockDataDir(dataDir);
  } catch (err) {
    if (err instanceof DataDirLockedError) throw new CliError(err.message, 1);
    throw err;
  }

  const services = await createServices(config, logger);
  if (config.role !== 'gateway') for (const warning of sandboxWarnings(services.sandbox)) logger.warn(warning);
  // A worker serves only its internal listener; a gateway and `all` serve the public interface, and the
  // run endpoint alone on the run port when there is one.
  const runAddress = createRunAddress(config);
  const app = config.role === 'worker' ? undefined : await buildServer(services, { runAddress });
  const runApp =
    app && config.runPort !== undefined ? await buildServer(services, { surface: 'run', runAddress }) : undefined;
  const internal =
    config.role === 'worker'
      ? createWorkerApi({
          builds: createWorkerBuilds(services.store),
          storeHealth: (timeoutMs) => services.storeHealth(timeoutMs),
          space: services.space,
          invoker: services.invoker,
          auth: services.clusterAuth,
          callers: services.callers,
          metrics: services.metrics,
          refreshGauges: () => services.refreshGauges(),
          logger: logger.child({ component: 'internal' }),
          maxBodyBytes: services.config.maxBodyBytes,
          streamBufferBytes: services.config.streamBufferBytes,
        })
      : undefined;
  const recovered = await services.pipeline.recover();
  if (recovered > 0) logger.info({ builds: recovered }, 'resuming builds left unfinished by a stopped server');
  await services.asyncWorker.start();
  if (services.recovered.interrupted > 0) {
    logger.warn(
      { runs: services.recovered.interrupted },
      'runs left in progress by a stopped server were marked failed (interrupted)',
    );
  }
  // A gateway has no replicas (composition/executor.ts NO_REPLICAS): this keeps nothing warm there.
  await services.replicas.warmUp();

  let address: string;
  let runEndpoint: string | undefined;
  /** Which listen failed, for the message. */
  let onRunPort = false;
  try {
    if (app) address = await app.listen({ host: config.host, port: config.port });
    else address = await listenInternal(internal!.server, config.host, config.port);
    if (runApp) {
      onRunPort = true;
      runEndpoint = await runApp.listen({ host: config.host, port: config.runPort });
      runAddress.listening(Number(new URL(runEndpoint).port));
    }
  } catch (err) {
    await runApp?.close();
    await app?.close();
    await services.close();
    unlock();
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'EADDRINUSE') {
      const [port, flag] = onRunPort
        ? [config.runPort, '--run-port or set FERRY_RUN_PORT']
        : [config.port, '--port or set FERRY_PORT'];
      throw new CliError(`Port ${port} on ${config.host} is already in use. Pass ${flag}.`);
    }
    throw err;
  }
  // `ferry admin bootstrap` and `login-link` read it to print this server's address rather than a default.
  const unrecord = config.role === 'worker' ? () => undefined : recordServer(dataDir, address);
  // Gateways and `all` record their address when the public server listens (routes/cluster.ts).
  if (config.role === 'worker') await services.listening(config.advertiseUrl ?? address);
  if (config.role === 'worker') {
    logger.info(
      { address, advertise: config.advertiseUrl ?? address, dataDir: dataDir.root, role: config.role },
      `Ferry worker ${services.node.id} is listening on ${address} (internal: gateways only; data in ${dataDir.root})`,
    );
  } else {
    logger.info(
      { address, dataDir: dataDir.root, role: config.role },
      `Ferry${config.role === 'gateway' ? ' gateway' : ''} is listening on ${address} (data in ${dataDir.root})`,
    );
    // Sign in with a token from `ferry admin bootstrap` (it prints a sign-in link) or the API keys page.
    logger.info({ dashboard: `${address}/` }, `Dashboard: ${address}/`);
    if (runEndpoint) {
      // What callers are told (FERRY_RUN_URL when set), and where this process serves it.
      const told = config.runUrl ?? runEndpoint;
      logger.info({ run: told, runAddress: runEndpoint }, `Run endpoint (apps): ${told}/v4/`);
    }
  }

  let stopping = false;
  const stop = async (signal: string) => {
    if (stopping) {
      logger.warn(`${signal} again: exiting now`);
      process.exit(1);
    }
    stopping = true;
    unrecord();
    const grace = config.shutdownGraceSeconds;
    logger.info(
      { graceSeconds: grace },
      `${signal}: shutting down (runs in flight get up to ${grace} s to end, then are interrupted; a second signal exits at once)`,
    );
    try {
      await shutDown({
        closeListeners: async () => {
          await Promise.all([runApp?.close(), app?.close(), internal?.close()]);
        },
        cutConnections() {
          runApp?.server.closeAllConnections();
          app?.server.closeAllConnections();
          internal?.server.closeAllConnections();
        },
        services,
        logger,
        graceMs: grace * 1000,
        exit(code) {
          logger.flush();
          unlock();
          process.exit(code);
        },
      });
    } catch (err) {
      logger.error({ err }, 'error during shutdown');
    } finally {
      unlock();
    }
    logger.info('stopped');
    logger.flush();
    process.exit(0);
  };
  process.on('SIGTERM', () => void stop('SIGTERM'));
  process.on('SIGINT', () => void stop('SIGINT'));
}

/** Listens with a plain node:http server; resolves with its address as a URL. */
function listenInternal(server: import('node:http').Server, host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.removeListener('error', reject);
      const address = server.address();
      const actual = typeof address === 'object' && address ? address.port : port;
      const shown = host.includes(':') ? `[${host}]` : host;
      resolve(`http://${shown}:${actual}`);
    });
  });
}
