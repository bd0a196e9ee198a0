#!/usr/bin/env node
/**
 * Webhook deliveries per second to a receiver on loopback. The receiver (node:http on 127.0.0.1, in a
 * worker thread of this process so its event loop is not the submitter's) answers 200 at once, counts
 * deliveries and checks a sample of signatures with `verifyWebhook`. The bench submits K async runs of a
 * no-op function with `webhookEndpoint` and `X-Webhook-Secret`, then measures the deliveries as received.
 * For comparison, in the same run, a plain loop of undici POSTs from this process to the same receiver
 * (the ceiling of the machine). Prints figures and the target; asserts nothing about timing.
 *
 *   npm run build && npm run bench:webhooks
 *   BENCH_WEBHOOK_RUNS=5000 BENCH_SUBMIT_CONNECTIONS=32 npm run bench:webhooks
 */
import http from 'node:http';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { isMainThread, parentPort, Worker, workerData } from 'node:worker_threads';
import { Pool } from 'undici';

const SECRET = 'bench-webhook-secret';
/** Every VERIFY_EVERY-th delivery (and the first) has its signature checked, after the 200 is sent. */
const VERIFY_EVERY = 50;
const nowMs = () => Number(process.hrtime.bigint()) / 1e6;

if (isMainThread) {
  const lib = await import('./lib.mjs');
  await lib.runMain(() => main(lib));
} else {
  await receiver(workerData);
}

// ---------------------------------------------------------------------------------------------------
// The receiver (worker thread)

/**
 * Listens on 127.0.0.1:0 and posts { type: 'listening', port }. Shared counter: Int32Array(sab)[0] = requests
 * received. On 'report' it posts the arrival times (CLOCK_MONOTONIC ms, the same clock as the main thread),
 * the request ids, signature checks and one sample delivery; 'reset' clears them; 'hold' keeps the
 * responses back until 'release'; 'close' stops it.
 */
async function receiver({ counter, signatureModule }) {
  const { verifyWebhook } = await import(signatureModule);
  const count = new Int32Array(counter);
  let arrivals = [];
  let ids = [];
  let verified = 0;
  let badSignatures = 0;
  let unsigned = 0;
  let sample;
  /** While holding, responses wait here (Ferry's attempts stay in flight, the rest wait in its outbox). */
  let held;
  const answer = (res) => res.writeHead(200, { 'content-type': 'text/plain' }).end('ok');
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      if (held) held.push(res);
      else answer(res);
      const at = nowMs();
      const n = arrivals.push(at);
      Atomics.store(count, 0, n);
      ids.push(String(req.headers['x-request-id'] ?? ''));
      const raw = Buffer.concat(chunks);
      sample ??= { headers: { ...req.headers }, body: raw.toString('utf8') };
      if (!req.headers['x-service-webhook-signature']) unsigned += 1;
      else if (n === 1 || n % VERIFY_EVERY === 0) {
        if (verifyWebhook(SECRET, req.headers, raw)) verified += 1;
        else badSignatures += 1;
      }
    });
  });
  server.keepAliveTimeout = 60_000;
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  parentPort.postMessage({ type: 'listening', port: server.address().port });
  parentPort.on('message', (msg) => {
    if (msg === 'report') {
      parentPort.postMessage({ type: 'report', arrivals, ids, verified, badSignatures, unsigned, sample });
    } else if (msg === 'reset') {
      arrivals = [];
      ids = [];
      verified = 0;
      badSignatures = 0;
      unsigned = 0;
      Atomics.store(count, 0, 0);
      parentPort.postMessage({ type: 'reset' });
    } else if (msg === 'hold') {
      held ??= [];
      parentPort.postMessage({ type: 'hold' });
    } else if (msg === 'release') {
      const waiting = held ?? [];
      held = undefined;
      const at = nowMs();
      for (const res of waiting) answer(res);
      parentPort.postMessage({ type: 'release', at, answered: waiting.length });
    } else if (msg === 'close') {
      server.closeAllConnections();
      server.close(() => parentPort.close());
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// The bench (main thread)

/** Deliveries per second over the steady part (10th to 90th percentile of the arrival times). */
function steadyRate(arrivals) {
  const sorted = [...arrivals].sort((x, y) => x - y);
  const n = sorted.length;
  if (n < 10) return { rate: Number.NaN, count: 0, seconds: Number.NaN };
  const i10 = Math.floor(0.1 * (n - 1));
  const i90 = Math.floor(0.9 * (n - 1));
  const seconds = (sorted[i90] - sorted[i10]) / 1000;
  return { rate: (i90 - i10) / seconds, count: i90 - i10, seconds };
}

async function main(lib) {
  const { envInt, fmt, summarize, table } = lib;
  const RUNS = envInt('BENCH_WEBHOOK_RUNS', 5000);
  const SUBMIT_CONNECTIONS = envInt('BENCH_SUBMIT_CONNECTIONS', 32);
  const CEILING_CONNECTIONS = envInt('BENCH_CEILING_CONNECTIONS', 64);
  const STALL_S = envInt('BENCH_STALL_TIMEOUT', 30);
  const APP = 'hooked';
  const TARGET = 1000; // deliveries per second, at least
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
  const { sleep } = lib;

  lib.requireDist();
  console.log('Ferry bench: webhook deliveries per second to a loopback receiver\n');
  console.log(lib.machineReport());

  // The receiver, in its own thread.
  const counter = new SharedArrayBuffer(4);
  const received = new Int32Array(counter);
  const signatureModule = pathToFileURL(path.join(lib.REPO_ROOT, 'dist', 'src', 'webhooks', 'signature.js')).href;
  const worker = new Worker(new URL(import.meta.url), { workerData: { counter, signatureModule } });
  const messages = [];
  const waiters = [];
  worker.on('message', (m) => {
    const i = waiters.findIndex((w) => w.type === m.type);
    if (i >= 0) waiters.splice(i, 1)[0].resolve(m);
    else messages.push(m);
  });
  const workerFailed = new Promise((_, reject) => worker.once('error', reject));
  workerFailed.catch(() => {});
  const next = (type) => {
    const i = messages.findIndex((m) => m.type === type);
    if (i >= 0) return Promise.resolve(messages.splice(i, 1)[0]);
    return Promise.race([new Promise((resolve) => waiters.push({ type, resolve })), workerFailed]);
  };
  const ask = (msg) => {
    const answer = next(msg);
    worker.postMessage(msg);
    return answer;
  };
  lib.onCleanup(async () => {
    const exited = new Promise((resolve) => worker.once('exit', resolve));
    worker.postMessage('close');
    const timer = setTimeout(() => void worker.terminate(), 2000);
    await exited;
    clearTimeout(timer);
  });
  const { port } = await next('listening');
  const hookUrl = `http://127.0.0.1:${port}/hook`;
  console.log(
    `receiver: ${hookUrl} (node:http in a worker thread; answers 200, checks 1 signature in ${VERIFY_EVERY})`,
  );

  const { auth, ferry } = await lib.startDeployed('webhooks', APP, APP_FILES, {
    FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
    // Phase (2) holds the receiver's answers until every run has finished: no attempt may time out meanwhile.
    FERRY_WEBHOOK_TIMEOUT_MS: '600000',
    FERRY_MAX_ASYNC_BACKLOG: String(Math.max(100_000, RUNS * 2)),
    FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT: String(Math.max(100_000, RUNS * 2)),
  });
  const runPath = `/v4/${auth.projectId}/${APP}/run?async=true&webhookEndpoint=${encodeURIComponent(hookUrl)}`;
  const headers = {
    'content-type': 'application/json',
    authorization: `Bearer ${auth.token}`,
    'x-webhook-secret': SECRET,
  };
  const endedRuns = async () =>
    lib.metricSum(await lib.fetchMetrics(ferry), 'ferry_runs_total', { project: auth.projectId, app: APP });

  // One delivery end to end first: the path works (address guard, signature) before the load.
  const firstRun = await lib.http(`${ferry.url}${runPath}`, { method: 'POST', headers, body: {} });
  if (firstRun.status !== 202) throw new Error(`the first async run answered ${firstRun.status}: ${firstRun.text}`);
  await lib.waitFor(() => Atomics.load(received, 0) >= 1, { ms: 30_000, what: 'the first webhook delivery' });
  const warm = await ask('report');
  if (warm.badSignatures > 0 || warm.verified !== 1 || warm.ids[0] !== firstRun.json.run_id) {
    throw new Error(`the first delivery is not the run's, or its signature did not verify: ${JSON.stringify(warm)}`);
  }
  const sample = warm.sample;
  const sandbox = await lib.sandboxReport(ferry);
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);

  /** Submits RUNS async runs with the webhook, SUBMIT_CONNECTIONS calls in flight: run id → time of its 202. */
  async function submit() {
    const pool = new Pool(ferry.url, { connections: SUBMIT_CONNECTIONS });
    const acceptedAt = new Map();
    const refused = {};
    let nextIndex = 0;
    const start = nowMs();
    try {
      await Promise.all(
        Array.from({ length: SUBMIT_CONNECTIONS }, async () => {
          while (nextIndex < RUNS) {
            nextIndex += 1;
            const res = await pool.request({ path: runPath, method: 'POST', headers, body: '{}' });
            const text = await res.body.text();
            if (res.statusCode === 202) acceptedAt.set(JSON.parse(text).run_id, nowMs());
            else refused[res.statusCode] = (refused[res.statusCode] ?? 0) + 1;
          }
        }),
      );
    } finally {
      await pool.close();
    }
    const end = nowMs();
    console.log(`  ${acceptedAt.size} accepted in ${fmt((end - start) / 1000, 2)} s`);
    return { acceptedAt, refused, start, end };
  }

  /** Until `expected` deliveries have arrived, or none for STALL_S seconds. */
  async function awaitDeliveries(expected) {
    let last = -1;
    let lastChange = nowMs();
    for (;;) {
      const n = Atomics.load(received, 0);
      if (n >= expected) return;
      if (n !== last) {
        last = n;
        lastChange = nowMs();
      } else if (nowMs() - lastChange > STALL_S * 1000) {
        console.log(`  STALLED: ${n} of ${expected} deliveries after ${STALL_S} s without a new one`);
        return;
      }
      await sleep(50);
    }
  }

  /** What the receiver got for the submitted runs: counts, repeats, runs never delivered. */
  function tally(report, acceptedAt) {
    const unique = new Set(report.ids);
    let missing = 0;
    for (const id of acceptedAt.keys()) if (!unique.has(id)) missing += 1;
    return { n: report.ids.length, repeats: report.ids.length - unique.size, missing };
  }

  // (1) Submitted and delivered together: runs are accepted, run and delivered by one server at once.
  await ask('reset');
  console.log(
    `\n(1) ${RUNS} async runs with webhookEndpoint, ${SUBMIT_CONNECTIONS} calls at a time, delivered as they end`,
  );
  const cpu0 = lib.cpuMs(ferry.child.pid);
  const p1 = await submit();
  await awaitDeliveries(p1.acceptedAt.size);
  const cpu1 = lib.cpuMs(ferry.child.pid);
  const r1 = await ask('report');
  const t1 = tally(r1, p1.acceptedAt);
  const steady1 = steadyRate(r1.arrivals);
  const last1 = Math.max(...r1.arrivals);
  const seconds1 = (last1 - p1.start) / 1000;
  const delays = [];
  for (const [i, id] of r1.ids.entries()) {
    const at = p1.acceptedAt.get(id);
    if (at !== undefined) delays.push(r1.arrivals[i] - at);
  }
  const delay = summarize(delays);

  // Some deliveries on the record: one attempt each, state delivered.
  const checked = [];
  const ids = [...p1.acceptedAt.keys()];
  for (let i = 0; i < ids.length; i += Math.max(1, Math.floor(ids.length / 5))) {
    const r = await lib.http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${APP}/runs/${ids[i]}`, {
      token: auth.token,
    });
    checked.push(`${r.json?.webhook?.state ?? r.status}/${r.json?.webhook?.attempts?.length ?? '?'}`);
  }

  // (2) Outbox drain: the receiver holds its answers while the runs are submitted and all finish, so the
  // deliveries wait in Ferry's outbox (64 attempts in flight, held); then it answers, and the deliveries
  // flow with nothing else for Ferry to do.
  await sleep(1000);
  await ask('reset');
  await ask('hold');
  console.log(`(2) ${RUNS} more, the receiver holding its answers until every run has ended, then the outbox drains`);
  const ended0 = await endedRuns();
  const p2 = await submit();
  await lib.waitFor(async () => (await endedRuns()) - ended0 >= p2.acceptedAt.size, {
    ms: 600_000,
    everyMs: 200,
    what: 'the runs of phase (2) to end',
  });
  await sleep(500);
  const heldCount = Atomics.load(received, 0);
  const cpu2 = lib.cpuMs(ferry.child.pid);
  const released = await ask('release');
  await awaitDeliveries(p2.acceptedAt.size);
  const cpu3 = lib.cpuMs(ferry.child.pid);
  const r2 = await ask('report');
  const t2 = tally(r2, p2.acceptedAt);
  const after = r2.arrivals.filter((a) => a > released.at);
  const steady2 = steadyRate(after);
  const last2 = Math.max(...r2.arrivals);
  const drainSeconds = (last2 - released.at) / 1000;

  // (3) The ceiling: a plain loop of undici POSTs from this process to the same receiver, same body and headers.
  await ask('reset');
  const sampleHeaders = { ...sample.headers };
  for (const h of ['host', 'connection', 'content-length', 'transfer-encoding']) delete sampleHeaders[h];
  console.log(
    `(3) ceiling: ${RUNS} undici POSTs of a captured delivery (${Buffer.byteLength(sample.body)} bytes) to the` +
      ` receiver, ${CEILING_CONNECTIONS} at a time`,
  );
  const hookPool = new Pool(`http://127.0.0.1:${port}`, { connections: CEILING_CONNECTIONS });
  let sent = 0;
  let ceilingErrors = 0;
  const c0 = nowMs();
  try {
    await Promise.all(
      Array.from({ length: CEILING_CONNECTIONS }, async () => {
        while (sent < RUNS) {
          sent += 1;
          const res = await hookPool.request({
            path: '/hook',
            method: 'POST',
            headers: sampleHeaders,
            body: sample.body,
          });
          await res.body.dump();
          if (res.statusCode !== 200) ceilingErrors += 1;
        }
      }),
    );
  } finally {
    await hookPool.close();
  }
  const c1 = nowMs();
  const r3 = await ask('report');
  const ceiling = r3.arrivals.length / ((c1 - c0) / 1000);
  const steady3 = steadyRate(r3.arrivals);

  console.log(`\nResults (${RUNS} runs per phase, submitted ${SUBMIT_CONNECTIONS} calls at a time)\n`);
  const row = (name, rate, count, seconds) => [name, fmt(rate, 0), String(count), fmt(seconds, 2)];
  console.log(
    table([
      ['figure', 'per second', 'count', 'seconds'],
      row(
        '(1) async runs accepted (202) while submitting',
        p1.acceptedAt.size / ((p1.end - p1.start) / 1000),
        p1.acceptedAt.size,
        (p1.end - p1.start) / 1000,
      ),
      row('(1) deliveries, steady (p10 -> p90 arrival)', steady1.rate, steady1.count, steady1.seconds),
      row('(1) deliveries, end to end (first submit -> last)', t1.n / seconds1, t1.n, seconds1),
      row('(2) outbox drain, steady (p10 -> p90 arrival)', steady2.rate, steady2.count, steady2.seconds),
      row(
        '(2) outbox drain, release -> last delivery',
        (after.length + released.answered) / drainSeconds,
        after.length + released.answered,
        drainSeconds,
      ),
      row(
        `(3) ceiling: undici loop, ${CEILING_CONNECTIONS} at a time, all`,
        ceiling,
        r3.arrivals.length,
        (c1 - c0) / 1000,
      ),
      row('(3) ceiling: steady (p10 -> p90 arrival)', steady3.rate, steady3.count, steady3.seconds),
    ]),
  );
  console.log(
    `\n(1) delay from the 202 to the delivery: p50 ${fmt(delay.median, 1)} ms, p90 ${fmt(delay.p90, 1)} ms, ` +
      `p99 ${fmt(delay.p99, 1)} ms, max ${fmt(delay.max, 1)} ms`,
  );
  for (const [name, t, p] of [
    ['(1)', t1, p1],
    ['(2)', t2, p2],
  ]) {
    console.log(
      `${name} deliveries: ${t.n} received, ${t.repeats} repeats, ${t.missing} accepted runs never delivered;` +
        ` refused submissions: ${JSON.stringify(p.refused)}`,
    );
  }
  console.log(`(2) attempts held before the release: ${heldCount} (answered at the release: ${released.answered})`);
  console.log(
    `signatures: ${r1.verified + r2.verified} checked and valid, ${r1.badSignatures + r2.badSignatures} invalid,` +
      ` ${r1.unsigned + r2.unsigned} unsigned; (1) on the record (webhook state/attempts of ${checked.length} runs):` +
      ` ${checked.join(' ')}; (3) errors: ${ceilingErrors}`,
  );
  const perMs = (ms, n) => `${fmt((ms / Math.max(1, n)) * 1000, 0)} µs`;
  console.log(
    `Ferry CPU: (1) ${fmt(((cpu1 - cpu0) / (seconds1 * 1000)) * 100, 0)}% of one core, ${perMs(cpu1 - cpu0, t1.n)}` +
      ` per run (accept + run + delivery); (2) drain ${fmt(((cpu3 - cpu2) / (drainSeconds * 1000)) * 100, 0)}%,` +
      ` ${perMs(cpu3 - cpu2, t2.n)} per delivery`,
  );

  const valid = (t, p) => t.missing === 0 && Object.keys(p.refused).length === 0 && t.n > 0;
  const signed = r1.badSignatures + r2.badSignatures === 0;
  const verdict = (ok, met) =>
    ok && signed ? (met ? 'met' : 'NOT met') : 'not judged (missing, refused or badly signed)';
  console.log('\nTarget\n');
  console.log(
    table([
      ['figure', 'value', 'target', 'verdict'],
      [
        '(1) deliveries/s, steady',
        fmt(steady1.rate, 0),
        `>= ${TARGET}`,
        verdict(valid(t1, p1), steady1.rate >= TARGET),
      ],
      [
        '(2) deliveries/s, outbox drain, steady',
        fmt(steady2.rate, 0),
        `>= ${TARGET}`,
        verdict(valid(t2, p2), steady2.rate >= TARGET),
      ],
      ['(1) / ceiling (steady)', fmt(steady1.rate / steady3.rate), '-', '-'],
      ['(2) / ceiling (steady)', fmt(steady2.rate / steady3.rate), '-', '-'],
    ]),
  );
  console.log(
    '\nNotes: in (1) runs are submitted while earlier ones are delivered, so it mixes accepting, running and' +
      ' delivering in one Ferry process and cannot deliver faster than it accepts; (2) is delivery alone. At' +
      ' most 64 webhook attempts are in flight at once. The receiver, the submitter, Ferry and the replicas' +
      ' share the machine.',
  );
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log(`load average at end: ${lib.loadAverage()}`);
}
