/**
 * The executor: what runs user code on this node. The sandbox network, the launcher, the warm pool, the
 * replica manager and the local invoker. Built on workers and `all` nodes, never on a gateway, which runs
 * no user code: there, the parts that ask about replicas (scaling, the change feed, retention, the node's
 * load) get `NO_REPLICAS`, and calls go through the cluster link's remote invoker.
 *
 * The sandbox probe and the builds' views are made first (`prepareSandboxViews`), because the build
 * storage (./build-storage.ts) removes a build's view with its folder.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { imagesDir } from '../images/host-tools.js';
import { createImageStore, type ImageStore } from '../images/image-store.js';
import type { RegistryLoginService } from '../images/registry-logins.js';
import { createLauncher } from '../replicas/launcher.js';
import { createReplicaManager, type ReplicaManager } from '../replicas/manager.js';
import { RUN_TIMEOUT_KILL_GRACE_MS } from '../replicas/pool.js';
import { createWarmPool, type WarmPool } from '../replicas/warm-pool.js';
import { createRunTally } from '../run-metrics.js';
import { createInvoker, type LocalInvoker } from '../runs/invoke.js';
import { createSandboxNetwork } from '../sandbox/choose-network.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import { type BuildViews, createBuildViews } from '../sandbox/views.js';
import { secretEnvironment } from '../secrets/secrets.js';
import type { Volumes } from '../volumes/volumes.js';
import type { BuildStorage } from './build-storage.js';
import type { ClusterLink } from './cluster-link.js';
import type { Core } from './core.js';

/** What the rest of a node asks of its replicas (a gateway's answer: there are none). */
export type ReplicaView = Pick<ReplicaManager, 'activate' | 'pools' | 'warmUp' | 'remove' | 'stop' | 'buildsInUse'>;

/** A gateway's replicas: none, and nothing to start, stop or keep warm. */
export const NO_REPLICAS: ReplicaView = {
  activate: async () => undefined,
  pools: () => [],
  warmUp: async () => undefined,
  remove: () => undefined,
  stop: () => undefined,
  buildsInUse: () => new Set<string>(),
};

export interface Executor {
  sandbox: SandboxCapabilities;
  /** Gives every sandbox (replica or build step) a network namespace of its own (sandbox/network.ts). */
  network: SandboxNetwork;
  /** Generic sandboxes waiting for an app (FERRY_WARM_POOL); undefined when off or without bwrap. */
  warmPool: WarmPool | undefined;
  replicas: ReplicaManager;
  /** Runs calls on this node's replicas. */
  invoker: LocalInvoker;
  /**
   * The node's images (`[image]` apps: their builds pull and pin here, their replicas run on them);
   * undefined without bwrap, where image apps fail their build (FERRY_IMAGE_NO_SANDBOX).
   */
  images: ImageStore | undefined;
  /**
   * A server stopping past its grace (cli/shutdown.ts): interrupts the runs in progress here (runs/invoke.ts)
   * and stops every replica now, SIGKILL after RUN_TIMEOUT_KILL_GRACE_MS (a replica already stopping with a
   * longer grace is cut as short). Returns how many runs were interrupted.
   */
  interrupt(): number;
}

/**
 * The builds' views for sandboxed replicas (they keep the data directory's path out of the replicas'
 * mountinfo); undefined without bubblewrap.
 */
export async function prepareSandboxViews(core: Core, sandbox: SandboxCapabilities): Promise<BuildViews | undefined> {
  if (!sandbox.bwrap) return undefined;
  const { logger } = core;
  const views = await createBuildViews({ buildsDir: core.dataDir.builds, othersRead: sandbox.identity !== null });
  if (views.reason) logger.warn(views.reason);
  void views.swept.then((removed) => {
    if (removed > 0) logger.info({ removed }, 'removed the build views folders of Ferry servers that are gone');
  });
  core.onClose(() => views.close());
  return views;
}

export async function createExecutor(
  core: Core,
  parts: {
    sandbox: SandboxCapabilities;
    views: BuildViews | undefined;
    storage: BuildStorage;
    volumes: Volumes;
    link: ClusterLink | undefined;
    /** The projects' registry logins, which the image store's pulls send (each project only its own). */
    registries: Pick<RegistryLoginService, 'credentials'>;
  },
): Promise<Executor> {
  const { config, logger, store, metrics, events, dataDir, secretsKey } = core;
  const { sandbox, views, storage, link } = parts;
  const runDir = path.join(dataDir.root, 'run');
  await fs.rm(runDir, { recursive: true, force: true });
  await fs.mkdir(runDir, { recursive: true, mode: 0o711 });
  const network = await createSandboxNetwork({
    egress: config.egress,
    sandbox,
    dataDir: dataDir.root,
    runDir,
    logger: logger.child({ component: 'network' }),
  });
  core.onClose(() => network.close());
  const ensureLocal = (buildId: string) => storage.buildOutput.ensureLocal(buildId);
  const secrets = (projectId: string) => secretEnvironment(store, secretsKey, projectId);
  const images = sandbox.bwrap
    ? await createImageStore({
        dir: imagesDir(dataDir.root),
        settings: config.images,
        shelf: storage.imageShelf,
        logger: logger.child({ component: 'images' }),
        sandbox,
        logins: parts.registries,
      })
    : undefined;
  core.onClose(() => images?.close());
  const launch = createLauncher({
    images,
    volumes: parts.volumes,
    store,
    buildsDir: dataDir.builds,
    runDir,
    sandbox,
    views,
    network,
    ensureLocal,
    secrets,
  });
  // Without bwrap (plain processes) there is no warm pool: the pool's guarantee is a sandbox that saw nothing
  // before its app, and a plain process starting as today is as good a cold start as that path gets.
  let warmPool: WarmPool | undefined;
  if (config.warmPool > 0) {
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
        ensureLocal,
        secrets,
      });
    }
  }
  // Before the replicas: a claim in progress is stopped too, and no sandbox is started after this.
  core.onClose(() => warmPool?.close());
  const replicaLogger = logger.child({ component: 'replica-output' });
  const replicas = createReplicaManager({
    store,
    logger: logger.child({ component: 'replicas' }),
    maxQueue: config.maxQueuePerApp,
    startTimeoutMs: config.replicaStartTimeoutMs,
    maxReplicas: config.workerMaxReplicas,
    ...(link?.isHome ? { isHome: link.isHome } : {}),
    ...(link?.elsewhere ? { elsewhere: link.elsewhere } : {}),
    // Gateways hear of a replica started or stopped here at once, not at the next announcement.
    onChange: () => events.emit('replicas:changed', {}),
    // A deleted build's folder, kept while its replicas ran, goes.
    onDrained: (buildId) => events.emit('replicas:drained', { buildId }),
    ...(warmPool ? { claimWarm: warmPool.claim } : {}),
    launch,
    onColdStart(build, ms) {
      const labels = { project: build.projectId, app: build.appId };
      metrics.coldStarts.inc(labels);
      metrics.coldStartDuration.observe(labels, ms / 1000);
    },
    onReplicaOutput(build, replicaId, stream, line) {
      core.appLog.append(build.projectId, build.appId, replicaId, stream, line);
      replicaLogger.info({ project: build.projectId, app: build.appId, replica: replicaId, stream }, line);
    },
  });
  core.onClose(() => replicas.close());
  const invoker = createInvoker({
    maxStoredResultBytes: config.maxStoredResultBytes,
    cancelGraceMs: config.cancelGraceSeconds * 1000,
    frameLimits: {
      resultBytes: config.maxResultBytes,
      itemBytes: config.maxStreamItemBytes,
      logLineBytes: config.maxLogLineBytes,
    },
    callerStallMs: config.callerStallSeconds * 1000,
    replicas,
    recorder: core.recorder,
    logger: logger.child({ component: 'runs' }),
    onFinished: createRunTally(metrics),
  });
  const interrupt = () => {
    const runs = invoker.interrupt();
    void replicas
      .close(RUN_TIMEOUT_KILL_GRACE_MS)
      .catch((err: unknown) => logger.warn({ err }, 'stopping replicas after interrupting runs failed'));
    return runs;
  };
  return { sandbox, network, warmPool, replicas, invoker, images, interrupt };
}
