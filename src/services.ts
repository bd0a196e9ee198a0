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
import { type AppService, createAppService } from './apps/app-service.js';
import { createHousekeeping, type Housekeeping } from './apps/housekeeping.js';
import { startRetentionTimers } from './apps/retention-timers.js';
import { type AccountService, createAccountService } from './auth/account-service.js';
import { type Authenticator, createAuthenticator } from './auth/authenticate.js';
import { createBuildActivation } from './builds/activation.js';
import { type ArtifactStore, createDiskArtifactStore } from './builds/artifact-store.js';
import { type BuildLog, createBuildLog } from './builds/build-log.js';
import { type BuildOutput, createBuildOutput } from './builds/build-output.js';
import { type BuildService, createBuildService } from './builds/build-service.js';
import { createNatsArtifactStore, lazyArtifactsBucket } from './builds/nats-artifact-store.js';
import { createNatsBuildOutput } from './builds/nats-build-output.js';
import { type BuildPipeline, createBuildPipeline } from './builds/pipeline.js';
import { applyChanges } from './cluster/apply-changes.js';
import { type CallerTally, createCallerTally } from './cluster/caller-tally.js';
import { type ChangeFeed, createLocalChangeFeed } from './cluster/change-feed.js';
import { CLUSTER_KEY_FILE, type ClusterAuth, createClusterAuth } from './cluster/cluster-auth.js';
import { createFinishedRelay } from './cluster/finished-relay.js';
import { clusterNames, createNatsLink, requireNats } from './cluster/nats.js';
import { createNodeLease, listNodes, type NodeLease, type NodeRow } from './cluster/node.js';
import { describeLoad, FERRY_VERSION } from './cluster/node-info.js';
import { createPgChangeFeed } from './cluster/pg-change-feed.js';
import { rankWorkers } from './cluster/placement.js';
import { createRecovery, type Recovery, type RecoveryResult } from './cluster/recovery.js';
import { workerLoad } from './cluster/worker-load.js';
import {
  createWorkerAnnouncer,
  createWorkerDirectory,
  type WorkerAnnouncer,
  type WorkerDirectory,
} from './cluster/workers.js';
import type { NodeRole, ServerConfig } from './config.js';
import { type DataDir, loadOrCreateKey, prepareArtifactsDir, prepareDataDir, prepareKeysDir } from './data-dir.js';
import { FerryError } from './errors.js';
import { createEventBus } from './events.js';
import { imagesDir } from './images/host-tools.js';
import { createImageStore } from './images/image-store.js';
import { createMetrics, type Metrics } from './metrics.js';
import { createLauncher } from './replicas/launcher.js';
import { createReplicaManager, type ReplicaManager } from './replicas/manager.js';
import { createWarmPool, type WarmPool } from './replicas/warm-pool.js';
import { createRunTally, refreshGauges } from './run-metrics.js';
import { createAsyncWorker } from './runs/async-worker.js';
import { createInvoker, type Invoker } from './runs/invoke.js';
import { createJetStreamRunQueue } from './runs/jetstream-queue.js';
import { createProjectBacklog, type ProjectBacklog } from './runs/project-backlog.js';
import { createRunRecorder, type RunRecorder } from './runs/recorder.js';
import { createRemoteInvoker } from './runs/remote-invoker.js';
import { createStoreRunQueue, type RunQueue } from './runs/run-queue.js';
import { createRunService, type RunService } from './runs/run-service.js';
import { createRunWaiters, type RunWaiters } from './runs/run-waiters.js';
import { createStreamReplay, type StreamReplay } from './runs/stream-replay.js';
import { createRunTargets, type RunTargets } from './runs/targets.js';
import { createDefaultBuilders } from './runtimes/index.js';
import { createSandboxNetwork } from './sandbox/choose-network.js';
import { detectSandbox, type SandboxCapabilities } from './sandbox/launch.js';
import { createLoopbackOnlyNetwork, type SandboxNetwork } from './sandbox/network.js';
import { createBuildViews } from './sandbox/views.js';
import { createScheduleService, type ScheduleService } from './schedules/schedule-service.js';
import { createScheduleRunStarter } from './schedules/start-run.js';
import { createScheduleTicker } from './schedules/ticker.js';
import { createSecretService, type SecretService } from './secrets/secret-service.js';
import { secretEnvironment } from './secrets/secrets.js';
import { openStore, probeStore, type Store, type StoreHealth } from './store/index.js';
import { createVolumes, type Volumes } from './volumes/volumes.js';
import { createWebhookDeliverer, type WebhookDeliverer } from './webhooks/deliverer.js';

export interface Services {
  config: ServerConfig;
  /** `--role`: gateway (public interface, no user code), worker (builds, replicas, internal listener) or all. */
  role: NodeRole;
  /** Signs and checks calls between the nodes of a cluster (`cluster.key` in the keys directory). */
  clusterAuth: ClusterAuth;
  /** Calls from gateways in flight here, per app and gateway (a worker announces them with its load). */
  callers: CallerTally;
  /** The live workers of the cluster (with --nats-url): where a gateway sends calls. */
  workers: WorkerDirectory | undefined;
  /** This node's announcement as a worker (worker, or all with --nats-url). */
  announcer: WorkerAnnouncer | undefined;
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
  /** Callers waiting for runs to end (`GET .../runs/{run_id}?wait=N`). */
  runWaiters: RunWaiters;
  replicas: ReplicaManager;
  /** Generic sandboxes waiting for an app (FERRY_WARM_POOL); undefined when off, on a gateway, or without bwrap. */
  warmPool: WarmPool | undefined;
  invoker: Invoker;
  /** Brings the gauges (replicas, queue depth) up to date; called before /metrics is rendered. */
  refreshGauges(): void;
  /** Deleting apps and builds, and retention (apps/housekeeping.ts). */
  housekeeping: Housekeeping;
  /** Runs one retention pass now (the timer runs one every FERRY_RETENTION_INTERVAL_SECONDS). */
  retention(): Promise<void>;
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
  /** Runs as the run endpoint and the runs routes use them (runs/run-service.ts). */
  runs: RunService;
  /** Builds as the builds routes use them; activation goes through the one writer (builds/activation.ts). */
  builds: BuildService;
  /** Apps as the apps and stats routes use them: reads, scaling, deletion (apps/app-service.ts). */
  apps: AppService;
  /** A project's secrets (secrets/secret-service.ts). */
  secrets: SecretService;
  /** Projects and their service accounts (auth/account-service.ts). */
  accounts: AccountService;
  /** The nodes sharing the store (`GET /v2/cluster`). */
  listNodes(limit: number): Promise<NodeRow[]>;
  /** Whether the store answers within `timeoutMs` (`/healthz`). */
  storeHealth(timeoutMs: number): Promise<StoreHealth>;
  /** The projects' volumes: rows, their filesystem images and mounts, their files (src/volumes/). */
  volumes: Volumes;
  /** Apps' schedules as the routes use them (src/schedules/). */
  schedules: ScheduleService;
  close(): Promise<void>;
}

export async function createServices(config: ServerConfig, logger: Logger): Promise<Services> {
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openStore({
    dataDir: dataDir.root,
    databaseUrl: config.databaseUrl,
    busyTimeoutMs: config.storeBusyTimeoutMs,
  });
  // Each part's close, pushed as the part is built: close() runs them in reverse, so nothing is closed while
  // a part built after it (and using it) is still open.
  const closers: Array<() => unknown> = [];
  const onClose = (close: () => unknown) => void closers.push(close);
  onClose(() => store.destroy());
  const keys = prepareKeysDir(config.keysDir);
  const jwtKey = loadOrCreateKey(path.join(keys, 'jwt.key'));
  const secretsKey = loadOrCreateKey(path.join(keys, 'secrets.key'));
  const clusterKey = loadOrCreateKey(path.join(keys, CLUSTER_KEY_FILE));
  const role = config.role;
  // A gateway runs no user code: no replicas, no builds, no async runs; a worker serves no public interface.
  const runsCode = role !== 'gateway';
  const startedAt = new Date().toISOString();
  // The node's info is written from its first registration, before the replicas and the async worker exist:
  // their load is read once they do.
  let listenUrl: string | null = null;
  let load: () => ReturnType<typeof describeLoad> | undefined = () => undefined;
  const node = createNodeLease({
    store,
    dataDir: dataDir.root,
    ttlMs: config.leaseMs,
    logger: logger.child({ component: 'cluster' }),
    info: () => ({ version: FERRY_VERSION, role, url: listenUrl, ...load() }),
  });
  await node.start();
  // Ending the lease lets the others take over at once whatever this process still held.
  onClose(() => node.close());
  const metrics = createMetrics({ node: node.id, role });
  // What happened, told to whoever reacts (events.ts): no part is handed a callback after it was built.
  const events = createEventBus(logger.child({ component: 'events' }));
  const clusterAuth = createClusterAuth({ key: clusterKey, nodeId: node.id });
  // With --nats-url, archives and build outputs live in the JetStream object store, not the artifacts folder.
  // Start-up does not wait for NATS: what needs it fails with a coded error (or waits) until it is reached.
  const nats = config.natsUrl
    ? createNatsLink({ url: config.natsUrl, name: node.id, logger: logger.child({ component: 'nats' }) })
    : undefined;
  onClose(() => nats?.close());
  const sandbox = await detectSandbox();
  // Only sandboxed replicas bind their build; the view keeps the data directory's path out of their mountinfo.
  // Made before the build output, which removes a build's view with its folder (local-build-cache.ts).
  const views =
    sandbox.bwrap && runsCode
      ? await createBuildViews({ buildsDir: dataDir.builds, othersRead: sandbox.identity !== null })
      : undefined;
  if (views?.reason) logger.warn(views.reason);
  void views?.swept.then((removed) => {
    if (removed > 0) logger.info({ removed }, 'removed the build views folders of Ferry servers that are gone');
  });
  onClose(() => views?.close());
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
      views,
      logger: logger.child({ component: 'builds' }),
    });
  } else {
    artifacts = createDiskArtifactStore(prepareArtifactsDir(config.artifactsDir));
    buildOutput = await createBuildOutput({
      buildsDir: dataDir.builds,
      artifactsDir: config.artifactsDir,
      artifacts,
      zipLimits: config.zipLimits,
      views,
      logger: logger.child({ component: 'builds' }),
    });
  }
  const changes = config.databaseUrl
    ? await createPgChangeFeed({ databaseUrl: config.databaseUrl, logger: logger.child({ component: 'changes' }) })
    : createLocalChangeFeed({ logger: logger.child({ component: 'changes' }) });
  onClose(() => changes.close());
  const auth = createAuthenticator({ store, key: jwtKey });
  const buildLog = createBuildLog({ store, maxBytes: config.buildLogBytes });
  const runTargets = createRunTargets({ store });
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
  // After the recorder's last flush (closed before this): what it queued is still woken for.
  onClose(() => webhooks.close());
  const recorder = createRunRecorder({
    store,
    logger: logger.child({ component: 'runs' }),
    owner: node.id,
    limits: { maxRunLogBytes: config.runLogBytes },
    onLateResults: (n) => metrics.lateResultsDiscarded.inc(n),
    onOutbox: () => events.emit('runs:outbox', {}),
    onFinished: (runIds) => events.emit('runs:finished', { runIds }),
  });
  onClose(() => recorder.close());
  const names = clusterNames(config.clusterName);
  // Every node of a cluster knows the live workers: gateways to place calls, workers to know which apps
  // they are home to (min_replicas counts for the whole cluster).
  const workers = nats
    ? createWorkerDirectory({
        nats,
        bucket: names.nodesBucket,
        logger: logger.child({ component: 'workers' }),
      })
    : undefined;
  await workers?.start();
  onClose(() => workers?.close());
  // A gateway is home to no app: it keeps no min_replicas (it runs no replica at all).
  const isHome =
    role === 'gateway'
      ? (): boolean => false
      : workers && role === 'worker'
        ? (projectId: string, appId: string): boolean => {
            const live = workers.live();
            if (live.length === 0) return true;
            return rankWorkers(`${projectId}/${appId}`, live)[0]?.id === node.id;
          }
        : undefined;
  const callers = createCallerTally();
  // Replicas of an app on the other live workers: max_replicas bounds the whole cluster.
  const elsewhere =
    workers && role === 'worker'
      ? (projectId: string, appId: string): number => {
          const key = `${projectId}/${appId}`;
          let n = 0;
          for (const w of workers.live()) if (w.id !== node.id) n += w.load.apps[key]?.replicas ?? 0;
          return n;
        }
      : undefined;
  const appLog = createAppLog({ linesPerApp: config.appLogLines });
  const runDir = path.join(dataDir.root, 'run');
  await fs.rm(runDir, { recursive: true, force: true });
  await fs.mkdir(runDir, { recursive: true, mode: 0o711 });
  const network = runsCode
    ? await createSandboxNetwork({
        egress: config.egress,
        sandbox,
        dataDir: dataDir.root,
        runDir,
        logger: logger.child({ component: 'network' }),
      })
    : createLoopbackOnlyNetwork();
  onClose(() => network.close());
  const volumes = await createVolumes({
    store,
    config,
    sandboxed: sandbox.bwrap !== null,
    nodeId: node.id,
    logger: logger.child({ component: 'volumes' }),
  });
  onClose(() => volumes.close());
  // Images ([image] in ferry.toml) run only sandboxed; without bwrap their builds fail (FERRY_IMAGE_NO_SANDBOX).
  const images =
    runsCode && sandbox.bwrap
      ? await createImageStore({ dir: imagesDir(dataDir.root), settings: config.images })
      : undefined;
  onClose(() => images?.cache.close());
  const launch = createLauncher({
    images,
    volumes,
    store,
    buildsDir: dataDir.builds,
    runDir,
    sandbox,
    views,
    network,
    ensureLocal: (buildId) => buildOutput.ensureLocal(buildId),
    secrets: (projectId) => secretEnvironment(store, secretsKey, projectId),
  });
  // A gateway runs no user code, so it keeps no warm sandboxes. Without bwrap (plain processes) there is
  // none either: the pool's guarantee is a sandbox that saw nothing before its app, and a plain process
  // starting as today is as good a cold start as that path gets.
  let warmPool: WarmPool | undefined;
  if (runsCode && config.warmPool > 0) {
    if (!sandbox.bwrap || !views || views.reason) {
      logger.info(
        `warm pool off (FERRY_WARM_POOL=${config.warmPool}): ${!sandbox.bwrap ? 'replicas are not sandboxed' : 'no views folder on the builds’ filesystem'}; replicas start cold`,
      );
    } else {
      warmPool = createWarmPool({
        size: config.warmPool,
        store,
        sandbox,
        views,
        network,
        startTimeoutMs: config.replicaStartTimeoutMs,
        logger: logger.child({ component: 'warm-pool' }),
        ensureLocal: (buildId) => buildOutput.ensureLocal(buildId),
        secrets: (projectId) => secretEnvironment(store, secretsKey, projectId),
      });
    }
  }
  // Before the replicas: a claim in progress is stopped too, and no sandbox is started after this.
  onClose(() => warmPool?.close());
  const replicas = createReplicaManager({
    store,
    logger: logger.child({ component: 'replicas' }),
    maxQueue: config.maxQueuePerApp,
    startTimeoutMs: config.replicaStartTimeoutMs,
    maxReplicas: config.workerMaxReplicas,
    ...(isHome ? { isHome } : {}),
    ...(elsewhere ? { elsewhere } : {}),
    // Gateways hear of a replica started or stopped here at once, not at the next announcement.
    onChange: () => events.emit('replicas:changed', {}),
    // A deleted build's folder, kept while its replicas ran, goes.
    onDrained: (buildId) => events.emit('replicas:drained', { buildId }),
    ...(warmPool ? { claimWarm: warmPool.claim } : {}),
    launch: runsCode
      ? launch
      : async () => {
          throw new FerryError('FERRY_INTERNAL', 'A gateway runs no user code');
        },
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
  onClose(() => replicas.close());
  const localInvoker = createInvoker({
    maxStoredResultBytes: config.maxStoredResultBytes,
    cancelGraceMs: config.cancelGraceSeconds * 1000,
    frameLimits: {
      resultBytes: config.maxResultBytes,
      itemBytes: config.maxStreamItemBytes,
      logLineBytes: config.maxLogLineBytes,
    },
    callerStallMs: config.callerStallSeconds * 1000,
    replicas,
    recorder,
    logger: logger.child({ component: 'runs' }),
    onFinished: createRunTally(metrics),
  });
  const remote =
    role === 'gateway' && workers
      ? createRemoteInvoker({
          directory: workers,
          auth: clusterAuth,
          nodeId: node.id,
          logger: logger.child({ component: 'gateway' }),
          callerStallMs: config.callerStallSeconds * 1000,
        })
      : undefined;
  onClose(() => remote?.close());
  const invoker: Invoker = remote ?? localInvoker;
  events.on('runs:outbox', () => webhooks.wake());
  // Callers waiting for runs to end: woken by this node's commits, by other nodes' (NATS), and a shared check.
  const runWaiters = createRunWaiters({ store, logger: logger.child({ component: 'runs' }) });
  onClose(() => runWaiters.close());
  const finishedRelay = nats
    ? createFinishedRelay({
        nats,
        subject: clusterNames(config.clusterName).finishedSubject,
        heard: (runIds) => runWaiters.finished(runIds),
        logger,
      })
    : undefined;
  events.on('runs:finished', ({ runIds }) => {
    runWaiters.finished(runIds);
    finishedRelay?.publish(runIds);
  });
  webhooks.start();
  // The run queue, chosen once: the store queue, or JetStream with --nats-url. `consume`: whether this node
  // fetches and runs async runs (a gateway only publishes them).
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
        consume: runsCode,
        createWorker: makeWorker,
        metrics: {
          published: (via, n) => metrics.asyncPublished.inc({ via }, n),
          publishFailed: (n) => metrics.asyncPublishFailures.inc(n),
          fetched: (outcome, n) => metrics.asyncFetched.inc({ outcome }, n),
        },
      })
    : createStoreRunQueue(makeWorker());
  onClose(() => asyncWorker.close());
  load = () => describeLoad(replicas.pools(), asyncWorker.backlog);
  // Only workers take calls from gateways (an `all` node runs its own calls and takes async runs and builds).
  const announcer =
    nats && role === 'worker'
      ? createWorkerAnnouncer({
          nats,
          bucket: names.nodesBucket,
          logger: logger.child({ component: 'workers' }),
          describe: () => ({
            id: node.id,
            url: config.advertiseUrl ?? listenUrl ?? '',
            role: 'worker',
            version: FERRY_VERSION,
            startedAt,
            load: workerLoad(replicas.pools(), config.workerMaxReplicas, elsewhere, callers),
          }),
        })
      : undefined;
  events.on('replicas:changed', () => announcer?.announceNow());
  // Gateways stop sending new calls here at once; calls in flight finish (the HTTP server closed first).
  onClose(() => announcer?.close());
  // The one writer of apps.active_build_id: the pipeline (a build becoming ready) and rollbacks alike.
  const activation = createBuildActivation({
    store,
    changes,
    switchHere: (projectId, appId) => replicas.activate(projectId, appId),
  });
  const pipeline = createBuildPipeline({
    store,
    buildLog,
    activation,
    buildsDir: dataDir.builds,
    cacheDir: dataDir.cache,
    builders: createDefaultBuilders(),
    sandbox,
    network,
    images,
    imageBuildTimeoutMs: config.images.buildTimeoutMs,
    limits: config.buildLimits,
    logger: logger.child({ component: 'builds' }),
    owner: node.id,
    output: buildOutput,
    builds: runsCode,
    onQueued(build) {
      // A gateway builds nothing: the processes that build hear of it now rather than at their next sweep.
      void changes.publish({
        type: 'build.queued',
        projectId: build.project_id,
        appId: build.app_id,
        buildId: build.id,
      });
    },
    onFinished(build) {
      metrics.builds.inc({ state: build.state });
      if (build.started_at && build.finished_at) {
        const seconds = (Date.parse(build.finished_at) - Date.parse(build.started_at)) / 1000;
        metrics.buildDuration.observe({ state: build.state }, seconds);
      }
    },
  });
  onClose(() => pipeline.close());
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
  onClose(() => recovery.close());
  const housekeeping = createHousekeeping({
    store,
    artifacts,
    buildOutput,
    changes,
    buildsDir: dataDir.builds,
    buildsInUse: () => replicas.buildsInUse(),
    cancelBuild: (projectId, appId, buildId) => pipeline.cancel(projectId, appId, buildId),
    logger: logger.child({ component: 'housekeeping' }),
    onRemoved({ builds = 0, runs = 0, bytes = 0 }) {
      if (builds > 0) metrics.buildsDeleted.inc({ reason: 'deleted' }, builds);
      if (runs > 0) metrics.runsDeleted.inc({ reason: 'deleted' }, runs);
      if (bytes > 0) metrics.bytesFreed.inc({ reason: 'deleted' }, bytes);
    },
  });
  const releaseBuild = (buildId: string) =>
    void housekeeping
      .released(buildId)
      .then((bytes) => bytes > 0 && metrics.bytesFreed.inc({ reason: 'deleted' }, bytes))
      .catch((err: unknown) => logger.warn({ err }, 'removing a deleted build’s folder failed'));
  events.on('replicas:drained', ({ buildId }) => releaseBuild(buildId));
  const sweepLocal = () =>
    void housekeeping
      .sweepLocal()
      .then((bytes) => bytes > 0 && metrics.bytesFreed.inc({ reason: 'deleted' }, bytes))
      .catch((err: unknown) => logger.warn({ err }, 'removing local copies of deleted builds failed'));
  // Stopped first: a change arriving while the rest closes must not start replicas about to be stopped.
  const stopApplying = applyChanges(changes, {
    auth,
    runTargets,
    replicas,
    cancelRun: (runId) => void invoker.cancel(runId),
    deleteApp(projectId, appId) {
      replicas.remove(projectId, appId);
      void asyncWorker
        .forgetApp?.(projectId, appId)
        .catch((err: unknown) => logger.warn({ err, app: appId }, 'dropping the deleted app’s queue failed'));
      sweepLocal();
    },
    // Its copy here goes now, or when the last replica running it stops (onDrained).
    buildDeleted: (buildId) => releaseBuild(buildId),
    ...(runsCode
      ? {
          claimBuilds: () =>
            void pipeline.recover().catch((err: unknown) => logger.warn({ err }, 'claiming free builds failed')),
        }
      : {}),
    logger: logger.child({ component: 'changes' }),
  });
  onClose(stopApplying);
  const streams = createStreamReplay({
    keepMs: config.streamReplaySeconds * 1000,
    maxBytesPerRun: config.streamReplayBytes,
    maxTotalBytes: config.streamReplayTotalBytes,
    graceMs: config.streamResumeGraceSeconds * 1000,
  });
  // Runs waiting for a reconnect would otherwise hold replicas open through the grace period.
  onClose(() => streams.close());
  // Retention: every process that keeps builds (not a gateway) runs a bounded pass now and then.
  const retentionTimers = startRetentionTimers({
    housekeeping,
    loggedBytes: () => recorder.loggedBytes(),
    metrics,
    settings: config,
    timers: role !== 'gateway',
    logger,
  });
  onClose(() => retentionTimers.close());
  const projectBacklog = createProjectBacklog({ store, limit: config.maxAsyncBacklogPerProject });
  const runs = createRunService({
    store,
    recorder,
    runTargets,
    auth,
    invoker,
    runQueue: asyncWorker,
    projectBacklog,
    maxAsyncBacklog: config.maxAsyncBacklog,
    runWaiters,
    changes,
    webhooks,
    cancelWaitMs: (config.cancelGraceSeconds + 10) * 1000,
    secretsKey,
  });
  // Schedules: every node looks for due ticks (one run per tick whichever looks first, schedules/ticker.ts).
  const ticker = createScheduleTicker({
    db: store,
    starter: createScheduleRunStarter({
      insertNow: (row) => recorder.insertNow(row),
      ownerFor: (projectId, appId) => asyncWorker.ownerFor(projectId, appId),
      accepted: (run, owner) => asyncWorker.accepted(run, owner),
      admit: async (projectId) =>
        asyncWorker.backlog < config.maxAsyncBacklog && (await projectBacklog.admit(projectId)),
      async runtimeOf(buildId) {
        const row = await store.selectFrom('builds').select('runtime').where('id', '=', buildId).executeTakeFirst();
        return row?.runtime === 'custom' ? 'custom' : 'cortex';
      },
    }),
    log: logger.child({ component: 'schedules' }),
    metrics,
  });
  ticker.start();
  onClose(() => ticker.close());
  const schedules = createScheduleService({ store, ticker });
  const builds = createBuildService({
    store,
    activation,
    pipeline,
    artifacts,
    buildLog,
    housekeeping,
    upload: {
      tmpDir: dataDir.tmp,
      buildsDir: dataDir.builds,
      maxUploadBytes: config.maxUploadBytes,
      zipLimits: config.zipLimits,
      checkVolumes: (projectId, appConfig) => volumes.checkMounts(projectId, appConfig),
      // A gateway builds nothing: the build stays free for a worker to claim.
      ...(role === 'gateway' ? {} : { owner: node.id }),
    },
  });
  const apps = createAppService({
    store,
    changes,
    replicas,
    housekeeping,
    wakeWebhooks: () => webhooks.wake(),
    appLog,
  });
  return {
    runs,
    builds,
    apps,
    secrets: createSecretService({ store, secretsKey, changes }),
    accounts: createAccountService({ store, jwtKey, changes }),
    listNodes: (limit) => listNodes(store, limit),
    storeHealth: (timeoutMs) => probeStore(store, timeoutMs),
    housekeeping,
    retention: retentionTimers.retention,
    config,
    role,
    clusterAuth,
    callers,
    runWaiters,
    workers,
    announcer,
    node,
    async listening(url) {
      listenUrl = url;
      await node.refresh();
      if (announcer && workers) {
        await announcer.start();
        // The app's home worker keeps its min_replicas: when workers come or go, homes move.
        let members = '';
        const homeTimer = setInterval(() => {
          const now = workers
            .live()
            .map((w) => w.id)
            .sort()
            .join(',');
          if (now === members) return;
          members = now;
          void replicas.warmUp().catch((err: unknown) => logger.warn({ err }, 'keeping min_replicas failed'));
        }, 2000);
        homeTimer.unref();
        onClose(() => clearInterval(homeTimer));
      }
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
    warmPool,
    invoker,
    asyncWorker,
    projectBacklog,
    webhooks,
    runTargets,
    appLog,
    streams,
    volumes,
    schedules,
    refreshGauges: () => refreshGauges(metrics, replicas.pools(), warmPool?.stats()),
    async close() {
      // In reverse order of construction (the HTTP server closed first, by its owner).
      for (let close = closers.pop(); close; close = closers.pop()) await close();
    },
  };
}
