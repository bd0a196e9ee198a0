/**
 * The NATS connection of a scaled-out Ferry (`--nats-url`), and the names of everything Ferry keeps in
 * NATS. Every stream, consumer, KV and object-store bucket and subject starts with the cluster name
 * (`--cluster-name`, default `ferry`), so several clusters (and parallel test runs) share one NATS server
 * without touching each other.
 */
import { connect, type NatsConnection } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import { CLUSTER_NAME } from '../config.js';

export interface ClusterNames {
  cluster: string;
  /** The work-queue stream of accepted async runs. */
  runsStream: string;
  /** The subject an accepted async run of this project and app is published on. */
  runsSubject(projectId: string, appId: string): string;
  /** Every run subject of the cluster (the stream's filter). */
  runsSubjects: string;
  /** The object-store bucket of uploaded archives and build outputs. */
  artifactsBucket: string;
  /** The object-store bucket of images by digest (images/image-shelf.ts). */
  imagesBucket: string;
  /** The KV bucket in which workers and gateways announce themselves. */
  nodesBucket: string;
  /** The subject of the change feed (cache invalidation). */
  changesSubject: string;
  /** Core NATS: after each commit of runs' final states, their ids (wakes callers waiting on other nodes). */
  finishedSubject: string;
}

export function clusterNames(cluster: string): ClusterNames {
  if (!CLUSTER_NAME.test(cluster)) {
    throw new Error(`cluster name "${cluster}" must be 1 to 32 of A-Z, a-z, 0-9, "_" and "-"`);
  }
  return {
    cluster,
    runsStream: `${cluster}_runs`,
    // Project ids (p-0a1b2c3d) and app names (a-z, 0-9, -) are valid subject tokens: no dots, no wildcards.
    runsSubject: (projectId, appId) => `${cluster}.runs.${projectId}.${appId}`,
    runsSubjects: `${cluster}.runs.>`,
    artifactsBucket: `${cluster}_artifacts`,
    imagesBucket: `${cluster}_images`,
    nodesBucket: `${cluster}_nodes`,
    changesSubject: `${cluster}.changes`,
    finishedSubject: `${cluster}.finished`,
  };
}

/**
 * The NATS connection of this process, which start-up does not wait for: `ferry serve` starts while NATS is
 * down, and whatever needs NATS asks `current()` (undefined until the first connection) and tells its own
 * caller so (a coded error, or a retry later). Once connected, the client reconnects by itself for as long
 * as the process runs: a NATS restart is an outage to wait out, not a reason to exit.
 */
export interface NatsLink {
  /** The connection, once it has connected once (it may be reconnecting: see `connected`). */
  current(): NatsConnection | undefined;
  /** True while connected (false before the first connection and between a disconnect and a reconnect). */
  readonly connected: boolean;
  /** Resolves with the connection once it has connected once; rejects if the link is closed first. */
  ready(): Promise<NatsConnection>;
  /** Called on every (re)connection (the queue republishes what waited for NATS). */
  onConnect(listener: () => void): void;
  close(): Promise<void>;
}

/** How long to wait between first-connection attempts while NATS cannot be reached. */
const FIRST_CONNECT_RETRY_MS = 1000;

/**
 * Connects to NATS at `url` (a comma-separated list of servers is allowed) in the background: the first
 * connection is retried every second until it succeeds or the link is closed, then the client keeps
 * reconnecting on its own.
 */
export function createNatsLink(options: { url: string; name: string; logger: Logger }): NatsLink {
  const { logger } = options;
  const servers = options.url
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s.length > 0);
  let nc: NatsConnection | undefined;
  let connected = false;
  let closed = false;
  let retry: NodeJS.Timeout | undefined;
  let wakeRetry: (() => void) | undefined;
  const listeners: Array<() => void> = [];
  let resolveReady!: (nc: NatsConnection) => void;
  let rejectReady!: (err: Error) => void;
  const readyPromise = new Promise<NatsConnection>((resolve, reject) => {
    resolveReady = resolve;
    rejectReady = reject;
  });
  readyPromise.catch(() => undefined);
  const notify = () => {
    for (const listener of listeners) {
      try {
        listener();
      } catch (err) {
        logger.warn({ err }, 'NATS connect listener failed');
      }
    }
  };

  void (async () => {
    let warned = false;
    while (!closed) {
      try {
        const conn = await connect({
          servers,
          name: options.name,
          maxReconnectAttempts: -1,
          reconnectTimeWait: 500,
          timeout: 5_000,
        });
        if (closed) {
          await conn.close();
          return;
        }
        nc = conn;
        connected = true;
        if (warned) logger.info({ servers }, 'NATS connection established');
        resolveReady(conn);
        notify();
        for await (const status of conn.status()) {
          if (status.type === 'disconnect' || status.type === 'reconnect' || status.type === 'error') {
            logger.warn(
              { nats: status.type, server: 'server' in status ? status.server : undefined },
              'NATS connection',
            );
          }
          if (status.type === 'disconnect') connected = false;
          if (status.type === 'reconnect') {
            connected = true;
            notify();
          }
        }
        return;
      } catch (err) {
        if (closed) return;
        if (!warned) {
          logger.warn({ err, servers }, 'NATS cannot be reached; retrying every second (what needs it waits)');
          warned = true;
        }
        await new Promise<void>((resolve) => {
          wakeRetry = resolve;
          retry = setTimeout(resolve, FIRST_CONNECT_RETRY_MS);
        });
      }
    }
  })().catch((err: unknown) => logger.error({ err }, 'NATS connection loop failed'));

  return {
    current: () => nc,
    get connected() {
      return connected && !closed;
    },
    ready: () => readyPromise,
    onConnect(listener) {
      listeners.push(listener);
    },
    async close() {
      closed = true;
      connected = false;
      if (retry) clearTimeout(retry);
      wakeRetry?.();
      rejectReady(new Error('the NATS connection was closed'));
      await nc?.close();
    },
  };
}

/** The connection, or an error saying NATS has not been reached yet (for callers that turn it into a coded 503). */
export function requireNats(link: NatsLink): NatsConnection {
  const nc = link.current();
  if (!nc) throw new Error('NATS has not been reached yet');
  return nc;
}
