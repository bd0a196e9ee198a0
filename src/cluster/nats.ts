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
  /** The KV bucket in which workers and gateways announce themselves. */
  nodesBucket: string;
  /** The subject of the change feed (cache invalidation). */
  changesSubject: string;
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
    nodesBucket: `${cluster}_nodes`,
    changesSubject: `${cluster}.changes`,
  };
}

/**
 * Connects to NATS at `url` (a comma-separated list of servers is allowed) and keeps reconnecting for as
 * long as the process runs: a NATS restart is an outage to wait out, not a reason to exit.
 */
export async function connectNats(options: { url: string; name: string; logger: Logger }): Promise<NatsConnection> {
  const servers = options.url
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s.length > 0);
  const nc = await connect({
    servers,
    name: options.name,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 500,
    timeout: 10_000,
  });
  void (async () => {
    for await (const status of nc.status()) {
      if (status.type === 'disconnect' || status.type === 'reconnect' || status.type === 'error') {
        options.logger.warn(
          { nats: status.type, server: 'server' in status ? status.server : undefined },
          'NATS connection',
        );
      }
    }
  })().catch(() => undefined);
  return nc;
}
