/**
 * A failed recorder write is retried, not dropped (issue 12): another process holds an exclusive lock on
 * the SQLite file while runs finish (async runs accepted before it, sync runs made and answered under it,
 * all with webhooks and log lines), so the recorder's writes fail with SQLITE_BUSY. Once the lock is
 * released, every run's final state, every log line and every webhook delivery is in the store, and every
 * webhook arrives.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { createLogger } from '../src/logger.js';
import { endRun } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { openSqliteStore } from '../src/store/index.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const ASYNC_RUNS = 8;
const SYNC_RUNS = 3;
const LINES = 3;
/** Over twice the store's 5 s busy timeout, so writes fail (not just wait) and are retried under the lock. */
const HOLD_MS = 12_000;

/** Holds `BEGIN EXCLUSIVE` on the file from another process; resolves once it holds it. */
function holdLock(file: string, ms: number): Promise<{ child: ChildProcess; released: Promise<number> }> {
  const script = `
const Database = require('better-sqlite3');
const db = new Database(process.argv[1]);
db.pragma('busy_timeout = 10000');
db.exec('BEGIN EXCLUSIVE');
process.stdout.write('locked ' + Date.now() + '\\n');
setTimeout(() => { db.exec('COMMIT'); db.close(); process.stdout.write('released ' + Date.now() + '\\n'); }, ${ms});
`;
  const child = spawn(process.execPath, ['-e', script, file], { cwd: REPO_ROOT, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  child.stderr?.on('data', (d: Buffer) => (err += d));
  const released = new Promise<number>((resolve, reject) => {
    child.on('exit', (code) => {
      const m = /released (\d+)/.exec(out);
      if (code === 0 && m) resolve(Number(m[1]));
      else reject(new Error(`the lock holder exited with ${code}: ${out}${err}`));
    });
  });
  return new Promise((resolve, reject) => {
    child.stdout?.on('data', (d: Buffer) => {
      out += d;
      if (out.includes('locked ')) resolve({ child, released });
    });
    released.catch(reject);
  });
}

describe('recorder retries when the store is locked', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  const logLines: Array<{ msg?: string; webhooks?: number }> = [];

  before(async () => {
    receiver = await startReceiver();
    server = await startServer({
      env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' },
      log: { level: 'info', destination: { write: (line: string) => void logLines.push(JSON.parse(line)) } },
    });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'slow', {
      'ferry.toml': '[app]\nname = "slow"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 16\n',
      'main.ts': `
export async function run({ i, ms }: { i: number; ms: number }) {
  for (let n = 1; n <= ${LINES}; n++) console.log('run ' + i + ' line ' + n);
  await new Promise((r) => setTimeout(r, ms));
  return { i };
}
`,
    });
  });
  after(async () => {
    await server.close();
    await receiver.close();
  });

  it('keeps run records, log lines and webhook deliveries through a locked store', { timeout: 180_000 }, async () => {
    const base = `${server.url}/v4/${auth.projectId}/slow/run`;
    const hook = encodeURIComponent(`${receiver.url}/hook`);
    const accepted: string[] = [];
    for (let i = 0; i < ASYNC_RUNS; i++) {
      const res = await http(`${base}?async=true&webhookEndpoint=${hook}`, {
        method: 'POST',
        token: auth.token,
        body: { i, ms: 3000 },
      });
      assert.equal(res.status, 202, res.text);
      accepted.push(res.json.run_id);
    }
    const store = server.services.store;
    await waitFor(
      async () => {
        const rows = await store.selectFrom('runs').select('state').where('id', 'in', accepted).execute();
        return rows.length === ASYNC_RUNS && rows.every((r) => r.state === 'running');
      },
      60_000,
      'every async run to be running',
    );

    const lock = await holdLock(path.join(server.dataDir, 'ferry.db'), HOLD_MS);
    // Sync runs that start and end under the lock: their rows are new (INSERTs), the async runs' UPDATEs.
    const sync = await Promise.all(
      Array.from({ length: SYNC_RUNS }, (_, k) =>
        http(`${base}?webhookEndpoint=${hook}`, { method: 'POST', token: auth.token, body: { i: 100 + k, ms: 10 } }),
      ),
    );
    const answeredAt = Date.now();
    for (const s of sync) assert.equal(s.status, 200, s.text);
    const releasedAt = await lock.released;
    assert.ok(answeredAt < releasedAt, 'the sync runs ended while the store was locked');

    const all = [...accepted, ...sync.map((s) => s.json.run_id as string)];
    const finals = await waitFor(
      async () => {
        const rows = await store
          .selectFrom('runs')
          .select(['id', 'state', 'finished_at'])
          .where('id', 'in', all)
          .execute();
        return rows.length === all.length && rows.every((r) => r.state === 'success') ? rows : undefined;
      },
      90_000,
      'every run row in its final state',
    );
    assert.equal(finals.length, all.length);
    const failedAt = logLines.findIndex(
      (l) => l.msg?.startsWith('writing run records failed') && (l.webhooks ?? 0) > 0,
    );
    const againAt = logLines.findIndex((l) => l.msg === 'writing run records again');
    assert.ok(failedAt >= 0, 'a write holding webhook deliveries failed while the store was locked');
    assert.ok(againAt > failedAt, 'and a later retry wrote it');

    for (const [k, id] of all.entries()) {
      const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/slow/runs/${id}/logs`, {
        token: auth.token,
      });
      assert.equal(res.status, 200, res.text);
      const printed = (res.json.lines as Array<{ stream: string; line: string }>)
        .filter((l) => l.stream === 'stdout')
        .map((l) => l.line);
      const i = k < ASYNC_RUNS ? k : 100 + k - ASYNC_RUNS;
      assert.deepEqual(
        printed,
        Array.from({ length: LINES }, (_, n) => `run ${i} line ${n + 1}`),
        `run ${id}: its log lines`,
      );
    }

    const outbox = await store.selectFrom('webhook_deliveries').select('run_id').where('run_id', 'in', all).execute();
    assert.equal(outbox.length, all.length, 'one webhook delivery per run');
    const arrived = await receiver.waitForRequests(all.length, 60_000);
    const hooked = new Set(arrived.map((r) => (JSON.parse(r.body.toString('utf8')) as { run_id: string }).run_id));
    for (const id of all) assert.ok(hooked.has(id), `the webhook of ${id} arrived`);
  });
});

describe('recorder memory while the store is locked', () => {
  it('drops log lines past its memory bound, saying so, and keeps the run and its webhook', {
    timeout: 120_000,
  }, async () => {
    const dataDir = await tempDir();
    const store = await openSqliteStore({ dataDir });
    const logged: Array<{ msg?: string; droppedLogLines?: number }> = [];
    const logger = createLogger({
      level: 'info',
      pretty: false,
      destination: { write: (line: string) => void logged.push(JSON.parse(line)) },
    });
    const LINE = 'x'.repeat(50);
    // Room for 20 lines of 50 bytes.
    const recorder = createRunRecorder({ store, logger, limits: { maxBufferedLogBytes: 1000 } });
    try {
      const lock = await holdLock(path.join(dataDir, 'ferry.db'), HOLD_MS);
      const row = newRunRow({
        id: '01a20000-0000-7000-8000-000000000001',
        build: { projectId: 'p', appId: 'a', buildId: 'b' },
        fn: 'run',
        mode: 'sync',
        input: '{}',
      });
      recorder.start(row);
      for (let i = 1; i <= 10; i++) recorder.log(row.id, 'stdout', `${i} ${LINE}`);
      await recorder.flush();
      assert.ok(
        logged.some((l) => l.msg?.startsWith('writing run records failed')),
        'the first write failed under the lock',
      );
      for (let i = 11; i <= 100; i++) recorder.log(row.id, 'stdout', `${i} ${LINE}`);
      recorder.finish(
        endRun(
          { id: row.id, webhookUrl: 'http://127.0.0.1:9/hook' },
          { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: null } },
        ),
      );
      const dropped = logged.find((l) => l.msg?.startsWith('run log lines dropped'));
      assert.ok(dropped, 'dropping log lines is logged');
      await lock.released;

      const stored = await waitFor(
        async () => {
          const run = await store.selectFrom('runs').select('state').where('id', '=', row.id).executeTakeFirst();
          return run?.state === 'success' ? run : undefined;
        },
        60_000,
        'the run row',
      );
      assert.equal(stored.state, 'success');
      const lines = await store
        .selectFrom('run_log_lines')
        .select(['seq', 'line'])
        .where('run_id', '=', row.id)
        .orderBy('seq')
        .execute();
      // The lines that fitted, in order and without a gap; the rest were dropped.
      assert.ok(lines.length >= 10 && lines.length < 100, `${lines.length} lines kept`);
      assert.deepEqual(
        lines.map((l) => l.seq),
        Array.from({ length: lines.length }, (_, k) => k + 1),
      );
      const outbox = await store.selectFrom('webhook_deliveries').select('run_id').execute();
      assert.deepEqual(
        outbox.map((o) => o.run_id),
        [row.id],
      );
    } finally {
      await recorder.close();
      await store.destroy();
    }
  });
});
