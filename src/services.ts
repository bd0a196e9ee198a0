/**
 * Composes a Ferry process by role from its parts (composition/): the core every role has, the cluster
 * link with `--nats-url`, the executor where user code runs (never on a gateway), and the services the
 * HTTP layer and the worker listener use (runs, builds, apps, schedules…). `ferry serve` and the tests
 * both start from here, so they run the same objects; each part still takes its dependencies explicitly
 * and can be built alone.
 */
import type { Logger } from 'pino';
import type { AppLog } from './apps/app-log.js';
import { type AppService, createAppService } from './apps/app-service.js';
import { createHousekeeping, type Housekeeping } from './apps/housekeeping.js';
import { startRetentionTimers } from './apps/retention-timers.js';
import { type AccountService, createAccountService } from './auth/account-service.js';
import type { Authenticator } from './auth/authenticate.js';
import { createBuildActivation } from './builds/activation.js';
import type { ArtifactStore } from './builds/artifact-store.js';
import type { BuildLog } from './builds/build-log.js';
import type { BuildOutput } from './builds/build-output.js';
import { type BuildService, createBuildService } from './builds/build-service.js';
import { type BuildPipeline, createBuildPipeline } from './builds/pipeline.js';
import { applyChanges } from './cluster/apply-changes.js';
import type { CallerTally } from './cluster/caller-tally.js';
import type { ChangeFeed } from './cluster/change-feed.js';
import type { ClusterAuth } from './cluster/cluster-auth.js';
import { listNodes, type NodeLease, type NodeRow } from './cluster/node.js';
import { describeLoad } from './cluster/node-info.js';
import { createRecovery, type Recovery, type RecoveryResult } from './cluster/recovery.js';
import type { WorkerAnnouncer, WorkerDirectory } from './cluster/workers.js';
import { createBuildStorage } from './composition/build-storage.js';
import { type ClusterLink, createClusterLink } from './composition/cluster-link.js';
import { createCore } from './composition/core.js';
import { createExecutor, NO_REPLICAS, prepareSandboxViews, type ReplicaView } from './composition/executor.js';
import type { NodeRole, ServerConfig } from './config.js';
import type { DataDir } from './data-dir.js';
import type { DiskSpace } from './disk-space.js';
import { FerryError } from './errors.js';
import { createRegistryLogins, type RegistryLoginService } from './images/registry-logins.js';
import type { Metrics } from './metrics.js';
import type { WarmPool } from './replicas/warm-pool.js';
import { refreshGauges } from './run-metrics.js';
import { createAsyncWorker } from './runs/async-worker.js';
import type { Invoker } from './runs/invoke.js';
import { createProjectBacklog, type ProjectBacklog } from './runs/project-backlog.js';
import type { RunRecorder } from './runs/recorder.js';
import { createStoreRunQueue, type RunQueue } from './runs/run-queue.js';
import { createRunService, type RunService } from './runs/run-service.js';
import type { RunWaiters } from './runs/run-waiters.js';
import { createStreamReplay, type StreamReplay } from './runs/stream-replay.js';
import type { RunTargets } from './runs/targets.js';
import { createDefaultBuilders } from './runtimes/index.js';
import { detectSandbox, type SandboxCapabilities } from './sandbox/launch.js';
import { createLoopbackOnlyNetwork, type SandboxNetwork } from './sandbox/network.js';
import { checkScheduleLimits } from './schedules/limits.js';
import { createScheduleService, type ScheduleService } from './schedules/schedule-service.js';
import { createScheduleRunStarter } from './schedules/start-run.js';
import { createScheduleTicker } from './schedules/ticker.js';
import { createSecretService, type SecretService } from './secrets/secret-service.js';
import { probeStore, type Store, type StoreHealth } from './store/index.js';
import { createVolumes, type Volumes } from './volumes/volumes.js';
import type { WebhookDeliverer } from './webhooks/deliverer.js';

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
  /** This node's replicas (composition/executor.ts); none on a gateway (`NO_REPLICAS`). */
  replicas: ReplicaView;
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
  /** A project's registry logins: what its pulls send to private registries (images/registry-logins.ts). */
  registries: RegistryLoginService;
  /** Projects and their service accounts (auth/account-service.ts). */
  accounts: AccountService;
  /** The nodes sharing the store (`GET /v2/cluster`). */
  listNodes(limit: number): Promise<NodeRow[]>;
  /** Whether the store answers within `timeoutMs` (`/healthz`). */
  storeHealth(timeoutMs: number): Promise<StoreHealth>;
  /** The data folder's free space: under FERRY_MIN_FREE_MIB intake closes and `/readyz` says `storage`. */
  space: DiskSpace;
  /** The projects' volumes: rows, their filesystem images and mounts, their files (src/volumes/). */
  volumes: Volumes;
  /** Apps' schedules as the routes use them (src/schedules/). */
  schedules: ScheduleService;
  /**
   * The first step of a shutdown (cli/shutdown.ts): stops starting work other than requests (schedule ticks,
   * async runs: those queued here are let go for any node) and resolves once the async runs in progress here
   * have ended. `close` does the same again at no cost.
   */
  drain(): Promise<void>;
  /**
   * A shutdown past its grace: interrupts every run in progress here and stops the replicas
   * (composition/executor.ts). Returns how many runs were interrupted; 0 on a gateway, which runs none.
   */
  interrupt(): number;
  close(): Promise<void>;
}

export async function createServices(config: ServerConfig, logger: Logger): Promise<Services> {
  // The core every role has (store, lease, recorder, events…), the cluster link with --nats-url, and the
  // executor on the roles that run user code: composed here, each built in its own module (composition/).
  const core = await createCore(config, logger);
  const { store, node, metrics, events, changes, role, dataDir, onClose } = core;
  const link = await createClusterLink(core);
  // A probe of this machine: the executor sandboxes with it, and volumes (whose API every role serves) ask it.
  const sandbox = await detectSandbox();
  const runsCode = role !== 'gateway';
  const views = runsCode ? await prepareSandboxViews(core, sandbox) : undefined;
  const storage = await createBuildStorage(core, link, views);
  const { artifacts, buildOutput } = storage;
  const volumes = await createVolumes({
    store,
    config,
    changes,
    sandboxed: sandbox.bwrap !== null,
    nodeId: node.id,
    logger: logger.child({ component: 'volumes' }),
  });
  onClose(() => volumes.close());
  // Every role serves the logins' routes; the executor's pulls read them from the store.
  const registries = createRegistryLogins({ store, secretsKey: core.secretsKey });
  // A gateway runs no user code: no executor, its calls go to the workers through the cluster link.
  const executor = runsCode
    ? await createExecutor(core, { sandbox, views, storage, volumes, link, registries })
    : undefined;
  const replicas: ReplicaView = executor?.replicas ?? NO_REPLICAS;
  const network = executor?.network ?? createLoopbackOnlyNetwork();
  const invoker: Invoker = executor?.invoker ?? requireLink(link).remoteInvoker();
  // The run queue, chosen once: the store queue, or JetStream with --nats-url. `consume`: whether this node
  // fetches and runs async runs (a gateway only publishes them).
  const makeWorker = (hooks?: Partial<Parameters<typeof createAsyncWorker>[0]>) =>
    createAsyncWorker({
      store,
      targets: core.runTargets,
      invoker,
      recorder: core.recorder,
      logger: logger.child({ component: 'async' }),
      owner: node.id,
      ...hooks,
    });
  const asyncWorker: RunQueue = link
    ? link.runQueue({ consume: runsCode, createWorker: makeWorker })
    : createStoreRunQueue(makeWorker());
  // Once, whoever asks first: a shutdown's drain, then the close (the JetStream queue closes once).
  let queueClosed: Promise<void> | undefined;
  const closeQueue = () => (queueClosed ??= asyncWorker.close());
  onClose(closeQueue);
  core.reportLoad(() => describeLoad(replicas.pools(), asyncWorker.backlog));
  // Only workers take calls from gateways (an `all` node runs its own calls and takes async runs and builds).
  const announcer =
    link && executor && role === 'worker' ? link.announcer({ pools: () => executor.replicas.pools() }) : undefined;
  // How many schedules an app and a project may have: checked at upload and, under the project's lock, when a
  // build becomes active (schedules/limits.ts).
  const scheduleLimits = { perApp: config.maxSchedulesPerApp, perProject: config.maxSchedulesPerProject };
  // The one writer of apps.active_build_id: the pipeline (a build becoming ready) and rollbacks alike.
  const activation = createBuildActivation({
    store,
    changes,
    switchHere: (projectId, appId) => replicas.activate(projectId, appId),
    scheduleLimits,
  });
  // On a gateway the pipeline only queues: the builds it receives stay free for a worker to claim.
  const pipeline = createBuildPipeline({
    store,
    buildLog: core.buildLog,
    activation,
    buildsDir: dataDir.builds,
    cacheDir: dataDir.cache,
    builders: createDefaultBuilders(),
    sandbox,
    network,
    images: executor?.images,
    imageBuildTimeoutMs: config.images.buildTimeoutMs,
    limits: config.buildLimits,
    logger: logger.child({ component: 'builds' }),
    owner: node.id,
    output: buildOutput,
    builds: executor !== undefined,
    onQueued(build) {
      // The processes that build hear of it now rather than at their next sweep.
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
      core.webhooks.wake();
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
    async imageGone(digest) {
      await storage.imageShelf.remove([digest], []);
      await executor?.images?.cache.remove(digest);
      logger.info({ digest }, 'image of deleted builds removed from the image shelf');
    },
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
  // This node's unpacked images that no build uses any more (their builds deleted here or elsewhere) go;
  // one in use by a replica stays until the next look after it stops.
  const sweepImages = () =>
    void executor?.images
      ?.sweep(async (digests) => {
        const rows = await store
          .selectFrom('builds')
          .select('image_digest')
          .where('image_digest', 'in', digests)
          .execute();
        return new Set(rows.map((r) => r.image_digest).filter((d): d is string => d !== null));
      })
      .then((n) => n > 0 && logger.info({ images: n }, 'removed unpacked images no build uses'))
      .catch((err: unknown) => logger.warn({ err }, 'removing unpacked images no build uses failed'));
  events.on('replicas:drained', ({ buildId }) => {
    releaseBuild(buildId);
    sweepImages();
  });
  const sweepLocal = () =>
    void housekeeping
      .sweepLocal()
      .then((bytes) => bytes > 0 && metrics.bytesFreed.inc({ reason: 'deleted' }, bytes))
      .catch((err: unknown) => logger.warn({ err }, 'removing local copies of deleted builds failed'));
  // Stopped first: a change arriving while the rest closes must not start replicas about to be stopped.
  const stopApplying = applyChanges(changes, {
    auth: core.auth,
    runTargets: core.runTargets,
    replicas,
    cancelRun: (runId) => void invoker.cancel(runId),
    deleteApp(projectId, appId) {
      replicas.remove(projectId, appId);
      void asyncWorker
        .forgetApp?.(projectId, appId)
        .catch((err: unknown) => logger.warn({ err, app: appId }, 'dropping the deleted app’s queue failed'));
      sweepLocal();
    },
    stopApp: (projectId, appId, reason) => replicas.stop(projectId, appId, reason),
    // Its copy here goes now, or when the last replica running it stops (onDrained); so does its image.
    buildDeleted(buildId) {
      releaseBuild(buildId);
      sweepImages();
    },
    ...(executor
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
    loggedBytes: () => core.recorder.loggedBytes(),
    metrics,
    settings: config,
    timers: executor !== undefined,
    logger,
  });
  onClose(() => retentionTimers.close());
  const projectBacklog = createProjectBacklog({ store, limit: config.maxAsyncBacklogPerProject });
  const runs = createRunService({
    store,
    recorder: core.recorder,
    runTargets: core.runTargets,
    auth: core.auth,
    invoker,
    runQueue: asyncWorker,
    projectBacklog,
    maxAsyncBacklog: config.maxAsyncBacklog,
    runWaiters: core.runWaiters,
    changes,
    webhooks: core.webhooks,
    cancelWaitMs: (config.cancelGraceSeconds + 10) * 1000,
    secretsKey: core.secretsKey,
    space: core.space,
  });
  // Schedules: every node looks for due ticks (one run per tick whichever looks first, schedules/ticker.ts).
  const ticker = createScheduleTicker({
    db: store,
    starter: createScheduleRunStarter({
      runs,
      // The schedule's build is the app's active one: its runtime comes from the run targets' cache.
      async runtimeOf(projectId, appId, buildId) {
        const target = await core.runTargets.get(projectId, appId);
        if (target?.buildId === buildId) return target.runtime === 'custom' ? 'custom' : 'cortex';
        const row = await store.selectFrom('builds').select('runtime').where('id', '=', buildId).executeTakeFirst();
        return row?.runtime === 'custom' ? 'custom' : 'cortex';
      },
    }),
    log: logger.child({ component: 'schedules' }),
    metrics,
  });
  ticker.start();
  onClose(() => ticker.close());
  const schedules = createScheduleService({ store, ticker, space: core.space });
  const builds = createBuildService({
    store,
    activation,
    pipeline,
    artifacts,
    buildLog: core.buildLog,
    housekeeping,
    space: core.space,
    upload: {
      tmpDir: dataDir.tmp,
      buildsDir: dataDir.builds,
      maxUploadBytes: config.maxUploadBytes,
      zipLimits: config.zipLimits,
      checkVolumes: (projectId, appConfig) => volumes.checkMounts(projectId, appConfig),
      checkSchedules: (projectId, appId, appConfig) =>
        checkScheduleLimits(store, { projectId, appId }, appConfig.schedules.length, scheduleLimits, { lock: false }),
      // A gateway builds nothing: the build stays free for a worker to claim.
      ...(executor ? { owner: node.id } : {}),
    },
  });
  const apps = createAppService({
    store,
    changes,
    replicas,
    housekeeping,
    wakeWebhooks: () => core.webhooks.wake(),
    appLog: core.appLog,
  });
  return {
    runs,
    builds,
    apps,
    secrets: createSecretService({ store, secretsKey: core.secretsKey, changes }),
    registries,
    accounts: createAccountService({ store, jwtKey: core.jwtKey, changes }),
    listNodes: (limit) => listNodes(store, limit),
    storeHealth: (timeoutMs) => probeStore(store, timeoutMs),
    space: core.space,
    housekeeping,
    retention: retentionTimers.retention,
    config,
    role,
    clusterAuth: core.clusterAuth,
    callers: core.callers,
    runWaiters: core.runWaiters,
    workers: link?.workers,
    announcer,
    node,
    async listening(url) {
      core.setListenUrl(url);
      await node.refresh();
      if (announcer && link) {
        await announcer.start();
        // The app's home worker keeps its min_replicas: when workers come or go, or one fills up or gets
        // room (placement.ts homeOf), homes move.
        let members = '';
        const homeTimer = setInterval(() => {
          const now = link.workers
            .live()
            .map((w) => `${w.id}${w.load.capacity > 0 && w.load.replicas >= w.load.capacity ? ':full' : ''}`)
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
    jwtKey: core.jwtKey,
    secretsKey: core.secretsKey,
    auth: core.auth,
    artifacts,
    buildOutput,
    changes,
    buildLog: core.buildLog,
    pipeline,
    metrics,
    logger,
    sandbox,
    network,
    recorder: core.recorder,
    replicas,
    warmPool: executor?.warmPool,
    invoker,
    asyncWorker,
    projectBacklog,
    webhooks: core.webhooks,
    runTargets: core.runTargets,
    appLog: core.appLog,
    streams,
    volumes,
    schedules,
    refreshGauges: () => refreshGauges(metrics, replicas.pools(), executor?.warmPool?.stats()),
    async drain() {
      await ticker.close();
      await closeQueue();
    },
    interrupt: () => executor?.interrupt() ?? 0,
    close: () => core.close(),
  };
}

function requireLink(link: ClusterLink | undefined): ClusterLink {
  // config.ts refuses --role gateway without --nats-url; this only guards the type.
  if (!link) throw new FerryError('FERRY_INTERNAL', 'A gateway needs the cluster link (--nats-url)');
  return link;
}
