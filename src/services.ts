/**
 * Wires Ferry's parts together from the server settings: data directory, store, keys, auth, artifact
 * store and build outputs, change feed, build log and pipeline. `ferry serve` and the tests both start
 * from here, so they run the same objects; each part still takes its dependencies explicitly and can be
 * built alone.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { type AppLog, createAppLog } from './apps/app-log.js';
import { type Authenticator, createAuthenticator } from './auth/authenticate.js';
import { type ArtifactStore, createDiskArtifactStore } from './builds/artifact-store.js';
import { type BuildLog, createBuildLog } from './builds/build-log.js';
import { type BuildOutput, createBuildOutput } from './builds/build-output.js';
import { createDefaultBuilders } from './builds/builders/index.js';
import { createNatsArtifactStore, lazyArtifactsBucket } from './builds/nats-artifact-store.js';
import { createNatsBuildOutput } from './builds/nats-build-output.js';
import { type BuildPipeline, createBuildPipeline } from './builds/pipeline.js';
import { applyChanges } from './cluster/apply-changes.js';
import { type ChangeFeed, createLocalChangeFeed } from './cluster/change-feed.js';
import { clusterNames, createNatsLink, requireNats } from './cluster/nats.js';
import { createNodeLease, type NodeLease } from './cluster/node.js';
import { describeLoad, FERRY_VERSION, NODE_ROLE } from './cluster/node-info.js';
import { createPgChangeFeed } from './cluster/pg-change-feed.js';
import { createRecovery, type Recovery, type RecoveryResult } from './cluster/recovery.js';
import type { ServerConfig } from './config.js';
import { type DataDir, loadOrCreateKey, prepareArtifactsDir, prepareDataDir, prepareKeysDir } from './data-dir.js';
import { createMetrics, type Metrics } from './metrics.js';
import { createBuildViews } from './replicas/build-view.js';
import { createLauncher } from './replicas/launcher.js';
import { createReplicaManager, type ReplicaManager } from './replicas/manager.js';
import { detectSandbox, type SandboxCapabilities } from './replicas/sandbox.js';
import { createAsyncWorker } from './runs/async-worker.js';
import { createInvoker, type Invoker } from './runs/invoke.js';
import { createJetStreamRunQueue } from './runs/jetstream-queue.js';
import { createProjectBacklog, type ProjectBacklog } from './runs/project-backlog.js';
import { createRunRecorder, type RunRecorder } from './runs/recorder.js';
import { createStoreRunQueue, type RunQueue } from './runs/run-queue.js';
import { createStreamReplay, type StreamReplay } from './runs/stream-replay.js';
import { createRunTargets, type RunTargets } from './runs/targets.js';
import { createSandboxNetwork } from './sandbox/choose-network.js';
import type { SandboxNetwork } from './sandbox/network.js';
import { secretEnvironment } from './secrets/secrets.js';
import { openStore, type Store } from './store/index.js';
import { createWebhookDeliverer, type WebhookDeliverer } from './webhooks/deliverer.js';

export interface Services {
  config: ServerConfig;
  /** This process as a node of the store: the owner of the work it holds (cluster/node.ts). */
  node: NodeLease;
  /** Records the address the HTTP server listens on, in this node's info (`GET /v2/cluster`). */
  listening(url: string): Promise<void>;
  /** Takes over the work of nodes whose lease ran out (cluster/recovery.ts). */
  recovery: Recovery;
  /** What the first recovery pass at start took over (logged by `ferry serve`). */
  recovered: RecoveryResult;
  dataDir: DataDir;
  store: Store;
  jwtKey: Uint8Array;
  secretsKey: Uint8Array;
  auth: Authenticator;
  artifacts: ArtifactStore;
  /** Build folders shared through the artifacts folder (or the NATS object store), so any process can run any build. */
  buildOutput: BuildOutput;
  /** Tells every process sharing the store about a change (in-process, or PostgreSQL LISTEN/NOTIFY). */
  changes: ChangeFeed;
  buildLog: BuildLog;
  pipeline: BuildPipeline;
  metrics: Metrics;
  logger: Logger;
  /** What isolation replicas get on this machine (bubblewrap, memory cgroup). */
  sandbox: SandboxCapabilities;
  /** Gives every sandbox (replica or build step) a network namespace of its own (sandbox/network.ts). */
  network: SandboxNetwork;
  recorder: RunRecorder;
  replicas: ReplicaManager;
  invoker: Invoker;
  /** Brings the gauges (replicas, queue depth) up to date; called before /metrics is rendered. */
  refreshGauges(): void;
  /** How accepted async runs reach a node that runs them: the store queue, or JetStream (run-queue.ts). */
  asyncWorker: RunQueue;
  /** Each project's async runs queued or running, from the store (FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT). */
  projectBacklog: ProjectBacklog;
  /** Delivers webhook payloads from the durable outbox. */
  webhooks: WebhookDeliverer;
  /** Each app's active build, config and functions, as runs resolve them (cached for a second). */
  runTargets: RunTargets;
  /** What replicas print outside runs, and their lifecycle, per app (in memory). */
  appLog: AppLog;
  /** Streaming runs' events, kept so a reconnect with Last-Event-ID resumes the run (in memory). */
  streams: StreamReplay;
  close(): Promise<void>;
}

export async function createServices(config: ServerConfig, logger: Logger): Promise<Services> {
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openStore({
    dataDir: dataDir.root,
    databaseUrl: config.databaseUrl,
    busyTimeoutMs: config.storeBusyTimeoutMs,
  });
  const keys = prepareKeysDir(config.keysDir);
  const jwtKey = loadOrCreateKey(path.join(keys, 'jwt.key'));
  const secretsKey = loadOrCreateKey(path.join(keys, 'secrets.key'));
  // The node's info is written from its first registration, before the replicas and the async worker exist:
  // their load is read once they do.
  let listenUrl: string | null = null;
  let load: () => ReturnType<typeof describeLoad> | undefined = () => undefined;
  const node = createNodeLease({
    store,
    dataDir: dataDir.root,
    ttlMs: config.leaseMs,
    logger: logger.child({ component: 'cluster' }),
    info: () => ({ version: FERRY_VERSION, role: NODE_ROLE, url: listenUrl, ...load() }),
  });
  await node.start();
  const metrics = createMetrics({ node: node.id, role: NODE_ROLE });
  // With --nats-url, archives and build outputs live in the JetStream object store, not the artifacts folder.
  // Start-up does not wait for NATS: what needs it fails with a coded error (or waits) until it is reached.
  const nats = config.natsUrl
    ? createNatsLink({ url: config.natsUrl, name: node.id, logger: logger.child({ component: 'nats' }) })
    : undefined;
  let artifacts: ArtifactStore;
  let buildOutput: BuildOutput;
  if (nats) {
    const bucket = clusterNames(config.clusterName).artifactsBucket;
    artifacts = await createNatsArtifactStore({
      nc: () => requireNats(nats),
      bucket,
      cacheDir: path.join(dataDir.root, 'archive-cache'),
      logger: logger.child({ component: 'builds' }),
    });
    buildOutput = await createNatsBuildOutput({
      buildsDir: dataDir.builds,
      bucket: lazyArtifactsBucket(() => requireNats(nats), bucket),
      artifacts,
      zipLimits: config.zipLimits,
      logger: logger.child({ component: 'builds' }),
    });
  } else {
    artifacts = createDiskArtifactStore(prepareArtifactsDir(config.artifactsDir));
    buildOutput = await createBuildOutput({
      buildsDir: dataDir.builds,
      artifactsDir: config.artifactsDir,
      artifacts,
      zipLimits: config.zipLimits,
      logger: logger.child({ component: 'builds' }),
    });
  }
  const changes = config.databaseUrl
    ? await createPgChangeFeed({ databaseUrl: config.databaseUrl, logger: logger.child({ component: 'changes' }) })
    : createLocalChangeFeed({ logger: logger.child({ component: 'changes' }) });
  const auth = createAuthenticator({ store, key: jwtKey });
  const buildLog = createBuildLog({ store });
  const runTargets = createRunTargets({ store });
  const recorder = createRunRecorder({ store, logger: logger.child({ component: 'runs' }), owner: node.id });
  const sandbox = await detectSandbox();
  const appLog = createAppLog({ linesPerApp: config.appLogLines });
  const runDir = path.join(dataDir.root, 'run');
  await fs.rm(runDir, { recursive: true, force: true });
  await fs.mkdir(runDir, { recursive: true, mode: 0o711 });
  // Only sandboxed replicas bind their build; the view keeps the data directory's path out of their mountinfo.
  const views = sandbox.bwrap ? await createBuildViews({ buildsDir: dataDir.builds }) : undefined;
  if (views?.reason) logger.warn(views.reason);
  const network = await createSandboxNetwork({
    egress: config.egress,
    sandbox,
    dataDir: dataDir.root,
    runDir,
    logger: logger.child({ component: 'network' }),
  });
  const replicas = createReplicaManager({
    store,
    logger: logger.child({ component: 'replicas' }),
    maxQueue: config.maxQueuePerApp,
    startTimeoutMs: config.replicaStartTimeoutMs,
    launch: createLauncher({
      store,
      buildsDir: dataDir.builds,
      runDir,
      sandbox,
      views,
      network,
      ensureLocal: (buildId) => buildOutput.ensureLocal(buildId),
      secrets: (projectId) => secretEnvironment(store, secretsKey, projectId),
    }),
    onColdStart(build, ms) {
      const labels = { project: build.projectId, app: build.appId };
      metrics.coldStarts.inc(labels);
      metrics.coldStartDuration.observe(labels, ms / 1000);
    },
    onReplicaOutput(build, replicaId, stream, line) {
      appLog.append(build.projectId, build.appId, replicaId, stream, line);
      replicaLogger.info({ project: build.projectId, app: build.appId, replica: replicaId, stream }, line);
    },
  });
  const replicaLogger = logger.child({ component: 'replica-output' });
  const invoker = createInvoker({
    maxStoredResultBytes: config.maxStoredResultBytes,
    replicas,
    recorder,
    logger: logger.child({ component: 'runs' }),
    onFinished(build, state, statusCode, seconds) {
      const labels = { project: build.projectId, app: build.appId };
      metrics.runs.inc({ ...labels, state, status: String(statusCode) });
      metrics.runDuration.observe(labels, seconds);
    },
  });
  const webhooks = createWebhookDeliverer({
    store,
    logger: logger.child({ component: 'webhooks' }),
    secretsKey,
    owner: node.id,
    allow: config.webhookAllow,
    attemptTimeoutMs: config.webhookTimeoutMs,
    onAttempt(verdict, final) {
      metrics.webhookAttempts.inc({ outcome: verdict });
      if (final) metrics.webhookDeliveries.inc({ state: final });
    },
  });
  recorder.onOutbox = () => webhooks.wake();
  webhooks.start();
  // The run queue, chosen once: the store queue, or JetStream with --nats-url. `consume`: whether this node
  // fetches and runs async runs (every node for now; `--role gateway` will turn it off).
  const makeWorker = (hooks?: Partial<Parameters<typeof createAsyncWorker>[0]>) =>
    createAsyncWorker({
      store,
      targets: runTargets,
      invoker,
      recorder,
      logger: logger.child({ component: 'async' }),
      owner: node.id,
      ...hooks,
    });
  const asyncWorker: RunQueue = nats
    ? createJetStreamRunQueue({
        link: nats,
        names: clusterNames(config.clusterName),
        store,
        logger: logger.child({ component: 'async' }),
        owner: node.id,
        consume: true,
        createWorker: makeWorker,
        metrics: {
          published: (via, n) => metrics.asyncPublished.inc({ via }, n),
          publishFailed: (n) => metrics.asyncPublishFailures.inc(n),
          fetched: (outcome, n) => metrics.asyncFetched.inc({ outcome }, n),
        },
      })
    : createStoreRunQueue(makeWorker());
  load = () => describeLoad(replicas.pools(), asyncWorker.backlog);
  const pipeline = createBuildPipeline({
    store,
    buildLog,
    buildsDir: dataDir.builds,
    cacheDir: dataDir.cache,
    builders: createDefaultBuilders(),
    sandbox,
    network,
    limits: config.buildLimits,
    logger: logger.child({ component: 'builds' }),
    owner: node.id,
    output: buildOutput,
    onFinished(build) {
      metrics.builds.inc({ state: build.state });
      if (build.started_at && build.finished_at) {
        const seconds = (Date.parse(build.finished_at) - Date.parse(build.started_at)) / 1000;
        metrics.buildDuration.observe({ state: build.state }, seconds);
      }
      // Every process (this one at once) forgets the app's run target and switches its replicas.
      if (build.state === 'ready') {
        void changes.publish({
          type: 'build.activated',
          projectId: build.project_id,
          appId: build.app_id,
          buildId: build.id,
        });
      }
    },
  });
  const recovery = createRecovery({
    store,
    node,
    logger: logger.child({ component: 'cluster' }),
    onRecovered() {
      webhooks.wake();
      asyncWorker.wake();
    },
    onSwept() {
      // Builds let go by a node that stopped (or taken over from one that died) are built by whoever is free.
      void pipeline.recover().catch((err: unknown) => logger.warn({ err }, 'claiming free builds failed'));
    },
  });
  // Before anything claims work: what a dead node (this data directory's last process included) left.
  const recovered = await recovery.sweep();
  recovery.start();
  applyChanges(changes, { auth, runTargets, replicas, logger: logger.child({ component: 'changes' }) });
  const streams = createStreamReplay({
    keepMs: config.streamReplaySeconds * 1000,
    maxBytesPerRun: config.streamReplayBytes,
    maxTotalBytes: config.streamReplayTotalBytes,
    graceMs: config.streamResumeGraceSeconds * 1000,
  });
  return {
    config,
    node,
    async listening(url) {
      listenUrl = url;
      await node.refresh();
    },
    recovery,
    recovered,
    dataDir,
    store,
    jwtKey,
    secretsKey,
    auth,
    artifacts,
    buildOutput,
    changes,
    buildLog,
    pipeline,
    metrics,
    logger,
    sandbox,
    network,
    recorder,
    replicas,
    invoker,
    asyncWorker,
    projectBacklog: createProjectBacklog({ store, limit: config.maxAsyncBacklogPerProject }),
    webhooks,
    runTargets,
    appLog,
    streams,
    refreshGauges() {
      metrics.replicas.reset();
      metrics.queueDepth.reset();
      metrics.runsInFlight.reset();
      for (const pool of replicas.pools()) {
        const labels = { project: pool.build.projectId, app: pool.build.appId };
        const { starting, ready, inflight, queued } = pool.stats;
        metrics.replicas.inc({ ...labels, state: 'starting' }, starting);
        metrics.replicas.inc({ ...labels, state: 'ready' }, ready);
        metrics.queueDepth.inc(labels, queued);
        metrics.runsInFlight.inc(labels, inflight);
      }
    },
    async close() {
      // First: a change arriving now must not start replicas that are about to be stopped.
      await changes.close();
      // Runs waiting for a reconnect would otherwise hold replicas open through the grace period.
      streams.close();
      await recovery.close();
      await pipeline.close();
      await asyncWorker.close();
      await replicas.close();
      await views?.close();
      await recorder.close();
      await webhooks.close();
      await network.close();
      // Last: ending the lease lets the others take over at once whatever this process still held.
      await node.close();
      await nats?.close();
      await store.destroy();
    },
  };
}
