/**
 * Wires Ferry's parts together from the server settings: data directory, store, keys, auth, artifact
 * store, build log and pipeline. `ferry serve` and the tests both start from here, so they run the same
 * objects; each part still takes its dependencies explicitly and can be built alone.
 */
import path from 'node:path';
import type { Logger } from 'pino';
import { type Authenticator, createAuthenticator } from './auth/authenticate.js';
import { type ArtifactStore, createDiskArtifactStore } from './builds/artifact-store.js';
import { type BuildLog, createBuildLog } from './builds/build-log.js';
import { createDefaultBuilders } from './builds/builders/index.js';
import { type BuildPipeline, createBuildPipeline } from './builds/pipeline.js';
import type { ServerConfig } from './config.js';
import { type DataDir, loadOrCreateKey, prepareDataDir } from './data-dir.js';
import { createMetrics, type Metrics } from './metrics.js';
import { openSqliteStore, type Store } from './store/index.js';

export interface Services {
  config: ServerConfig;
  dataDir: DataDir;
  store: Store;
  jwtKey: Uint8Array;
  secretsKey: Uint8Array;
  auth: Authenticator;
  artifacts: ArtifactStore;
  buildLog: BuildLog;
  pipeline: BuildPipeline;
  metrics: Metrics;
  logger: Logger;
  close(): Promise<void>;
}

export async function createServices(config: ServerConfig, logger: Logger): Promise<Services> {
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openSqliteStore({ dataDir: dataDir.root });
  const jwtKey = loadOrCreateKey(path.join(dataDir.keys, 'jwt.key'));
  const secretsKey = loadOrCreateKey(path.join(dataDir.keys, 'secrets.key'));
  const metrics = createMetrics();
  const buildLog = createBuildLog({ store });
  const pipeline = createBuildPipeline({
    store,
    buildLog,
    buildsDir: dataDir.builds,
    cacheDir: dataDir.cache,
    builders: createDefaultBuilders(),
    logger: logger.child({ component: 'builds' }),
    onFinished(build) {
      metrics.builds.inc({ state: build.state });
      if (build.started_at && build.finished_at) {
        const seconds = (Date.parse(build.finished_at) - Date.parse(build.started_at)) / 1000;
        metrics.buildDuration.observe({ state: build.state }, seconds);
      }
    },
  });
  return {
    config,
    dataDir,
    store,
    jwtKey,
    secretsKey,
    auth: createAuthenticator({ store, key: jwtKey }),
    artifacts: createDiskArtifactStore(dataDir.artifacts),
    buildLog,
    pipeline,
    metrics,
    logger,
    async close() {
      await pipeline.close();
      await store.destroy();
    },
  };
}
