/**
 * Test helpers for a fleet of `ferry serve` processes on one PostgreSQL database: a fresh database per
 * test run, serve processes in process groups of their own (so a SIGKILL takes a process and its replicas
 * at once, as when a machine dies, and nothing outlives the test), a sweep for strays, an async client
 * that fails over between processes with one Idempotency-Key per call, and the evidence the fleet app's
 * function leaves: one line when an execution starts, one when it ends, read back as intervals per run.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createWriteStream, readdirSync, readFileSync } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import pg from 'pg';
import { FERRY_BIN, http, runCli } from './ferry.js';

// ---- the database ----

/** The machine's PostgreSQL (trust auth); tests create and drop their own database in it. */
export const ADMIN_DATABASE_URL =
  process.env.FERRY_TEST_ADMIN_DATABASE_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';

export interface TestDatabase {
  name: string;
  url: string;
  /** Drops the database, closing whatever is still connected to it. */
  drop(): Promise<void>;
}

async function withAdmin<T>(fn: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: ADMIN_DATABASE_URL, connectionTimeoutMillis: 10_000 });
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end();
  }
}

/** Creates a fresh, empty database with a name no other test run uses. */
export async function createTestDatabase(prefix = 'ferry_test'): Promise<TestDatabase> {
  const name = `${prefix}_${process.pid}_${randomBytes(4).toString('hex')}`;
  // The name is ours (letters, digits, underscores), so quoting it as an identifier is enough.
  await withAdmin((c) => c.query(`CREATE DATABASE "${name}"`));
  const url = new URL(ADMIN_DATABASE_URL);
  url.pathname = `/${name}`;
  return {
    name,
    url: url.toString(),
    drop: () => withAdmin((c) => c.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`)).then(() => undefined),
  };
}

// ---- serve processes ----

export interface FleetSettings {
  databaseUrl: string;
  keysDir: string;
  artifactsDir: string;
  /**
   * More environment for the serve process (PATH, HOME and FERRY_LOG_FORMAT=json are always set;
   * FERRY_WARM_POOL is 0 unless set here).
   */
  env?: NodeJS.ProcessEnv;
}

export interface FleetProcess {
  readonly label: string;
  readonly dataDir: string;
  readonly url: string;
  readonly pid: number;
  /** Date.now() when it was spawned. */
  readonly startedAt: number;
  /** The last 256 KiB of its stdout and stderr. */
  output(): string;
  /**
   * SIGKILLs the process group (the serve and every replica it started) and waits until none of it is
   * left; resolves with Date.now() taken right after the SIGKILL was sent, after which nothing of it can
   * run (see `groupKiller`).
   */
  kill(): Promise<number>;
  /** SIGTERM to the serve, then SIGKILL to its whole group after `graceMs`; leaves nothing of the group. */
  stop(graceMs?: number): Promise<void>;
}

const OUTPUT_KEEP = 256 * 1024;

/**
 * Starts `ferry serve --port 0` on the shared database, keys and artifacts, in a process group of its own
 * (detached), and waits until it listens.
 */
export async function startFleetProcess(
  label: string,
  dataDir: string,
  settings: FleetSettings,
): Promise<FleetProcess> {
  const startedAt = Date.now();
  const args = [
    FERRY_BIN,
    'serve',
    '--port',
    '0',
    '--data-dir',
    dataDir,
    '--database-url',
    settings.databaseUrl,
    '--keys-dir',
    settings.keysDir,
    '--artifacts-dir',
    settings.artifactsDir,
  ];
  const child = spawn(process.execPath, args, {
    // No warm pool unless the test sets one: two background sandboxes per process that most tests never take.
    env: {
      PATH: process.env.PATH,
      HOME: process.env.HOME,
      FERRY_LOG_FORMAT: 'json',
      FERRY_WARM_POOL: '0',
      // FERRY_TEST_LOG=debug shows the serve processes' debug lines too (with FERRY_TEST_FLEET_LOGS to read them).
      ...(process.env.FERRY_TEST_LOG ? { FERRY_LOG_LEVEL: process.env.FERRY_TEST_LOG } : {}),
      ...settings.env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
    // Its own process group: a kill of -pid reaches the replicas too (without the sandbox nothing else
    // ties them to the serve process, and an orphan would go on running).
    detached: true,
  });
  let out = '';
  const keep = (d: Buffer) => {
    out += d.toString('utf8');
    if (out.length > 2 * OUTPUT_KEEP) out = out.slice(-OUTPUT_KEEP);
  };
  child.stdout.on('data', keep);
  child.stderr.on('data', keep);
  // FERRY_TEST_FLEET_LOGS=<folder>: every serve's whole output is kept there too (`<label>-<start>.log`), for
  // reading what each process did after a failure (the test's own data dirs are removed at its end).
  const logDir = process.env.FERRY_TEST_FLEET_LOGS;
  if (logDir) {
    const file = createWriteStream(path.join(logDir, `${label}-${startedAt}.log`));
    child.stdout.on('data', (d: Buffer) => file.write(d));
    child.stderr.on('data', (d: Buffer) => file.write(d));
    child.once('close', () => file.end());
  }
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const pid = child.pid;
  if (pid === undefined) throw new Error(`ferry serve ${label} did not start`);
  const killGroup = groupKiller(pid, child, exited);
  let url: string;
  try {
    url = await listeningAddress(child, () => out, exited);
  } catch (err) {
    await killGroup();
    throw err;
  }
  return {
    label,
    dataDir,
    url,
    pid,
    startedAt,
    output: () => out.slice(-OUTPUT_KEEP),
    kill: () => killGroup(),
    async stop(graceMs = 10_000) {
      // The serve alone first: it stops its replicas itself on a graceful shutdown.
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM');
      await within(exited, graceMs);
      await killGroup();
    },
  };
}

function listeningAddress(child: ChildProcess, output: () => string, exited: Promise<void>): Promise<string> {
  return new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`ferry serve did not start within 30 s:\n${output()}`)), 30_000);
    const onData = () => {
      const match = /"address":"(http:\/\/[^"]+)"/.exec(output());
      if (match?.[1]) {
        clearTimeout(timer);
        child.stdout?.off('data', onData);
        resolve(match[1]);
      }
    };
    child.stdout?.on('data', onData);
    void exited.then(() => {
      clearTimeout(timer);
      reject(new Error(`ferry serve exited with ${child.exitCode ?? child.signalCode}:\n${output()}`));
    });
  });
}

function signalGroup(pgid: number, signal: NodeJS.Signals): boolean {
  try {
    process.kill(-pgid, signal);
    return true;
  } catch {
    return false; // ESRCH: the group is empty already
  }
}

/**
 * Whether any process of the group is left, zombies aside (a zombie runs nothing, and who reaps it, the
 * serve or init, is not ours to wait for): read from /proc/<pid>/stat, whose fields after the command's
 * closing parenthesis are state, ppid, pgrp.
 *
 * Read synchronously: a few hundred small reads of /proc take milliseconds, whereas awaiting each one
 * costs a turn of this process's event loop, and on a loaded machine, with the fleet test's callers
 * busy in the same loop, one scan took 18 to 43 s that way.
 */
function groupAlive(pgid: number): boolean {
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    let stat: string;
    try {
      stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
    } catch {
      continue;
    }
    const [state, , pgrp] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    if (Number(pgrp) === pgid && state !== 'Z' && state !== 'X') return true;
  }
  return false;
}

/**
 * SIGKILLs a process group and waits (at most 10 s) until the leader exited and no member runs. Signals
 * go to the group only while it is known to exist (the leader unreaped, or a member seen in /proc), so a
 * process group id reused by someone else later is never hit.
 *
 * Resolves with Date.now() taken right after kill(2) returned: the moment the group stopped running.
 * A SIGKILL cannot be blocked or caught; kill(2) marks it pending on every thread of every member and
 * wakes them, and a thread with it pending never returns to user space: no member executes another line
 * of its code after that moment (a member forked meanwhile is covered too: fork restarts when a signal to
 * the group arrives during it). The confirmation that follows (the leader reaped, no member left in
 * /proc) comes later, by how long this process takes to see it, which on a loaded machine was seconds:
 * dating the death there made the executions the kill cut short look as if they went on running.
 */
function groupKiller(pgid: number, leader: ChildProcess, leaderExited: Promise<void>): () => Promise<number> {
  let diedAt: number | undefined;
  const leaderUnreaped = () => leader.exitCode === null && leader.signalCode === null;
  return async function killGroup() {
    if (diedAt !== undefined) return diedAt;
    const end = Date.now() + 10_000;
    if (leaderUnreaped() || groupAlive(pgid)) signalGroup(pgid, 'SIGKILL');
    const signalledAt = Date.now();
    await within(leaderExited, 10_000);
    while (groupAlive(pgid)) {
      if (Date.now() > end) throw new Error(`process group ${pgid} survived SIGKILL for 10 s`);
      signalGroup(pgid, 'SIGKILL');
      await sleep(20);
    }
    diedAt = signalledAt;
    return diedAt;
  };
}

/**
 * SIGKILLs every process (other than this one) whose command line or environment mentions `root`: a
 * safety net after the groups were stopped, for anything that left its group. Returns how many it found.
 */
export async function sweepStrays(root: string): Promise<number> {
  let found = 0;
  for (const entry of await fs.readdir('/proc')) {
    const pid = Number(entry);
    if (!Number.isInteger(pid) || pid === process.pid) continue;
    let text: string;
    try {
      const [cmdline, environ] = await Promise.all([
        fs.readFile(`/proc/${pid}/cmdline`, 'utf8'),
        fs.readFile(`/proc/${pid}/environ`, 'utf8'),
      ]);
      text = `${cmdline}\0${environ}`;
    } catch {
      continue; // gone, or not ours to read
    }
    if (!text.includes(root)) continue;
    found += 1;
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // exited meanwhile
    }
  }
  return found;
}

// ---- the async client ----

/** One place a call can go: a serve process's current address, or none while it is down. */
export interface Slot {
  label: string;
  url: string | undefined;
}

export interface Accepted {
  runId: string;
  /** The slot whose 202 was read. */
  slot: string;
  /** Calls that failed at the connection (sent again elsewhere with the same key). */
  connectionFailures: number;
}

/**
 * Sends one async call, first to `slots[first]`, then on to the next slot whenever a process cannot be
 * reached (connection refused or reset, no address while it is down) or answers 429/503, always with the
 * same Idempotency-Key: so a call that a dying process had already committed answers that same run id.
 * Bounded: `maxTries` sends in all, each bounded by the HTTP helper's 30 s timeout.
 */
export async function submitAsync(
  slots: readonly Slot[],
  first: number,
  request: { path: string; token: string; body: unknown; idempotencyKey: string },
  maxTries = 12,
): Promise<Accepted> {
  let connectionFailures = 0;
  const problems: string[] = [];
  for (let attempt = 0; attempt < maxTries; attempt++) {
    const slot = slots[(first + attempt) % slots.length]!;
    const url = slot.url;
    if (url === undefined) {
      problems.push(`${slot.label}: down`);
      await sleep(50);
      continue;
    }
    let res: Awaited<ReturnType<typeof http>>;
    try {
      res = await http(`${url}${request.path}`, {
        method: 'POST',
        token: request.token,
        body: request.body,
        headers: { 'idempotency-key': request.idempotencyKey },
      });
    } catch (err) {
      connectionFailures += 1;
      problems.push(`${slot.label}: ${(err as Error).message} (${String((err as Error).cause ?? '')})`);
      await sleep(50);
      continue;
    }
    if (res.status === 202) return { runId: res.json.run_id as string, slot: slot.label, connectionFailures };
    if (res.status === 429 || res.status === 503) {
      problems.push(`${slot.label}: ${res.status} ${res.json?.error?.code ?? ''}`);
      const retryAfter = Number(res.headers.get('retry-after') ?? '1');
      await sleep(Math.min(Number.isFinite(retryAfter) ? retryAfter * 1000 : 1000, 2000));
      continue;
    }
    throw new Error(`${request.idempotencyKey} through ${slot.label}: ${res.status} ${res.text}`);
  }
  throw new Error(`${request.idempotencyKey}: no process accepted it in ${maxTries} tries: ${problems.join('; ')}`);
}

// ---- evidence of execution ----

/** One line the fleet app's function appends: at the start and at the end of each execution. */
export interface EvidenceLine {
  ev: 'start' | 'end';
  /** The call's number (its input), mapped to the run id from the 202 answers. */
  n: number;
  /** Random per execution: pairs a start with its end. */
  exec: string;
  /** Date.now() in the replica. */
  t: number;
  /** FERRY_SOCKET of the replica: inside the serving process's data dir when the sandbox is off. */
  sock: string;
  pid: number;
}

/**
 * The fleet app: `work({n, ms})` appends a start line, sleeps `ms`, appends an end line. appendFileSync
 * of one short line is a single write(2) on an O_APPEND file, so lines of concurrent executions never mix.
 */
export function fleetAppFiles(name: string, evidenceFile: string): Record<string, string> {
  return {
    'ferry.toml': `[app]
name = "${name}"
retry_interrupted = true

[scaling]
min_replicas = 0
max_replicas = 2
replica_concurrency = 4

[env]
EVIDENCE = ${JSON.stringify(evidenceFile)}
`,
    'main.ts': `import { appendFileSync } from 'node:fs';
import { randomUUID } from 'node:crypto';

function note(ev: 'start' | 'end', n: number, exec: string): void {
  const line = { ev, n, exec, t: Date.now(), sock: process.env.FERRY_SOCKET ?? '', pid: process.pid };
  appendFileSync(process.env.EVIDENCE ?? '/dev/null', JSON.stringify(line) + '\\n');
}

export async function work({ n, ms }: { n: number; ms: number }): Promise<{ n: number }> {
  const exec = randomUUID();
  note('start', n, exec);
  await new Promise((resolve) => setTimeout(resolve, ms));
  note('end', n, exec);
  return { n };
}
`,
  };
}

/** Parses whole lines; a last line without its newline yet is left for the next read. */
export function parseEvidence(text: string): { lines: EvidenceLine[]; rest: string } {
  const parts = text.split('\n');
  const rest = parts.pop() ?? '';
  const lines = parts.filter((p) => p.trim() !== '').map((p) => JSON.parse(p) as EvidenceLine);
  return { lines, rest };
}

/** Reads the evidence file as it grows, and says which executions are under way right now. */
export class EvidenceTail {
  private offset = 0;
  private rest = '';
  private readonly open = new Map<string, EvidenceLine>();

  constructor(private readonly file: string) {}

  /** Executions started and not ended, as of the file's current end. */
  async openExecutions(): Promise<EvidenceLine[]> {
    let handle: fs.FileHandle;
    try {
      handle = await fs.open(this.file, 'r');
    } catch {
      return []; // nothing written yet
    }
    try {
      const { size } = await handle.stat();
      if (size > this.offset) {
        const buf = Buffer.alloc(size - this.offset);
        const { bytesRead } = await handle.read(buf, 0, buf.length, this.offset);
        this.offset += bytesRead;
        const parsed = parseEvidence(this.rest + buf.subarray(0, bytesRead).toString('utf8'));
        this.rest = parsed.rest;
        for (const line of parsed.lines) {
          if (line.ev === 'start') this.open.set(line.exec, line);
          else this.open.delete(line.exec);
        }
      }
    } finally {
      await handle.close();
    }
    return [...this.open.values()];
  }
}

/** One life of a serve process: its data dir and the span of time it could run anything. */
export interface Incarnation {
  label: string;
  dataDir: string;
  from: number;
  /** When it was SIGKILLed (nothing of it runs after: `FleetProcess.kill`), or Infinity while it lives. */
  until: number;
}

export interface Execution {
  n: number;
  exec: string;
  /** The incarnation that ran it. */
  on: string;
  start: number;
  /** The end line's time; for an execution cut by the kill, the moment of the kill; else undefined. */
  end: number | undefined;
  /** Started on an incarnation that was killed, and never ended. */
  interrupted: boolean;
}

/**
 * Pairs start and end lines into executions and names the incarnation that ran each (by the data dir
 * in its socket path, and the time it started). Lines that fit no incarnation are returned as problems.
 */
export function collectExecutions(
  lines: readonly EvidenceLine[],
  incarnations: readonly Incarnation[],
): { executions: Execution[]; problems: string[] } {
  const problems: string[] = [];
  const byExec = new Map<string, Execution>();
  for (const line of lines) {
    if (line.ev !== 'start') continue;
    const owner = incarnations.find(
      (inc) => line.sock.startsWith(`${inc.dataDir}${path.sep}`) && line.t >= inc.from && line.t <= inc.until,
    );
    if (!owner) {
      problems.push(`execution ${line.exec} of n=${line.n} fits no process: ${JSON.stringify(line)}`);
      continue;
    }
    if (byExec.has(line.exec)) problems.push(`execution ${line.exec} started twice`);
    byExec.set(line.exec, {
      n: line.n,
      exec: line.exec,
      on: owner.label,
      start: line.t,
      end: undefined,
      interrupted: false,
    });
  }
  for (const line of lines) {
    if (line.ev !== 'end') continue;
    const execution = byExec.get(line.exec);
    if (!execution) problems.push(`an end without a start: ${JSON.stringify(line)}`);
    else execution.end = line.t;
  }
  for (const execution of byExec.values()) {
    if (execution.end !== undefined) continue;
    const owner = incarnations.find((inc) => inc.label === execution.on)!;
    if (Number.isFinite(owner.until)) {
      execution.end = owner.until;
      execution.interrupted = true;
    }
  }
  return { executions: [...byExec.values()], problems };
}

/** Pairs of executions of one run that were under way at the same time (an open one lasts forever). */
export function overlapping(executions: readonly Execution[]): Array<[Execution, Execution]> {
  const sorted = [...executions].sort((a, b) => a.start - b.start);
  const pairs: Array<[Execution, Execution]> = [];
  for (let i = 0; i < sorted.length; i++) {
    for (let j = i + 1; j < sorted.length; j++) {
      const a = sorted[i]!;
      const b = sorted[j]!;
      if (b.start < (a.end ?? Number.POSITIVE_INFINITY)) pairs.push([a, b]);
    }
  }
  return pairs;
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** Waits for `promise`, or `ms` at most; the timer is cleared either way, so it keeps nothing alive. */
export async function within(promise: Promise<unknown>, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([promise, new Promise<void>((resolve) => (timer = setTimeout(resolve, ms)))]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * `ferry admin bootstrap` on a shared database (it also migrates it and makes the shared keys, before any
 * serve starts): the first project and its owner token.
 */
export async function bootstrapShared(
  dataDir: string,
  databaseUrl: string,
  keysDir: string,
): Promise<{ projectId: string; token: string }> {
  const boot = await runCli([
    'admin',
    'bootstrap',
    '--data-dir',
    dataDir,
    '--database-url',
    databaseUrl,
    '--keys-dir',
    keysDir,
    '--json',
  ]);
  if (boot.code !== 0) throw new Error(`ferry admin bootstrap failed (${boot.code}): ${boot.stderr}`);
  const { project_id: projectId, token } = JSON.parse(boot.stdout) as { project_id: string; token: string };
  return { projectId, token };
}
