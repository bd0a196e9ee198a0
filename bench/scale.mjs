#!/usr/bin/env node
/**
 * Ferry with many apps and many run records (issue 31, target 3): the same measurements on a store
 * holding two apps and a few runs, and then on the same store grown to BENCH_SCALE_APPS apps and
 * BENCH_SCALE_RUNS finished runs, side by side in one run, with ratios. Asserts nothing about timing.
 *
 * Per store (SQLite; with `--database-url <url>` also PostgreSQL, in a database the bench creates there):
 *   1. deploy two apps through the API (real builds): `bench`, whose runs the bench reads, called once
 *      each way, and `intake`, which takes the load;
 *   2. empty: restart Ferry, its idle memory (RSS), the read routes of `bench` (runs lists, a run, its
 *      logs, the dashboard's stats, the apps list), then sync calls and async intake (202s) of `intake`
 *      under load, and the stats of `intake` (a window full of runs);
 *   3. load, with Ferry stopped: the other apps (copies of the deployed app's build) and the runs, with
 *      inputs, results and log lines, written by Ferry's own store code (bench/scale-load.mjs);
 *   4. loaded: restart Ferry, and the same measurements as in 2, then a paced async load without retention;
 *   5. retention: restart Ferry with FERRY_RUN_RETENTION_DAYS=30 and FERRY_RETENTION_INTERVAL_SECONDS=5
 *      under the same paced async load, until the expired runs are gone: how long, and the worst 202. The
 *      first pass comes 5 s after the start (as it comes 15 s after it in production), after Ferry's own
 *      start and the intake app's first replica: the 202s before it are shown apart, not judged.
 *
 *   npm run build && npm run bench:scale
 *   npm run bench:scale -- --database-url postgres://postgres@127.0.0.1:5432/postgres
 *   BENCH_SCALE_APPS=20 BENCH_SCALE_RUNS=20000 npm run bench:scale      # a quick look
 */
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import autocannon from 'autocannon';
import { request } from 'undici';
import {
  bootstrapProject,
  cpuMs,
  createDatabase,
  deployApp,
  envInt,
  fetchMetrics,
  fmt,
  http,
  loadAverage,
  machineReport,
  metricSum,
  requireDist,
  runMain,
  sleep,
  startFerry,
  summarize,
  table,
  tempDir,
  waitFor,
} from './lib.mjs';
import { loadScale } from './scale-load.mjs';

const APPS = envInt('BENCH_SCALE_APPS', 1000);
const RUNS = envInt('BENCH_SCALE_RUNS', 1_000_000);
const REQUESTS = envInt('BENCH_SCALE_REQUESTS', 200);
const DURATION = envInt('BENCH_DURATION', 5);
const WARMUP = envInt('BENCH_WARMUP', 2, 0);
/** Rounds of sync then async load per phase (medians reported). */
const ROUNDS = envInt('BENCH_SCALE_ROUNDS', 3);
const CONNECTIONS = envInt('BENCH_CONNECTIONS', 32);
const IDLE_SECONDS = envInt('BENCH_SCALE_IDLE_SECONDS', 10);
/**
 * 202s per second asked during the retention phase (and its baseline): a steady intake, not a flood. By
 * default a quarter of what the loaded store accepted under load (capped at 1,000), so the latencies are
 * the store's and not a queue's; BENCH_SCALE_PACED_RATE sets it.
 */
const PACED_RATE_SET = envInt('BENCH_SCALE_PACED_RATE', 0, 0);
/** Requests per read route before the measured ones (the first calls after a start compile its path). */
const READ_WARMUP = 10;
const PACED_SECONDS = envInt('BENCH_SCALE_PACED_SECONDS', 10);
const RETENTION_TIMEOUT_S = envInt('BENCH_SCALE_RETENTION_TIMEOUT', 1800);
const EXPIRED_SHARE = 0.9;
/**
 * The retention phase's FERRY_RETENTION_INTERVAL_SECONDS: a process's first pass comes this long after its
 * start (production's first pass comes RETENTION_FIRST_SECONDS, 15 s, after it), so the pass meets a
 * started Ferry with the intake app's replica up, and the passes that follow come at most this far apart.
 */
const RETENTION_INTERVAL_S = 5;
/** Share of the runs that belong to the deployed app (the one whose routes are read). */
const MAIN_SHARE = 0.1;
/** The app whose runs the bench reads, and the app that takes the load (so its runs stay out of the reads). */
const APP = 'bench';
const INTAKE = 'intake';

const TARGET_RATIO = 0.8;
const TARGET_P50_MS = 20;
const TARGET_P99_MS = 100;
const TARGET_MEMORY_RATIO = 2;
const TARGET_PAUSE_MS = 100;

const appFiles = (name) => ({
  'ferry.toml': `[app]
name = "${name}"

[scaling]
min_replicas = 0
max_replicas = 2
replica_concurrency = 64
response_grace_period = 30
`,
  'main.ts': 'export function run(input: unknown) { return { ok: true, echo: input }; }\n',
});

/** The figures of the two phases, by key, for the side-by-side table. */
function phaseTable(empty, loaded) {
  const rows = [['figure', 'empty', 'loaded', 'loaded / empty', 'target', 'verdict']];
  const ratio = (a, b) => (Number.isFinite(a) && Number.isFinite(b) && b > 0 ? a / b : Number.NaN);
  const verdict = (ok) => (ok === undefined ? '-' : ok ? 'met' : 'NOT met');
  rows.push([
    'async accepted (202)/s',
    fmt(empty.async.rate, 0),
    fmt(loaded.async.rate, 0),
    fmt(ratio(loaded.async.rate, empty.async.rate)),
    `>= ${TARGET_RATIO}x`,
    verdict(loaded.async.valid && ratio(loaded.async.rate, empty.async.rate) >= TARGET_RATIO),
  ]);
  rows.push([
    'async 202 p50 ms',
    fmt(empty.async.p50),
    fmt(loaded.async.p50),
    fmt(ratio(loaded.async.p50, empty.async.p50)),
    '-',
    '-',
  ]);
  rows.push([
    'Ferry CPU per 202, µs',
    fmt(empty.async.cpuUs, 0),
    fmt(loaded.async.cpuUs, 0),
    fmt(ratio(loaded.async.cpuUs, empty.async.cpuUs)),
    '-',
    '-',
  ]);
  rows.push([
    'sync calls/s',
    fmt(empty.sync.rate, 0),
    fmt(loaded.sync.rate, 0),
    fmt(ratio(loaded.sync.rate, empty.sync.rate)),
    '-',
    '-',
  ]);
  // "At least 0.8x" for a latency: the empty p50 over the loaded one (1.0 = as fast, 0.5 = twice as slow).
  rows.push([
    'sync p50 ms (ratio: empty / loaded)',
    fmt(empty.sync.p50),
    fmt(loaded.sync.p50),
    fmt(ratio(empty.sync.p50, loaded.sync.p50)),
    `>= ${TARGET_RATIO}x`,
    verdict(loaded.sync.valid && ratio(empty.sync.p50, loaded.sync.p50) >= TARGET_RATIO),
  ]);
  rows.push([
    'Ferry CPU per sync call, µs',
    fmt(empty.sync.cpuUs, 0),
    fmt(loaded.sync.cpuUs, 0),
    fmt(ratio(loaded.sync.cpuUs, empty.sync.cpuUs)),
    '-',
    '-',
  ]);
  rows.push([
    'Ferry RSS idle, MiB',
    fmt(empty.rssMiB, 1),
    fmt(loaded.rssMiB, 1),
    fmt(ratio(loaded.rssMiB, empty.rssMiB)),
    `< ${TARGET_MEMORY_RATIO}x`,
    verdict(ratio(loaded.rssMiB, empty.rssMiB) < TARGET_MEMORY_RATIO),
  ]);
  for (const [i, read] of loaded.reads.entries()) {
    const before = empty.reads[i];
    rows.push([
      `${read.label} p50 / p99 ms${read.inWindow !== undefined ? ` (${before.inWindow} / ${read.inWindow} runs in it)` : ''}`,
      `${fmt(before.p50)} / ${fmt(before.p99)}`,
      `${fmt(read.p50)} / ${fmt(read.p99)}`,
      fmt(ratio(read.p50, before.p50)),
      read.target ? `< ${TARGET_P50_MS} / < ${TARGET_P99_MS}` : '-',
      read.target ? verdict(read.valid && read.p50 < TARGET_P50_MS && read.p99 < TARGET_P99_MS) : '-',
    ]);
  }
  return table(rows);
}

/** Ferry's resident memory now, from /proc (MiB). */
function rssMiB(pid) {
  const status = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
  const kb = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1]);
  return kb / 1024;
}

/** Waits IDLE_SECONDS after a start with nothing sent, and reads the RSS each second: the last one. */
async function idleMemory(ferry) {
  const samples = [];
  for (let s = 0; s < IDLE_SECONDS; s++) {
    await sleep(1000);
    samples.push(rssMiB(ferry.child.pid));
  }
  return samples.at(-1);
}

/** `count` GETs of `url` one after the other (keep-alive), each timed from sending to the whole body. */
async function timedGets(url, token, count) {
  const times = [];
  let bad = 0;
  let lastStatus = 0;
  let lastText = '';
  for (let i = 0; i < count; i++) {
    const u = typeof url === 'function' ? url(i) : url;
    const t0 = performance.now();
    const res = await request(u, { headers: { authorization: `Bearer ${token}` } });
    const text = await res.body.text();
    times.push(performance.now() - t0);
    lastStatus = res.statusCode;
    if (res.statusCode !== 200) {
      bad++;
      lastText = text;
    }
  }
  const s = summarize(times);
  return { p50: s.median, p99: s.p99, max: s.max, bad, lastStatus, lastText, valid: bad === 0 };
}

/** The read routes, REQUESTS each: what the dashboard and the CLI ask of a store. */
async function measureReads(ferry, auth, runIds, deepCursor) {
  const base = `${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}`;
  const reads = [
    { label: 'GET runs (first page)', url: `${base}/runs`, target: true },
    { label: 'GET runs?state=failure', url: `${base}/runs?state=failure`, target: true },
    { label: 'GET runs?state=queued (none)', url: `${base}/runs?state=queued&limit=1`, target: true },
    { label: 'GET runs?before= (deep page)', url: `${base}/runs?before=${deepCursor}`, target: true },
    { label: 'GET runs/{id}', url: (i) => `${base}/runs/${runIds[i % runIds.length]}`, target: true },
    { label: 'GET runs/{id}/logs', url: (i) => `${base}/runs/${runIds[i % runIds.length]}/logs`, target: false },
    { label: 'GET stats (60 min)', url: `${base}/stats`, target: true },
    { label: 'GET apps (all apps)', url: `${ferry.url}/v2/projects/${auth.projectId}/apps`, target: false },
  ];
  const out = [];
  for (const r of reads) {
    await timedGets(r.url, auth.token, READ_WARMUP);
    process.stdout.write(`  ${r.label}: ${REQUESTS} requests... `);
    const m = await timedGets(r.url, auth.token, REQUESTS);
    console.log(
      `p50 ${fmt(m.p50)} ms, p99 ${fmt(m.p99)} ms${m.bad ? `, ${m.bad} not 200 (${m.lastStatus}: ${m.lastText.slice(0, 200)})` : ''}`,
    );
    out.push({ ...r, ...m });
  }
  return out;
}

/** autocannon's non-2xx and errors, as one number. */
function failures(result, okCount) {
  return result.non2xx + (result['2xx'] - okCount) + result.errors + result.timeouts;
}

/** Runs of the intake app that have ended, from ferry_runs_total. */
async function endedRuns(ferry, projectId) {
  return metricSum(await fetchMetrics(ferry), 'ferry_runs_total', { project: projectId, app: INTAKE });
}

async function drain(ferry, auth, base, expected) {
  await waitFor(async () => (await endedRuns(ferry, auth.projectId)) - base >= expected, {
    ms: 600_000,
    everyMs: 250,
    what: `${expected} async runs to finish`,
  });
}

/** One load of `url` for DURATION s (after WARMUP s): answers `ok` per second, their p50, Ferry's CPU per answer. */
async function loadOnce(ferry, common, url, ok) {
  const warm = WARMUP > 0 ? await autocannon({ ...common, url, duration: WARMUP }) : undefined;
  const times = [];
  const run = autocannon({ ...common, url, duration: DURATION });
  run.on('response', (_c, status, _b, ms) => {
    if (status === ok) times.push(ms);
  });
  const cpu0 = cpuMs(ferry.child.pid);
  const t0 = performance.now();
  const result = await run;
  const seconds = (performance.now() - t0) / 1000;
  const cpuUs = ((cpuMs(ferry.child.pid) - cpu0) / Math.max(1, times.length)) * 1000;
  const lat = summarize(times);
  return {
    rate: times.length / seconds,
    p50: lat.median,
    p99: lat.p99,
    cpuUs,
    count: times.length,
    warm: warm?.statusCodeStats?.[String(ok)]?.count ?? 0,
    failed: failures(result, times.length),
  };
}

/** The median of each figure over rounds (and the failures summed). */
function medians(rounds) {
  const med = (key) => summarize(rounds.map((r) => r[key])).median;
  const failed = rounds.reduce((n, r) => n + r.failed, 0);
  return {
    rate: med('rate'),
    p50: med('p50'),
    p99: med('p99'),
    cpuUs: med('cpuUs'),
    failed,
    valid: failed === 0 && rounds.every((r) => r.count > 0),
  };
}

/**
 * Sync calls and async intake under load (autocannon, CONNECTIONS connections), as bench:async does,
 * ROUNDS times in turn; the medians. Ferry's CPU per answer is the steadiest of these on a shared machine.
 */
async function measureIntake(ferry, auth) {
  const runUrl = `${ferry.url}/v4/${auth.projectId}/${INTAKE}/run`;
  const headers = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  const body = JSON.stringify({ order: 12345, items: [{ sku: 'sku-1', qty: 2 }] });
  const common = { headers, method: 'POST', body, connections: CONNECTIONS, pipelining: 1 };
  const syncRounds = [];
  const asyncRounds = [];
  for (let round = 1; round <= ROUNDS; round++) {
    const sync = await loadOnce(ferry, common, runUrl, 200);
    syncRounds.push(sync);
    await sleep(1000);
    const base = await endedRuns(ferry, auth.projectId);
    const accepted = await loadOnce(ferry, common, `${runUrl}?async=true`, 202);
    asyncRounds.push(accepted);
    // Every run accepted (warm-up included) has ended before the next load.
    await drain(ferry, auth, base, accepted.count + accepted.warm);
    await sleep(1000);
    console.log(
      `  round ${round}: sync ${fmt(sync.rate, 0)}/s p50 ${fmt(sync.p50)} ms ${fmt(sync.cpuUs, 0)} µs/call; ` +
        `async ${fmt(accepted.rate, 0)} 202/s p50 ${fmt(accepted.p50)} ms ${fmt(accepted.cpuUs, 0)} µs/202` +
        `${sync.failed + accepted.failed ? `; ${sync.failed + accepted.failed} failed` : ''}`,
    );
  }
  return { sync: medians(syncRounds), async: medians(asyncRounds) };
}

/**
 * Async calls at `rate` per second (8 connections) until `until()` says stop or `seconds` pass:
 * every 202's latency with the time it was answered.
 */
async function pacedLoad(ferry, auth, rate, seconds, until) {
  const url = `${ferry.url}/v4/${auth.projectId}/${INTAKE}/run?async=true`;
  const headers = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  const answers = [];
  const run = autocannon({
    url,
    headers,
    method: 'POST',
    body: '{"order":1}',
    connections: 8,
    pipelining: 1,
    overallRate: rate,
    duration: seconds,
  });
  run.on('response', (_c, status, _b, ms) => {
    if (status === 202) answers.push({ at: performance.now(), wall: Date.now(), ms });
  });
  let stopped = false;
  const watcher = (async () => {
    if (!until) return;
    while (!stopped) {
      if (await until()) {
        run.stop();
        return;
      }
      await sleep(250);
    }
  })();
  const result = await run;
  stopped = true;
  await watcher;
  return { answers, failed: failures(result, answers.length) };
}

/** ferry_runs_deleted_total{reason="retention"} now. */
async function retained(ferry) {
  return metricSum(await fetchMetrics(ferry), 'ferry_runs_deleted_total', { reason: 'retention' });
}

/** One phase's measurements on a freshly started Ferry. */
async function measurePhase(label, dataDir, env, auth, runIds, deepCursor) {
  console.log(`\n-- ${label} --`);
  const ferry = await startFerry(dataDir, { env });
  console.log(`ferry serve: ${ferry.url} (pid ${ferry.child.pid}); idle for ${IDLE_SECONDS} s...`);
  const rss = await idleMemory(ferry);
  console.log(`  idle RSS: ${fmt(rss, 1)} MiB`);
  const reads = await measureReads(ferry, auth, runIds, deepCursor);
  const intake = await measureIntake(ferry, auth);
  // The dashboard's stats of an app whose window is full of runs: the intake app's, after its load.
  const statsUrl = `${ferry.url}/v2/projects/${auth.projectId}/apps/${INTAKE}/stats`;
  const series = JSON.parse((await http(statsUrl, { token: auth.token })).text).series ?? [];
  const inWindow = series.reduce((n, m) => n + m.success + m.failure + m.timeout + m.cancelled, 0);
  process.stdout.write(`  GET stats of ${INTAKE} (${inWindow} runs in its 60 minutes): ${REQUESTS} requests... `);
  const busy = await timedGets(statsUrl, auth.token, REQUESTS);
  console.log(`p50 ${fmt(busy.p50)} ms, p99 ${fmt(busy.p99)} ms`);
  reads.push({ label: `GET stats of ${INTAKE} (busy window)`, inWindow, target: false, ...busy });
  return { ferry, rssMiB: rss, reads, ...intake };
}

async function measure(store) {
  console.log(`\n=== Store: ${store.name} ===`);
  const env = { FERRY_RETENTION_INTERVAL_SECONDS: '0' };
  if (store.adminUrl) {
    env.FERRY_DATABASE_URL = await createDatabase(store.adminUrl, 'scale_');
    console.log(
      `database: ${new URL(env.FERRY_DATABASE_URL).pathname.slice(1)} (created for this run, dropped at the end)`,
    );
  }
  const dataDir = await tempDir(`scale-${store.key}-`);
  const auth = await bootstrapProject(dataDir, env);
  let ferry = await startFerry(dataDir, { env });
  console.log(`ferry serve: ${ferry.url} (pid ${ferry.child.pid}, data dir ${dataDir})`);
  await deployApp(ferry, auth, APP, appFiles(APP));
  await deployApp(ferry, auth, INTAKE, appFiles(INTAKE));
  const runUrl = `${ferry.url}/v4/${auth.projectId}/${APP}/run`;
  const first = await http(runUrl, { method: 'POST', token: auth.token, body: {} });
  if (first.status !== 200) throw new Error(`the first sync run answered ${first.status}: ${first.text}`);
  const firstId = first.headers['x-request-id'];
  const accepted = await http(`${runUrl}?async=true`, { method: 'POST', token: auth.token, body: {} });
  if (accepted.status !== 202) throw new Error(`the first async run answered ${accepted.status}: ${accepted.text}`);
  await waitFor(
    async () => {
      const r = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}/runs/${accepted.json.run_id}`, {
        token: auth.token,
      });
      return r.json?.state === 'success';
    },
    { ms: 60_000, what: 'the first async run' },
  );
  await ferry.stop();

  const empty = await measurePhase(
    'empty: two apps, a few runs',
    dataDir,
    env,
    auth,
    [firstId, accepted.json.run_id],
    accepted.json.run_id,
  );
  await empty.ferry.stop();

  console.log(`\n-- loading ${APPS} apps and ${RUNS} runs (Ferry stopped) --`);
  const loadNow = Date.now();
  const loaded = await loadScale({
    dataDir,
    databaseUrl: env.FERRY_DATABASE_URL,
    projectId: auth.projectId,
    appId: APP,
    apps: APPS,
    runs: RUNS,
    expiredShare: EXPIRED_SHARE,
    mainShare: MAIN_SHARE,
    now: loadNow,
  });
  console.log(
    `  ${loaded.appIds.length} apps in ${fmt(loaded.appsSeconds, 1)} s; ${RUNS} runs (${loaded.expired} expired, ${loaded.mainCount} of app ${APP}) ` +
      `and ${loaded.logLines} log lines in ${fmt(loaded.runsSeconds, 1)} s (${fmt(RUNS / loaded.runsSeconds, 0)} runs/s)`,
  );
  // What the load wrote is flushed to disk before anything is measured, so the loaded phase never shares the
  // disk with the writeback of the load itself (a store of a million runs was written over months, not in
  // the minute before); the time it took is printed. On the 2026-11-27 machine there was nothing left to
  // write by then (0.0 s): the kernel had written the load back while it ran.
  const flushAt = performance.now();
  if (store.adminUrl) {
    const { default: pg } = await import('pg');
    const client = new pg.Client({ connectionString: env.FERRY_DATABASE_URL, connectionTimeoutMillis: 10_000 });
    await client.connect();
    try {
      // PostgreSQL 15 lets superusers and pg_checkpoint members do this; otherwise its own checkpoints do.
      await client.query('CHECKPOINT').catch((err) => console.log(`  (no CHECKPOINT: ${err.message})`));
    } finally {
      await client.end().catch(() => {});
    }
  }
  spawnSync('sync', [], { stdio: 'ignore' });
  console.log(
    `  flushed to disk in ${fmt((performance.now() - flushAt) / 1000, 1)} s${store.adminUrl ? ' (CHECKPOINT, then sync)' : ' (sync)'}`,
  );
  if (!store.adminUrl) {
    const bytes =
      fs.statSync(`${dataDir}/ferry.db`).size +
      (fs.statSync(`${dataDir}/ferry.db-wal`, { throwIfNoEntry: false })?.size ?? 0);
    console.log(`  SQLite file: ${fmt(bytes / 2 ** 20, 0)} MiB`);
  }

  const full = await measurePhase(
    `loaded: ${APPS} apps, ${RUNS} runs`,
    dataDir,
    env,
    auth,
    loaded.mainRuns,
    loaded.deepCursor,
  );
  const pacedRate = PACED_RATE_SET || Math.max(20, Math.min(1000, Math.round(full.async.rate / 4)));
  process.stdout.write(`  paced async, ${pacedRate}/s for ${PACED_SECONDS} s (no retention): `);
  const steady = await pacedLoad(full.ferry, auth, pacedRate, PACED_SECONDS);
  const steadyLat = summarize(steady.answers.map((a) => a.ms));
  console.log(
    `${steady.answers.length} 202s, p50 ${fmt(steadyLat.median)} ms, p99 ${fmt(steadyLat.p99)} ms, worst ${fmt(steadyLat.max)} ms`,
  );
  await full.ferry.stop();

  console.log(
    `\n-- retention: FERRY_RUN_RETENTION_DAYS=30, FERRY_RETENTION_INTERVAL_SECONDS=${RETENTION_INTERVAL_S}, ${pacedRate} async calls/s --`,
  );
  const retentionEnv = {
    ...env,
    FERRY_RUN_RETENTION_DAYS: '30',
    FERRY_RETENTION_INTERVAL_SECONDS: String(RETENTION_INTERVAL_S),
  };
  ferry = await startFerry(dataDir, { env: retentionEnv });
  console.log(`ferry serve: ${ferry.url} (pid ${ferry.child.pid})`);
  let firstAt;
  let doneAt;
  const progress = [];
  const paced = await pacedLoad(ferry, auth, pacedRate, RETENTION_TIMEOUT_S, async () => {
    const n = await retained(ferry);
    const at = performance.now();
    if (n > 0 && firstAt === undefined) firstAt = at;
    progress.push({ at, n });
    if (n >= loaded.expired) doneAt ??= at;
    return doneAt !== undefined;
  });
  const deleted = await retained(ferry);
  // The 202s answered while the expired runs were being deleted (from the first count seen above 0 to the
  // last one, each within 250 ms of the event).
  const during = paced.answers.filter(
    (a) => firstAt !== undefined && a.at >= firstAt && a.at <= (doneAt ?? Number.POSITIVE_INFINITY),
  );
  const duringLat = summarize(during.map((a) => a.ms));
  const retention = {
    deleted,
    expected: loaded.expired,
    seconds: firstAt !== undefined && doneAt !== undefined ? (doneAt - firstAt) / 1000 : Number.NaN,
    p50: duringLat.median,
    p99: duringLat.p99,
    worst: duringLat.max,
    count: during.length,
    failed: paced.failed,
    steady: { p50: steadyLat.median, p99: steadyLat.p99, worst: steadyLat.max },
  };
  console.log(
    `  deleted ${deleted} of ${loaded.expired} expired runs in ${fmt(retention.seconds, 1)} s ` +
      `(${fmt(deleted / retention.seconds, 0)} runs/s); ${during.length} 202s meanwhile: p50 ${fmt(retention.p50)} ms, ` +
      `p99 ${fmt(retention.p99)} ms, worst ${fmt(retention.worst)} ms${paced.failed ? `; ${paced.failed} failed` : ''}`,
  );
  // Before the first pass: Ferry starting and the intake app's first replica (shown, not judged).
  const before = summarize(paced.answers.filter((a) => firstAt !== undefined && a.at < firstAt).map((a) => a.ms));
  console.log(
    `  before the first pass (Ferry starting, not judged): ${before.n} 202s, p99 ${fmt(before.p99)} ms, worst ${fmt(before.max)} ms`,
  );
  // The slowest 202s, with when they were answered: to line them up with the server's own logs.
  const slowest = [...during].sort((x, y) => y.ms - x.ms).slice(0, 5);
  console.log(
    `  slowest 202s meanwhile: ${slowest
      .map(
        (a) =>
          `${fmt(a.ms)} ms at +${fmt((a.at - firstAt) / 1000, 1)} s (${new Date(a.wall).toISOString().slice(11, 23)})`,
      )
      .join(', ')}`,
  );
  await ferry.stop();

  console.log(`\n${store.name}: empty vs loaded (${APPS} apps, ${RUNS} runs)\n`);
  console.log(phaseTable(empty, full));
  console.log(
    `\nretention of ${loaded.expired} expired runs: ${fmt(retention.seconds, 1)} s; 202 latency at ${pacedRate}/s ` +
      `without retention p50 ${fmt(retention.steady.p50)} / p99 ${fmt(retention.steady.p99)} / worst ${fmt(retention.steady.worst)} ms, ` +
      `during it p50 ${fmt(retention.p50)} / p99 ${fmt(retention.p99)} / worst ${fmt(retention.worst)} ms ` +
      `(target: worst < ${TARGET_PAUSE_MS} ms: ${retention.worst < TARGET_PAUSE_MS && deleted >= loaded.expired ? 'met' : 'NOT met'})`,
  );
  console.log(`load average: ${loadAverage()}`);
  return { store: store.name, empty, loaded: full, retention, load: loaded };
}

/** `--database-url <url>`, `--database-url=<url>` or FERRY_DATABASE_URL. */
function databaseUrl() {
  const args = process.argv.slice(2);
  for (let i = 0; i < args.length; i++) {
    if (args[i] === '--database-url') return args[i + 1];
    if (args[i].startsWith('--database-url=')) return args[i].slice('--database-url='.length);
    console.error(`unknown argument ${args[i]} (the bench takes --database-url <postgres://...>)`);
    process.exit(2);
  }
  return process.env.FERRY_DATABASE_URL || undefined;
}

async function main() {
  requireDist();
  console.log(`Ferry bench: ${APPS} apps and ${RUNS} runs against an empty store\n`);
  console.log(machineReport());
  const adminUrl = databaseUrl();
  const stores = [{ key: 'sqlite', name: 'SQLite' }];
  if (adminUrl) stores.push({ key: 'postgres', name: 'PostgreSQL', adminUrl });
  else console.log('(SQLite only: pass --database-url postgres://... to measure PostgreSQL too)');
  const only = process.env.BENCH_STORES?.split(',').map((k) => k.trim());
  const results = [];
  for (const store of stores) if (!only || only.includes(store.key)) results.push(await measure(store));
  if (results.length > 1) {
    console.log('\n=== Side by side ===\n');
    for (const r of results) {
      console.log(`${r.store}:`);
      console.log(phaseTable(r.empty, r.loaded));
      console.log(
        `retention: ${r.retention.deleted} runs in ${fmt(r.retention.seconds, 1)} s, worst 202 ${fmt(r.retention.worst)} ms\n`,
      );
    }
  }
  console.log(`load average at end: ${loadAverage()}`);
}

await runMain(main);
