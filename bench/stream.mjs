#!/usr/bin/env node
/**
 * Streaming runs: the latency Ferry adds to each event of an async generator, over reading the same
 * generator's items straight from the replica's socket. Three paths, in turn in every repetition so noise
 * hits them alike:
 *   (a) direct:       POST /_ferry/call/run on the replica's Unix socket, NDJSON `item` frames;
 *   (b) Ferry:        POST /v4/<project>/<app>/run with `Accept: text/event-stream`, one `data:` event per item;
 *   (c) Ferry + gzip: the same with `Accept-Encoding: gzip`, decoded incrementally with zlib.
 * Each item carries the time the generator yielded it (process.hrtime, CLOCK_MONOTONIC, one clock for every
 * process of the machine); an event's latency is its arrival (decoded, parsed) minus that time. Prints
 * figures and the target; asserts nothing about timing (shared, noisy machines).
 *
 *   npm run build && npm run bench:stream
 *   BENCH_STREAM_REPS=20 BENCH_STREAM_EVENTS=200 BENCH_STREAM_INTERVAL_MS=5 npm run bench:stream
 */
import { createGunzip } from 'node:zlib';
import { Client } from 'undici';
import {
  cpuMs,
  envInt,
  fmt,
  http,
  loadAverage,
  machineReport,
  onlyReplicaSocket,
  replicaSockets,
  requireDist,
  runMain,
  sandboxReport,
  startDeployed,
  summarize,
  table,
} from './lib.mjs';

const REPS = envInt('BENCH_STREAM_REPS', 20);
const WARMUP_REPS = envInt('BENCH_STREAM_WARMUP', 2, 0);
const EVENTS = envInt('BENCH_STREAM_EVENTS', 200);
const INTERVAL_MS = envInt('BENCH_STREAM_INTERVAL_MS', 5, 0);
const APP = 'stream';

const TARGET_ADDED_MS = 2; // added latency per event, less than

// The generator of the brief, its items stamped with the time they were yielded (ms of CLOCK_MONOTONIC).
const APP_FILES = {
  'ferry.toml': `[app]
name = "${APP}"

[scaling]
min_replicas = 1
max_replicas = 1
replica_concurrency = 8
response_grace_period = 60
`,
  'main.ts': `export async function* run({ n = 200, ms = 5 }: { n?: number; ms?: number }) {
  for (let i = 0; i < n; i++) {
    await new Promise((r) => setTimeout(r, ms));
    yield { i, at: Number(process.hrtime.bigint()) / 1e6 };
  }
}
`,
};

const nowMs = () => Number(process.hrtime.bigint()) / 1e6;

/**
 * One streaming call. The body is read as it comes (gunzipped first for `expectEncoding: 'gzip'`); `split`
 * takes the text so far and returns [complete items, rest]. Returns, per event, its latency when parsed
 * (`latencies`) and when its bytes arrived from the socket (`wire`: for gzip, the arrival of the compressed
 * chunk that held it, without this reader's decoding; otherwise the same), and the times of the first and
 * the last event after sending.
 */
async function streamOnce(client, { path: reqPath, headers, expectEncoding, split }) {
  const body = JSON.stringify({ n: EVENTS, ms: INTERVAL_MS });
  const sent = nowMs();
  const res = await client.request({ path: reqPath, method: 'POST', headers, body });
  if (res.statusCode !== 200) {
    throw new Error(`${reqPath} answered ${res.statusCode}: ${(await res.body.text()).slice(0, 300)}`);
  }
  const encoding = res.headers['content-encoding'];
  if ((encoding ?? 'identity') !== (expectEncoding ?? 'identity')) {
    throw new Error(`${reqPath}: content-encoding ${encoding ?? '(none)'}, expected ${expectEncoding ?? '(none)'}`);
  }
  let source = res.body;
  let wireTime = () => nowMs();
  if (expectEncoding === 'gzip') {
    // Compressed chunks as they arrive: [end offset in the compressed stream, arrival time]. When gunzip
    // emits output, bytesWritten is the end of the input it has taken, so its chunk's arrival is known.
    const raw = [];
    let rawBytes = 0;
    res.body.on('data', (chunk) => {
      rawBytes += chunk.length;
      raw.push([rawBytes, nowMs()]);
    });
    const gunzip = createGunzip();
    res.body.on('error', (err) => gunzip.destroy(err));
    source = res.body.pipe(gunzip);
    wireTime = () => {
      const consumed = gunzip.bytesWritten;
      return (raw.find(([endOffset]) => endOffset >= consumed) ?? raw.at(-1))[1];
    };
  }
  const latencies = [];
  const wire = [];
  let first;
  let last;
  let rest = '';
  let expected = 0;
  await new Promise((resolve, reject) => {
    source.on('data', (chunk) => {
      // Read at once in the 'data' event (not through an async iterator, which may lag behind).
      const at = nowMs();
      const wireAt = wireTime();
      try {
        const [items, remaining] = split(rest + chunk.toString('utf8'));
        rest = remaining;
        for (const item of items) {
          if (item.i !== expected) throw new Error(`${reqPath}: event ${item.i} arrived, expected ${expected}`);
          expected += 1;
          latencies.push(at - item.at);
          wire.push(wireAt - item.at);
          first ??= at - sent;
          last = at - sent;
        }
      } catch (err) {
        source.destroy();
        reject(err);
      }
    });
    source.once('end', resolve);
    source.once('error', reject);
  });
  if (expected !== EVENTS) throw new Error(`${reqPath}: the stream ended after ${expected} of ${EVENTS} events`);
  return { latencies, wire, first, last };
}

/** NDJSON frames of the replica protocol: the `item` frames' data; an `error` frame throws. */
function splitNdjson(text) {
  const lines = text.split('\n');
  const rest = lines.pop();
  const items = [];
  for (const line of lines) {
    if (!line) continue;
    const frame = JSON.parse(line);
    if (frame.type === 'item') items.push(frame.data);
    else if (frame.type === 'error') throw new Error(`the replica sent an error frame: ${line}`);
  }
  return [items, rest];
}

/**
 * Server-sent events: each item event's `data:` lines joined, parsed as JSON; an `event: error` throws;
 * `retry:`, `id:` and the closing `event: end` are not items.
 */
function splitSse(text) {
  const blocks = text.split('\n\n');
  const rest = blocks.pop();
  const items = [];
  for (const block of blocks) {
    let event = 'message';
    const data = [];
    for (const line of block.split('\n')) {
      if (line.startsWith('event:')) event = line.slice(6).trim();
      else if (line.startsWith('data:')) data.push(line.slice(line[5] === ' ' ? 6 : 5));
    }
    if (event === 'error') throw new Error(`Ferry sent an error event: ${data.join('\n')}`);
    if (event === 'message' && data.length > 0) items.push(JSON.parse(data.join('\n')));
  }
  return [items, rest];
}

async function main() {
  requireDist();
  console.log('Ferry bench: streaming runs, latency added per event, direct vs Ferry (SSE, SSE + gzip)\n');
  console.log(machineReport());

  // One replica socket to find and measure: no warm sandboxes waiting beside it (they have sockets too).
  const { dataDir, auth, ferry } = await startDeployed('stream', APP, APP_FILES, { FERRY_WARM_POOL: '0' });
  const runPath = `/v4/${auth.projectId}/${APP}/run`;
  const first = await http(`${ferry.url}${runPath}`, { method: 'POST', token: auth.token, body: { n: 2, ms: 0 } });
  if (first.status !== 200 || first.json?.result?.length !== 2)
    throw new Error(`the first (JSON) run answered ${first.status}: ${first.text}`);

  const socketPath = onlyReplicaSocket(dataDir, ferry);
  const sandbox = await sandboxReport(ferry);
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);

  const direct = new Client('http://localhost', { socketPath });
  const viaFerry = new Client(ferry.url);
  const ferryHeaders = {
    'content-type': 'application/json',
    authorization: `Bearer ${auth.token}`,
    accept: 'text/event-stream',
  };
  let callNo = 0;
  const paths = [
    {
      name: '(a) direct',
      client: direct,
      opts: () => ({
        path: '/_ferry/call/run',
        headers: { 'content-type': 'application/json', 'x-ferry-run-id': `bench-stream-${++callNo}` },
        split: splitNdjson,
      }),
    },
    {
      name: '(b) Ferry SSE',
      client: viaFerry,
      opts: () => ({ path: runPath, headers: ferryHeaders, split: splitSse }),
    },
    {
      name: '(c) Ferry SSE + gzip',
      client: viaFerry,
      opts: () => ({
        path: runPath,
        headers: { ...ferryHeaders, 'accept-encoding': 'gzip' },
        expectEncoding: 'gzip',
        split: splitSse,
      }),
    },
  ];
  const results = paths.map(() => ({ latencies: [], wire: [], first: [], last: [], ferryCpu: 0 }));

  const total = WARMUP_REPS + REPS;
  console.log(
    `\n${REPS} repetitions (+${WARMUP_REPS} warm-up) of ${EVENTS} events ${INTERVAL_MS} ms apart, the three paths in turn:`,
  );
  for (let rep = 0; rep < total; rep++) {
    for (const [p, target] of paths.entries()) {
      const cpu0 = cpuMs(ferry.child.pid);
      const r = await streamOnce(target.client, target.opts());
      const cpu = cpuMs(ferry.child.pid) - cpu0;
      if (rep < WARMUP_REPS) continue;
      results[p].latencies.push(...r.latencies);
      results[p].wire.push(...r.wire);
      results[p].first.push(r.first);
      results[p].last.push(r.last);
      results[p].ferryCpu += cpu;
    }
    process.stdout.write(rep < WARMUP_REPS ? 'w' : '.');
  }
  console.log(' done');
  await direct.close();
  await viaFerry.close();
  const after = replicaSockets(dataDir, ferry);
  const sameReplica = after.length === 1 && after[0] === socketPath;

  const stats = results.map((r) => ({
    lat: summarize(r.latencies),
    wire: summarize(r.wire),
    first: summarize(r.first),
    last: summarize(r.last),
    cpuPerEvent: (r.ferryCpu / r.latencies.length) * 1000,
  }));
  console.log(
    `\nPer-event latency: arrival (parsed) minus the generator's yield time; ${REPS} × ${EVENTS} events per path\n`,
  );
  const rows = [
    ['path', 'events', 'p50 ms', 'p90 ms', 'p99 ms', 'max ms', 'first event ms', 'last event ms', 'Ferry CPU/event'],
  ];
  for (const [p, s] of stats.entries()) {
    rows.push([
      paths[p].name,
      String(s.lat.n),
      fmt(s.lat.median, 3),
      fmt(s.lat.p90, 3),
      fmt(s.lat.p99, 3),
      fmt(s.lat.max, 3),
      fmt(s.first.median, 2),
      fmt(s.last.median, 1),
      `${fmt(s.cpuPerEvent, 0)} µs`,
    ]);
  }
  // The gzip path measured when its compressed bytes arrived: Ferry's part, without this reader's gunzip.
  const cw = stats[2].wire;
  rows.push([
    '(c) at the wire (compressed)',
    String(cw.n),
    fmt(cw.median, 3),
    fmt(cw.p90, 3),
    fmt(cw.p99, 3),
    fmt(cw.max, 3),
    '-',
    '-',
    '-',
  ]);
  console.log(table(rows));
  console.log(
    '(first / last event ms: medians over the repetitions, from sending the call; Ferry CPU/event: the' +
      " server's CPU time during the path's calls over their events, run start and end included; for (a)" +
      ' Ferry is idle: its background work)',
  );

  const [a, b, c] = stats;
  const sane = a.lat.min >= -0.05;
  const verdict = (ms) => (sane ? (ms < TARGET_ADDED_MS ? 'met' : 'NOT met') : 'not judged (clock check failed)');
  console.log('\nAdded latency per event (Ferry − direct, same percentile)\n');
  console.log(
    table([
      ['figure', 'value', 'target', 'verdict'],
      [
        'p50 added, SSE (b − a)',
        `${fmt(b.lat.median - a.lat.median, 3)} ms`,
        `< ${TARGET_ADDED_MS} ms`,
        verdict(b.lat.median - a.lat.median),
      ],
      [
        'p99 added, SSE (b − a)',
        `${fmt(b.lat.p99 - a.lat.p99, 3)} ms`,
        `< ${TARGET_ADDED_MS} ms`,
        verdict(b.lat.p99 - a.lat.p99),
      ],
      [
        'p50 added, SSE + gzip (c − a)',
        `${fmt(c.lat.median - a.lat.median, 3)} ms`,
        `< ${TARGET_ADDED_MS} ms`,
        verdict(c.lat.median - a.lat.median),
      ],
      [
        'p99 added, SSE + gzip (c − a)',
        `${fmt(c.lat.p99 - a.lat.p99, 3)} ms`,
        `< ${TARGET_ADDED_MS} ms`,
        verdict(c.lat.p99 - a.lat.p99),
      ],
      ['p50 gzip cost (c − b)', `${fmt(c.lat.median - b.lat.median, 3)} ms`, '-', '-'],
      ['p50 added, gzip at the wire (c wire − a)', `${fmt(c.wire.median - a.lat.median, 3)} ms`, '-', '-'],
      ['p99 added, gzip at the wire (c wire − a)', `${fmt(c.wire.p99 - a.lat.p99, 3)} ms`, '-', '-'],
      ['first event added (b − a, medians)', `${fmt(b.first.median - a.first.median, 2)} ms`, '-', '-'],
    ]),
  );
  if (!sane) {
    console.log(
      `WARNING: a direct event arrived ${fmt(-a.lat.min, 3)} ms before it was yielded: the replica's clock is not` +
        ' the bench process clock (time namespace?), so the latencies are not judged.',
    );
  }
  console.log(
    '\nNotes: the direct path includes what any reader pays (socket, parse); the difference is what Ferry adds' +
      ' (the replica protocol read, SSE framing, the extra socket, gzip when asked). The generator, the' +
      ' replica, Ferry and this reader share the machine.',
  );
  if (!sameReplica) console.log('WARNING: the replica changed during the bench (restarted?): figures are suspect.');
  console.log(`sandbox: ${sandbox.observed}; ferry doctor: ${sandbox.doctor}`);
  console.log(`load average at end: ${loadAverage()}`);
}

await runMain(main);
