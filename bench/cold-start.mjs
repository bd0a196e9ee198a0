#!/usr/bin/env node
/**
 * Cold-start latency of a TypeScript and of a Python function: the time of one synchronous run (sent →
 * full response) when no replica of the app is running, so Ferry has to start one; and, in the same
 * iteration, a warm run right after it, for comparison. Both apps on one server, one after the other.
 * Prints figures and the targets of issue 15 (median under 30 ms for TypeScript, 60 ms for Python);
 * asserts nothing about timing.
 *
 *   npm run build && npm run bench:cold-start
 *   BENCH_COLD_RUNS=20 npm run bench:cold-start
 */
import { Client } from 'undici';
import {
  deployApp,
  envInt,
  fmt,
  http,
  loadAverage,
  machineReport,
  replicaGauges,
  replicaSockets,
  requireDist,
  runMain,
  sandboxReport,
  startDeployed,
  summarize,
  table,
  waitFor,
  warmGauges,
} from './lib.mjs';

const RUNS = envInt('BENCH_COLD_RUNS', 20);

const SCALING = `
[scaling]
min_replicas = 0
max_replicas = 1
cooldown = 0
response_grace_period = 30
`;

const RUNTIMES = [
  {
    label: 'TypeScript',
    app: 'cold',
    target: 30,
    files: {
      'ferry.toml': `[app]\nname = "cold"\n${SCALING}`,
      'main.ts': `interface Result {
  ok: boolean;
}

export function run(): Result {
  return { ok: true };
}
`,
    },
  },
  {
    label: 'Python',
    app: 'cold-py',
    target: 60,
    files: {
      'ferry.toml': `[app]\nname = "cold-py"\n${SCALING}`,
      'main.py': 'def run():\n    return {"ok": True}\n',
    },
  },
  {
    // Reported, no target (issue 15): a custom runtime app is the user's own server, started from nothing
    // (no warm pool), and ready once it answers its readiness check.
    label: 'Custom (node:http)',
    app: 'cold-custom',
    target: null,
    custom: true,
    files: {
      'ferry.toml': `[app]\nname = "cold-custom"\nruntime = "custom"\n\n[runtime.custom]\nentrypoint = ["node", "server.mjs"]\nport = 8080\nhealthcheck_endpoint = "/health"\nreadycheck_endpoint = "/ready"\n${SCALING}`,
      'server.mjs': `import http from 'node:http';
http
  .createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      const body = req.url === '/health' || req.url === '/ready' ? 'ok' : '{"ok":true}';
      res.writeHead(200, { 'content-type': 'application/json', 'content-length': body.length });
      res.end(body);
    });
  })
  .listen(Number(process.env.PORT));
`,
    },
  },
];

/** One run through `client` (keep-alive to Ferry); the time from sending to the full response, in ms. */
async function timedRun(client, path, token, custom = false) {
  const start = process.hrtime.bigint();
  const res = await client.request({
    path,
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${token}` },
    body: '{}',
  });
  const text = await res.body.text();
  const ms = Number(process.hrtime.bigint() - start) / 1e6;
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = undefined;
  }
  // A custom app answers its server's own body; the run's id is in X-Request-Id.
  const ok = custom ? body?.ok === true : body?.result?.ok === true;
  if (res.statusCode !== 200 || !ok) throw new Error(`run answered ${res.statusCode}: ${text.slice(0, 300)}`);
  if (custom) return { ms, runId: String(res.headers['x-request-id']), runTimeMs: '-' };
  return { ms, runId: body.run_id, runTimeMs: body.run_time_ms };
}

async function main() {
  requireDist();
  console.log('Ferry bench: cold starts of a TypeScript and a Python function, and of a custom runtime app\n');
  console.log(machineReport());
  const [first, ...others] = RUNTIMES;
  const { dataDir, auth, ferry } = await startDeployed('cold', first.app, first.files);
  for (const r of others) await deployApp(ferry, auth, r.app, r.files);
  const verdicts = [];
  for (const r of RUNTIMES) verdicts.push(await measure(r, { dataDir, auth, ferry }));
  console.log('\nTargets (issue 15)\n');
  console.log(table([['runtime', 'median cold ms', 'target', 'verdict'], ...verdicts]));
  console.log(`load average at end: ${loadAverage()}`);
  console.log(
    `warm pool: FERRY_WARM_POOL=${process.env.FERRY_WARM_POOL ?? '(default)'}; warm sandboxes ready at end: ${(await warmGauges(ferry)).ready}`,
  );
}

async function measure({ label, app: APP, target, custom = false }, { dataDir, auth, ferry }) {
  console.log(
    `\n${label}: app "${APP}", min_replicas = 0, max_replicas = 1, cooldown = 0 (the reaper runs every second)`,
  );
  const client = new Client(ferry.url);
  const runPath = custom ? `/v4/${auth.projectId}/${APP}/ping` : `/v4/${auth.projectId}/${APP}/run`;
  const record = async (runId) => {
    const res = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}/runs/${runId}`, {
      token: auth.token,
    });
    if (res.status !== 200) throw new Error(`GET run ${runId} answered ${res.status}: ${res.text}`);
    return res.json;
  };
  const sandboxSeen = new Set();
  const noteSandbox = () => {
    const procs = ferry.replicaProcesses();
    if (procs.length > 0) sandboxSeen.add(procs.some((p) => p.comm === 'bwrap') ? 'bwrap' : 'plain');
  };
  // With the warm pool on (FERRY_WARM_POOL, the default), the sandboxes left are the warm ones, each with
  // its socket: a cold run starts once the app's replica is gone and the pool is full again (its steady
  // state on a server that is not starting apps all the time).
  const noReplica = async () => {
    const gauges = await replicaGauges(ferry, APP);
    const warmPool = await warmGauges(ferry);
    return (
      gauges.ready === 0 &&
      gauges.starting === 0 &&
      warmPool.starting === 0 &&
      replicaSockets(dataDir, ferry).length === warmPool.ready &&
      (warmPool.ready > 0 || ferry.replicaProcesses().length === 0)
    );
  };

  // The app's first run also switches it to its build (a scaled-to-zero app does that on its first
  // run): timed and shown, not counted.
  const priming = await timedRun(client, runPath, auth.token, custom);
  noteSandbox();
  console.log(`first run after the deploy: ${fmt(priming.ms, 1)} ms (not counted)\n`);

  const cold = [];
  const warm = [];
  const waits = [];
  let notCold = 0;
  let notWarm = 0;
  for (let i = 1; i <= RUNS; i++) {
    const waitStart = Date.now();
    await waitFor(noReplica, { ms: 30_000, everyMs: 20, what: 'the replica to stop (cooldown 0)' });
    const idleWait = Date.now() - waitStart;
    const c = await timedRun(client, runPath, auth.token, custom);
    const w = await timedRun(client, runPath, auth.token, custom);
    noteSandbox();
    const [cRec, wRec] = await Promise.all([record(c.runId), record(w.runId)]);
    const serverWait = Date.parse(cRec.started_at) - Date.parse(cRec.created_at);
    let line = `  ${String(i).padStart(2)}/${RUNS}  cold ${fmt(c.ms, 1).padStart(6)} ms (waited ${serverWait} ms for the replica, run ${c.runTimeMs} ms)   warm ${fmt(w.ms, 2).padStart(6)} ms`;
    if (cRec.cold_start === true) {
      cold.push(c.ms);
      waits.push(serverWait);
    } else {
      notCold++;
      line += '   [first call NOT marked cold_start: left out]';
    }
    if (wRec.cold_start === false) warm.push(w.ms);
    else {
      notWarm++;
      line += '   [second call was a cold start (the reaper stopped the replica in between): left out]';
    }
    console.log(`${line}   (idle wait ${idleWait} ms)`);
  }
  await client.close();

  const metrics = await http(`${ferry.url}/metrics`);
  const metric = (name) => {
    const line = metrics.text.split('\n').find((l) => l.startsWith(`${name}{`) && l.includes(`app="${APP}"`));
    return line ? Number(line.slice(line.lastIndexOf(' ') + 1)) : Number.NaN;
  };
  const startSum = metric('ferry_cold_start_duration_seconds_sum');
  const startCount = metric('ferry_cold_start_duration_seconds_count');
  const sandbox = await sandboxReport(undefined);

  const cs = summarize(cold);
  const ws = summarize(warm);
  const wt = summarize(waits);
  console.log(`\nResults (${RUNS} iterations; client time from sending the request to the full response)\n`);
  console.log(
    table([
      ['', 'n', 'median ms', 'p90 ms', 'min ms', 'max ms'],
      ['cold', String(cs.n), fmt(cs.median, 1), fmt(cs.p90, 1), fmt(cs.min, 1), fmt(cs.max, 1)],
      ['warm', String(ws.n), fmt(ws.median, 2), fmt(ws.p90, 2), fmt(ws.min, 2), fmt(ws.max, 2)],
      [
        'cold: run record created -> started',
        String(wt.n),
        fmt(wt.median, 0),
        fmt(wt.p90, 0),
        fmt(wt.min, 0),
        fmt(wt.max, 0),
      ],
    ]),
  );
  if (Number.isFinite(startSum) && startCount > 0)
    console.log(
      `\nferry_cold_start_duration_seconds (replica spawn, or warm sandbox claim, -> ready), mean of ${startCount}: ${fmt((startSum / startCount) * 1000, 1)} ms`,
    );
  if (notCold > 0) console.log(`${notCold} first call(s) were not cold starts and were left out.`);
  if (notWarm > 0) console.log(`${notWarm} second call(s) were cold starts and were left out of "warm".`);
  const met = target !== null && cs.median < target;
  const verdict = target === null ? 'reported' : cs.n === 0 ? 'not judged (no cold run)' : met ? 'met' : 'NOT met';
  console.log(
    target === null
      ? `\nNo target for ${label}: median cold ${fmt(cs.median, 1)} ms; cold - warm median ${fmt(cs.median - ws.median, 1)} ms`
      : `\nTarget: median cold < ${target} ms for a ${label} function: ${verdict} (median ${fmt(cs.median, 1)} ms; cold - warm median ${fmt(cs.median - ws.median, 1)} ms)`,
  );
  const observed =
    sandboxSeen.size === 0
      ? 'unknown (no replica seen running)'
      : sandboxSeen.has('bwrap') && sandboxSeen.size === 1
        ? 'on (replicas ran under bwrap)'
        : sandboxSeen.has('plain') && sandboxSeen.size === 1
          ? 'off (replicas ran as plain node processes)'
          : 'mixed (some replicas under bwrap, some not)';
  console.log(`sandbox: ${observed}; ferry doctor: ${sandbox.doctor}`);
  return [label, fmt(cs.median, 1), target === null ? '-' : `< ${target}`, verdict];
}

await runMain(main);
