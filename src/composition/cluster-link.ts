/**
 * The cluster link (with `--nats-url`): the NATS connection, the live workers' directory, the relay that
 * tells other nodes which runs ended here, and the factories of the parts that cross nodes: the remote
 * invoker (a gateway's calls to workers), the JetStream run queue, a worker's announcement. Absent
 * without NATS, when one process (or several sharing a store) does everything itself.
 *
 * Start-up does not wait for NATS: what needs it fails with a coded error (or waits) until it is reached.
 */
import { createFinishedRelay } from '../cluster/finished-relay.js';
import { type ClusterNames, clusterNames, createNatsLink, type NatsLink } from '../cluster/nats.js';
import { FERRY_VERSION } from '../cluster/node-info.js';
import { homeOf } from '../cluster/placement.js';
import { workerLoad } from '../cluster/worker-load.js';
import {
  createWorkerAnnouncer,
  createWorkerDirectory,
  type WorkerAnnouncer,
  type WorkerDirectory,
} from '../cluster/workers.js';
import type { ReplicaPool } from '../replicas/pool.js';
import type { createAsyncWorker } from '../runs/async-worker.js';
import type { Invoker } from '../runs/invoke.js';
import { createJetStreamRunQueue } from '../runs/jetstream-queue.js';
import { createRemoteInvoker } from '../runs/remote-invoker.js';
import type { RunQueue } from '../runs/run-queue.js';
import type { Core } from './core.js';

export interface ClusterLink {
  nats: NatsLink;
  names: ClusterNames;
  /** The live workers of the cluster: where a gateway sends calls, and which apps a worker is home to. */
  workers: WorkerDirectory;
  /**
   * On a worker: whether this node is the app's home worker (it keeps the app's min_replicas). Undefined
   * elsewhere: an `all` node is home to every app, a gateway to none.
   */
  isHome?: (projectId: string, appId: string) => boolean;
  /** On a worker: replicas of an app on the other live workers (max_replicas bounds the whole cluster). */
  elsewhere?: (projectId: string, appId: string) => number;
  /** A gateway's invoker: calls placed on the live workers. */
  remoteInvoker(): Invoker;
  /** The JetStream run queue; `consume`: whether this node fetches and runs async runs. */
  runQueue(options: {
    consume: boolean;
    createWorker: (hooks?: WorkerHooks) => ReturnType<typeof createAsyncWorker>;
  }): RunQueue;
  /** A worker's announcement in the directory, with its load. */
  announcer(options: { pools: () => ReplicaPool[] }): WorkerAnnouncer;
}

type WorkerHooks = Partial<Parameters<typeof createAsyncWorker>[0]>;

export async function createClusterLink(core: Core): Promise<ClusterLink | undefined> {
  const { config, logger, node, role, metrics } = core;
  if (!config.natsUrl) return undefined;
  const nats = createNatsLink({ url: config.natsUrl, name: node.id, logger: logger.child({ component: 'nats' }) });
  core.onClose(() => nats.close());
  const names = clusterNames(config.clusterName);
  // Every node of a cluster knows the live workers: gateways to place calls, workers to know which apps
  // they are home to (min_replicas counts for the whole cluster).
  const workers = createWorkerDirectory({
    nats,
    bucket: names.nodesBucket,
    logger: logger.child({ component: 'workers' }),
  });
  await workers.start();
  core.onClose(() => workers.close());
  const relay = createFinishedRelay({
    nats,
    subject: names.finishedSubject,
    heard: (runIds) => core.runWaiters.finished(runIds),
    logger,
  });
  core.events.on('runs:finished', ({ runIds }) => relay.publish(runIds));
  const worker = role === 'worker';
  const elsewhere = worker
    ? (projectId: string, appId: string): number => {
        const key = `${projectId}/${appId}`;
        let n = 0;
        for (const w of workers.live()) if (w.id !== node.id) n += w.load.apps[key]?.replicas ?? 0;
        return n;
      }
    : undefined;
  return {
    nats,
    names,
    workers,
    ...(worker
      ? {
          isHome(projectId: string, appId: string): boolean {
            const live = workers.live();
            if (live.length === 0) return true;
            return homeOf(`${projectId}/${appId}`, live)?.id === node.id;
          },
          elsewhere,
        }
      : {}),
    remoteInvoker() {
      const remote = createRemoteInvoker({
        directory: workers,
        auth: core.clusterAuth,
        nodeId: node.id,
        logger: logger.child({ component: 'gateway' }),
        callerStallMs: config.callerStallSeconds * 1000,
      });
      core.onClose(() => remote.close());
      return remote;
    },
    runQueue({ consume, createWorker }) {
      const queue = createJetStreamRunQueue({
        link: nats,
        names,
        store: core.store,
        logger: logger.child({ component: 'async' }),
        owner: node.id,
        consume,
        createWorker,
        metrics: {
          published: (via, n) => metrics.asyncPublished.inc({ via }, n),
          publishFailed: (n) => metrics.asyncPublishFailures.inc(n),
          fetched: (outcome, n) => metrics.asyncFetched.inc({ outcome }, n),
          stage: (stage, seconds) => metrics.asyncStage.observe({ stage }, seconds),
        },
      });
      // Runs this node ended: their messages are acknowledged at once, not at the queue's next look.
      if (consume) core.events.on('runs:finished', ({ runIds }) => queue.finished?.(runIds));
      return queue;
    },
    announcer({ pools }) {
      const announcer = createWorkerAnnouncer({
        nats,
        bucket: names.nodesBucket,
        logger: logger.child({ component: 'workers' }),
        describe: () => ({
          id: node.id,
          url: config.advertiseUrl ?? core.listenUrl() ?? '',
          role: 'worker',
          version: FERRY_VERSION,
          startedAt: core.startedAt,
          load: workerLoad(pools(), config.workerMaxReplicas, elsewhere, core.callers),
        }),
      });
      core.events.on('replicas:changed', () => announcer.announceNow());
      // Gateways stop sending new calls here at once; calls in flight finish (the HTTP server closed first).
      core.onClose(() => announcer.close());
      return announcer;
    },
  };
}
