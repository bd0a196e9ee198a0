#!/usr/bin/env node
/**
 * Apps on their own image (issue 26), measured side by side with the same app on the host runtime, in one
 * run, offline: the base images are made here from the machine's own bits (busybox-static's binary; the
 * "large" one also a copy of the host's Python standard library, for a realistic number of files) and
 * served by Debian's docker-registry on loopback.
 *
 * The app is the same on both sides: `busybox httpd` serving the app folder's `www/` (a custom runtime
 * app, its entrypoint named in ferry.toml, so it starts in the app folder either way). On the host runtime
 * `busybox` is the host's /bin/busybox, on the image the same binary copied into it: the same program and
 * the same files, so what differs is only what Ferry does for an image (its root, its view), not the
 * server. busybox httpd starts in about a millisecond, so the figures are Ferry's own costs, undiluted.
 *
 *   (1) cold start, the image already unpacked on the node: min_replicas 0, cooldown 0; each round waits
 *       until no replica is left (an image's view is kept between replicas), then times one call (a cold start) and one more
 *       (warm); the host app and the two image apps in turn. Target: image / host at most 1.2 (medians).
 *   (2) a second deploy changing only the source (`www/ping.json`): upload → build ready, for the host app
 *       and for image apps with `[image] base + run` (the `run` step cached), in turn. Target: image / host
 *       at most 1.5 (medians).
 *   (3) the first start of an image app on a node that never had it: PostgreSQL + NATS, one `--role all`
 *       process deploys, then each round a fresh `--role all` process (empty data dir, same database and
 *       NATS) serves its first calls of the host app and of the image app; where the time goes comes
 *       from its log (the build fetched from the object store; the image fetched from the image shelf,
 *       verified, unpacked). Reported, no target.
 *
 *   npm run build && npm run bench:images
 *   BENCH_IMAGE_COLD_RUNS=20 BENCH_IMAGE_DEPLOYS=8 BENCH_IMAGE_NODES=5 npm run bench:images
 *
 * Asserts nothing about timing.
 */
import crypto from 'node:crypto';
import fs from 'node:fs';
import fsp from 'node:fs/promises';
import path from 'node:path';
import { Client } from 'undici';
import {
  bootstrapProject,
  createDatabase,
  deleteClusterStreams,
  deployApp,
  envInt,
  fetchMetrics,
  fmt,
  http,
  loadAverage,
  machineReport,
  makeBaseImage,
  onCleanup,
  replicaGauges,
  requireDist,
  requireImageTools,
  runMain,
  sandboxReport,
  startFerry,
  startRegistry,
  summarize,
  table,
  tempDir,
  waitFor,
  zipFiles,
} from './lib.mjs';

const COLD_RUNS = envInt('BENCH_IMAGE_COLD_RUNS', 10);
const DEPLOYS = envInt('BENCH_IMAGE_DEPLOYS', 15);
const NODES = envInt('BENCH_IMAGE_NODES', 3);
const REGISTRY_PORT = process.env.BENCH_REGISTRY_PORT ? envInt('BENCH_REGISTRY_PORT', 5000) : undefined;
const ADMIN_URL = process.env.BENCH_DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
const NATS_URL = process.env.BENCH_NATS_URL ?? 'nats://127.0.0.1:4222';

const TARGET_COLD = 1.2;
const TARGET_DEPLOY = 1.5;

const SCALING = `
[scaling]
min_replicas = 0
max_replicas = 1
cooldown = 0
`;

/** The host folders copied into the large image: BENCH_IMAGE_COPY (":"-separated), else the host Python's stdlib. */
function largeImageFolders() {
  if (process.env.BENCH_IMAGE_COPY !== undefined) return process.env.BENCH_IMAGE_COPY.split(':').filter(Boolean);
  try {
    const python = fs.realpathSync('/usr/bin/python3');
    const stdlib = `/usr/lib/${path.basename(python)}`;
    return fs.existsSync(stdlib) ? [stdlib] : [];
  } catch {
    return [];
  }
}

/**
 * The app: busybox httpd on port 8080 serving `www/` of the app folder, with its health and readiness
 * files; on the image `base` when given (with `run` steps when given). `version` changes only the source.
 */
function httpdApp(name, { base, run, version = 1 } = {}) {
  const image = base ? `\n[image]\nbase = "${base}"\n${run ? `run = ${JSON.stringify(run)}\n` : ''}` : '';
  return {
    'ferry.toml': `[app]\nname = "${name}"\nruntime = "custom"\n${image}
[runtime.custom]
entrypoint = ["busybox", "httpd", "-f", "-p", "8080", "-h", "www"]
port = 8080
healthcheck_endpoint = "/health"
readycheck_endpoint = "/ready"
${SCALING}`,
    'www/ping.json': `{"ok":true,"version":${version}}\n`,
    'www/health': 'ok\n',
    'www/ready': 'ok\n',
  };
}

/**
 * A Ferry server for this bench: a fresh data dir, its own TMPDIR (so its image views can be watched), the
 * warm pool off (it serves no custom app, image or host: off, it starts no sandboxes in the background).
 */
async function startServer(label, env = {}) {
  const dataDir = await tempDir(`ferry-bench-images-${label}-`);
  const tmp = path.join(dataDir, '..', `${path.basename(dataDir)}-tmp`);
  await fsp.mkdir(tmp, { mode: 0o755 });
  onCleanup(() => fsp.rm(tmp, { recursive: true, force: true }));
  const serverEnv = { FERRY_WARM_POOL: '0', TMPDIR: tmp, ...env };
  return { dataDir, tmp, serverEnv };
}

/** One GET through `client`; the time from sending to the full response, and the run id. */
async function timedGet(client, urlPath, token) {
  const start = process.hrtime.bigint();
  const res = await client.request({ path: urlPath, method: 'GET', headers: { authorization: `Bearer ${token}` } });
  const text = await res.body.text();
  const ms = Number(process.hrtime.bigint() - start) / 1e6;
  if (res.statusCode !== 200 || !text.includes('"ok":true'))
    throw new Error(`GET ${urlPath} answered ${res.statusCode}: ${text.slice(0, 300)}`);
  return { ms, runId: String(res.headers['x-request-id']) };
}

async function runRecord(ferry, auth, app, runId) {
  const res = await http(`${ferry.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}`, { token: auth.token });
  if (res.status !== 200) throw new Error(`GET run ${runId} answered ${res.status}: ${res.text}`);
  return res.json;
}

/**
 * Waits until no replica of `apps` runs on `ferry`. An image's view is kept between replicas (until the cache
 * discards the image), so the next cold start makes none: that is part of what a cold start costs now.
 */
async function idle(ferry, apps) {
  await waitFor(
    async () => {
      for (const app of apps) {
        const g = await replicaGauges(ferry, app);
        if (g.ready + g.starting > 0) return false;
      }
      return ferry.replicaProcesses().length === 0;
    },
    { ms: 60_000, everyMs: 20, what: 'the replicas to stop (cooldown 0)' },
  );
}

/** The mean of `ferry_cold_start_duration_seconds` (spawn → ready) per app, in ms. */
async function coldStartMeans(ferry) {
  const text = await fetchMetrics(ferry);
  const sums = new Map();
  for (const line of text.split('\n')) {
    const m = /^ferry_cold_start_duration_seconds_(sum|count)\{[^}]*app="([^"]+)"[^}]*\} (\S+)$/.exec(line);
    if (!m) continue;
    const entry = sums.get(m[2]) ?? { sum: 0, count: 0 };
    entry[m[1]] += Number(m[3]);
    sums.set(m[2], entry);
  }
  return (app) => {
    const e = sums.get(app);
    return e && e.count > 0 ? (e.sum / e.count) * 1000 : Number.NaN;
  };
}

/** Uploads the app and waits for its build to end, as `ferry deploy` does: wall time, and the build's own figures. */
/** Reads a build log's event stream (text/event-stream) until its `end` event, within `ms`. */
async function followUntilEnd(url, token, ms) {
  const res = await fetch(url, {
    headers: { authorization: `Bearer ${token}`, accept: 'text/event-stream' },
    signal: AbortSignal.timeout(ms),
  });
  if (res.status !== 200) throw new Error(`the build log answered ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let text = '';
  for await (const chunk of res.body) {
    text += decoder.decode(chunk, { stream: true });
    if (/^event: end$/m.test(text)) break;
  }
  await res.body.cancel().catch(() => undefined);
}

async function timedDeploy(ferry, auth, app, files) {
  const zip = await zipFiles(files);
  const base = `${ferry.url}/v2/projects/${auth.projectId}/apps/${app}`;
  const start = process.hrtime.bigint();
  const res = await http(`${base}/builds`, {
    method: 'POST',
    token: auth.token,
    body: zip,
    headers: { 'content-type': 'application/zip' },
  });
  if (res.status !== 201) throw new Error(`upload of ${app} failed (${res.status}): ${res.text}`);
  // As `ferry deploy` waits: the build log's event stream, which ends when the build does (no polling
  // interval in the figure).
  await followUntilEnd(`${base}/builds/${res.json.id}/logs`, auth.token, 300_000);
  const ms = Number(process.hrtime.bigint() - start) / 1e6;
  const build = (await http(`${base}/builds/${res.json.id}`, { token: auth.token })).json;
  const logs = await http(`${base}/builds/${build.id}/logs`, { token: auth.token });
  const text = (logs.json?.lines ?? []).map((l) => l.line).join('\n');
  if (build.state !== 'ready') throw new Error(`build of ${app} ended ${build.state}: ${build.error ?? ''}\n${text}`);
  const steps = /\((\d+) steps? ran, (\d+) cached\)/.exec(text);
  return {
    ms,
    id: build.id,
    buildMs: build.duration_ms,
    queuedMs: Date.parse(build.started_at) - Date.parse(build.created_at),
    ran: steps ? Number(steps[1]) : undefined,
    cached: steps ? Number(steps[2]) : undefined,
    digest: build.image?.digest,
    lines: logs.json?.lines ?? [],
    createdAt: build.created_at,
  };
}

/** JSON log lines of a Ferry child process with the message `msg` (or starting with it). */
function logLines(ferry, msg) {
  const out = [];
  for (const line of ferry.output().split('\n')) {
    if (!line.includes(msg)) continue;
    try {
      const json = JSON.parse(line);
      if (typeof json.msg === 'string' && json.msg.startsWith(msg)) out.push(json);
    } catch {
      // a partial line at the tail
    }
  }
  return out;
}

const ratioText = (a, b) => (Number.isFinite(a) && Number.isFinite(b) && b > 0 ? `${fmt(a / b)}×` : 'n/a');
const verdict = (ratio, target) => (!Number.isFinite(ratio) ? 'not judged' : ratio <= target ? 'met' : 'NOT met');

// ---------------------------------------------------------------------------------------------------

async function coldStarts(ferry, auth, apps) {
  console.log(
    `\n(1) Cold start, the image already unpacked on the node: ${COLD_RUNS} rounds, the apps in turn (the order rotates each round)`,
  );
  const client = new Client(ferry.url);
  const names = apps.map((a) => a.app);
  for (const a of apps) {
    // The first call after the deploy also switches the scaled-to-zero app to its build (and, for an image
    // app on a node that pulled it at build time, finds the image unpacked): shown, not counted.
    const first = await timedGet(client, `/v4/${auth.projectId}/${a.app}/ping.json`, auth.token);
    console.log(`  ${a.label}: first call after the deploy ${fmt(first.ms, 1)} ms (not counted)`);
    a.cold = [];
    a.warm = [];
    a.skipped = 0;
  }
  const sandboxSeen = new Set();
  for (let i = 0; i < COLD_RUNS; i++) {
    const order = apps.map((_, k) => apps[(k + i) % apps.length]);
    const parts = [];
    for (const a of order) {
      await idle(ferry, names);
      const c = await timedGet(client, `/v4/${auth.projectId}/${a.app}/ping.json`, auth.token);
      const procs = ferry.replicaProcesses();
      if (procs.length > 0) sandboxSeen.add(procs.some((p) => p.comm === 'bwrap') ? 'bwrap' : 'plain');
      const w = await timedGet(client, `/v4/${auth.projectId}/${a.app}/ping.json`, auth.token);
      const [cRec, wRec] = await Promise.all([
        runRecord(ferry, auth, a.app, c.runId),
        runRecord(ferry, auth, a.app, w.runId),
      ]);
      if (cRec.cold_start === true) a.cold.push(c.ms);
      else a.skipped++;
      if (wRec.cold_start === false) a.warm.push(w.ms);
      parts.push(`${a.short} ${fmt(c.ms, 1)}${cRec.cold_start === true ? '' : ' (not cold: left out)'}`);
    }
    console.log(`  ${String(i + 1).padStart(2)}/${COLD_RUNS}  cold ms: ${parts.join(', ')}`);
  }
  await client.close();
  const spawnMean = await coldStartMeans(ferry);
  const host = summarize(apps[0].cold);
  const rows = [['app', 'n', 'cold median ms', 'p90', 'min', 'max', 'warm median', 'spawn→ready mean', 'vs host']];
  for (const a of apps) {
    const s = summarize(a.cold);
    rows.push([
      a.label,
      String(s.n),
      fmt(s.median, 1),
      fmt(s.p90, 1),
      fmt(s.min, 1),
      fmt(s.max, 1),
      fmt(summarize(a.warm).median, 2),
      fmt(spawnMean(a.app), 1),
      a === apps[0] ? '-' : ratioText(s.median, host.median),
    ]);
  }
  console.log(`\n${table(rows)}`);
  console.log(
    '(client time from sending the call to the full answer; "spawn→ready mean": ferry_cold_start_duration_seconds, the server side of a cold start)',
  );
  for (const a of apps)
    if (a.skipped > 0) console.log(`  ${a.label}: ${a.skipped} call(s) not marked cold_start, left out`);
  const observed =
    sandboxSeen.size === 1 ? (sandboxSeen.has('bwrap') ? 'on (bwrap)' : 'off (plain processes)') : 'mixed or unknown';
  console.log(`sandbox: ${observed}; ferry doctor: ${(await sandboxReport(undefined)).doctor}`);
  return apps.slice(1).map((a) => {
    const ratio = summarize(a.cold).median / host.median;
    return [
      `(1) cold start, ${a.label} / host runtime`,
      `${fmt(ratio)}×`,
      `≤ ${TARGET_COLD}×`,
      verdict(ratio, TARGET_COLD),
    ];
  });
}

async function secondDeploys(ferry, auth, apps) {
  console.log(
    `\n(2) Second deploy, only the source changed (www/ping.json): ${DEPLOYS} rounds, the apps in turn (the order rotates each round)`,
  );
  for (const a of apps) {
    const first = await timedDeploy(ferry, auth, a.app, httpdApp(a.app, { ...a.options, version: 0 }));
    console.log(
      `  ${a.label}: first deploy ${fmt(first.ms, 0)} ms (not counted)${first.ran !== undefined ? `, ${first.ran} step(s) ran, ${first.cached} cached` : ''}${first.digest ? `, image ${first.digest.slice(0, 19)}` : ''}`,
    );
    a.times = [];
    a.buildMs = [];
    a.queuedMs = [];
    a.notCached = 0;
  }
  for (let i = 0; i < DEPLOYS; i++) {
    const order = apps.map((_, k) => apps[(k + i) % apps.length]);
    const parts = [];
    for (const a of order) {
      const d = await timedDeploy(ferry, auth, a.app, httpdApp(a.app, { ...a.options, version: i + 1 }));
      a.times.push(d.ms);
      a.buildMs.push(d.buildMs);
      a.queuedMs.push(d.queuedMs);
      if (d.ran !== undefined && d.ran > 0) a.notCached++;
      a.last = d;
      parts.push(`${a.short} ${fmt(d.ms, 0)}${d.ran !== undefined ? ` (${d.ran} ran, ${d.cached} cached)` : ''}`);
    }
    console.log(`  ${String(i + 1).padStart(2)}/${DEPLOYS}  ms: ${parts.join(', ')}`);
  }
  const host = summarize(apps[0].times);
  const rows = [
    ['app', 'n', 'upload→ready median ms', 'p90', 'min', 'max', 'build (started→finished)', 'queued', 'vs host'],
  ];
  for (const a of apps) {
    const s = summarize(a.times);
    rows.push([
      a.label,
      String(s.n),
      fmt(s.median, 0),
      fmt(s.p90, 0),
      fmt(s.min, 0),
      fmt(s.max, 0),
      fmt(summarize(a.buildMs).median, 0),
      fmt(summarize(a.queuedMs).median, 0),
      a === apps[0] ? '-' : ratioText(s.median, host.median),
    ]);
  }
  console.log(`\n${table(rows)}`);
  console.log(
    "(wall time from the upload to the end of the build log's event stream, as `ferry deploy` waits; build and queued: from the build record)",
  );
  for (const a of apps)
    if (a.notCached > 0) console.log(`  ${a.label}: ${a.notCached} deploy(s) re-ran a step (the layer cache missed)`);
  // Where a deploy's time goes: the last deploy's build log, each line at its time since the upload.
  for (const a of [apps[0], apps.at(-1)]) {
    console.log(`\n  build log of the last ${a.label} deploy (${fmt(a.last.ms, 0)} ms), ms since the upload:`);
    for (const l of a.last.lines) {
      const at = Date.parse(l.at) - Date.parse(a.last.createdAt);
      console.log(`    ${String(at).padStart(5)}  ${l.line.length > 110 ? `${l.line.slice(0, 107)}...` : l.line}`);
    }
  }
  return apps.slice(1).map((a) => {
    const ratio = summarize(a.times).median / host.median;
    return [
      `(2) second deploy, ${a.label} / host runtime`,
      `${fmt(ratio)}×`,
      `≤ ${TARGET_DEPLOY}×`,
      verdict(ratio, TARGET_DEPLOY),
    ];
  });
}

async function firstStarts(registry, baseLarge, largeInfo) {
  console.log(
    `\n(3) First start on a node that never had the image: PostgreSQL + NATS (${NATS_URL}), one \`--role all\` process deploys; ${NODES} fresh \`--role all\` process${NODES > 1 ? 'es' : ''}, one after the other, serve their first calls`,
  );
  const databaseUrl = await createDatabase(ADMIN_URL, 'ferry_bench_images_');
  const cluster = `benchimg_${crypto.randomBytes(4).toString('hex')}`;
  onCleanup(() => deleteClusterStreams(NATS_URL, cluster));
  const keysDir = await tempDir('ferry-bench-images-keys-');
  const common = {
    FERRY_DATABASE_URL: databaseUrl,
    FERRY_NATS_URL: NATS_URL,
    FERRY_CLUSTER_NAME: cluster,
    FERRY_KEYS_DIR: keysDir,
  };
  const auth = await bootstrapProject(await tempDir('ferry-bench-images-boot-'), common);
  const a = await startServer('deployer', { ...common, FERRY_INSECURE_REGISTRIES: registry.host });
  const deployer = await startFerry(a.dataDir, { env: a.serverEnv });
  console.log(
    `  deployer: ${deployer.url} (pid ${deployer.child.pid}); database ${new URL(databaseUrl).pathname.slice(1)}, cluster ${cluster}`,
  );
  const hostApp = 'first-host';
  const imageApp = 'first-img';
  const hostBuild = await deployApp(deployer, auth, hostApp, httpdApp(hostApp));
  const imageBuild = await deployApp(
    deployer,
    auth,
    imageApp,
    httpdApp(imageApp, { base: baseLarge, run: ['echo built > /etc/bench-step'] }),
  );
  console.log(
    `  deployed ${hostApp} (host runtime) and ${imageApp} (the large image + a run step: built here, so only the image shelf has it): ${imageBuild.image?.digest}`,
  );

  const rounds = [];
  for (let i = 0; i < NODES; i++) {
    // No FERRY_INSECURE_REGISTRIES here: the fresh node cannot reach the registry, only the shelf.
    const b = await startServer(`node${i + 1}`, common);
    const node = await startFerry(b.dataDir, { env: b.serverEnv });
    const client = new Client(node.url);
    const call = (app) => timedGet(client, `/v4/${auth.projectId}/${app}/ping.json`, auth.token);
    const order = i % 2 === 0 ? [hostApp, imageApp] : [imageApp, hostApp];
    const first = {};
    for (const app of order) first[app] = (await call(app)).ms;
    // The same node again, both apps scaled to zero: a cold start with the build and the image on the node.
    const again = {};
    for (const app of order) {
      await idle(node, [hostApp, imageApp]);
      again[app] = (await call(app)).ms;
    }
    await client.close();
    const builds = logLines(node, 'fetched the build from');
    const buildFetch = (id) => builds.find((l) => l.buildId === id)?.ms ?? Number.NaN;
    const shelf = logLines(node, 'fetched the image from the image shelf')[0];
    const round = {
      hostFirst: first[hostApp],
      imageFirst: first[imageApp],
      hostBuildFetch: buildFetch(hostBuild.id),
      imageBuildFetch: buildFetch(imageBuild.id),
      fetch: shelf?.fetchMs ?? Number.NaN,
      verify: shelf?.verifyMs ?? Number.NaN,
      unpack: shelf?.unpackMs ?? Number.NaN,
      bytes: shelf?.bytes ?? Number.NaN,
      blobs: shelf?.blobs ?? Number.NaN,
      cacheBytes: shelf?.cacheBytes ?? Number.NaN,
      hostAgain: again[hostApp],
      imageAgain: again[imageApp],
    };
    round.rest = round.imageFirst - round.imageBuildFetch - round.fetch - round.unpack;
    rounds.push(round);
    console.log(
      `  node ${i + 1}/${NODES} (${order[0] === hostApp ? 'host app first' : 'image app first'}): first call host ${fmt(round.hostFirst, 0)} ms, image ${fmt(round.imageFirst, 0)} ms ` +
        `(build fetch ${fmt(round.imageBuildFetch, 0)}, image fetch ${fmt(round.fetch, 0)} of which verify ${fmt(round.verify, 0)}, unpack ${fmt(round.unpack, 0)}); ` +
        `cold again on the node: host ${fmt(round.hostAgain, 0)} ms, image ${fmt(round.imageAgain, 0)} ms`,
    );
    if (!shelf) console.log('    (no "fetched the image from the image shelf" line in the node\'s log)');
    await node.stop();
  }
  await deployer.stop();
  const med = (key) => summarize(rounds.map((r) => r[key]).filter(Number.isFinite)).median;
  console.log(
    `\n  image: ${largeInfo.files} files, ${fmt(largeInfo.bytes / 2 ** 20, 1)} MiB in its root; fetched ${fmt(med('blobs'), 0)} blobs, ${fmt(med('bytes') / 2 ** 20, 1)} MiB (compressed layers); on the node's disk after unpacking ${fmt(med('cacheBytes') / 2 ** 20, 1)} MiB (root + kept layout)`,
  );
  console.log(
    table([
      [`first start on a fresh node (medians of ${rounds.length}, each line on its own)`, 'ms'],
      ['host app: first call', fmt(med('hostFirst'), 0)],
      ['  of which: build fetched from the object store', fmt(med('hostBuildFetch'), 0)],
      ['image app: first call', fmt(med('imageFirst'), 0)],
      ['  of which: build fetched from the object store', fmt(med('imageBuildFetch'), 0)],
      ['  of which: image fetched from the shelf (with verify)', fmt(med('fetch'), 0)],
      ['    of which: verify (SHA-256 of each blob as it arrives)', fmt(med('verify'), 0)],
      ['  of which: image unpacked into the node cache', fmt(med('unpack'), 0)],
      ['  the rest (image view, sandbox start, server ready, the call)', fmt(med('rest'), 0)],
      ['host app: cold start again on that node', fmt(med('hostAgain'), 0)],
      ['image app: cold start again on that node (image there)', fmt(med('imageAgain'), 0)],
    ]),
  );
  return [
    ['(3) first start of the image app on a fresh node', `${fmt(med('imageFirst'), 0)} ms`, 'reported', '-'],
    ['(3) ... the host app on a fresh node, for comparison', `${fmt(med('hostFirst'), 0)} ms`, 'reported', '-'],
  ];
}

async function main() {
  requireDist();
  requireImageTools();
  console.log('Ferry bench: apps on their own image vs the host runtime (issue 26)\n');
  console.log(machineReport());

  const work = await tempDir('ferry-bench-images-work-');
  const copy = largeImageFolders();
  const small = await makeBaseImage(path.join(work, 'small'), { files: { 'etc/os-release': 'ID=bench-small\n' } });
  const large = await makeBaseImage(path.join(work, 'large'), {
    files: { 'etc/os-release': 'ID=bench-large\n' },
    copy: copy.map((from) => ({ from, to: from.slice(1) })),
  });
  const registry = await startRegistry(REGISTRY_PORT);
  await registry.push(small, 'bench/small:1');
  await registry.push(large, 'bench/large:1');
  const baseSmall = `${registry.host}/bench/small:1`;
  const baseLarge = `${registry.host}/bench/large:1`;
  console.log(
    `registry ${registry.host}; images: small = busybox only (${small.files} files, ${fmt(small.bytes / 2 ** 20, 1)} MiB), large = busybox + ${copy.join(', ') || 'nothing (BENCH_IMAGE_COPY empty)'} (${large.files} files, ${fmt(large.bytes / 2 ** 20, 1)} MiB)`,
  );

  const s = await startServer('single', { FERRY_INSECURE_REGISTRIES: registry.host });
  const auth = await bootstrapProject(s.dataDir);
  const ferry = await startFerry(s.dataDir, { env: s.serverEnv });
  console.log(`ferry serve: ${ferry.url} (pid ${ferry.child.pid}, data dir ${s.dataDir}), FERRY_WARM_POOL=0`);

  const coldApps = [
    { label: 'host runtime', short: 'host', app: 'cold-host', options: {} },
    { label: 'image, small', short: 'small', app: 'cold-img-small', options: { base: baseSmall } },
    {
      label: `image, large (${large.files} files)`,
      short: 'large',
      app: 'cold-img-large',
      options: { base: baseLarge },
    },
  ];
  for (const a of coldApps) await deployApp(ferry, auth, a.app, httpdApp(a.app, a.options));
  const summary = await coldStarts(ferry, auth, coldApps);

  const run = ['echo built > /etc/bench-step'];
  const deployApps = [
    { label: 'host runtime', short: 'host', app: 'dep-host', options: {} },
    { label: 'image small + run', short: 'small', app: 'dep-img-small', options: { base: baseSmall, run } },
    { label: 'image large + run', short: 'large', app: 'dep-img-large', options: { base: baseLarge, run } },
  ];
  summary.push(...(await secondDeploys(ferry, auth, deployApps)));
  await ferry.stop();

  summary.push(...(await firstStarts(registry, baseLarge, large)));

  console.log('\nSummary (issue 26, "Performance")\n');
  console.log(table([['figure', 'value', 'target', 'verdict'], ...summary]));
  console.log(`load average at end: ${loadAverage()}`);
}

await runMain(main);
