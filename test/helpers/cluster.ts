/**
 * A cluster for a test (issue 13's harness, used by day-two tests too): `gateways` × `ferry serve --role
 * gateway` and `workers` × `--role worker` on a fresh PostgreSQL database and the machine's NATS JetStream
 * under a cluster name of its own, each process with its own data directory, a bootstrapped project and
 * its token, and `close()` that leaves no process, database, stream or directory behind.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { zipFiles } from './app-zip.js';
import { http, tempDir, waitFor } from './ferry.js';
import {
  bootstrapShared,
  createTestDatabase,
  type FleetProcess,
  type FleetSettings,
  startFleetProcess,
  sweepStrays,
  type TestDatabase,
} from './fleet.js';
import { deleteClusterStreams, NATS_URL } from './nats.js';

export interface ClusterOptions {
  gateways?: number;
  workers?: number;
  /** More environment for every process (after the defaults). */
  env?: NodeJS.ProcessEnv;
  /** More environment for the process of `label` (`gateway-1`, `worker-2`), after `env`. */
  envOf?: (label: string) => NodeJS.ProcessEnv;
}

export interface TestCluster {
  readonly name: string;
  readonly root: string;
  readonly db: TestDatabase;
  readonly gateways: FleetProcess[];
  readonly workers: FleetProcess[];
  readonly auth: { projectId: string; token: string };
  /** Starts one more process of `role` on the same cluster (it is stopped by `close`). */
  start(label: string, role: 'gateway' | 'worker' | 'all', env?: NodeJS.ProcessEnv): Promise<FleetProcess>;
  /** Uploads `files` as a build of `app` through `via` (default the first gateway) and waits for it to be ready. */
  deploy(app: string, files: Record<string, string>, via?: { url: string }): Promise<{ id: string; state: string }>;
  close(): Promise<void>;
}

export async function startCluster(options: ClusterOptions = {}): Promise<TestCluster> {
  const root = await tempDir('ferry-cluster-');
  const db = await createTestDatabase('ferry_cluster');
  const name = `t_${process.pid}_${randomBytes(3).toString('hex')}`;
  const procs: FleetProcess[] = [];
  const settings: FleetSettings = {
    databaseUrl: db.url,
    keysDir: path.join(root, 'keys'),
    artifactsDir: path.join(root, 'unused-artifacts'),
    env: {
      FERRY_NATS_URL: NATS_URL,
      FERRY_CLUSTER_NAME: name,
      FERRY_LEASE_SECONDS: '4',
      FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
      FERRY_STREAM_RESUME_GRACE_SECONDS: '1',
      ...options.env,
    },
  };
  const start = async (label: string, role: 'gateway' | 'worker' | 'all', env: NodeJS.ProcessEnv = {}) => {
    const p = await startFleetProcess(label, path.join(root, label), {
      ...settings,
      env: { ...settings.env, ...options.envOf?.(label), ...env, FERRY_ROLE: role },
    });
    procs.push(p);
    return p;
  };
  const close = async () => {
    const results = await Promise.allSettled(procs.map((p) => p.stop(10_000)));
    const strays = await sweepStrays(root);
    results.push(
      ...(await Promise.allSettled([
        db.drop(),
        deleteClusterStreams(name, options.env?.FERRY_NATS_URL ?? NATS_URL),
        fs.rm(root, { recursive: true, force: true }),
      ])),
    );
    assert.equal(strays, 0, 'no process of the cluster may outlive it');
    for (const r of results) if (r.status === 'rejected') throw r.reason;
  };
  try {
    const auth = await bootstrapShared(path.join(root, 'boot'), db.url, settings.keysDir);
    const { projectId, token } = auth;
    const nGateways = options.gateways ?? 2;
    const nWorkers = options.workers ?? 2;
    const started = await Promise.all([
      ...Array.from({ length: nGateways }, (_, i) => start(`gateway-${i + 1}`, 'gateway')),
      ...Array.from({ length: nWorkers }, (_, i) => start(`worker-${i + 1}`, 'worker')),
    ]);
    const gateways = started.slice(0, nGateways);
    const workers = started.slice(nGateways);
    const want = [...Array(nGateways).fill('gateway'), ...Array(nWorkers).fill('worker')].sort().join(',');
    if (gateways.length > 0) {
      await waitFor(
        async () => {
          for (const g of gateways) {
            const res = await http(`${g.url}/v2/cluster`, { token });
            const roles = (res.json?.nodes ?? []).map((n: { role: string }) => n.role).sort();
            if (roles.join(',') !== want) return undefined;
          }
          return true;
        },
        30_000,
        `every gateway to list ${nGateways} gateways and ${nWorkers} workers`,
      );
    }
    const deploy = async (app: string, files: Record<string, string>, via?: { url: string }) => {
      const g = via ?? gateways[0];
      assert.ok(g, 'deploy needs a gateway');
      const res = await http(`${g.url}/v2/projects/${projectId}/apps/${app}/builds`, {
        method: 'POST',
        token,
        body: await zipFiles(files),
        headers: { 'content-type': 'application/zip' },
      });
      assert.equal(res.status, 201, res.text);
      const build = await waitFor(
        async () => {
          const b = await http(`${g.url}/v2/projects/${projectId}/apps/${app}/builds/${res.json.id}`, { token });
          return ['ready', 'failed', 'cancelled'].includes(b.json?.state) ? b.json : undefined;
        },
        120_000,
        `build of ${app}`,
      );
      if (build.state !== 'ready') {
        // What to read after a failure on CI: the build's log, and every process's lines about the build
        // (the data dirs, with their logs, are gone once the test ends).
        const log = await http(`${g.url}/v2/projects/${projectId}/apps/${app}/builds/${build.id}/logs`, { token });
        const lines = (log.json?.lines ?? []).map((l: { line: string }) => l.line).join('\n');
        const said = procs
          .map(
            (p) =>
              `--- ${p.label}:\n${p
                .output()
                .split('\n')
                .filter((l) => l.includes(build.id))
                .join('\n')}`,
          )
          .join('\n');
        assert.fail(`build of ${app} ended ${build.state}: ${build.error}\n--- build log:\n${lines}\n${said}`);
      }
      return build as { id: string; state: string };
    };
    return { name, root, db, gateways, workers, auth, start, deploy, close };
  } catch (err) {
    await close().catch(() => undefined);
    throw err;
  }
}
