/**
 * The core of every Ferry process, whatever its role: the data directory and keys, the store and this
 * process's lease on it, metrics, the event bus, the change feed, and the parts that record and announce
 * runs (recorder, webhook outbox, callers waiting for runs). Nothing here runs user code or talks to NATS:
 * the executor (./executor.ts) and the cluster link (./cluster-link.ts) are built on top of it, and
 * services.ts composes the three by role.
 *
 * Each part's close is registered as the part is built (`onClose`); `close()` runs them in reverse, so
 * nothing is closed while a part built after it (and using it) is still open.
 */
import path from 'node:path';
import type { Logger } from 'pino';
import { type AppLog, createAppLog } from '../apps/app-log.js';
import { type Authenticator, createAuthenticator } from '../auth/authenticate.js';
import { type BuildLog, createBuildLog } from '../builds/build-log.js';
import { type CallerTally, createCallerTally } from '../cluster/caller-tally.js';
import { type ChangeFeed, createLocalChangeFeed } from '../cluster/change-feed.js';
import { CLUSTER_KEY_FILE, type ClusterAuth, createClusterAuth } from '../cluster/cluster-auth.js';
import { createNodeLease, type NodeLease } from '../cluster/node.js';
import { type describeLoad, FERRY_VERSION } from '../cluster/node-info.js';
import { createPgChangeFeed } from '../cluster/pg-change-feed.js';
import type { NodeRole, ServerConfig } from '../config.js';
import { type DataDir, loadOrCreateKey, prepareDataDir, prepareKeysDir } from '../data-dir.js';
import { createDiskSpace, type DiskSpace } from '../disk-space.js';
import { createEventBus, type EventBus } from '../events.js';
import { createMetrics, type Metrics } from '../metrics.js';
import { createRunRecorder, type RunRecorder } from '../runs/recorder.js';
import { createRunWaiters, type RunWaiters } from '../runs/run-waiters.js';
import { createRunTargets, type RunTargets } from '../runs/targets.js';
import { openStore, type Store } from '../store/index.js';
import { createWebhookDeliverer, type WebhookDeliverer } from '../webhooks/deliverer.js';

export interface Core {
  config: ServerConfig;
  logger: Logger;
  role: NodeRole;
  dataDir: DataDir;
  /** The data folder's free space, looked at every second: under FERRY_MIN_FREE_MIB intake closes (disk-space.ts). */
  space: DiskSpace;
  store: Store;
  jwtKey: Uint8Array;
  secretsKey: Uint8Array;
  /** Signs and checks calls between the nodes of a cluster (`cluster.key` in the keys directory). */
  clusterAuth: ClusterAuth;
  /** This process as a node of the store: the owner of the work it holds (cluster/node.ts). */
  node: NodeLease;
  startedAt: string;
  metrics: Metrics;
  /** What happened, told to whoever reacts (events.ts). */
  events: EventBus;
  /** Tells every process sharing the store about a change (in-process, or PostgreSQL LISTEN/NOTIFY). */
  changes: ChangeFeed;
  auth: Authenticator;
  buildLog: BuildLog;
  /** Each app's active build, config and functions, as runs resolve them (cached for a second). */
  runTargets: RunTargets;
  /** What replicas print outside runs, and their lifecycle, per app (in memory). */
  appLog: AppLog;
  /** Calls from gateways in flight here, per app and gateway (a worker announces them with its load). */
  callers: CallerTally;
  webhooks: WebhookDeliverer;
  recorder: RunRecorder;
  /** Callers waiting for runs to end (`GET .../runs/{run_id}?wait=N`). */
  runWaiters: RunWaiters;
  /** The address the public (or internal) server listens on, once it does. */
  listenUrl(): string | null;
  setListenUrl(url: string): void;
  /** What the node's info reports as its load (replicas, backlog): set once the parts that know exist. */
  reportLoad(load: () => ReturnType<typeof describeLoad>): void;
  /** Registers a part's close; `close()` runs them in reverse order of registration. */
  onClose(close: () => unknown): void;
  close(): Promise<void>;
}

export async function createCore(config: ServerConfig, logger: Logger): Promise<Core> {
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openStore({
    dataDir: dataDir.root,
    databaseUrl: config.databaseUrl,
    busyTimeoutMs: config.storeBusyTimeoutMs,
    // A server's commits never wait on a checkpoint of the log (store/sqlite-checkpointer.ts).
    checkpointInThread: {
      onProblem: (message) => logger.warn(message),
      onRestart: (restart) => logger.debug(restart, 'the SQLite log was started over'),
    },
  });
  const closers: Array<() => unknown> = [];
  const onClose = (close: () => unknown) => void closers.push(close);
  onClose(() => store.destroy());
  // Looked at once before anything is served: a server starting on a nearly full disk refuses intake at once.
  const space = createDiskSpace({
    dir: dataDir.root,
    minFreeBytes: config.minFreeMib * 1024 * 1024,
    logger: logger.child({ component: 'storage' }),
  });
  await space.look();
  space.start();
  onClose(() => space.close());
  const keys = prepareKeysDir(config.keysDir);
  const jwtKey = loadOrCreateKey(path.join(keys, 'jwt.key'));
  const secretsKey = loadOrCreateKey(path.join(keys, 'secrets.key'));
  const clusterKey = loadOrCreateKey(path.join(keys, CLUSTER_KEY_FILE));
  const role = config.role;
  const startedAt = new Date().toISOString();
  // The node's info is written from its first registration, before the replicas and the run queue exist:
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
  const events = createEventBus(logger.child({ component: 'events' }));
  const changes = config.databaseUrl
    ? await createPgChangeFeed({ databaseUrl: config.databaseUrl, logger: logger.child({ component: 'changes' }) })
    : createLocalChangeFeed({ logger: logger.child({ component: 'changes' }) });
  onClose(() => changes.close());
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
  // Callers waiting for runs to end: woken by this node's commits, by other nodes' (the cluster link's
  // relay), and by a shared check.
  const runWaiters = createRunWaiters({ store, logger: logger.child({ component: 'runs' }) });
  onClose(() => runWaiters.close());
  events.on('runs:outbox', () => webhooks.wake());
  events.on('runs:finished', ({ runIds }) => runWaiters.finished(runIds));
  webhooks.start();
  return {
    config,
    logger,
    role,
    dataDir,
    space,
    store,
    jwtKey,
    secretsKey,
    clusterAuth: createClusterAuth({ key: clusterKey, nodeId: node.id }),
    node,
    startedAt,
    metrics,
    events,
    changes,
    auth: createAuthenticator({ store, key: jwtKey }),
    buildLog: createBuildLog({ store, maxBytes: config.buildLogBytes }),
    runTargets: createRunTargets({ store }),
    appLog: createAppLog({ linesPerApp: config.appLogLines }),
    callers: createCallerTally(),
    webhooks,
    recorder,
    runWaiters,
    listenUrl: () => listenUrl,
    setListenUrl(url) {
      listenUrl = url;
    },
    reportLoad(fn) {
      load = fn;
    },
    onClose,
    async close() {
      for (let close = closers.pop(); close; close = closers.pop()) await close();
    },
  };
}
