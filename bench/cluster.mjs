#!/usr/bin/env node
/**
 * Gateways and workers (issue 13), measured side by side in one run on one PostgreSQL database and one
 * NATS JetStream server (the machine's, or BENCH_DATABASE_URL / BENCH_NATS_URL):
 *
 *   (a) the hop: unloaded latency of a sync call to a trivial function with a warm replica, through one
 *       `--role all` process and through a gateway to a worker, one call at a time, the two in turn (so
 *       noise hits both alike). Target: the gateway adds less than 1 ms at p50.
 *   (b) capacity: a function that sleeps 50 ms (I/O-bound, so the limit is replicas, not the machine's
 *       cores), each worker with FERRY_WORKER_MAX_REPLICAS=1 and the app's replica_concurrency BENCH_SLOTS (2); one
 *       gateway; completed runs per second with 1, 2 and 3 workers under the same closed-loop load.
 *       Targets: 2 and 3 workers at least 1.8× and 2.6× one.
 *   (c) async end to end (issue 31, target 2): completed async runs per second of a function that returns
 *       at once, through 2 gateways and 2 workers on PostgreSQL + NATS JetStream, against one `--role all`
 *       process on PostgreSQL alone (its own database, no NATS), in alternating rounds (cluster, all,
 *       cluster, all, ...). Target: cluster / all at least 0.9. Also where a cluster run's time goes, stage
 *       by stage (ferry_async_stage_seconds and the run records' timestamps). With BENCH_ASYNC_SPLIT_ALL=N,
 *       a third target, measured in the same alternation: N `--role all` processes on one database of their
 *       own (no NATS), the callers split over them; a diagnostic of what splitting the work over more
 *       processes costs on the machine, whatever their roles.
 *
 *   npm run build && npm run bench:cluster
 *   BENCH_LATENCY_REQUESTS=2000 BENCH_HOP_WARMUP=3000 BENCH_DURATION=10 BENCH_CONCURRENCY=24 npm run bench:cluster
 *   BENCH_CLUSTER_PARTS=c BENCH_ASYNC_DURATION=10 BENCH_ASYNC_ROUNDS=3 npm run bench:cluster
 *
 * The hop is timed after BENCH_HOP_WARMUP rounds (3000) of the same calls, unmeasured: the processes are
 * new, and their first two thousand or so calls are slower for both targets while V8 compiles the hot
 * path (on 2026-11-25, rounds 1-400 added 1.24 ms at p50, rounds 2800-3200 0.32 to 0.47 ms). The other
 * benches time latency after their load phases, on warm processes; this does the same.
 */
import crypto from 'node:crypto';
import fs from 'node:fs';
import { Client, Pool } from 'undici';
import {
  bootstrapProject,
  cpuMs,
  createDatabase,
  deleteClusterStreams,
  deployApp,
  envInt,
  fetchMetrics,
  fmt,
  http,
  loadAverage,
  machineReport,
  metricSum,
  onCleanup,
  pgDatabaseStats,
  requireDist,
  runMain,
  sandboxReport,
  sleep,
  startFerry,
  summarize,
  table,
  tempDir,
  waitFor,
} from './lib.mjs';

const LATENCY_REQUESTS = envInt('BENCH_LATENCY_REQUESTS', 2000);
const HOP_WARMUP = envInt('BENCH_HOP_WARMUP', 3000, 0);
const DURATION = envInt('BENCH_DURATION', 10);
const SLOTS_PER_WORKER = envInt('BENCH_SLOTS', 2);
const CONCURRENCY = envInt('BENCH_CONCURRENCY', 3 * SLOTS_PER_WORKER * 2);
const ADMIN_URL = process.env.BENCH_DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const NATS_URL = process.env.BENCH_NATS_URL ?? 'nats://127.0.0.1:4222';
/** Which parts to run: BENCH_CLUSTER_PARTS=c (or a,b), default all three. */
const PARTS = new Set(
  (process.env.BENCH_CLUSTER_PARTS || 'a,b,c')
    .split(',')
    .map((p) => p.trim().toLowerCase())
    .filter(Boolean),
);
/** The databases the bench creates (and drops) start with this; the cluster names with BENCH_CLUSTER_PREFIX. */
const DATABASE_PREFIX = process.env.BENCH_DATABASE_PREFIX || 'ferry_bench_cluster_';
const CLUSTER_PREFIX = process.env.BENCH_CLUSTER_PREFIX || 'bench_';
// (c)
const ASYNC_DURATION = envInt('BENCH_ASYNC_DURATION', 10);
const ASYNC_ROUNDS = envInt('BENCH_ASYNC_ROUNDS', 3);
const ASYNC_CONCURRENCY = envInt('BENCH_ASYNC_CONCURRENCY', 32);
const ASYNC_WARMUP = envInt('BENCH_ASYNC_WARMUP', 2, 0);
const DRAIN_TIMEOUT_S = envInt('BENCH_DRAIN_TIMEOUT', 300);
/** The cluster's gateways and workers (the target: 2 and 2; other counts are a diagnostic). */
const ASYNC_GATEWAYS = envInt('BENCH_ASYNC_GATEWAYS', 2);
const ASYNC_WORKERS = envInt('BENCH_ASYNC_WORKERS', 2);
/**
 * A diagnostic third target (0: none): this many `--role all` processes on one PostgreSQL database alone (the
 * store queue, no NATS), the callers split over them as over the gateways: what splitting the same work over
 * more processes costs on this machine, whatever their roles.
 */
const ASYNC_SPLIT_ALL = envInt('BENCH_ASYNC_SPLIT_ALL', 0, 0);
/** Far above what the bench submits, so no backlog limit (429) caps the rate. */
const MAX_ASYNC_BACKLOG = 10_000_000;
const TARGET_ASYNC_RATIO = 0.9;
const TERMINAL = ['success', 'failure', 'timeout', 'cancelled'];
const STAGES = ['publish', 'claim', 'start', 'ack'];

const TARGET_ADDED_P50_MS = 1;
const TARGET_TWO = 1.8;
const TARGET_THREE = 2.6;

const ECHO = {
  'ferry.toml': '[app]\nname = "echo"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 64\n',
  'main.ts': 'export function run() { return { ok: true }; }\n',
};
const NOOP = {
  'ferry.toml':
    '[app]\nname = "noop"\n[scaling]\nmin_replicas = 1\nmax_replicas = 2\nreplica_concurrency = 64\nresponse_grace_period = 30\n',
  'main.ts': 'export function run() { return null; }\n',
};
const SLEEPY = {
  'ferry.toml': `[app]\nname = "sleepy"\n[scaling]\nmax_replicas = 10\nreplica_concurrency = ${SLOTS_PER_WORKER}\ncooldown = 600\n`,
  'main.ts': 'export async function run() { await new Promise((r) => setTimeout(r, 50)); return { slept: 50 }; }\n',
};

/** Runs of the `sleepy` app created since `since`, per node that ran them, as `a/b/c`. */
async function runsPerNode(databaseUrl, since) {
  const { default: pg } = await import('pg');
  const client = new pg.Client({ connectionString: databaseUrl });
  await client.connect();
  try {
    const { rows } = await client.query(
      "SELECT owner, count(*)::int AS n FROM runs WHERE app_id = 'sleepy' AND created_at >= $1 GROUP BY owner ORDER BY owner",
      [since],
    );
    return rows.map((row) => row.n).join('/');
  } finally {
    await client.end();
  }
}

/** Waits until the gateway's cluster view lists exactly `n` live workers, then for their announcements. */
async function waitForWorkers(gateway, auth, n) {
  await waitFor(
    async () => {
      const res = await http(`${gateway.url}/v2/cluster`, { token: auth.token });
      return (res.json?.nodes ?? []).filter((node) => node.role === 'worker').length === n;
    },
    { ms: 60_000, what: `${n} live workers` },
  );
  await sleep(1_500);
}

/** One call at a time to each target in turn; latencies of the rounds after `warmup` rounds. */
async function unloaded(targets, count, warmup) {
  const times = targets.map(() => []);
  for (let i = 0; i < count + warmup; i++) {
    for (const [t, target] of targets.entries()) {
      const start = process.hrtime.bigint();
      const res = await target.client.request({
        path: target.path,
        method: 'POST',
        headers: target.headers,
        body: '{}',
      });
      await res.body.dump();
      const ms = Number(process.hrtime.bigint() - start) / 1e6;
      if (res.statusCode !== 200) throw new Error(`${target.name}: answered ${res.statusCode}`);
      if (i >= warmup) times[t].push(ms);
    }
  }
  return times.map(summarize);
}

/** Closed-loop load: `concurrency` callers, each calling again as soon as its call ends, for `seconds`. */
async function closedLoop(url, headers, concurrency, seconds) {
  const origin = new URL(url);
  const pool = new Pool(origin.origin, { connections: concurrency });
  const end = Date.now() + seconds * 1000;
  let ok = 0;
  const errors = new Map();
  const latencies = [];
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      for (let i = 0; i < 1_000_000 && Date.now() < end; i++) {
        const t0 = performance.now();
        const res = await pool.request({ path: origin.pathname, method: 'POST', headers, body: '{}' });
        const text = await res.body.text();
        if (res.statusCode === 200) {
          ok += 1;
          latencies.push(performance.now() - t0);
        } else {
          const code = JSON.parse(text)?.error?.code ?? String(res.statusCode);
          errors.set(code, (errors.get(code) ?? 0) + 1);
        }
      }
    }),
  );
  await pool.close();
  return { rps: ok / seconds, ok, errors, latency: summarize(latencies) };
}

// ---- (c) async end to end ----

/** Closed-loop async calls: `concurrency` callers spread over `urls` (caller i on urls[i % n]), for `seconds`. */
async function asyncLoad(urls, path, headers, concurrency, seconds) {
  const pools = urls.map(
    (url) => new Pool(url, { connections: Math.ceil(concurrency / urls.length), headersTimeout: 30_000 }),
  );
  const end = Date.now() + seconds * 1000;
  const latencies = [];
  const errors = new Map();
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: concurrency }, async (_, c) => {
      const pool = pools[c % pools.length];
      for (let i = 0; i < 1_000_000 && Date.now() < end; i++) {
        const start = performance.now();
        try {
          const res = await pool.request({ path, method: 'POST', headers, body: '{}' });
          const text = await res.body.text();
          if (res.statusCode === 202) latencies.push(performance.now() - start);
          else {
            let code = String(res.statusCode);
            try {
              code = JSON.parse(text)?.error?.code ?? code;
            } catch {}
            errors.set(code, (errors.get(code) ?? 0) + 1);
          }
        } catch (err) {
          const code = err?.code ?? 'error';
          errors.set(code, (errors.get(code) ?? 0) + 1);
        }
      }
    }),
  );
  const seconds1 = (performance.now() - t0) / 1000;
  await Promise.all(pools.map((p) => p.close()));
  return { accepted: latencies.length, seconds: seconds1, latency: summarize(latencies), errors };
}

/** The async runs of `noop` created since `sinceIso`: counts, and each run's timestamps (ms) and node. */
async function roundRuns(pg, sinceIso) {
  const { rows } = await pg.query(
    "SELECT state, owner, created_at, started_at, finished_at FROM runs WHERE app_id = 'noop' AND mode = 'async' AND created_at >= $1",
    [sinceIso],
  );
  return rows.map((r) => ({
    state: r.state,
    owner: r.owner,
    created: Date.parse(r.created_at),
    started: r.started_at ? Date.parse(r.started_at) : Number.NaN,
    finished: r.finished_at ? Date.parse(r.finished_at) : Number.NaN,
  }));
}

/** Whether the app's runs list (through `ferry`) shows no queued and no running run. */
async function queueEmpty(ferry, auth) {
  for (const state of ['queued', 'running']) {
    const res = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/noop/runs?state=${state}&limit=1`, {
      token: auth.token,
    });
    if (res.status !== 200) throw new Error(`GET runs?state=${state} answered ${res.status}: ${res.text}`);
    if ((res.json.runs?.length ?? 0) > 0) return false;
  }
  return true;
}

/** Runs of `noop` that have ended, summed over the target's processes (ferry_runs_total, every state). */
async function endedCount(target) {
  const texts = await Promise.all(target.nodes.map((n) => fetchMetrics(n)));
  return texts.reduce((sum, text) => sum + metricSum(text, 'ferry_runs_total', { app: 'noop' }), 0);
}

/**
 * Waits until `accepted` more runs than `base` have ended (the processes' counters, every 200 ms: cheap, so
 * the wait takes little from the target) and the runs list shows none unfinished; then reads the round's
 * runs from the database once.
 */
async function drainRuns(target, sinceIso, base, accepted) {
  await waitFor(
    async () => (await endedCount(target)) - base >= accepted && (await queueEmpty(target.entry, target.auth)),
    { ms: DRAIN_TIMEOUT_S * 1000, everyMs: 200, what: `${accepted} async runs to end (${target.name})` },
  );
  return roundRuns(target.pg, sinceIso);
}

/** ferry_async_stage_seconds buckets summed over `nodes`: { stage: [[le, cumulative count], ...] }. */
async function stageBuckets(nodes) {
  const texts = await Promise.all(nodes.map((n) => fetchMetrics(n)));
  const out = {};
  for (const stage of STAGES) {
    const les = new Map();
    for (const text of texts) {
      for (const line of text.split('\n')) {
        if (!line.startsWith('ferry_async_stage_seconds_bucket{') || !line.includes(`stage="${stage}"`)) continue;
        const le = /le="([^"]+)"/.exec(line)?.[1];
        if (!le) continue;
        les.set(le, (les.get(le) ?? 0) + Number(line.slice(line.lastIndexOf(' ') + 1)));
      }
    }
    out[stage] = [...les].map(([le, n]) => [le === '+Inf' ? Number.POSITIVE_INFINITY : Number(le), n]);
    out[stage].sort((a, b) => a[0] - b[0]);
  }
  return out;
}

/** after - before, bucket by bucket. */
function bucketDelta(before, after) {
  const out = {};
  for (const stage of STAGES) {
    const b = new Map(before[stage] ?? []);
    out[stage] = (after[stage] ?? []).map(([le, n]) => [le, n - (b.get(le) ?? 0)]);
  }
  return out;
}

function bucketAdd(a, b) {
  const out = {};
  for (const stage of STAGES) {
    const m = new Map(a[stage] ?? []);
    for (const [le, n] of b[stage] ?? []) m.set(le, (m.get(le) ?? 0) + n);
    out[stage] = [...m].sort((x, y) => x[0] - y[0]);
  }
  return out;
}

/** A quantile (in ms) of cumulative histogram buckets, linear within the bucket it falls in. */
function bucketQuantile(buckets, q) {
  const total = buckets.at(-1)?.[1] ?? 0;
  if (total === 0) return Number.NaN;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const [le, count] of buckets) {
    if (count >= rank) {
      if (!Number.isFinite(le)) return prevLe * 1000; // beyond the last bucket: its bound, a lower bound
      const within = count - prevCount;
      return (prevLe + (within > 0 ? ((rank - prevCount) / within) * (le - prevLe) : 0)) * 1000;
    }
    prevLe = le;
    prevCount = count;
  }
  return Number.NaN;
}

/** Rows read so far from the runs table: by each of its indexes, and by sequential scans ('seq'). */
async function tableScans(pg) {
  const { rows } = await pg.query(
    "SELECT indexrelname AS name, idx_tup_read::float8 AS n FROM pg_stat_user_indexes WHERE relname = 'runs' UNION ALL SELECT 'seq', seq_tup_read::float8 FROM pg_stat_user_tables WHERE relname = 'runs'",
  );
  return new Map(rows.map((r) => [r.name, r.n]));
}

/** The pid of the machine's nats-server (read-only: its CPU time), or undefined. */
function natsServerPid() {
  for (const pid of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(pid)) continue;
    try {
      if (fs.readFileSync(`/proc/${pid}/comm`, 'utf8').trim() === 'nats-server') return Number(pid);
    } catch {}
  }
  return undefined;
}

/** CPU time so far (ms) of each group of a target's processes: its Ferry processes by role, replicas, NATS, PostgreSQL. */
async function cpuSnapshot(t, natsPid) {
  const sum = (xs) => xs.reduce((a, b) => a + (Number.isFinite(b) ? b : 0), 0);
  const pgStats = await pgDatabaseStats(t.databaseUrl);
  const self = process.cpuUsage();
  return {
    gateways: sum(t.gateways.map((n) => cpuMs(n.child.pid))),
    workers: sum(t.workers.map((n) => cpuMs(n.child.pid))),
    replicas: sum(
      t.workers.flatMap((n) =>
        n
          .replicaProcesses()
          .filter((p) => p.comm !== 'bwrap')
          .map((p) => cpuMs(p.pid)),
      ),
    ),
    nats: natsPid ? cpuMs(natsPid) : Number.NaN,
    postgres: pgStats.backendCpuMs - (cpuMs(t.pgPid) || 0),
    commits: pgStats.commits,
    updated: pgStats.updated,
    fetched: pgStats.fetched,
    loadgen: (self.user + self.system) / 1000,
  };
}

const CPU_GROUPS = ['gateways', 'workers', 'replicas', 'nats', 'postgres', 'loadgen'];

async function asyncEndToEnd() {
  const { default: pg } = await import('pg');
  console.log(
    `\n(c) Async end to end: \`return null\`, ${ASYNC_CONCURRENCY} closed-loop callers of ?async=true for ${ASYNC_DURATION} s a round, ${ASYNC_ROUNDS} rounds per target, alternating`,
  );
  const backlog = {
    FERRY_MAX_ASYNC_BACKLOG: String(MAX_ASYNC_BACKLOG),
    FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT: String(MAX_ASYNC_BACKLOG),
  };
  // The cluster: 2 gateways and 2 workers (BENCH_ASYNC_GATEWAYS, BENCH_ASYNC_WORKERS) on one database and
  // one cluster name.
  const clusterDb = await createDatabase(ADMIN_URL, DATABASE_PREFIX);
  const clusterName = `${CLUSTER_PREFIX}${crypto.randomBytes(4).toString('hex')}`;
  onCleanup(() => deleteClusterStreams(NATS_URL, clusterName));
  const common = {
    FERRY_DATABASE_URL: clusterDb,
    FERRY_NATS_URL: NATS_URL,
    FERRY_CLUSTER_NAME: clusterName,
    FERRY_KEYS_DIR: await tempDir('ferry-bench-cluster-c-keys-'),
    ...backlog,
  };
  const clusterAuth = await bootstrapProject(await tempDir('ferry-bench-cluster-c-boot-'), common);
  const start = async (label, env) => {
    const ferry = await startFerry(await tempDir(`ferry-bench-cluster-c-${label}-`), { env });
    console.log(
      `  ${label}: ${env.FERRY_ROLE ? `--role ${env.FERRY_ROLE}` : ''} at ${ferry.url} (pid ${ferry.child.pid})`,
    );
    return ferry;
  };
  const gateways = [];
  for (let i = 1; i <= ASYNC_GATEWAYS; i++)
    gateways.push(await start(`gateway-${i}`, { ...common, FERRY_ROLE: 'gateway' }));
  const workers = [];
  for (let i = 1; i <= ASYNC_WORKERS; i++)
    workers.push(await start(`worker-${i}`, { ...common, FERRY_ROLE: 'worker' }));
  for (const g of gateways) await waitForWorkers(g, clusterAuth, ASYNC_WORKERS);
  // The other target: one `--role all` process on a database of its own, no NATS (the store queue).
  const allDb = await createDatabase(ADMIN_URL, DATABASE_PREFIX);
  const allEnv = {
    FERRY_DATABASE_URL: allDb,
    FERRY_KEYS_DIR: await tempDir('ferry-bench-cluster-c-allkeys-'),
    FERRY_ROLE: 'all',
    ...backlog,
  };
  const allAuth = await bootstrapProject(await tempDir('ferry-bench-cluster-c-allboot-'), allEnv);
  const all = await start('all', allEnv);
  console.log(
    `  databases ${new URL(clusterDb).pathname.slice(1)} (cluster ${clusterName}, NATS ${NATS_URL}) and ${new URL(allDb).pathname.slice(1)} (all, no NATS)`,
  );
  // The diagnostic: ASYNC_SPLIT_ALL `--role all` processes on one database of their own, sharing keys and artifacts.
  const splits = [];
  let split;
  if (ASYNC_SPLIT_ALL > 0) {
    const splitDb = await createDatabase(ADMIN_URL, DATABASE_PREFIX);
    const splitEnv = {
      FERRY_DATABASE_URL: splitDb,
      FERRY_KEYS_DIR: await tempDir('ferry-bench-cluster-c-splitkeys-'),
      FERRY_ARTIFACTS_DIR: await tempDir('ferry-bench-cluster-c-splitartifacts-'),
      FERRY_ROLE: 'all',
      ...backlog,
    };
    const splitAuth = await bootstrapProject(await tempDir('ferry-bench-cluster-c-splitboot-'), splitEnv);
    for (let i = 1; i <= ASYNC_SPLIT_ALL; i++) splits.push(await start(`split-all-${i}`, splitEnv));
    await deployApp(splits[0], splitAuth, 'noop', NOOP);
    split = {
      name: 'split',
      label: `${ASYNC_SPLIT_ALL} × --role all, PostgreSQL alone (a diagnostic)`,
      urls: splits.map((n) => n.url),
      entry: splits[0],
      nodes: splits,
      gateways: [],
      workers: splits,
      auth: splitAuth,
      databaseUrl: splitDb,
    };
  }
  await deployApp(gateways[0], clusterAuth, 'noop', NOOP);
  await deployApp(all, allAuth, 'noop', NOOP);
  console.log('  app noop: min_replicas 1, max_replicas 2, replica_concurrency 64; body {}');

  const targets = [
    {
      name: 'cluster',
      label: `${ASYNC_GATEWAYS} gateway${ASYNC_GATEWAYS === 1 ? '' : 's'} + ${ASYNC_WORKERS} worker${ASYNC_WORKERS === 1 ? '' : 's'}, PostgreSQL + NATS`,
      urls: gateways.map((g) => g.url),
      entry: gateways[0],
      nodes: [...gateways, ...workers],
      gateways,
      workers,
      auth: clusterAuth,
      databaseUrl: clusterDb,
    },
    {
      name: 'all',
      label: 'one --role all, PostgreSQL alone',
      urls: [all.url],
      entry: all,
      nodes: [all],
      gateways: [],
      workers: [all],
      auth: allAuth,
      databaseUrl: allDb,
    },
    ...(split ? [split] : []),
  ];
  for (const t of targets) {
    t.pg = new pg.Client({ connectionString: t.databaseUrl });
    t.pg.on('error', () => {});
    await t.pg.connect();
    // The bench's own backend, left out of the database's CPU figures.
    t.pgPid = (await t.pg.query('SELECT pg_backend_pid() AS pid')).rows[0].pid;
    onCleanup(() => t.pg.end().catch(() => {}));
    t.path = `/v4/${t.auth.projectId}/noop/run?async=true`;
    t.headers = { 'content-type': 'application/json', authorization: `Bearer ${t.auth.token}` };
    t.rounds = [];
    t.runs = [];
    // One async call through each entry point, polled to success: the path works before it is timed.
    for (const url of t.urls) {
      const res = await http(`${url}${t.path}`, { method: 'POST', token: t.auth.token, body: {} });
      if (res.status !== 202) throw new Error(`${t.name}: the first async call answered ${res.status}: ${res.text}`);
      const done = await waitFor(
        async () => {
          const r = await http(`${url}/v2/projects/${t.auth.projectId}/apps/noop/runs/${res.json.run_id}`, {
            token: t.auth.token,
          });
          return TERMINAL.includes(r.json?.state) ? r.json : undefined;
        },
        { ms: 60_000, what: `${t.name}: the first async run to end` },
      );
      if (done.state !== 'success') throw new Error(`${t.name}: the first async run ended ${done.state}`);
    }
    if (ASYNC_WARMUP > 0) {
      const since = new Date().toISOString();
      const base = await endedCount(t);
      const w = await asyncLoad(t.urls, t.path, t.headers, ASYNC_CONCURRENCY, ASYNC_WARMUP);
      await drainRuns(t, since, base, w.accepted);
    }
  }
  console.log(`  warm-up: ${ASYNC_WARMUP} s of the same load per target, drained`);
  const natsPid = natsServerPid();
  const sandbox = await sandboxReport(all);
  console.log(`  sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log('  (the target not being measured stays up, idle)\n');

  for (const t of targets) t.scans0 = await tableScans(t.pg);
  let stagesTotal;
  const lines = [
    [
      'round',
      'target',
      'load avg',
      '202s',
      '202/s',
      '202 p50 ms',
      'errors',
      'ended',
      's to empty',
      'completed/s',
      'runs per node',
    ],
  ];
  for (let round = 1; round <= ASYNC_ROUNDS; round++) {
    for (const t of targets) {
      await sleep(1_000);
      const load = loadAverage();
      const before = t.name === 'cluster' ? await stageBuckets(t.nodes) : undefined;
      const cpu0 = await cpuSnapshot(t, natsPid);
      const since = new Date(Date.now() - 1).toISOString();
      const base = await endedCount(t);
      const t0 = Date.now();
      const r = await asyncLoad(t.urls, t.path, t.headers, ASYNC_CONCURRENCY, ASYNC_DURATION);
      let runs;
      let drainError;
      try {
        runs = await drainRuns(t, since, base, r.accepted);
      } catch (err) {
        drainError = err;
        runs = await roundRuns(t.pg, since);
      }
      const cpu1 = await cpuSnapshot(t, natsPid);
      const ended = runs.filter((x) => TERMINAL.includes(x.state));
      const lastEnd = ended.reduce((m, x) => (Number.isFinite(x.finished) ? Math.max(m, x.finished) : m), t0);
      const seconds = (lastEnd - t0) / 1000;
      const completed = ended.length / seconds;
      const success = ended.filter((x) => x.state === 'success').length;
      const valid = !drainError && r.errors.size === 0 && ended.length === r.accepted && success === ended.length;
      if (before) {
        const delta = bucketDelta(before, await stageBuckets(t.nodes));
        stagesTotal = stagesTotal ? bucketAdd(stagesTotal, delta) : delta;
      }
      const cpuPerRun = Object.fromEntries(CPU_GROUPS.map((g) => [g, ((cpu1[g] - cpu0[g]) / ended.length) * 1000]));
      const pgPerRun = Object.fromEntries(
        ['commits', 'updated', 'fetched'].map((k) => [k, (cpu1[k] - cpu0[k]) / ended.length]),
      );
      const cpuPct = Object.fromEntries(
        CPU_GROUPS.map((g) => [g, ((cpu1[g] - cpu0[g]) / Math.max(1, Date.now() - t0)) * 100]),
      );
      t.rounds.push({
        completed,
        accepted: r.accepted,
        p50: r.latency.median,
        latencies: r.latency,
        valid,
        cpuPerRun,
        cpuPct,
        pgPerRun,
      });
      // One by one: a spread of 120,000 and more arguments overflows the stack (4 + 4 on 16 cores).
      for (const run of ended) t.runs.push(run);
      t.intake ??= [];
      t.intake.push(r.latency.median);
      const owners = new Map();
      for (const x of ended) owners.set(x.owner ?? '-', (owners.get(x.owner ?? '-') ?? 0) + 1);
      const errors = [...r.errors].map(([code, n]) => `${code}×${n}`).join(' ') || '0';
      lines.push([
        String(round),
        t.name,
        load.split(' ')[0] ?? load,
        String(r.accepted),
        fmt(r.accepted / r.seconds, 0),
        fmt(r.latency.median),
        errors,
        `${ended.length}${success === ended.length ? '' : ` (${success} success)`}`,
        fmt(seconds, 1),
        fmt(completed, 0) + (valid ? '' : ' (not judged)'),
        [...owners.values()].sort((a, b) => b - a).join('/'),
      ]);
      console.log(
        `  round ${round} ${t.name}: ${r.accepted} 202s, ${ended.length} ended in ${fmt(seconds, 1)} s: ${fmt(completed, 0)} runs/s, 202 p50 ${fmt(r.latency.median)} ms${drainError ? `; NOT drained: ${drainError.message}` : ''} (load ${load})`,
      );
    }
  }
  console.log(`\n${table(lines)}`);
  console.log(
    '\n202/s: 202s ÷ the load\'s seconds; completed/s: runs ended ÷ (load start → the last run\'s finished_at); "s to empty" is that span.',
  );

  // Summary.
  const median = (xs) => summarize(xs).median;
  const [cl, al, sp] = targets;
  const clRate = median(cl.rounds.map((x) => x.completed));
  const alRate = median(al.rounds.map((x) => x.completed));
  const spRate = sp ? median(sp.rounds.map((x) => x.completed)) : Number.NaN;
  const ratio = clRate / alRate;
  const pairs = cl.rounds.map((x, i) => fmt(x.completed / al.rounds[i].completed));
  const valid = targets.every((t) => t.rounds.every((x) => x.valid));
  console.log(
    `\n${table([
      ['target', 'completed runs/s (median of rounds)', '202 p50 ms (median of rounds)'],
      [`cluster (${cl.label})`, fmt(clRate, 0), fmt(median(cl.intake))],
      [`all (${al.label})`, fmt(alRate, 0), fmt(median(al.intake))],
      ...(sp ? [[`split (${sp.label})`, fmt(spRate, 0), fmt(median(sp.intake))]] : []),
    ])}`,
  );
  if (sp) {
    console.log(
      `split / role-all completed runs/s: ${fmt(spRate / alRate)} (round by round ${sp.rounds.map((x, i) => fmt(x.completed / al.rounds[i].completed)).join(', ')}; ${ASYNC_SPLIT_ALL} --role all processes against one, a diagnostic, not judged)`,
    );
  }
  console.log(
    `cluster / role-all completed runs/s: ${fmt(ratio)} (round by round ${pairs.join(', ')}; target ≥ ${TARGET_ASYNC_RATIO}): ${
      !valid
        ? 'not judged (errors, or runs not ended success)'
        : ASYNC_GATEWAYS !== 2 || ASYNC_WORKERS !== 2
          ? 'not judged (the target is for 2 gateways and 2 workers; this is a diagnostic)'
          : ratio >= TARGET_ASYNC_RATIO
            ? 'met'
            : 'NOT met'
    }`,
  );

  // Which scans of the runs table read the most rows (pg_stat_user_tables and _indexes, over all rounds).
  for (const t of targets) {
    const after = await tableScans(t.pg);
    const runs = t.rounds.reduce((a, x) => a + x.accepted, 0);
    const rows = [...after]
      .map(([name, n]) => [name, (n - (t.scans0.get(name) ?? 0)) / runs])
      .filter(([, n]) => n >= 0.05)
      .sort((a, b) => b[1] - a[1])
      .map(([name, n]) => `${name} ${fmt(n, 1)}`);
    console.log(`rows read per run on runs, by index (seq: sequential scans), ${t.name}: ${rows.join(', ') || 'none'}`);
  }

  // Where the CPU goes.
  const cpuRow = (t, g) => [
    g === 'workers' ? ({ all: 'the all process', split: 'the all processes' }[t.name] ?? g) : g,
    fmt(median(t.rounds.map((x) => x.cpuPerRun[g])), 0),
    fmt(median(t.rounds.map((x) => x.cpuPct[g])), 0),
  ];
  console.log(
    "\nCPU per completed run (µs) and % of one core, load start -> queue empty (median of rounds); nats: the machine's nats-server, postgres: the backends connected to the target's database but the bench's own\n",
  );
  /** A target's CPU table: a row per process group, then the groups' total (medians of the rounds). */
  const cpuTable = (t, groups) => {
    const total = (field) =>
      median(t.rounds.map((x) => groups.reduce((a, g) => a + (Number.isFinite(x[field][g]) ? x[field][g] : 0), 0)));
    return table([
      [t.name, 'µs per run', '% of a core'],
      ...groups.map((g) => cpuRow(t, g)),
      ['total', fmt(total('cpuPerRun'), 0), fmt(total('cpuPct'), 0)],
    ]);
  };
  console.log(cpuTable(cl, CPU_GROUPS));
  for (const t of [al, ...(sp ? [sp] : [])]) {
    console.log('');
    console.log(
      cpuTable(
        t,
        CPU_GROUPS.filter((g) => g !== 'gateways'),
      ),
    );
  }

  console.log(
    `\nPostgreSQL per completed run (pg_stat_database, median of rounds; the bench's one read of the round's runs included): ${targets
      .map(
        (t) =>
          `${t.name} ${['commits', 'updated', 'fetched']
            .map(
              (k) =>
                `${k === 'commits' ? 'transactions' : `rows ${k}`} ${fmt(median(t.rounds.map((x) => x.pgPerRun[k])))}`,
            )
            .join(', ')}`,
      )
      .join('; ')}`,
  );

  // Where a run's time goes.
  const stat = (xs) => summarize(xs.filter(Number.isFinite));
  const rowOf = (name, source, s) => [name, source, String(s.n), fmt(s.median), fmt(s.p90)];
  const hist = (stage) => {
    const b = stagesTotal?.[stage] ?? [];
    return { n: b.at(-1)?.[1] ?? 0, median: bucketQuantile(b, 0.5), p90: bucketQuantile(b, 0.9) };
  };
  const intakeAll = (t) => ({
    n: t.rounds.reduce((a, x) => a + x.accepted, 0),
    median: median(t.intake),
    p90: median(t.rounds.map((x) => x.latencies.p90)),
  });
  console.log(`\nWhere a cluster run's time goes (all ${ASYNC_ROUNDS} cluster rounds; ms)\n`);
  console.log(
    table([
      ['stage', 'measured by', 'runs', 'p50', 'p90'],
      rowOf('intake: request -> 202', 'the load generator (median of rounds)', intakeAll(cl)),
      rowOf('publish: committed -> stored in the stream', 'ferry_async_stage_seconds (gateways)', hist('publish')),
      rowOf('claim: stored -> claimed by a worker', 'ferry_async_stage_seconds (workers)', hist('claim')),
      rowOf('start: claimed -> start written', 'ferry_async_stage_seconds (workers)', hist('start')),
      rowOf(
        'finish: started -> finished',
        'runs: started_at -> finished_at',
        stat(cl.runs.map((x) => x.finished - x.started)),
      ),
      rowOf('ack: done -> message acknowledged', 'ferry_async_stage_seconds (workers)', hist('ack')),
      rowOf(
        '(all of it) created -> finished',
        'runs: created_at -> finished_at',
        stat(cl.runs.map((x) => x.finished - x.created)),
      ),
      rowOf(
        '(queue) created -> started',
        'runs: created_at -> started_at',
        stat(cl.runs.map((x) => x.started - x.created)),
      ),
    ]),
  );
  console.log(`\nThe same from the --role all rounds (no JetStream: the store queue; ms)\n`);
  console.log(
    table([
      ['stage', 'measured by', 'runs', 'p50', 'p90'],
      rowOf('intake: request -> 202', 'the load generator (median of rounds)', intakeAll(al)),
      rowOf(
        '(queue) created -> started',
        'runs: created_at -> started_at',
        stat(al.runs.map((x) => x.started - x.created)),
      ),
      rowOf(
        'finish: started -> finished',
        'runs: started_at -> finished_at',
        stat(al.runs.map((x) => x.finished - x.started)),
      ),
      rowOf(
        '(all of it) created -> finished',
        'runs: created_at -> finished_at',
        stat(al.runs.map((x) => x.finished - x.created)),
      ),
    ]),
  );
  console.log(
    '\nHistogram stages are quantiles of bucket counts (bounds 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500 ms, ...), linear within a bucket;' +
      " claim compares the NATS server's clock with the worker's (one machine here). Timestamps of the records are whole ms.",
  );
  console.log(`load average at end of (c): ${loadAverage()}`);
  for (const t of targets) await t.pg.end().catch(() => {});
  for (const n of [...gateways, ...workers, all, ...splits]) await n.stop();
}

async function main() {
  requireDist();
  console.log('Ferry bench: gateways and workers (PostgreSQL + NATS JetStream)\n');
  console.log(machineReport());
  console.log(`parts: ${[...PARTS].sort().join(', ')} (BENCH_CLUSTER_PARTS)`);
  if (PARTS.has('a') || PARTS.has('b')) await hopAndCapacity();
  if (PARTS.has('c')) await asyncEndToEnd();
}

/** Parts (a) and (b): one database and cluster, one gateway throughout. */
async function hopAndCapacity() {
  const databaseUrl = await createDatabase(ADMIN_URL, DATABASE_PREFIX);
  const cluster = `${CLUSTER_PREFIX}${crypto.randomBytes(4).toString('hex')}`;
  onCleanup(() => deleteClusterStreams(NATS_URL, cluster));
  const keysDir = await tempDir('ferry-bench-cluster-keys-');
  const common = {
    FERRY_DATABASE_URL: databaseUrl,
    FERRY_NATS_URL: NATS_URL,
    FERRY_CLUSTER_NAME: cluster,
    FERRY_KEYS_DIR: keysDir,
  };
  const start = async (label, role, extra = {}) => {
    const dataDir = await tempDir(`ferry-bench-cluster-${label}-`);
    const ferry = await startFerry(dataDir, { env: { ...common, FERRY_ROLE: role, ...extra } });
    console.log(`  ${label}: --role ${role} at ${ferry.url} (pid ${ferry.child.pid})`);
    return ferry;
  };
  const auth = await bootstrapProject(await tempDir('ferry-bench-cluster-boot-'), common);
  console.log(`database ${new URL(databaseUrl).pathname.slice(1)}, NATS ${NATS_URL}, cluster ${cluster}`);
  console.log(
    `sandbox: ${process.env.FERRY_SANDBOX === 'off' ? 'off (FERRY_SANDBOX=off)' : 'as ferry doctor reports (bubblewrap when present)'}`,
  );

  const gateway = await start('gateway', 'gateway');
  const headers = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  if (PARTS.has('a')) await hop(start, gateway, auth);
  if (PARTS.has('b')) await capacity(start, gateway, auth, headers, databaseUrl);
  await gateway.stop();
}

/** (a) the hop. */
async function hop(start, gateway, auth) {
  console.log(
    `\n(a) The gateway-to-worker hop: one call at a time, \`all\` and gateway in turn, timed after ${HOP_WARMUP} rounds of warm-up`,
  );
  const all = await start('all', 'all');
  const worker = await start('worker-hop', 'worker');
  await waitForWorkers(gateway, auth, 1);
  await deployApp(gateway, auth, 'echo', ECHO);
  const headers = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  const echoPath = `/v4/${auth.projectId}/echo/run`;
  const targets = [
    { name: '--role all', client: new Client(all.url), path: echoPath, headers },
    { name: 'gateway -> worker', client: new Client(gateway.url), path: echoPath, headers },
  ];
  const [allLat, gwLat] = await unloaded(targets, LATENCY_REQUESTS, HOP_WARMUP);
  for (const t of targets) await t.client.close();
  const added = gwLat.median - allLat.median;
  console.log(
    table([
      ['target', 'calls', 'p50 ms', 'p90 ms', 'p99 ms'],
      ['--role all', LATENCY_REQUESTS, fmt(allLat.median), fmt(allLat.p90), fmt(allLat.p99)],
      ['gateway -> worker', LATENCY_REQUESTS, fmt(gwLat.median), fmt(gwLat.p90), fmt(gwLat.p99)],
    ]),
  );
  console.log(
    `added by the hop at p50: ${fmt(added, 3)} ms (target < ${TARGET_ADDED_P50_MS} ms): ${added < TARGET_ADDED_P50_MS ? 'met' : 'NOT met'}`,
  );
  await all.stop();
  await worker.stop();
}

/** (b) capacity. */
async function capacity(start, gateway, auth, headers, databaseUrl) {
  console.log(
    `\n(b) Capacity: sleep(50 ms), ${SLOTS_PER_WORKER} slots per worker (FERRY_WORKER_MAX_REPLICAS=1, replica_concurrency ${SLOTS_PER_WORKER}), ${CONCURRENCY} callers, ${DURATION} s each`,
  );
  const workers = [];
  const results = [];
  for (const n of [1, 2, 3]) {
    while (workers.length < n) {
      workers.push(await start(`worker-${workers.length + 1}`, 'worker', { FERRY_WORKER_MAX_REPLICAS: '1' }));
    }
    await waitForWorkers(gateway, auth, n);
    if (n === 1) await deployApp(gateway, auth, 'sleepy', SLEEPY);
    const url = `${gateway.url}/v4/${auth.projectId}/sleepy/run`;
    // Warm-up: every worker gets its replica before the measured run.
    await closedLoop(url, headers, CONCURRENCY, 3);
    const load0 = loadAverage();
    const since = new Date().toISOString();
    const r = await closedLoop(url, headers, CONCURRENCY, DURATION);
    results.push(r);
    // Which worker ran how many of the measured runs (each run's record names the node that ran it).
    const share = await runsPerNode(databaseUrl, since);
    const errors = [...r.errors].map(([code, count]) => `${code}×${count}`).join(' ') || 'none';
    console.log(
      `  ${n} worker${n > 1 ? 's' : ''}: ${fmt(r.rps, 1)} runs/s, p50 ${fmt(r.latency.median)} ms, errors ${errors}, runs per worker ${share} (load ${load0})`,
    );
  }
  const ratio = (i) => results[i].rps / results[0].rps;
  console.log(
    table([
      ['workers', 'runs/s', 'vs 1 worker', 'target', ''],
      ['1', fmt(results[0].rps, 1), '1.00×', '', ''],
      [
        '2',
        fmt(results[1].rps, 1),
        `${fmt(ratio(1))}×`,
        `≥ ${TARGET_TWO}×`,
        ratio(1) >= TARGET_TWO ? 'met' : 'NOT met',
      ],
      [
        '3',
        fmt(results[2].rps, 1),
        `${fmt(ratio(2))}×`,
        `≥ ${TARGET_THREE}×`,
        ratio(2) >= TARGET_THREE ? 'met' : 'NOT met',
      ],
    ]),
  );
  console.log(`ideal: ${fmt((SLOTS_PER_WORKER * 1000) / 50, 0)} runs/s per worker (${SLOTS_PER_WORKER} slots / 50 ms)`);
  for (const w of workers) await w.stop();
}

await runMain(main);
