#!/usr/bin/env node
/**
 * Async runs of a no-op function: how many `?async=true` calls Ferry accepts per second (each answered
 * 202 only once its run is committed to the store), and how many of those runs it completes per second,
 * next to synchronous calls of the same function measured in the same run. Prints figures and the
 * targets of issue 4; asserts nothing about timing (shared, noisy machines).
 *
 * On the embedded SQLite store, and with `--database-url <url>` (or FERRY_DATABASE_URL) also on
 * PostgreSQL, one store after the other, then both side by side. The URL names any database of the
 * PostgreSQL server the user may create databases on (e.g. postgres://postgres@127.0.0.1:5432/postgres):
 * the bench creates its own database there, runs Ferry on it and drops it at the end.
 *
 *   npm run build && npm run bench:async
 *   npm run bench:async -- --database-url postgres://postgres@127.0.0.1:5432/postgres
 *   npm run bench:async -- --database-url postgres://postgres@127.0.0.1:5432/postgres --nats-url nats://127.0.0.1:4222
 *   BENCH_DURATION=10 BENCH_WARMUP=2 BENCH_CONNECTIONS=32 BENCH_SYNC_DURATION=5 npm run bench:async
 */
import autocannon from 'autocannon';
import {
  cpuMs,
  createDatabase,
  envInt,
  fetchMetrics,
  fmt,
  http,
  loadAverage,
  machineReport,
  metricSum,
  pgDatabaseStats,
  replicaGauges,
  requireDist,
  runMain,
  sandboxReport,
  sleep,
  startDeployed,
  summarize,
  table,
  waitFor,
} from './lib.mjs';

const DURATION = envInt('BENCH_DURATION', 10);
const WARMUP = envInt('BENCH_WARMUP', 2, 0);
const CONNECTIONS = envInt('BENCH_CONNECTIONS', 32);
const SYNC_DURATION = envInt('BENCH_SYNC_DURATION', 5);
const DRAIN_TIMEOUT_S = envInt('BENCH_DRAIN_TIMEOUT', 600);
/** The name of the database the bench creates on PostgreSQL starts with this (several benches on one server). */
const DATABASE_PREFIX = process.env.BENCH_DATABASE_PREFIX || 'ferry_bench_';
const SAMPLE_MS = 200;
/** Far above what the bench can submit, so neither backlog limit (429) caps the accept rate. */
const MAX_ASYNC_BACKLOG = 10_000_000;
const APP = 'noop';

const TARGET_ACCEPTED = 8000; // accepted (committed) async runs per second, at least (issue 15; issue 4 asked 3000)
const TARGET_COMPLETED = 3000; // async runs completed per second, at least (issue 4's bar)

const APP_FILES = {
  'ferry.toml': `[app]
name = "${APP}"

[scaling]
min_replicas = 1
max_replicas = 2
replica_concurrency = 64
response_grace_period = 30
`,
  'main.ts': 'export function run() { return null; }\n',
};

/** Runs of the app that have ended (any state) and that ended `success`, from ferry_runs_total. */
async function endedRuns(ferry, projectId) {
  const text = await fetchMetrics(ferry);
  const labels = { project: projectId, app: APP };
  return {
    ended: metricSum(text, 'ferry_runs_total', labels),
    success: metricSum(text, 'ferry_runs_total', { ...labels, state: 'success' }),
  };
}

/**
 * Reads ferry_runs_total every SAMPLE_MS in the background: [{ t (performance.now() at the middle of the
 * scrape), ended, success, accepted (202s seen so far by the load generator) }].
 */
function startSampler(ferry, projectId, acceptedSoFar) {
  const samples = [];
  let stopped = false;
  const loop = (async () => {
    while (!stopped) {
      const t0 = performance.now();
      const counts = await endedRuns(ferry, projectId);
      samples.push({ t: (t0 + performance.now()) / 2, ...counts, accepted: acceptedSoFar() });
      await sleep(SAMPLE_MS);
    }
  })();
  return {
    samples,
    async stop() {
      stopped = true;
      await loop;
    },
  };
}

/** The counter at time `t`, interpolated linearly between the two samples around it. */
function counterAt(samples, t, key = 'ended') {
  if (samples.length === 0) return Number.NaN;
  if (t <= samples[0].t) return samples[0][key];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1];
    const b = samples[i];
    if (t <= b.t) return a[key] + ((b[key] - a[key]) * (t - a.t)) / (b.t - a.t);
  }
  return samples.at(-1)[key];
}

/** The unfinished (queued or running) runs of the app, from the management API: 0, or at least 1. */
async function unfinished(ferry, auth) {
  let n = 0;
  for (const state of ['queued', 'running']) {
    const res = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}/runs?state=${state}&limit=1`, {
      token: auth.token,
    });
    if (res.status !== 200) throw new Error(`GET runs?state=${state} answered ${res.status}: ${res.text}`);
    n += res.json.runs?.length ?? 0;
  }
  return n;
}

/** Waits until `expected` more runs than `base` have ended and the store holds no unfinished run. */
async function drain(ferry, auth, base, expected) {
  await waitFor(
    async () => {
      const { ended } = await endedRuns(ferry, auth.projectId);
      return ended - base >= expected && (await unfinished(ferry, auth)) === 0;
    },
    { ms: DRAIN_TIMEOUT_S * 1000, everyMs: SAMPLE_MS, what: `${expected} async runs to finish` },
  );
}

/** Non-2xx status codes of an autocannon result, as "429×12 503×1". */
function otherCodes(result, ok) {
  return Object.entries(result.statusCodeStats ?? {})
    .filter(([code]) => code !== ok)
    .map(([code, { count }]) => `${code}×${count}`)
    .join(' ');
}

/** The replicas' node processes (not their bwrap parents) and their CPU time so far, in ms. */
function replicaCpu(ferry) {
  return ferry
    .replicaProcesses()
    .filter((p) => p.comm !== 'bwrap')
    .reduce((sum, p) => sum + (cpuMs(p.pid) || 0), 0);
}

/** Synchronous calls of the function: autocannon with its own warm-up, 200s counted. */
async function syncLoad(url, headers) {
  process.stdout.write(`  sync: ${WARMUP} s warm-up + ${SYNC_DURATION} s, ${CONNECTIONS} connections... `);
  const common = { url, headers, method: 'POST', body: '{}', connections: CONNECTIONS, pipelining: 1 };
  if (WARMUP > 0) await autocannon({ ...common, duration: WARMUP });
  const latencies = [];
  const instance = autocannon({ ...common, duration: SYNC_DURATION });
  instance.on('response', (_client, statusCode, _bytes, ms) => {
    if (statusCode === 200) latencies.push(ms);
  });
  const t0 = performance.now();
  const result = await instance;
  const seconds = (performance.now() - t0) / 1000;
  const lat = summarize(latencies);
  const rate = latencies.length / seconds;
  console.log(`${Math.round(rate)} runs/s`);
  return {
    rate,
    count: latencies.length,
    p50: lat.median,
    p99: lat.p99,
    other: result.non2xx + (result['2xx'] - latencies.length),
    errors: result.errors + result.timeouts,
    codes: otherCodes(result, '200'),
  };
}

/** The PostgreSQL server to measure on too: `--database-url <url>`, `--database-url=<url>` or FERRY_DATABASE_URL. */
function argument(name, envName) {
  const args = process.argv.slice(2);
  for (let i = 0; i < args.length; i++) {
    if (args[i] === '--database-url' || args[i] === '--nats-url') {
      if (args[i] === name) return args[i + 1];
      i++;
      continue;
    }
    if (args[i].startsWith(`${name}=`)) return args[i].slice(name.length + 1);
    if (args[i].startsWith('--database-url=') || args[i].startsWith('--nats-url=')) continue;
    console.error(
      `unknown argument ${args[i]} (the bench takes --database-url <postgres://...> and --nats-url <nats://...>)`,
    );
    process.exit(2);
  }
  return process.env[envName] || undefined;
}

/** Deletes the bench cluster's streams (runs stream, artifacts bucket) from NATS. */
async function deleteNatsCluster(natsUrl, cluster) {
  const { connect } = await import('@nats-io/transport-node');
  const { jetstreamManager } = await import('@nats-io/jetstream');
  const nc = await connect({ servers: natsUrl, timeout: 5000 });
  try {
    const jsm = await jetstreamManager(nc);
    for (const stream of [`${cluster}_runs`, `OBJ_${cluster}_artifacts`])
      await jsm.streams.delete(stream).catch(() => false);
  } finally {
    await nc.close();
  }
}

/** The whole bench on one store: prints its tables and returns the figures for the side-by-side table. */
async function measure(store) {
  console.log(`\n=== Store: ${store.name} ===\n`);
  const env = {
    FERRY_MAX_ASYNC_BACKLOG: String(MAX_ASYNC_BACKLOG),
    FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT: String(MAX_ASYNC_BACKLOG),
  };
  if (store.adminUrl) {
    env.FERRY_DATABASE_URL = await createDatabase(store.adminUrl, DATABASE_PREFIX);
    console.log(
      `database: ${new URL(env.FERRY_DATABASE_URL).pathname.slice(1)} (created for this run, dropped at the end)`,
    );
  }
  if (store.natsUrl) {
    env.FERRY_NATS_URL = store.natsUrl;
    env.FERRY_CLUSTER_NAME = `bench_${process.pid}`;
    console.log(`NATS: ${store.natsUrl}, cluster ${env.FERRY_CLUSTER_NAME} (its streams deleted at the end)`);
  }
  const { auth, ferry } = await startDeployed(`async-${store.key}`, APP, APP_FILES, env);
  console.log(
    `FERRY_MAX_ASYNC_BACKLOG=FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT=${MAX_ASYNC_BACKLOG} (so 429s do not cap the accept rate)`,
  );

  const runPath = `/v4/${auth.projectId}/${APP}/run`;
  const headers = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  const first = await http(`${ferry.url}${runPath}`, { method: 'POST', token: auth.token, body: {} });
  if (first.status !== 200 || first.json?.result !== null)
    throw new Error(`the first sync run answered ${first.status}: ${first.text}`);
  const accepted = await http(`${ferry.url}${runPath}?async=true`, { method: 'POST', token: auth.token, body: {} });
  if (accepted.status !== 202 || !accepted.json?.run_id)
    throw new Error(`the first async run answered ${accepted.status}: ${accepted.text}`);
  const done = await waitFor(
    async () => {
      const r = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}/runs/${accepted.json.run_id}`, {
        token: auth.token,
      });
      return ['success', 'failure', 'timeout', 'cancelled'].includes(r.json?.state) ? r.json : undefined;
    },
    { ms: 30_000, what: 'the first async run to finish' },
  );
  if (done.state !== 'success') throw new Error(`the first async run ended ${done.state}: ${JSON.stringify(done)}`);
  const sandbox = await sandboxReport(ferry);
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log(`app: ${APP}, min_replicas 1, max_replicas 2, replica_concurrency 64; body {}`);

  console.log('\nLoad (autocannon, pipelining 1), one phase after the other:');
  // (s) The same function called synchronously: what the caller gets without durability.
  const sync = await syncLoad(`${ferry.url}${runPath}`, headers);
  await sleep(1000);

  const asyncOpts = {
    url: `${ferry.url}${runPath}?async=true`,
    headers,
    method: 'POST',
    body: '{}',
    connections: CONNECTIONS,
    pipelining: 1,
  };
  if (WARMUP > 0) {
    process.stdout.write(`  async warm-up: ${WARMUP} s, then until its runs have finished... `);
    const base = (await endedRuns(ferry, auth.projectId)).ended;
    const w = await autocannon({ ...asyncOpts, duration: WARMUP });
    await drain(ferry, auth, base, w.statusCodeStats?.['202']?.count ?? 0);
    console.log('done');
    await sleep(1000);
  }

  // (a) Accepting: DURATION seconds of ?async=true. The sampler keeps reading the completion counter,
  // during the load and after it while the backlog drains.
  process.stdout.write(`  async: ${DURATION} s, ${CONNECTIONS} connections, then until the backlog is empty... `);
  const base = await endedRuns(ferry, auth.projectId);
  let acceptedCount = 0;
  const latencies = [];
  const sampler = startSampler(ferry, auth.projectId, () => acceptedCount);
  await sleep(2 * SAMPLE_MS);
  const instance = autocannon({ ...asyncOpts, duration: DURATION });
  instance.on('response', (_client, statusCode, _bytes, ms) => {
    if (statusCode === 202) {
      acceptedCount += 1;
      latencies.push(ms);
    }
  });
  const pg0 = env.FERRY_DATABASE_URL ? await pgDatabaseStats(env.FERRY_DATABASE_URL) : undefined;
  const cpu0 = { ferry: cpuMs(ferry.child.pid), replicas: replicaCpu(ferry), self: process.cpuUsage() };
  const t0 = performance.now();
  const result = await instance;
  const t1 = performance.now();
  const cpu1 = {
    ferry: cpuMs(ferry.child.pid),
    replicas: replicaCpu(ferry),
    self: process.cpuUsage(cpu0.self),
  };
  const replicasAtEnd = await replicaGauges(ferry, APP);
  // Drained: every accepted run has ended (counter) and the store has no queued or running run left.
  let drainError;
  try {
    await drain(ferry, auth, base.ended, acceptedCount);
  } catch (err) {
    drainError = err;
  }
  await sleep(2 * SAMPLE_MS);
  await sampler.stop();
  const samples = sampler.samples;
  // Runs committed: the 202s, plus calls the load generator cut when it stopped (answered after it
  // closed their connections, so not counted as 202s) whose runs were committed all the same.
  const final = samples.at(-1);
  const committed = final.ended - base.ended;
  // The drain ended at the first sample that saw the final count (resolution: SAMPLE_MS).
  const endSample = samples.find((s) => s.ended >= final.ended);
  const t2 = endSample.t;
  const cpu2 = { ferry: cpuMs(ferry.child.pid), replicas: replicaCpu(ferry) };
  console.log(drainError ? `NOT drained: ${drainError.message}` : 'done');

  const accSeconds = (t1 - t0) / 1000;
  const acceptRate = acceptedCount / accSeconds;
  const lat = summarize(latencies);
  const tooMany = result.statusCodeStats?.['429']?.count ?? 0;
  const non202 = result.non2xx + (result['2xx'] - acceptedCount);
  const failed = result.errors + result.timeouts;
  const endedInLoad = counterAt(samples, t1) - counterAt(samples, t0);
  const endedInDrain = endSample.ended - counterAt(samples, t1);
  const drainSeconds = (t2 - t1) / 1000;
  const totalSeconds = (t2 - t0) / 1000;
  const succeeded = final.success - base.success;
  const peakBacklog = Math.max(0, ...samples.map((s) => s.accepted - (s.ended - base.ended)));
  // Peak completion rate: the best 1-second window of the counter (from the samples).
  let peak = 0;
  for (const s of samples) {
    if (s.t < t0 || s.t > t2) continue;
    const back = counterAt(samples, s.t - 1000);
    if (s.t - 1000 >= samples[0].t) peak = Math.max(peak, s.ended - back);
  }
  const completedRate = committed / totalSeconds;

  console.log(
    `\nResults (sync ${SYNC_DURATION} s; async ${DURATION} s of load, ${CONNECTIONS} connections, then the drain)\n`,
  );
  const rows = [['phase', 'runs/s', 'runs', 'seconds', 'p50 ms', 'p99 ms', 'other', 'errors']];
  rows.push([
    '(s) sync calls answered 200',
    fmt(sync.rate, 0),
    String(sync.count),
    fmt(SYNC_DURATION, 1),
    fmt(sync.p50),
    fmt(sync.p99),
    `${sync.other}${sync.codes ? ` (${sync.codes})` : ''}`,
    String(sync.errors),
  ]);
  rows.push([
    '(a) async accepted (202)',
    fmt(acceptRate, 0),
    String(acceptedCount),
    fmt(accSeconds, 1),
    fmt(lat.median),
    fmt(lat.p99),
    `${non202}${result.non2xx > 0 ? ` (${otherCodes(result, '202')})` : ''}`,
    String(failed),
  ]);
  rows.push([
    '(b) async completed during the load',
    fmt(endedInLoad / accSeconds, 0),
    fmt(endedInLoad, 0),
    fmt(accSeconds, 1),
    '-',
    '-',
    '-',
    '-',
  ]);
  rows.push([
    '(c) async completed while draining',
    drainSeconds > 0 ? fmt(endedInDrain / drainSeconds, 0) : '-',
    fmt(endedInDrain, 0),
    fmt(drainSeconds, 1),
    '-',
    '-',
    '-',
    '-',
  ]);
  rows.push([
    '(d) async completed, load start -> empty',
    fmt(completedRate, 0),
    String(committed),
    fmt(totalSeconds, 1),
    '-',
    '-',
    '-',
    '-',
  ]);
  console.log(table(rows));
  console.log(
    `\n429 (a backlog full): ${tooMany}; peak backlog (accepted, not ended): ${peakBacklog}; ` +
      `best 1-s completion window: ${fmt(peak, 0)} runs; runs committed and ended: ${committed} ` +
      `(${acceptedCount} answered 202, ${committed - acceptedCount} cut by the load generator's stop), ` +
      `${succeeded} success`,
  );
  console.log(
    `replicas at the end of the load: ${replicasAtEnd.ready} ready, ${replicasAtEnd.starting} starting (max 2)`,
  );

  const pct = (ms, s) => `${fmt((ms / (s * 1000)) * 100, 0)}%`;
  const per = (ms, n) => (n > 0 ? `${fmt((ms / n) * 1000, 0)} µs` : '-');
  const loadgen = (cpu1.self.user + cpu1.self.system) / 1000;
  console.log('\nCPU (% of one core; CPU time per run that ended in the phase, or per 202 for the load generator)\n');
  console.log(
    table([
      ['phase', 'Ferry', 'Ferry per run', 'replicas', 'load generator'],
      [
        `load (${fmt(accSeconds, 1)} s)`,
        pct(cpu1.ferry - cpu0.ferry, accSeconds),
        per(cpu1.ferry - cpu0.ferry, acceptedCount),
        pct(cpu1.replicas - cpu0.replicas, accSeconds),
        `${pct(loadgen, accSeconds)} ${per(loadgen, acceptedCount)}`,
      ],
      drainSeconds >= 1
        ? [
            `drain (${fmt(drainSeconds, 1)} s)`,
            pct(cpu2.ferry - cpu1.ferry, drainSeconds),
            per(cpu2.ferry - cpu1.ferry, endedInDrain),
            pct(cpu2.replicas - cpu1.replicas, drainSeconds),
            '-',
          ]
        : [`drain (${fmt(drainSeconds, 1)} s)`, 'too short', 'to measure', '-', '-'],
    ]),
  );
  console.log('(Ferry per run in the load phase: CPU / 202s, though it also completed runs during the load.)');
  let pgWork;
  if (pg0) {
    // pg_stat_database is published about once a second: wait for the figures of the drain to arrive.
    await sleep(1500);
    const pg1 = await pgDatabaseStats(env.FERRY_DATABASE_URL);
    const per = (n) => fmt(n / committed, 2);
    pgWork = {
      commitsPerRun: (pg1.commits - pg0.commits) / committed,
      updatedPerRun: (pg1.updated - pg0.updated) / committed,
      fetchedPerRun: (pg1.fetched - pg0.fetched) / committed,
      backendCpuPerRunUs: ((pg1.backendCpuMs - pg0.backendCpuMs) / committed) * 1000,
      backendCpuPct: ((pg1.backendCpuMs - pg0.backendCpuMs) / (totalSeconds * 1000)) * 100,
    };
    console.log(
      `\nPostgreSQL, load start -> empty (${fmt(totalSeconds, 1)} s, ${committed} runs): ` +
        `${pg1.commits - pg0.commits} transactions committed (${per(pg1.commits - pg0.commits)} per run), ` +
        `rows inserted ${pg1.inserted - pg0.inserted} (${per(pg1.inserted - pg0.inserted)}), ` +
        `updated ${pg1.updated - pg0.updated} (${per(pg1.updated - pg0.updated)}), ` +
        `fetched ${pg1.fetched - pg0.fetched} (${per(pg1.fetched - pg0.fetched)}); ` +
        `its ${pg1.backends} backends for Ferry: ${fmt(pgWork.backendCpuPct, 0)}% of a core, ` +
        `${fmt(pgWork.backendCpuPerRunUs, 0)} µs per run`,
    );
  }

  const valid =
    !drainError &&
    failed === 0 &&
    non202 === 0 &&
    acceptedCount > 0 &&
    committed >= acceptedCount &&
    succeeded === committed;
  const verdict = (met) => (valid ? (met ? 'met' : 'NOT met') : 'not judged (errors, or runs not finished)');
  console.log(`\nTargets (issue 4; set for SQLite, the embedded default, and shown for ${store.name})\n`);
  console.log(
    table([
      ['figure', 'value', 'target', 'verdict'],
      [
        'accepted async runs/s (a)',
        fmt(acceptRate, 0),
        `>= ${TARGET_ACCEPTED}`,
        verdict(acceptRate >= TARGET_ACCEPTED),
      ],
      [
        'completed async runs/s (d)',
        fmt(completedRate, 0),
        `>= ${TARGET_COMPLETED}`,
        verdict(completedRate >= TARGET_COMPLETED),
      ],
      ['accepted async / sync (a/s)', fmt(acceptRate / sync.rate), '-', '-'],
      ['completed async / sync (d/s)', fmt(completedRate / sync.rate), '-', '-'],
    ]),
  );
  console.log(
    `\nNotes: an async call is answered 202 only once its run is committed to ${store.name} (group commit); the` +
      ' runs are executed by the same server while it accepts more, so (a) and (b) share its one event loop.' +
      ' Completions are read from ferry_runs_total every ' +
      `${SAMPLE_MS} ms (the drain's end has that resolution); the backlog is confirmed empty through the API.`,
  );
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log(`load average at end: ${loadAverage()}`);
  if (drainError) throw drainError;
  // The next store gets the machine to itself (this server's cleanup stays registered; stopping twice is fine).
  await ferry.stop();
  if (store.natsUrl) await deleteNatsCluster(store.natsUrl, env.FERRY_CLUSTER_NAME);
  return {
    store: store.name,
    valid,
    sync,
    acceptRate,
    acceptP50: lat.median,
    acceptP99: lat.p99,
    duringLoad: endedInLoad / accSeconds,
    completedRate,
    drainSeconds,
    peakBacklog,
    cpuPerRunUs: ((cpu1.ferry - cpu0.ferry) / acceptedCount) * 1000,
    ferryCpuPct: ((cpu1.ferry - cpu0.ferry) / (accSeconds * 1000)) * 100,
    pgWork,
  };
}

/** One row per figure, one column per store, and the ratio of the second store to the first. */
function sideBySide(results) {
  // Each store after the first against the one before it (PostgreSQL / SQLite, PostgreSQL + NATS / PostgreSQL).
  const pairs = results.slice(1).map((b, i) => [results[i], b]);
  const row = (label, pick, digits = 0) => [
    label,
    ...results.map((r) => fmt(pick(r), digits)),
    ...pairs.map(([a, b]) => fmt(pick(b) / pick(a), 2)),
  ];
  return table([
    ['figure', ...results.map((r) => r.store), ...pairs.map(([a, b]) => `${b.store} / ${a.store}`)],
    row('(s) sync calls/s', (r) => r.sync.rate),
    row('(a) async accepted (202)/s', (r) => r.acceptRate),
    row('(a) 202 latency p50 ms', (r) => r.acceptP50, 2),
    row('(a) 202 latency p99 ms', (r) => r.acceptP99, 2),
    row('(b) async completed/s during the load', (r) => r.duringLoad),
    row('(d) async completed/s, start -> empty', (r) => r.completedRate),
    row('drain after the load, s', (r) => r.drainSeconds, 1),
    row('peak backlog (runs)', (r) => r.peakBacklog),
    row('Ferry CPU in the load, % of a core', (r) => r.ferryCpuPct),
    row('Ferry CPU per 202, µs', (r) => r.cpuPerRunUs),
  ]);
}

/** PostgreSQL's own work per run, when it was measured. */
function databaseWork(results) {
  const rows = results.filter((r) => r.pgWork);
  if (rows.length === 0) return '';
  return table([
    ['database work per run (load start -> empty)', ...rows.map((r) => r.store)],
    ['transactions committed', ...rows.map((r) => fmt(r.pgWork.commitsPerRun, 2))],
    ['rows updated', ...rows.map((r) => fmt(r.pgWork.updatedPerRun, 2))],
    ['rows fetched', ...rows.map((r) => fmt(r.pgWork.fetchedPerRun, 2))],
    ['backends CPU, µs', ...rows.map((r) => fmt(r.pgWork.backendCpuPerRunUs, 0))],
    ['backends CPU, % of a core', ...rows.map((r) => fmt(r.pgWork.backendCpuPct, 0))],
  ]);
}

async function main() {
  requireDist();
  console.log('Ferry bench: async runs of a no-op function, accepted and completed per second\n');
  console.log(machineReport());
  const adminUrl = argument('--database-url', 'FERRY_DATABASE_URL');
  const natsUrl = argument('--nats-url', 'FERRY_NATS_URL');
  const stores = [{ key: 'sqlite', name: 'SQLite' }];
  if (adminUrl) stores.push({ key: 'postgres', name: 'PostgreSQL', adminUrl });
  else console.log('(SQLite only: pass --database-url postgres://... to measure PostgreSQL side by side)');
  // The JetStream run queue (PostgreSQL for the store): accepted runs published to NATS and fetched back.
  if (adminUrl && natsUrl) stores.push({ key: 'pg-nats', name: 'PostgreSQL + NATS', adminUrl, natsUrl });
  else if (natsUrl) console.log('(--nats-url needs --database-url too: the JetStream queue is measured on PostgreSQL)');
  // BENCH_STORES=postgres,pg-nats: only these (keys sqlite, postgres, pg-nats).
  const only = process.env.BENCH_STORES?.split(',').map((k) => k.trim());
  const results = [];
  for (const store of stores) if (!only || only.includes(store.key)) results.push(await measure(store));
  console.log(`\n=== Side by side (${results.map((r) => r.store).join(', ')}; one after the other, same knobs) ===\n`);
  console.log(sideBySide(results));
  const work = databaseWork(results);
  if (work) console.log(`\n${work}`);
  const invalid = results.filter((r) => !r.valid).map((r) => r.store);
  if (invalid.length > 0) console.log(`\nnot judged (errors, or runs not finished) on: ${invalid.join(', ')}`);
  console.log(`load average at end: ${loadAverage()}`);
}

await runMain(main);
