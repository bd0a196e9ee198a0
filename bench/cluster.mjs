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
 *
 *   npm run build && npm run bench:cluster
 *   BENCH_LATENCY_REQUESTS=2000 BENCH_HOP_WARMUP=3000 BENCH_DURATION=10 BENCH_CONCURRENCY=24 npm run bench:cluster
 *
 * The hop is timed after BENCH_HOP_WARMUP rounds (3000) of the same calls, unmeasured: the processes are
 * new, and their first two thousand or so calls are slower for both targets while V8 compiles the hot
 * path (on 2026-11-25, rounds 1-400 added 1.24 ms at p50, rounds 2800-3200 0.32 to 0.47 ms). The other
 * benches time latency after their load phases, on warm processes; this does the same.
 */
import crypto from 'node:crypto';
import { Client, Pool } from 'undici';
import {
  bootstrapProject,
  createDatabase,
  deleteClusterStreams,
  deployApp,
  envInt,
  fmt,
  http,
  loadAverage,
  machineReport,
  onCleanup,
  requireDist,
  runMain,
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

const TARGET_ADDED_P50_MS = 1;
const TARGET_TWO = 1.8;
const TARGET_THREE = 2.6;

const ECHO = {
  'ferry.toml': '[app]\nname = "echo"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 64\n',
  'main.ts': 'export function run() { return { ok: true }; }\n',
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

async function main() {
  requireDist();
  console.log('Ferry bench: gateways and workers (PostgreSQL + NATS JetStream)\n');
  console.log(machineReport());
  const databaseUrl = await createDatabase(ADMIN_URL, 'ferry_bench_cluster_');
  const cluster = `bench_${crypto.randomBytes(4).toString('hex')}`;
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

  // ---- (a) the hop ----
  console.log(
    `\n(a) The gateway-to-worker hop: one call at a time, \`all\` and gateway in turn, timed after ${HOP_WARMUP} rounds of warm-up`,
  );
  const all = await start('all', 'all');
  const gateway = await start('gateway', 'gateway');
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

  // ---- (b) capacity ----
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
  await gateway.stop();
}

await runMain(main);
