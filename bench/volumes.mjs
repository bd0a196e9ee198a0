#!/usr/bin/env node
/**
 * bench:volumes (issue 27): volumes against their baselines, side by side in one run.
 *
 * 1. Reading a file from a volume inside a replica vs reading the same file from the host's disk with the
 *    same code (a Node loop of 4 MiB readSync calls) in a plain process. Both copies are read once first
 *    (the page cache then holds both, so the figures compare the paths, not the disk), then each is timed
 *    three times, alternating; the best of each is compared. Goal: volume ≥ 0.8× host.
 * 2. `ferry volumes cp` uploading and downloading the file through the API vs `curl` uploading it to (and
 *    downloading it from) a bare Node `http` server that writes it to (reads it from) disk.
 *
 * BENCH_FILE_MIB (default 1024): the file's size. Needs what volumes need (root, loop devices, e2fsprogs,
 * acl, bubblewrap) and curl.
 */
import { spawnSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import {
  bootstrapProject,
  deployApp,
  envInt,
  FERRY_BIN,
  fmt,
  machineReport,
  onCleanup,
  http as request,
  requireDist,
  runCommand,
  runMain,
  startFerry,
  table,
  tempDir,
} from './lib.mjs';

const FILE_MIB = envInt('BENCH_FILE_MIB', 1024);
const MIB = 1024 * 1024;

const READ_CODE = `
import fs from 'node:fs';
export function readAll({ file }) {
  const buf = Buffer.allocUnsafe(4 * 1024 * 1024);
  const fd = fs.openSync(file, 'r');
  const t = process.hrtime.bigint();
  let total = 0;
  for (;;) { const n = fs.readSync(fd, buf, 0, buf.length, null); if (n === 0) break; total += n; }
  fs.closeSync(fd);
  return { bytes: total, ms: Number(process.hrtime.bigint() - t) / 1e6 };
}
`;

function mbps(bytes, ms) {
  return bytes / 1e6 / (ms / 1000);
}

/** The same read loop in a plain host process. */
function hostRead(file) {
  const script = `${READ_CODE.replace('export function', 'function')}\nprocess.stdout.write(JSON.stringify(readAll({ file: ${JSON.stringify(file)} })));`;
  const res = spawnSync(process.execPath, ['--input-type=module', '-e', script], { encoding: 'utf8' });
  if (res.status !== 0) throw new Error(res.stderr);
  return JSON.parse(res.stdout);
}

/** A bare Node server: PUT writes the body to a file, GET streams it back. */
async function bareServer(dir) {
  const server = http.createServer((req, res) => {
    const file = path.join(dir, 'upload.bin');
    if (req.method === 'PUT') {
      const out = fs.createWriteStream(file);
      req.pipe(out);
      out.on('finish', () => res.end('ok'));
    } else {
      res.setHeader('content-length', String(fs.statSync(file).size));
      fs.createReadStream(file).pipe(res);
    }
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  onCleanup(() => new Promise((r) => server.close(r)));
  return `http://127.0.0.1:${server.address().port}/`;
}

async function timed(fn) {
  const t = performance.now();
  await fn();
  return performance.now() - t;
}

await runMain(async () => {
  requireDist();
  console.log(machineReport());
  const work = await tempDir('ferry-bench-volumes-');
  const file = path.join(work, 'weights.bin');
  const block = crypto.randomBytes(MIB);
  const fd = fs.openSync(file, 'w');
  for (let i = 0; i < FILE_MIB; i++) fs.writeSync(fd, block);
  fs.closeSync(fd);
  const bytes = FILE_MIB * MIB;

  const dataDir = await tempDir('ferry-bench-volumes-data-');
  const auth = await bootstrapProject(dataDir);
  const ferry = await startFerry(dataDir);
  const env = { ...process.env, FERRY_URL: ferry.url, FERRY_TOKEN: auth.token, FERRY_PROJECT: auth.projectId };
  const sizeMiB = FILE_MIB + Math.max(64, Math.ceil(FILE_MIB / 10));
  const created = await request(`${ferry.url}/v2/projects/${auth.projectId}/volumes`, {
    method: 'POST',
    token: auth.token,
    body: { name: 'bench', size_mib: sizeMiB },
  });
  if (created.status !== 201) throw new Error(`volume: ${created.text}`);

  // 2. cp vs curl
  const cli = (args) => runCommand(process.execPath, [FERRY_BIN, ...args], { env, timeoutMs: 600_000 });
  let upload;
  const cpUpMs = await timed(async () => {
    upload = await cli(['volumes', 'cp', file, 'bench:/weights.bin', '--json']);
  });
  if (upload.code !== 0) throw new Error(upload.stderr);
  const back = path.join(work, 'back.bin');
  const cpDownMs = await timed(async () => {
    const r = await cli(['volumes', 'cp', 'bench:/weights.bin', back, '--json']);
    if (r.code !== 0) throw new Error(r.stderr);
  });
  fs.rmSync(back);
  const bare = await bareServer(work);
  const curlUpMs = await timed(async () => {
    const r = await runCommand('curl', ['-sS', '-o', '/dev/null', '-T', file, bare], { timeoutMs: 600_000 });
    if (r.code !== 0) throw new Error(r.stderr);
  });
  const curlDownMs = await timed(async () => {
    const r = await runCommand('curl', ['-sS', '-o', back, bare], { timeoutMs: 600_000 });
    if (r.code !== 0) throw new Error(r.stderr);
  });
  fs.rmSync(back);
  fs.rmSync(path.join(work, 'upload.bin'));

  // 1. read in a replica vs on the host
  await deployApp(ferry, auth, 'reader', {
    'ferry.toml':
      '[app]\nname = "reader"\n\n[scaling]\nmax_replicas = 1\n\n[[volumes]]\nname = "bench"\nmount = "/data"\nread_only = true\n',
    'main.mjs': READ_CODE,
  });
  const replicaRead = async () => {
    const res = await request(`${ferry.url}/v4/${auth.projectId}/reader/readAll`, {
      method: 'POST',
      token: auth.token,
      body: { file: '/data/weights.bin' },
    });
    if (res.status !== 200 || res.json.result.bytes !== bytes) throw new Error(`read in the replica: ${res.text}`);
    return res.json.result.ms;
  };
  await replicaRead();
  hostRead(file);
  const replicaMs = [];
  const hostMs = [];
  for (let i = 0; i < 3; i++) {
    replicaMs.push(await replicaRead());
    hostMs.push(hostRead(file).ms);
  }
  const bestReplica = Math.min(...replicaMs);
  const bestHost = Math.min(...hostMs);

  console.log(`\nfile: ${FILE_MIB} MiB of random data; volume of ${sizeMiB} MiB\n`);
  console.log(
    table([
      ['read (same code, page cache warm)', 'MB/s', 'best ms'],
      ['host disk, plain process', fmt(mbps(bytes, bestHost), 0), fmt(bestHost, 0)],
      ['volume, inside a replica', fmt(mbps(bytes, bestReplica), 0), fmt(bestReplica, 0)],
    ]),
  );
  console.log(`volume / host read speed: ${fmt(bestHost / bestReplica)}× (goal: at least 0.80×)\n`);
  console.log(
    table([
      ['transfer', 'upload MB/s', 'download MB/s'],
      ['ferry volumes cp (API)', fmt(mbps(bytes, cpUpMs), 0), fmt(mbps(bytes, cpDownMs), 0)],
      ['curl ↔ bare Node http server', fmt(mbps(bytes, curlUpMs), 0), fmt(mbps(bytes, curlDownMs), 0)],
    ]),
  );
  console.log(
    `cp / curl: upload ${fmt(curlUpMs / cpUpMs)}×, download ${fmt(curlDownMs / cpDownMs)}× (cp includes the CLI's start, ~0.3 s)`,
  );
  await ferry.stop();
  fs.rmSync(work, { recursive: true, force: true });
});
