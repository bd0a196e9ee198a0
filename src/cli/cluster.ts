/**
 * `ferry cluster`: the Ferry processes (nodes) sharing the server's store, from `GET /v2/cluster`, as a
 * table. `ferry doctor` prints the same lines when it can reach a server (`readCluster`).
 */
import { request } from 'undici';
import { createClient, printJson } from './client.js';
import { resolveCliSettings } from './config-file.js';

export interface ClusterNode {
  id: string;
  started_at: string;
  lease_until: string;
  hostname: string | null;
  pid: number | null;
  version: string | null;
  role: string | null;
  url: string | null;
  load: {
    runs_in_flight: number;
    runs_queued: number;
    async_backlog: number;
    replicas_starting: number;
    replicas_ready: number;
  } | null;
  apps: Array<{ app_id: string; replicas_starting: number; replicas_ready: number; runs_in_flight: number }>;
}

export interface ClusterView {
  node: string;
  nodes: ClusterNode[];
  expired: ClusterNode[];
}

/** How long `ferry doctor` waits for the server: it reports, it does not hang on an unreachable one. */
const DOCTOR_TIMEOUT_MS = 3000;

export async function clusterCommand(options: { json?: boolean }): Promise<void> {
  const client = createClient({ needProject: false });
  const view = await client.call<ClusterView>('GET', '/v2/cluster');
  if (options.json) return printJson(view);
  process.stdout.write(`${clusterLines(view).join('\n')}\n`);
}

/**
 * The cluster as the configured server sees it, for `ferry doctor`: the view, or why there is none
 * (no token configured, the server cannot be reached, or it refused).
 */
export async function readCluster(): Promise<{ url: string; view?: ClusterView; problem?: string }> {
  const settings = resolveCliSettings();
  const url = settings.url ?? 'http://127.0.0.1:8000';
  if (!settings.token) return { url, problem: 'no token configured (ferry login, or FERRY_TOKEN)' };
  try {
    const res = await request(`${url}/v2/cluster`, {
      headers: { authorization: `Bearer ${settings.token}`, accept: 'application/json' },
      signal: AbortSignal.timeout(DOCTOR_TIMEOUT_MS),
    });
    const text = await res.body.text();
    if (res.statusCode !== 200) {
      let reason = `answered ${res.statusCode}`;
      try {
        const body = JSON.parse(text) as { error?: { code?: string; message?: string } };
        if (body.error?.message) reason = `${body.error.message} (${body.error.code ?? res.statusCode})`;
      } catch {
        // not JSON: the status says enough
      }
      return { url, problem: reason };
    }
    return { url, view: JSON.parse(text) as ClusterView };
  } catch (err) {
    const code = (err as { code?: string }).code ?? (err as { cause?: { code?: string } }).cause?.code;
    const name = (err as { name?: string }).name;
    const reason =
      name === 'TimeoutError'
        ? `no answer within ${DOCTOR_TIMEOUT_MS / 1000} s`
        : code === 'ECONNREFUSED'
          ? 'connection refused'
          : (code ?? (err instanceof Error ? err.message : String(err)));
    return { url, problem: `cannot reach Ferry (${reason})` };
  }
}

/** The nodes as an aligned table; the answering node is marked `*`, expired ones follow apart. */
export function clusterLines(view: ClusterView): string[] {
  const columns = [
    '',
    'NODE',
    'ROLE',
    'VERSION',
    'URL',
    'RUNS',
    'QUEUED',
    'BACKLOG',
    'REPLICAS',
    'APPS',
    'LEASE UNTIL',
  ];
  const row = (n: ClusterNode) => [
    n.id === view.node ? '*' : '',
    n.id,
    n.role ?? '-',
    n.version ?? '-',
    n.url ?? '-',
    n.load ? String(n.load.runs_in_flight) : '-',
    n.load ? String(n.load.runs_queued) : '-',
    n.load ? String(n.load.async_backlog) : '-',
    n.load ? `${n.load.replicas_ready} ready, ${n.load.replicas_starting} starting` : '-',
    n.apps.length > 0 ? n.apps.map((a) => `${a.app_id}(${a.replicas_ready + a.replicas_starting})`).join(',') : '-',
    n.lease_until,
  ];
  const table = (nodes: ClusterNode[]) => {
    const cells = [columns, ...nodes.map(row)];
    const widths = columns.map((_, i) => Math.max(...cells.map((r) => r[i]!.length)));
    return cells.map((r) =>
      r
        .map((v, i) => v.padEnd(widths[i]!))
        .join('  ')
        .trimEnd(),
    );
  };
  const live = view.nodes.length === 1 ? '1 node' : `${view.nodes.length} nodes`;
  const lines = [`${live} live (* answered)`, ...table(view.nodes)];
  if (view.expired.length > 0) {
    lines.push('', `Lease ran out, not removed yet (${view.expired.length}):`, ...table(view.expired));
  }
  return lines;
}
