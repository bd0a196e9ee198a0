#!/usr/bin/env node
/**
 * Synchronous-run throughput and latency of Ferry's gateway, against two baselines measured side by side
 * in the same run on the same warm replica:
 *   (a) direct: POST /_ferry/call/run on the replica's Unix socket (no gateway at all);
 *   (b) nginx:  the same call through nginx (1 worker, keep-alive upstream to the socket);
 *   (c) Ferry:  POST /v4/<project>/<app>/run with a bearer token (auth, run record, replica protocol);
 *   (d) node proxy: the same call through a bare Node proxy (bench/node-proxy.mjs: node:http and an undici
 *       Pool to the socket, about 20 lines), what a gateway in Node needs at the least (issue 15).
 * Prints figures and ratios; asserts nothing about timing (shared, noisy machines).
 *
 *   npm run build && npm run bench:run-sync
 *   BENCH_DURATION=10 BENCH_WARMUP=2 BENCH_CONNECTIONS=32 BENCH_LATENCY_REQUESTS=2000 npm run bench:run-sync
 */
import autocannon from 'autocannon';
import { Client } from 'undici';
import {
  cpuMs,
  ensureNginx,
  envInt,
  fmt,
  freePort,
  http,
  loadAverage,
  machineReport,
  nginxVersion,
  onCleanup,
  onlyReplicaSocket,
  replicaSockets,
  requireDist,
  runMain,
  sandboxReport,
  startDeployed,
  startNginx,
  summarize,
  table,
  tempDir,
} from './lib.mjs';

const DURATION = envInt('BENCH_DURATION', 10);
const WARMUP = envInt('BENCH_WARMUP', 2, 0);
const CONNECTIONS = envInt('BENCH_CONNECTIONS', 32);
const LATENCY_REQUESTS = envInt('BENCH_LATENCY_REQUESTS', 2000, 0);
const APP = 'bench';

const TARGET_THROUGHPUT = 0.8; // Ferry / nginx, at least
const TARGET_ADDED_P50_MS = 1; // Ferry p50 - direct p50, less than
const TARGET_CPU_VS_PROXY = 1.6; // Ferry's gateway CPU per call / the bare Node proxy's, at most (issue 15)
const TARGET_RPS_VS_PROXY = 0.6; // Ferry / bare Node proxy throughput, at least (issue 15)

const APP_FILES = {
  'ferry.toml': `[app]
name = "${APP}"

[scaling]
min_replicas = 1
max_replicas = 1
replica_concurrency = 64
response_grace_period = 30
`,
  'main.ts': 'export function run() { return { ok: true }; }\n',
};

/**
 * One autocannon run after its own warm-up run. Latencies of 2xx responses are kept unrounded (autocannon's
 * own percentiles are whole ms). The CPU time of the load generator, the gateway and the replica is read
 * from /proc around the measured run: CPU per request is steadier than throughput on a shared machine.
 */
async function load(name, opts, pids) {
  process.stdout.write(`  ${name}: ${WARMUP} s warm-up + ${DURATION} s, ${CONNECTIONS} connections... `);
  const common = { ...opts, method: 'POST', body: '{}', connections: CONNECTIONS, pipelining: 1 };
  if (WARMUP > 0) await autocannon({ ...common, duration: WARMUP });
  const latencies = [];
  const instance = autocannon({ ...common, duration: DURATION });
  instance.on('response', (_client, statusCode, _bytes, ms) => {
    if (statusCode >= 200 && statusCode < 300) latencies.push(ms);
  });
  const gateway0 = pids.gateway ? cpuMs(pids.gateway) : Number.NaN;
  const replica0 = cpuMs(pids.replica);
  const self0 = process.cpuUsage();
  const t0 = performance.now();
  const result = await instance;
  const elapsed = performance.now() - t0;
  const self = process.cpuUsage(self0);
  const cpu = {
    loadgen: (self.user + self.system) / 1000,
    gateway: pids.gateway ? cpuMs(pids.gateway) - gateway0 : Number.NaN,
    replica: cpuMs(pids.replica) - replica0,
  };
  const lat = summarize(latencies);
  const non2xx = result.non2xx ?? 0;
  const failed = result.errors + result.timeouts;
  const codes = Object.entries(result.statusCodeStats ?? {})
    .filter(([code]) => !code.startsWith('2'))
    .map(([code, { count }]) => `${code}×${count}`)
    .join(' ');
  console.log(`${Math.round(result.requests.mean)} req/s`);
  const total = result.requests.total;
  const share = (ms) =>
    Number.isFinite(ms) ? `${fmt((ms / elapsed) * 100, 0)}% ${fmt((ms / total) * 1000, 0)} µs` : '-';
  return {
    name,
    rps: result.requests.mean,
    ok: result['2xx'],
    p50: lat.median,
    p99: lat.p99,
    non2xx,
    failed,
    codes,
    cpu: { loadgen: share(cpu.loadgen), gateway: share(cpu.gateway), replica: share(cpu.replica) },
    gatewayUsPerCall: Number.isFinite(cpu.gateway) ? (cpu.gateway / total) * 1000 : Number.NaN,
    valid: non2xx === 0 && failed === 0 && result['2xx'] > 0,
  };
}

/** Checks one call of each target answers as expected before loading it. */
async function sanityCheck(name, client, opts) {
  const res = await client.request({ path: opts.path, method: 'POST', headers: opts.headers, body: '{}' });
  const text = await res.body.text();
  const good =
    res.statusCode === 200 &&
    (opts.path.startsWith('/v4/') ? JSON.parse(text).result?.ok : text.includes('"type":"result"'));
  if (!good) throw new Error(`${name}: a single call answered ${res.statusCode}: ${text.slice(0, 300)}`);
}

/**
 * Unloaded latency: one request at a time, the three targets in turn (so noise hits them alike), timed
 * with hrtime. What a single caller waits, without the queueing that 32 connections add.
 */
async function unloaded(targets, count) {
  const times = targets.map(() => []);
  for (let i = 0; i < count + 100; i++) {
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
      if (res.statusCode !== 200) throw new Error(`${target.name}: answered ${res.statusCode} in the latency pass`);
      if (i >= 100) times[t].push(ms); // the first 100 rounds warm up
    }
  }
  return times.map(summarize);
}

/** Starts bench/node-proxy.mjs in front of the replica socket; resolves once it listens. */
async function startNodeProxy(socketPath) {
  const { spawn } = await import('node:child_process');
  const child = spawn(process.execPath, [new URL('./node-proxy.mjs', import.meta.url).pathname], {
    env: { PATH: process.env.PATH, SOCKET: socketPath, PORT: '0' },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  onCleanup(() => child.kill('SIGKILL'));
  const port = await new Promise((resolve, reject) => {
    child.stdout.once('data', (d) => resolve(Number(String(d).trim())));
    child.once('exit', (code) => reject(new Error(`the node proxy exited with ${code}`)));
  });
  return { child, port };
}

async function main() {
  requireDist();
  console.log('Ferry bench: synchronous runs, direct vs nginx vs Ferry vs a bare Node proxy\n');
  console.log(machineReport());
  const nginxBin = ensureNginx();
  console.log(`nginx: ${nginxVersion(nginxBin)} (${nginxBin})`);

  // One replica socket to find and measure: no warm sandboxes waiting beside it (they have sockets too).
  const { dataDir, auth, ferry } = await startDeployed('sync', APP, APP_FILES, { FERRY_WARM_POOL: '0' });
  const runUrl = `${ferry.url}/v4/${auth.projectId}/${APP}/run`;
  const first = await http(runUrl, { method: 'POST', token: auth.token, body: {} });
  if (first.status !== 200 || first.json?.result?.ok !== true)
    throw new Error(`the first run answered ${first.status}: ${first.text}`);

  const socketPath = onlyReplicaSocket(dataDir, ferry);
  const sandbox = await sandboxReport(ferry);
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);

  const nginxDir = await tempDir('ferry-bench-nginx-');
  const nginxPort = await freePort();
  const nginx = await startNginx(nginxBin, nginxDir, socketPath, nginxPort);
  console.log(`nginx: 127.0.0.1:${nginxPort} -> unix:${socketPath} (worker_processes 1, keepalive 64)`);
  const proxy = await startNodeProxy(socketPath);
  console.log(
    `node proxy: 127.0.0.1:${proxy.port} -> unix:${socketPath} (bench/node-proxy.mjs, pid ${proxy.child.pid})`,
  );

  const replicaHeaders = { 'content-type': 'application/json', 'x-ferry-run-id': 'bench' };
  const ferryHeaders = { 'content-type': 'application/json', authorization: `Bearer ${auth.token}` };
  const ferryPath = `/v4/${auth.projectId}/${APP}/run`;
  const targets = [
    {
      name: '(a) direct',
      client: new Client('http://localhost', { socketPath }),
      path: '/_ferry/call/run',
      headers: replicaHeaders,
      load: { url: 'http://localhost/_ferry/call/run', socketPath, headers: replicaHeaders },
    },
    {
      name: '(b) nginx',
      client: new Client(`http://127.0.0.1:${nginxPort}`),
      path: '/_ferry/call/run',
      headers: replicaHeaders,
      load: { url: `http://127.0.0.1:${nginxPort}/_ferry/call/run`, headers: replicaHeaders },
    },
    {
      name: '(c) Ferry',
      client: new Client(ferry.url),
      path: ferryPath,
      headers: ferryHeaders,
      load: { url: `${ferry.url}${ferryPath}`, headers: ferryHeaders },
    },
    {
      name: '(d) node proxy',
      client: new Client(`http://127.0.0.1:${proxy.port}`),
      path: '/_ferry/call/run',
      headers: replicaHeaders,
      load: { url: `http://127.0.0.1:${proxy.port}/_ferry/call/run`, headers: replicaHeaders },
    },
  ];
  for (const t of targets) await sanityCheck(t.name, t.client, t);

  console.log(`\nLoad (autocannon, pipelining 1, body {}), one target after the other:`);
  const results = [];
  const replicaPid = ferry.replicaProcesses().find((p) => p.comm !== 'bwrap')?.pid;
  const gateways = [undefined, nginx.workerPid(), ferry.child.pid, proxy.child.pid];
  for (const [i, t] of targets.entries()) {
    results.push(await load(t.name, t.load, { gateway: gateways[i], replica: replicaPid }));
    await new Promise((r) => setTimeout(r, 1000));
  }
  let idle;
  if (LATENCY_REQUESTS > 0) {
    console.log(`  unloaded latency: ${LATENCY_REQUESTS} sequential calls per target, interleaved...`);
    idle = await unloaded(targets, LATENCY_REQUESTS);
  }
  for (const t of targets) await t.client.close();
  const after = replicaSockets(dataDir, ferry);
  const sameReplica = after.length === 1 && after[0] === socketPath;

  const [a, b, c, d] = results;
  console.log(`\nResults (${DURATION} s per target, ${CONNECTIONS} connections; latency of 2xx responses)\n`);
  const rows = [['target', 'req/s (mean)', 'p50 ms', 'p99 ms', '2xx', 'non-2xx', 'errors', 'status']];
  const cpuRows = [['target', 'load generator', 'gateway', 'replica']];
  for (const r of results) {
    rows.push([
      r.name,
      fmt(r.rps, 0),
      fmt(r.p50),
      fmt(r.p99),
      String(r.ok),
      String(r.non2xx),
      String(r.failed),
      r.valid ? 'ok' : `ERRORS ${r.codes}`.trim(),
    ]);
    cpuRows.push([r.name, r.cpu.loadgen, r.cpu.gateway, r.cpu.replica]);
  }
  console.log(table(rows));
  console.log(
    '\nCPU during each measured run (% of one core, CPU time per request; gateway = nginx worker, Ferry or the node proxy)\n',
  );
  console.log(table(cpuRows));

  if (idle) {
    console.log(`\nUnloaded latency (1 request at a time, ${LATENCY_REQUESTS} per target)\n`);
    const idleRows = [['target', 'p50 ms', 'p90 ms', 'p99 ms', 'min ms']];
    for (const [i, s] of idle.entries())
      idleRows.push([targets[i].name, fmt(s.median, 3), fmt(s.p90, 3), fmt(s.p99, 3), fmt(s.min, 3)]);
    console.log(table(idleRows));
  }

  const allValid = results.every((r) => r.valid);
  const verdict = (met) => (allValid ? (met ? 'met' : 'NOT met') : 'not judged (a target had errors)');
  const cOverB = c.rps / b.rps;
  const added = c.p50 - a.p50;
  console.log('\nRatios');
  const ratioRows = [
    ['figure', 'value', 'target', 'verdict'],
    ['throughput c/a (Ferry / direct)', fmt(c.rps / a.rps), '-', '-'],
    ['throughput b/a (nginx / direct)', fmt(b.rps / a.rps), '-', '-'],
    ['throughput c/b (Ferry / nginx)', fmt(cOverB), `>= ${TARGET_THROUGHPUT}`, verdict(cOverB >= TARGET_THROUGHPUT)],
    [
      `p50 added c - a, ${CONNECTIONS} connections`,
      `${fmt(added)} ms`,
      `< ${TARGET_ADDED_P50_MS} ms`,
      verdict(added < TARGET_ADDED_P50_MS),
    ],
    [`p50 added b - a, ${CONNECTIONS} connections`, `${fmt(b.p50 - a.p50)} ms`, '-', '-'],
    [
      'throughput c/d (Ferry / node proxy)',
      fmt(c.rps / d.rps),
      `>= ${TARGET_RPS_VS_PROXY}`,
      verdict(c.rps / d.rps >= TARGET_RPS_VS_PROXY),
    ],
    [
      'gateway CPU per call c/d (Ferry / node proxy)',
      `${fmt(c.gatewayUsPerCall / d.gatewayUsPerCall)} (${fmt(c.gatewayUsPerCall, 0)} / ${fmt(d.gatewayUsPerCall, 0)} µs)`,
      `<= ${TARGET_CPU_VS_PROXY}`,
      verdict(c.gatewayUsPerCall / d.gatewayUsPerCall <= TARGET_CPU_VS_PROXY),
    ],
  ];
  if (idle) {
    const idleAdded = idle[2].median - idle[0].median;
    ratioRows.push(
      [
        'p50 added c - a, unloaded',
        `${fmt(idleAdded, 3)} ms`,
        `< ${TARGET_ADDED_P50_MS} ms`,
        verdict(idleAdded < TARGET_ADDED_P50_MS),
      ],
      ['p50 added b - a, unloaded', `${fmt(idle[1].median - idle[0].median, 3)} ms`, '-', '-'],
    );
  }
  console.log(table(ratioRows));
  console.log(
    `\nNotes: under load the p50 includes queueing (about ${CONNECTIONS} / throughput), so a slower target also` +
      ' shows a higher p50; the unloaded figure is the per-call overhead. The load generator, the gateway' +
      ' (nginx or Ferry) and the replica share the machine.',
  );
  if (!sameReplica) console.log('WARNING: the replica changed during the bench (restarted?): figures are suspect.');
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log(`load average at end: ${loadAverage()}`);
}

await runMain(main);
