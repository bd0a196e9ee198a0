/**
 * Shared helpers of the benches (bench/run-sync.mjs, cold-start.mjs, async.mjs, stream.mjs, webhooks.mjs,
 * cluster.mjs, images.mjs): a real `ferry serve` child process on a temp data dir, bootstrap and deploy
 * through the CLI and the HTTP API, cleanup that also runs on Ctrl-C and errors, nginx (installed with
 * apt-get when missing), metrics from GET /metrics, a throwaway PostgreSQL database and NATS cluster
 * streams, offline base images and a loopback registry (umoci, skopeo, docker-registry), and small
 * statistics and table helpers. Plain ESM on node:* built-ins plus yazl, undici, pg and the NATS client
 * (dependencies of Ferry itself).
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import fsp from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { request } from 'undici';
import yazl from 'yazl';

export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const FERRY_BIN = path.join(REPO_ROOT, 'bin', 'ferry.js');

/** Integer from the environment, or the default; exits with a message for a bad value. */
export function envInt(name, fallback, min = 1) {
  const raw = process.env[name];
  if (raw === undefined || raw === '') return fallback;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < min) {
    console.error(`${name} must be a whole number >= ${min}, not "${raw}"`);
    process.exit(2);
  }
  return n;
}

/** Exits with a hint when the compiled code is missing: the benches run dist/, they build nothing. */
export function requireDist() {
  const entry = path.join(REPO_ROOT, 'dist', 'src', 'cli', 'index.js');
  if (!fs.existsSync(entry)) {
    console.error('dist/ is missing: run `npm run build` first (the benches run the compiled code).');
    process.exit(1);
  }
}

// ---------------------------------------------------------------------------------------------------
// Cleanup: functions run last-registered first, once, on normal end, error, Ctrl-C or SIGTERM.

const cleanups = [];
/**
 * Processes this bench started (directly, or replicas through Ferry), killed on a hard exit: pid → its
 * start time in /proc (undefined for our own children, whose pid cannot be reused before we reap them).
 */
const ownedPids = new Map();
let cleaningUp;

export function onCleanup(fn) {
  cleanups.push(fn);
}

export function runCleanup() {
  cleaningUp ??= (async () => {
    while (cleanups.length > 0) {
      const fn = cleanups.pop();
      try {
        await fn();
      } catch (err) {
        console.error(`cleanup: ${err?.message ?? err}`);
      }
    }
  })();
  return cleaningUp;
}

/**
 * Runs `main`, then the cleanups. Ctrl-C (SIGINT) and SIGTERM stop the bench and clean up; a second
 * signal exits at once. Children are started in their own process group, so a Ctrl-C reaches only this
 * process and the shutdown order stays ours.
 */
export async function runMain(main) {
  let signalled = false;
  const onSignal = (signal) => {
    if (signalled) {
      killOwned();
      process.exit(130);
    }
    signalled = true;
    console.error(`\n${signal}: stopping and cleaning up...`);
    void runCleanup().finally(() => process.exit(130));
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  process.on('exit', killOwned);
  let code = 0;
  try {
    await main();
  } catch (err) {
    console.error(`\nbench failed: ${err?.stack ?? err}`);
    code = 1;
  }
  await runCleanup();
  process.exit(code);
}

/** Last resort (hard exit): SIGKILL what we started and is still running. */
function killOwned() {
  for (const [pid, start] of ownedPids) {
    if (start !== undefined && procInfo(pid)?.start !== start) continue;
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }
}

export async function tempDir(prefix) {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), prefix));
  onCleanup(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

// ---------------------------------------------------------------------------------------------------
// Processes

/** The pids below `pid` (children first), from /proc; empty when it has exited. */
export function descendants(pid) {
  const out = [];
  let tasks;
  try {
    tasks = fs.readdirSync(`/proc/${pid}/task`);
  } catch {
    return out;
  }
  for (const task of tasks) {
    let children = '';
    try {
      children = fs.readFileSync(`/proc/${pid}/task/${task}/children`, 'utf8');
    } catch {
      continue;
    }
    for (const child of children.trim().split(/\s+/).filter(Boolean)) {
      const n = Number(child);
      out.push(n, ...descendants(n));
    }
  }
  return out;
}

function procInfo(pid) {
  try {
    const comm = fs.readFileSync(`/proc/${pid}/comm`, 'utf8').trim();
    const cmdline = fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);
    // Field 22 of stat (start time): tells a reused pid from the process we saw.
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    const start = stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19];
    return { pid, comm, cmdline, start };
  } catch {
    return undefined;
  }
}

let clockTicks;
/** CPU time (user + system) a process has used so far, in ms; NaN when it is gone. */
export function cpuMs(pid) {
  clockTicks ??= Number(spawnSync('getconf', ['CLK_TCK'], { encoding: 'utf8' }).stdout.trim()) || 100;
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return ((Number(fields[11]) + Number(fields[12])) * 1000) / clockTicks;
  } catch {
    return Number.NaN;
  }
}

/** The load average now, as "1m 5m 15m". */
export function loadAverage() {
  return os
    .loadavg()
    .map((l) => l.toFixed(2))
    .join(' ');
}

function sameProcessAlive(info) {
  return procInfo(info.pid)?.start === info.start;
}

/** Resolves when the child has exited (at once when it already has). */
function exitedPromise(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => child.once('exit', () => resolve()));
}

async function stopChild(child, signal, graceMs) {
  if (child.exitCode !== null || child.signalCode !== null) return;
  child.kill(signal);
  const timer = setTimeout(() => child.kill('SIGKILL'), graceMs);
  await exitedPromise(child);
  clearTimeout(timer);
}

/** Runs a command to completion; resolves with its exit code and output. */
export function runCommand(file, args, options = {}) {
  return new Promise((resolve, reject) => {
    const child = spawn(file, args, { stdio: ['ignore', 'pipe', 'pipe'], ...options });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => {
      stdout += d;
    });
    child.stderr.on('data', (d) => {
      stderr += d;
    });
    const timer = setTimeout(() => child.kill('SIGKILL'), options.timeoutMs ?? 120_000);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

// ---------------------------------------------------------------------------------------------------
// PostgreSQL

/**
 * Creates a fresh database `<prefix><random hex>` on the PostgreSQL server of `adminUrl` (any database
 * there the user may create databases from) and returns its URL; the cleanup drops it, after the Ferry
 * started later has stopped (cleanups run last-registered first).
 */
export async function createDatabase(adminUrl, prefix) {
  const { default: pg } = await import('pg');
  const name = `${prefix}${crypto.randomBytes(6).toString('hex')}`;
  const admin = async (statement) => {
    const client = new pg.Client({ connectionString: adminUrl, connectionTimeoutMillis: 10_000 });
    client.on('error', () => {});
    await client.connect();
    try {
      await client.query(statement);
    } finally {
      await client.end().catch(() => {});
    }
  };
  await admin(`CREATE DATABASE "${name}"`);
  onCleanup(() => admin(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`));
  const url = new URL(adminUrl);
  url.pathname = `/${name}`;
  return url.toString();
}

/**
 * What PostgreSQL did for the database of `databaseUrl` so far: transactions committed and rows written
 * (pg_stat_database; the server publishes these about once a second), and the CPU time of the backends
 * connected to it now (from /proc: the bench runs on the database's machine).
 */
export async function pgDatabaseStats(databaseUrl) {
  const { default: pg } = await import('pg');
  const name = new URL(databaseUrl).pathname.slice(1);
  const client = new pg.Client({ connectionString: databaseUrl, connectionTimeoutMillis: 10_000 });
  client.on('error', () => {});
  await client.connect();
  try {
    const stats = await client.query(
      'select xact_commit::float8 as commits, tup_inserted::float8 as inserted, tup_updated::float8 as updated,' +
        ' tup_fetched::float8 as fetched from pg_stat_database where datname = $1',
      [name],
    );
    const backends = await client.query(
      'select pid from pg_stat_activity where datname = $1 and pid <> pg_backend_pid()',
      [name],
    );
    const cpu = backends.rows.map((r) => cpuMs(r.pid)).filter((ms) => !Number.isNaN(ms));
    return { ...stats.rows[0], backends: cpu.length, backendCpuMs: cpu.reduce((a, b) => a + b, 0) };
  } finally {
    await client.end().catch(() => {});
  }
}

// ---------------------------------------------------------------------------------------------------
// Ferry

/** The environment for Ferry's processes: only what they need, plus the sandbox switch when set. */
function ferryEnv(extra = {}) {
  const env = { PATH: process.env.PATH, HOME: process.env.HOME, FERRY_LOG_FORMAT: 'json', ...extra };
  if (process.env.FERRY_SANDBOX !== undefined) env.FERRY_SANDBOX = process.env.FERRY_SANDBOX;
  // FERRY_EGRESS=off compares cold starts without the sandbox's network namespace (docs/operations.md).
  if (process.env.FERRY_EGRESS !== undefined) env.FERRY_EGRESS = process.env.FERRY_EGRESS;
  // FERRY_WARM_POOL=0 compares cold starts without the warm pool (docs/operations.md).
  if (process.env.FERRY_WARM_POOL !== undefined) env.FERRY_WARM_POOL = process.env.FERRY_WARM_POOL;
  // FERRY_NO_BUNDLE=1 runs Ferry from dist/src instead of its bundle (docs/operations.md).
  if (process.env.FERRY_NO_BUNDLE !== undefined) env.FERRY_NO_BUNDLE = process.env.FERRY_NO_BUNDLE;
  return env;
}

/**
 * `ferry admin bootstrap --json` on the data dir: the project id and an owner token (manage + run).
 * `env`: the server's settings (FERRY_DATABASE_URL among them, so it bootstraps the same store).
 */
export async function bootstrapProject(dataDir, env = {}) {
  const res = await runCommand(process.execPath, [FERRY_BIN, 'admin', 'bootstrap', '--data-dir', dataDir, '--json'], {
    env: ferryEnv(env),
  });
  if (res.code !== 0) throw new Error(`ferry admin bootstrap failed (${res.code}):\n${res.stdout}${res.stderr}`);
  const { project_id: projectId, token } = JSON.parse(res.stdout);
  return { projectId, token };
}

/**
 * Starts `ferry serve --port 0` as a child process (its own event loop, not the load generator's) and
 * waits for its "listening" log line. Stopping it (SIGTERM) stops its replicas; any replica still running
 * after it exited is killed by pid. `options.env`: extra environment variables for the server (server
 * settings such as `FERRY_MAX_ASYNC_BACKLOG` or `FERRY_WEBHOOK_ALLOW`).
 */
export async function startFerry(dataDir, options = {}) {
  // BENCH_FERRY_NODE_ARGS: extra node options for the server, e.g. "--cpu-prof --cpu-prof-dir=/tmp/prof".
  const nodeArgs = (process.env.BENCH_FERRY_NODE_ARGS ?? '').split(/\s+/).filter(Boolean);
  const child = spawn(process.execPath, [...nodeArgs, FERRY_BIN, 'serve', '--port', '0', '--data-dir', dataDir], {
    env: ferryEnv(options.env),
    stdio: ['ignore', 'pipe', 'pipe'],
    detached: true,
  });
  ownedPids.set(child.pid, undefined);
  // The log pipes are always drained (a full pipe would block the server); only the tail is kept.
  let out = '';
  const keep = (d) => {
    out += d;
    if (out.length > 256 * 1024) out = out.slice(-128 * 1024);
  };
  child.stderr.on('data', keep);
  let seen = [];
  const ferry = {
    child,
    url: '',
    dataDir,
    output: () => out,
    /** The replica processes running now (node bootstrap or its bwrap sandbox), below the server. */
    replicaProcesses() {
      const procs = descendants(child.pid)
        .map(procInfo)
        .filter((p) => p && (p.comm === 'bwrap' || p.cmdline.some((a) => a.includes('bootstrap'))));
      for (const p of seen) if (!sameProcessAlive(p)) ownedPids.delete(p.pid);
      seen = [...seen.filter((p) => sameProcessAlive(p) && !procs.some((q) => q.pid === p.pid)), ...procs];
      for (const p of procs) ownedPids.set(p.pid, p.start);
      return procs;
    },
    async stop() {
      ferry.replicaProcesses();
      await stopChild(child, 'SIGTERM', 15_000);
      ownedPids.delete(child.pid);
      // Ferry's replica stop ends when the outer bwrap exits; the inner one may take a moment longer.
      const until = Date.now() + 3_000;
      while (seen.some(sameProcessAlive) && Date.now() < until) await new Promise((r) => setTimeout(r, 50));
      for (const p of seen) {
        if (sameProcessAlive(p)) {
          console.error(`killing replica process ${p.pid} left after Ferry stopped`);
          process.kill(p.pid, 'SIGKILL');
        }
        ownedPids.delete(p.pid);
      }
    },
  };
  onCleanup(() => ferry.stop());
  ferry.url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`ferry serve did not start within 30 s:\n${out}`)), 30_000);
    let matched = false;
    child.stdout.on('data', (d) => {
      keep(d);
      const match = matched ? null : /"address":"(http:\/\/[^"]+)"/.exec(out);
      if (match) {
        matched = true;
        clearTimeout(timer);
        resolve(match[1]);
      }
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`ferry serve exited with ${code}:\n${out}`));
    });
  });
  return ferry;
}

/** One HTTP request with undici; JSON bodies for objects, Buffers as they are. */
export async function http(url, { method = 'GET', token, body, headers = {} } = {}) {
  const h = { ...headers };
  if (token) h.authorization = `Bearer ${token}`;
  let payload;
  if (Buffer.isBuffer(body)) payload = body;
  else if (body !== undefined) {
    payload = JSON.stringify(body);
    h['content-type'] ??= 'application/json';
  }
  const res = await request(url, { method, headers: h, body: payload, headersTimeout: 60_000, bodyTimeout: 60_000 });
  const text = await res.body.text();
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return { status: res.statusCode, headers: res.headers, text, json };
}

/** Polls `check` every `everyMs` until it returns a truthy value; throws after `ms`. */
export async function waitFor(check, { ms = 60_000, everyMs = 100, what = 'condition' } = {}) {
  const end = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > end) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, everyMs));
  }
}

/** A ZIP of the given files (name → text), made with yazl the way `ferry deploy` packs apps. */
export function zipFiles(files) {
  return new Promise((resolve, reject) => {
    const zip = new yazl.ZipFile();
    for (const [name, data] of Object.entries(files)) {
      zip.addBuffer(Buffer.from(data), name, { mtime: new Date('2026-01-01T00:00:00Z') });
    }
    zip.end();
    const chunks = [];
    zip.outputStream.on('data', (c) => chunks.push(c));
    zip.outputStream.on('end', () => resolve(Buffer.concat(chunks)));
    zip.outputStream.on('error', reject);
  });
}

/** Uploads the app (POST .../apps/{name}/builds) and waits for its build to be ready. */
export async function deployApp(ferry, auth, name, files) {
  const zip = await zipFiles(files);
  const base = `${ferry.url}/v2/projects/${auth.projectId}/apps/${name}`;
  const res = await http(`${base}/builds`, {
    method: 'POST',
    token: auth.token,
    body: zip,
    headers: { 'content-type': 'application/zip' },
  });
  if (res.status !== 201) throw new Error(`upload of ${name} failed (${res.status}): ${res.text}`);
  const build = await waitFor(
    async () => {
      const b = await http(`${base}/builds/${res.json.id}`, { token: auth.token });
      return ['ready', 'failed', 'cancelled'].includes(b.json?.state) ? b.json : undefined;
    },
    { what: `the build of ${name}` },
  );
  if (build.state !== 'ready') {
    const logs = await http(`${base}/builds/${build.id}/logs`, { token: auth.token });
    const lines = (logs.json?.lines ?? []).map((l) => l.line).join('\n');
    throw new Error(`build of ${name} ended ${build.state}: ${build.error ?? ''}\n${lines}`);
  }
  return build;
}

/**
 * The replica sockets now open: under `<data-dir>/run` (one folder per replica) without the sandbox; in a
 * sandbox's own /run/ferry, reached through `/proc/<pid>/root`, for the replicas below `ferry` under bwrap.
 */
export function replicaSockets(dataDir, ferry) {
  const runDir = path.join(dataDir, 'run');
  let entries = [];
  try {
    entries = fs.readdirSync(runDir, { recursive: true });
  } catch {
    // none
  }
  const sockets = entries
    .map(String)
    .filter((e) => path.basename(e) === 'replica.sock')
    .map((e) => path.join(runDir, e));
  const seen = new Set();
  for (const pid of ferry ? descendants(ferry.child.pid) : []) {
    const socket = `/proc/${pid}/root/run/ferry/replica.sock`;
    try {
      const stat = fs.statSync(socket);
      // Every process of one sandbox shares its root: one socket per sandbox.
      const key = `${stat.dev}:${stat.ino}`;
      if (!stat.isSocket() || seen.has(key)) continue;
      seen.add(key);
      sockets.push(socket);
    } catch {
      // not a sandbox, or it has no socket (yet)
    }
  }
  return sockets;
}

/** `ferry_replicas{...app="<app>",state="..."}` from GET /metrics: { starting, ready } (0 when absent). */
export async function replicaGauges(ferry, app) {
  const res = await http(`${ferry.url}/metrics`);
  const out = { starting: 0, ready: 0 };
  for (const line of res.text.split('\n')) {
    if (!line.startsWith('ferry_replicas{') || !line.includes(`app="${app}"`)) continue;
    const state = /state="([a-z]+)"/.exec(line)?.[1];
    if (state === 'starting' || state === 'ready') out[state] += Number(line.slice(line.lastIndexOf(' ') + 1));
  }
  return out;
}

/** Warm sandboxes waiting for an app (ferry_warm_sandboxes, FERRY_WARM_POOL), over runtimes; 0 on servers without. */
export async function warmGauges(ferry) {
  const res = await http(`${ferry.url}/metrics`);
  return {
    ready: metricSum(res.text, 'ferry_warm_sandboxes', { state: 'ready' }),
    starting: metricSum(res.text, 'ferry_warm_sandboxes', { state: 'starting' }),
  };
}

/**
 * Sums the samples of the Prometheus metric `name` in `text` (the body of GET /metrics) whose labels
 * include every pair of `labels` (a sample without labels matches only an empty `labels`).
 */
export function metricSum(text, name, labels = {}) {
  let sum = 0;
  const wanted = Object.entries(labels).map(([k, v]) => `${k}="${v}"`);
  for (const line of text.split('\n')) {
    if (!line.startsWith(name)) continue;
    const rest = line.slice(name.length);
    if (rest[0] !== '{' && rest[0] !== ' ') continue; // another metric with this prefix
    const labelText = rest[0] === '{' ? rest.slice(1, rest.indexOf('}')) : '';
    const have = labelText ? labelText.split(/,(?=[a-zA-Z_]+=")/) : [];
    if (!wanted.every((w) => have.includes(w))) continue;
    sum += Number(line.slice(line.lastIndexOf(' ') + 1));
  }
  return sum;
}

/** GET /metrics of the server: the Prometheus text. */
export async function fetchMetrics(ferry) {
  return (await http(`${ferry.url}/metrics`)).text;
}

/**
 * Whether replicas are sandboxed: what `ferry doctor --json` says the machine offers (when this build
 * has the command), and what the replica processes running now show (a bwrap process above the bootstrap).
 */
export async function sandboxReport(ferry) {
  let doctor;
  const res = await runCommand(process.execPath, [FERRY_BIN, 'doctor', '--json'], {
    env: ferryEnv(),
    timeoutMs: 30_000,
  });
  if (res.code !== 0) {
    doctor = /unknown command/i.test(res.stderr)
      ? 'unknown (this build has no `ferry doctor` command)'
      : `unknown (\`ferry doctor --json\` exited ${res.code}: ${res.stderr.trim().split('\n')[0] ?? ''})`;
  } else {
    try {
      const caps = JSON.parse(res.stdout);
      const memory = caps.cgroup ? `cgroup v${caps.cgroup.version}` : caps.prlimit ? 'RLIMIT_DATA' : 'none';
      doctor = caps.bwrap
        ? `available (bubblewrap ${caps.bwrapVersion ?? '?'}), memory limit: ${memory}`
        : `NOT available (${caps.reasons?.join('; ') || 'no reason given'}), memory limit: ${memory}`;
    } catch {
      doctor = 'unknown (`ferry doctor --json` did not print JSON)';
    }
  }
  let observed = 'unknown (no replica was running when checked)';
  const procs = ferry?.replicaProcesses() ?? [];
  if (procs.length > 0) {
    observed = procs.some((p) => p.comm === 'bwrap')
      ? 'on: the replica runs under bwrap'
      : 'off: the replica is a plain node process';
  }
  return { doctor, observed };
}

// ---------------------------------------------------------------------------------------------------
// nginx

function onPath(command) {
  const dirs = [...(process.env.PATH ?? '').split(':'), '/usr/sbin', '/sbin', '/usr/local/sbin'];
  for (const dir of dirs) {
    const file = path.join(dir, command);
    try {
      fs.accessSync(file, fs.constants.X_OK);
      return file;
    } catch {
      // not here
    }
  }
  return undefined;
}

/** The nginx binary; installs nginx-light (or nginx) with apt-get when there is none, and says so. */
export function ensureNginx() {
  const found = onPath('nginx');
  if (found) return found;
  console.log('nginx is not installed: installing it with `apt-get install -y nginx-light` (Debian)...');
  const env = { ...process.env, DEBIAN_FRONTEND: 'noninteractive' };
  const apt = (...args) => spawnSync('apt-get', args, { stdio: ['ignore', 'inherit', 'inherit'], env }).status === 0;
  let ok = apt('install', '-y', '-q', 'nginx-light') || apt('install', '-y', '-q', 'nginx');
  if (!ok) {
    console.log('install failed: running `apt-get update` once and trying again...');
    ok = apt('update', '-q') && (apt('install', '-y', '-q', 'nginx-light') || apt('install', '-y', '-q', 'nginx'));
  }
  const installed = onPath('nginx');
  if (!ok || !installed) throw new Error('could not install nginx (apt-get failed); install it and run again');
  console.log(`nginx installed: ${installed}`);
  return installed;
}

export function nginxVersion(bin) {
  try {
    const r = spawnSync(bin, ['-v'], { encoding: 'utf8' });
    return (r.stderr || r.stdout).trim().replace(/^nginx version: /, '');
  } catch {
    return 'unknown';
  }
}

/** A free TCP port on 127.0.0.1 (bound, read and released). */
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

function canConnect(port) {
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1');
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('error', () => resolve(false));
  });
}

/**
 * Starts nginx in the foreground (`daemon off`) with its own config, pid file, logs and temp folders in
 * `dir`, as a keep-alive reverse proxy of the Unix socket `socketPath` on 127.0.0.1:`port`.
 */
export async function startNginx(bin, dir, socketPath, port) {
  const conf = path.join(dir, 'nginx.conf');
  const isRoot = typeof process.getuid === 'function' && process.getuid() === 0;
  const text = `# Generated by bench/run-sync.mjs
daemon off;
master_process on;
# One worker: Ferry's gateway is one Node process (one event loop), so one nginx worker is the like-for-like
# baseline on a machine where the load generator and the replica need the other core.
worker_processes 1;
pid ${dir}/nginx.pid;
error_log ${dir}/error.log warn;
${isRoot ? "# Ferry's socket folders are 0700 root: the worker must run as root to reach the socket.\nuser root;" : ''}
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path ${dir}/client_body;
  proxy_temp_path ${dir}/proxy;
  fastcgi_temp_path ${dir}/fastcgi;
  uwsgi_temp_path ${dir}/uwsgi;
  scgi_temp_path ${dir}/scgi;
  upstream replica {
    server unix:${socketPath};
    keepalive 64;
  }
  server {
    listen 127.0.0.1:${port};
    location / {
      proxy_pass http://replica;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
`;
  await fsp.writeFile(conf, text);
  const test = spawnSync(bin, ['-t', '-p', dir, '-c', conf, '-e', path.join(dir, 'error.log')], { encoding: 'utf8' });
  if (test.status !== 0) throw new Error(`nginx -t failed:\n${test.stderr}`);
  const child = spawn(bin, ['-p', dir, '-c', conf, '-e', path.join(dir, 'error.log')], {
    stdio: ['ignore', 'ignore', 'pipe'],
    detached: true,
  });
  ownedPids.set(child.pid, undefined);
  let err = '';
  child.stderr.on('data', (d) => {
    err += d;
  });
  const stop = async () => {
    // SIGQUIT: graceful stop of master and worker; SIGKILL to the master after 5 s.
    await stopChild(child, 'SIGQUIT', 5_000);
    ownedPids.delete(child.pid);
  };
  onCleanup(stop);
  await waitFor(
    async () => {
      if (child.exitCode !== null) throw new Error(`nginx exited with ${child.exitCode}: ${err}`);
      return canConnect(port);
    },
    { ms: 10_000, everyMs: 50, what: 'nginx to listen' },
  );
  const workerPid = () => descendants(child.pid)[0];
  return { child, conf, stop, workerPid };
}

// ---------------------------------------------------------------------------------------------------
// Figures

/** The q-quantile (0..1) of sorted numbers, nearest rank. */
export function quantile(sorted, q) {
  if (sorted.length === 0) return Number.NaN;
  const rank = Math.ceil(q * sorted.length);
  return sorted[Math.min(sorted.length - 1, Math.max(0, rank - 1))];
}

export function summarize(values) {
  const sorted = [...values].sort((a, b) => a - b);
  return {
    n: sorted.length,
    median: quantile(sorted, 0.5),
    p90: quantile(sorted, 0.9),
    p99: quantile(sorted, 0.99),
    min: sorted[0] ?? Number.NaN,
    max: sorted.at(-1) ?? Number.NaN,
  };
}

export function fmt(n, digits = 2) {
  return Number.isFinite(n) ? n.toFixed(digits) : 'n/a';
}

/** A plain-text table: `rows` are arrays of strings; the first row is the header. */
export function table(rows) {
  const widths = rows[0].map((_, i) => Math.max(...rows.map((r) => String(r[i]).length)));
  const line = (r) => r.map((c, i) => (i === 0 ? String(c).padEnd(widths[i]) : String(c).padStart(widths[i])));
  const sep = widths.map((w) => '-'.repeat(w));
  return [line(rows[0]).join('  '), sep.join('  '), ...rows.slice(1).map((r) => line(r).join('  '))].join('\n');
}

export function machineReport() {
  const cpus = os.cpus();
  let governor = '';
  try {
    governor = fs.readFileSync('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor', 'utf8').trim();
  } catch {
    // not exposed (VMs, containers)
  }
  let commit = 'unknown';
  try {
    commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: REPO_ROOT, encoding: 'utf8' }).trim();
    const dirty = execFileSync('git', ['status', '--porcelain', '--', 'src'], { cwd: REPO_ROOT, encoding: 'utf8' });
    if (dirty.trim()) commit += ' (src/ has uncommitted changes)';
  } catch {
    // Not a git checkout (a kit carried to a bare host): the commit the build was made from, if it knew.
    try {
      const info = JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'dist', 'build-info.json'), 'utf8'));
      if (info.commit) commit = `${info.commit} (from the build, ${info.builtAt})`;
    } catch {
      // a build made outside a checkout as well
    }
  }
  const load = loadAverage();
  return [
    `machine: ${cpus.length} CPUs (${cpus[0]?.model ?? 'unknown model'}${governor ? `, governor ${governor}` : ''}), ${Math.round(os.totalmem() / 2 ** 30)} GiB RAM, ${os.type()} ${os.release()} ${os.arch()}`,
    `node: ${process.version}; ferry: ${commit}; load average at start: ${load}`,
  ].join('\n');
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * How every bench begins: a fresh data dir, a bootstrapped project, a Ferry child process (with `env`
 * as its extra settings), and `files` deployed as app `app`.
 */
export async function startDeployed(label, app, files, env = {}) {
  const dataDir = await tempDir(`ferry-bench-${label}-`);
  const auth = await bootstrapProject(dataDir, env);
  const ferry = await startFerry(dataDir, { env });
  const settings = Object.entries(env).map(([name, value]) => `${name}=${value}`);
  console.log(
    `ferry serve: ${ferry.url} (pid ${ferry.child.pid}, data dir ${dataDir})${settings.length > 0 ? `, ${settings.join(', ')}` : ''}`,
  );
  await deployApp(ferry, auth, app, files);
  return { dataDir, auth, ferry };
}

/** The socket of the app's only replica (the benches deploy with max_replicas = 1). */
export function onlyReplicaSocket(dataDir, ferry) {
  const sockets = replicaSockets(dataDir, ferry);
  if (sockets.length !== 1)
    throw new Error(`expected one replica socket (under ${dataDir}/run or in a sandbox), found ${sockets.length}`);
  console.log(`replica socket: ${sockets[0].startsWith(dataDir) ? path.relative(dataDir, sockets[0]) : sockets[0]}`);
  return sockets[0];
}

// ---------------------------------------------------------------------------------------------------
// NATS

/** Deletes every JetStream stream of the cluster `cluster` (its queues, KV buckets and object stores). */
export async function deleteClusterStreams(natsUrl, cluster) {
  const { jetstreamManager } = await import('@nats-io/jetstream');
  const { connect } = await import('@nats-io/transport-node');
  const nc = await connect({ servers: natsUrl, timeout: 5_000 });
  try {
    const jsm = await jetstreamManager(nc);
    for await (const name of jsm.streams.names()) {
      if (name.startsWith(cluster) || name.startsWith(`KV_${cluster}`) || name.startsWith(`OBJ_${cluster}`)) {
        await jsm.streams.delete(name);
      }
    }
  } finally {
    await nc.close();
  }
}

// ---------------------------------------------------------------------------------------------------
// Images (issue 26), offline: base images made from the machine's own bits with umoci, served by Debian's
// docker-registry on loopback (the same approach as test/helpers/registry.ts, in plain ESM).

const IMAGE_TOOLS = {
  '/usr/bin/umoci': 'umoci',
  '/usr/bin/skopeo': 'skopeo',
  '/usr/bin/docker-registry': 'docker-registry',
  '/bin/busybox': 'busybox-static',
};

/** Exits naming the Debian packages when a tool the image benches use is missing. */
export function requireImageTools() {
  const missing = Object.entries(IMAGE_TOOLS)
    .filter(([file]) => !fs.existsSync(file))
    .map(([, pkg]) => pkg);
  if (missing.length > 0) {
    console.error(`this bench needs ${missing.join(', ')}: bash scripts/setup-system.sh installs them`);
    process.exit(1);
  }
}

async function mustRun(file, args, options = {}) {
  const res = await runCommand(file, args, { timeoutMs: 300_000, ...options });
  if (res.code !== 0) throw new Error(`${path.basename(file)} ${args[0]} failed (${res.code}): ${res.stderr}`);
  return res;
}

/**
 * Writes an OCI layout with one image under `dir`: busybox-static's binary as /bin/busybox (and /bin/sh),
 * `files` (path → text) and host folders `copy` ({ from, to }, links followed) on top, in one layer; its
 * config has `env`, WorkingDir `/` and Cmd /bin/sh. Returns `{ layout, source }` (`oci:<layout>:<tag>`)
 * and what the root holds (`files`, `bytes`).
 */
export async function makeBaseImage(dir, { files = {}, copy = [], env = ['PATH=/bin'], tag = 'base' } = {}) {
  const layout = path.join(dir, 'oci');
  const bundle = path.join(dir, `bundle-${tag}`);
  const image = `${layout}:${tag}`;
  if (!fs.existsSync(path.join(layout, 'index.json'))) await mustRun('/usr/bin/umoci', ['init', '--layout', layout]);
  await mustRun('/usr/bin/umoci', ['new', '--image', image]);
  await mustRun('/usr/bin/umoci', ['unpack', '--rootless', '--image', image, bundle]);
  const rootfs = path.join(bundle, 'rootfs');
  await fsp.mkdir(path.join(rootfs, 'bin'), { recursive: true });
  await fsp.copyFile('/bin/busybox', path.join(rootfs, 'bin', 'busybox'));
  await fsp.chmod(path.join(rootfs, 'bin', 'busybox'), 0o755);
  await fsp.symlink('busybox', path.join(rootfs, 'bin', 'sh'));
  for (const [file, content] of Object.entries(files)) {
    const target = path.join(rootfs, file);
    await fsp.mkdir(path.dirname(target), { recursive: true });
    await fsp.writeFile(target, content);
  }
  for (const { from, to } of copy) {
    const target = path.join(rootfs, to);
    await fsp.mkdir(path.dirname(target), { recursive: true });
    await fsp.cp(from, target, { recursive: true, dereference: true });
  }
  let count = 0;
  let bytes = 0;
  for (const entry of await fsp.readdir(rootfs, { recursive: true, withFileTypes: true })) {
    if (!entry.isFile()) continue;
    count++;
    bytes += (await fsp.stat(path.join(entry.parentPath, entry.name))).size;
  }
  await mustRun('/usr/bin/umoci', ['repack', '--image', image, bundle]);
  const repeat = (flag, values) => values.flatMap((value) => [flag, value]);
  await mustRun('/usr/bin/umoci', [
    'config',
    '--image',
    image,
    '--config.cmd',
    '/bin/sh',
    ...repeat('--config.env', env),
    '--config.workingdir',
    '/',
  ]);
  await fsp.rm(bundle, { recursive: true, force: true });
  return { layout, tag, source: `oci:${layout}:${tag}`, files: count, bytes };
}

/**
 * Starts Debian's docker-registry on 127.0.0.1:`port` (a free one when not given), storage in a temp
 * folder; stopped by the cleanup. It answers with a header carrying a random token, so a registry that lost
 * its port to another process fails here instead of talking to a stranger. `push(image, name)` copies an
 * OCI layout into it with skopeo and returns the manifest digest.
 */
export async function startRegistry(port) {
  const dir = await tempDir('ferry-bench-registry-');
  const storage = path.join(dir, 'data');
  await fsp.mkdir(storage);
  const listen = port ?? (await freePort());
  const token = crypto.randomBytes(8).toString('hex');
  const config = [
    'version: 0.1',
    'log:',
    '  level: error',
    '  accesslog:',
    '    disabled: true',
    'storage:',
    '  filesystem:',
    `    rootdirectory: ${storage}`,
    'http:',
    `  addr: 127.0.0.1:${listen}`,
    '  headers:',
    `    X-Ferry-Bench-Registry: [${token}]`,
    '',
  ].join('\n');
  await fsp.writeFile(path.join(dir, 'config.yml'), config);
  const child = spawn('/usr/bin/docker-registry', ['serve', path.join(dir, 'config.yml')], {
    stdio: ['ignore', 'ignore', 'pipe'],
    detached: true,
  });
  ownedPids.set(child.pid, undefined);
  let stderr = '';
  child.stderr.on('data', (d) => {
    stderr = (stderr + d).slice(-4000);
  });
  onCleanup(async () => {
    await stopChild(child, 'SIGTERM', 5_000);
    ownedPids.delete(child.pid);
  });
  const host = `127.0.0.1:${listen}`;
  await waitFor(
    async () => {
      if (child.exitCode !== null) throw new Error(`docker-registry exited at start: ${stderr}`);
      const res = await request(`http://${host}/v2/`).catch(() => undefined);
      if (!res) return false;
      await res.body.dump();
      if (res.headers['x-ferry-bench-registry'] !== token)
        throw new Error(`another server answers on ${host}: the registry lost its port`);
      return true;
    },
    { ms: 20_000, everyMs: 100, what: 'the registry to listen' },
  );
  return {
    host,
    async push(image, name) {
      const digestFile = path.join(dir, `digest-${crypto.randomBytes(4).toString('hex')}`);
      await mustRun(
        '/usr/bin/skopeo',
        [
          '--insecure-policy',
          'copy',
          '--quiet',
          '--dest-tls-verify=false',
          '--digestfile',
          digestFile,
          image.source,
          `docker://${host}/${name}`,
        ],
        { env: { ...process.env, HOME: dir } },
      );
      return (await fsp.readFile(digestFile, 'utf8')).trim();
    },
  };
}
