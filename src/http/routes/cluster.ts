/**
 * `GET /v2/cluster`: the processes (nodes) sharing this store, from the `nodes` table: each node's lease and
 * the info it writes at every renewal (cluster/node.ts, cluster/node-info.ts). Live nodes (lease not run
 * out) and nodes whose lease ran out but that recovery has not removed yet are listed apart.
 *
 * A route about the server, not a project: any project's `manage` token opens it. Projects are tenants, so
 * a node's `apps` are only the caller's project's; its `load` totals count every project's.
 */
import { Type } from 'typebox';
import type { NodeRow } from '../../cluster/node.js';
import { parseNodeInfo } from '../../cluster/node-info.js';
import { type AuthDeps, requireAnyProjectScope } from '../auth.js';
import { errors, Nullable } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

/** Nodes read at most: a cluster has a handful; this only bounds an answer gone wrong. */
const MAX_NODES = 1000;

const Count = (description: string) => Type.Integer({ minimum: 0, description });

const Node = Type.Object({
  id: Type.String({
    description: 'The node id: the `owner` of the work it holds, and the `node` label of its metrics',
  }),
  started_at: Type.String({ format: 'date-time' }),
  lease_until: Type.String({
    format: 'date-time',
    description: 'Its lease runs until then unless renewed (every third of FERRY_LEASE_SECONDS, with its info)',
  }),
  hostname: Nullable(Type.String()),
  pid: Nullable(Type.Integer()),
  version: Nullable(Type.String({ description: 'Ferry version (null: written by a Ferry that did not say)' })),
  role: Nullable(
    Type.String({
      description:
        '`gateway` (public interface, no user code), `worker` (builds and replicas behind an internal listener) or `all` (every part in one process)',
    }),
  ),
  url: Nullable(
    Type.String({ description: 'The address its HTTP server listens on (null before it listens, or unknown)' }),
  ),
  load: Nullable(
    Type.Object(
      {
        runs_in_flight: Count('Runs executing in its replicas'),
        runs_queued: Count('Runs waiting there for a replica slot'),
        async_backlog: Count('Async runs it holds, queued there or running'),
        replicas_starting: Count('Replicas starting'),
        replicas_ready: Count('Replicas ready'),
      },
      { description: 'As of its last renewal, over every project (null: not reported by this node)' },
    ),
  ),
  apps: Type.Array(
    Type.Object({
      app_id: Type.String(),
      replicas_starting: Count('Replicas starting'),
      replicas_ready: Count('Replicas ready'),
      runs_in_flight: Count('Runs executing'),
    }),
    { description: "The caller's project's apps with replicas or runs on the node, as of its last renewal" },
  ),
});

const Cluster = Type.Object({
  node: Type.String({ description: 'The id of the node that answered' }),
  nodes: Type.Array(Node, { description: 'Live nodes (lease not run out), oldest first' }),
  expired: Type.Array(Node, {
    description:
      'Nodes whose lease ran out (or that stopped) and are not removed yet: a live node takes their work over and removes them',
  }),
});

export interface ClusterRouteDeps extends AuthDeps {
  /** This node (its id answers `node`). */
  node: { id: string };
  /** Records the address the server listens on, in this node's info. */
  listening(url: string): Promise<void>;
  listNodes(limit: number): Promise<NodeRow[]>;
}

export function registerClusterRoutes(app: TypedServer, services: ClusterRouteDeps): void {
  // The address goes into this node's info as soon as the server listens (its port may have been 0).
  app.addHook('onListen', async () => {
    const address = app.server.address();
    if (!address || typeof address === 'string') return;
    const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
    await services.listening(`http://${host}:${address.port}`);
  });

  app.get(
    '/v2/cluster',
    {
      onRequest: requireAnyProjectScope(services, 'manage'),
      schema: {
        summary: 'The Ferry processes (nodes) sharing this store, with their version, role, address and load',
        description:
          'Every Ferry process is a node with a lease it renews every third of FERRY_LEASE_SECONDS, writing its ' +
          'version, role, listen address and load at the same time. `nodes` are live; `expired` are nodes whose ' +
          'lease ran out or that stopped, until another node takes their work over. Any project’s token with the ' +
          "`manage` scope may read it; `apps` lists only that project's apps. See docs/scaling-out.md.",
        tags: ['cluster'],
        response: { 200: Cluster, ...errors(400, 401, 403, 404, 503) },
      },
    },
    async (request) => {
      const project = request.principal?.projectId;
      const rows = await services.listNodes(MAX_NODES);
      const now = new Date().toISOString();
      const nodes = rows.map((row) => {
        const info = parseNodeInfo(row.info);
        return {
          id: row.id,
          started_at: row.started_at,
          lease_until: row.lease_until,
          hostname: info.hostname,
          pid: info.pid,
          version: info.version,
          role: info.role,
          url: info.url,
          load: info.load,
          apps: info.apps.filter((a) => a.project_id === project).map(({ project_id: _project, ...rest }) => rest),
        };
      });
      return {
        node: services.node.id,
        nodes: nodes.filter((n) => n.lease_until > now),
        expired: nodes.filter((n) => n.lease_until <= now),
      };
    },
  );
}
