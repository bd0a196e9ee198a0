/**
 * A locked SQLite file does not freeze the server (issue 12, point 5). Another process holds
 * `BEGIN EXCLUSIVE` on a running server's `ferry.db`. Meanwhile `/healthz` and reads answer, writes (a
 * secret, an async run's acceptance) wait off the event loop and complete once the lock is released, or,
 * with FERRY_STORE_BUSY_TIMEOUT_MS shorter than the hold, answer 503 FERRY_STORE_BUSY with Retry-After
 * while it is still held. The event loop's longest delay stays far under the hold. The recorder's writes
 * that meet the lock are kept and retried.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import path from 'node:path';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { after, before, describe, it } from 'node:test';
import { createLogger } from '../src/logger.js';
import { endRun } from '../src/runs/lifecycle.js';
import { createRunRecorder, newRunRow } from '../src/runs/recorder.js';
import { openSqliteStore, probeStore } from '../src/store/index.js';
import {
  deployFiles,
  http,
  REPO_ROOT,
  type Response,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';

/** How long the lock is held at least. */
const HOLD_MS = 3000;

interface Lock {
  release(): Promise<void>;
}

/** Holds `BEGIN EXCLUSIVE` on `file` from another process, until release() (or 60 s, if the test died). */
function holdLock(file: string): Promise<Lock> {
  const script = `
const Database = require('better-sqlite3');
const db = new Database(process.argv[1]);
db.pragma('busy_timeout = 10000');
db.exec('BEGIN EXCLUSIVE');
process.stdout.write('locked\\n');
const release = () => { db.exec('COMMIT'); db.close(); process.stdout.write('released\\n'); process.exit(0); };
process.stdin.on('data', release);
setTimeout(release, 60000);
`;
  const child: ChildProcess = spawn(process.execPath, ['-e', script, file], {
    cwd: REPO_ROOT,
    stdio: ['pipe', 'pipe', 'pipe'],
  });
  let out = '';
  let err = '';
  child.stderr?.on('data', (d: Buffer) => (err += d));
  const exited = new Promise<void>((resolve, reject) => {
    child.on('exit', (code) => {
      if (code === 0 && out.includes('released')) resolve();
      else reject(new Error(`the lock holder exited with ${code}: ${out}${err}`));
    });
  });
  return new Promise((resolve, reject) => {
    child.stdout?.on('data', (d: Buffer) => {
      out += d;
      if (out.includes('locked'))
        resolve({
          async release() {
            child.stdin?.write('release\n');
            await exited;
          },
        });
    });
    exited.catch(reject);
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/**
 * Polls /healthz (at most 50 times, 100 ms apart) until it reports the store busy; returns the last answer.
 * Never fails itself, so that the order of events is checked first.
 */
async function healthWhileBusy(url: string): Promise<Response> {
  let last = await http(`${url}/healthz`);
  for (let i = 0; i < 50 && last.json?.store !== 'busy'; i++) {
    await sleep(100);
    last = await http(`${url}/healthz`);
  }
  return last;
}

function eventLoopMonitor(): ReturnType<typeof monitorEventLoopDelay> {
  const h = monitorEventLoopDelay({ resolution: 10 });
  h.enable();
  return h;
}

const APP_FILES = {
  'ferry.toml': '[app]\nname = "noop"\n',
  'main.ts': 'export function run() { return null; }\n',
};

/** A server with a deployed app, its busy timeout set, warmed up (token checked, last_used_at written). */
async function startWithApp(busyTimeoutMs: number) {
  const server = await startServer({ env: { FERRY_STORE_BUSY_TIMEOUT_MS: String(busyTimeoutMs) } });
  const auth = await server.bootstrap();
  await deployFiles(server, auth, 'noop', APP_FILES);
  const warm = await http(`${server.url}/v2/projects/${auth.projectId}/secrets`, { token: auth.token });
  assert.equal(warm.status, 200, warm.text);
  return { server, auth };
}

describe('a locked store, with a busy timeout longer than the lock', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  before(async () => ({ server, auth } = await startWithApp(60_000)));
  after(async () => server?.close());

  it('answers /healthz and reads under the lock; writes complete once it is released', {
    timeout: 60_000,
  }, async () => {
    const events: string[] = [];
    const delay = eventLoopMonitor();
    const lock = await holdLock(path.join(server.dataDir, 'ferry.db'));
    const lockedAt = Date.now();
    events.push('locked');

    const secret = http(`${server.url}/v2/projects/${auth.projectId}/secrets/API_KEY`, {
      method: 'PUT',
      token: auth.token,
      body: { value: 'hunter2' },
    }).then((res) => {
      events.push('secret answered');
      return res;
    });
    const accepted = http(`${server.url}/v4/${auth.projectId}/noop/run?async=true`, {
      method: 'POST',
      token: auth.token,
      body: {},
    }).then((res) => {
      events.push('async run answered');
      return res;
    });

    const health = await healthWhileBusy(server.url);
    events.push('healthz answered');
    const list = await http(`${server.url}/v2/projects/${auth.projectId}/secrets`, { token: auth.token });
    events.push('read answered');

    await sleep(Math.max(0, lockedAt + HOLD_MS - Date.now()));
    events.push('released');
    await lock.release();

    const [put, run] = await Promise.all([secret, accepted]);
    delay.disable();
    assert.deepEqual(events.slice(0, 4), ['locked', 'healthz answered', 'read answered', 'released']);
    assert.deepEqual(events.slice(4).sort(), ['async run answered', 'secret answered']);
    const maxMs = delay.max / 1e6;
    assert.ok(maxMs < HOLD_MS / 2, `the event loop was blocked for ${maxMs} ms`);
    assert.equal(health.status, 200, health.text);
    assert.deepEqual(health.json, { status: 'ok', store: 'busy' });
    assert.equal(list.status, 200, list.text);
    assert.equal(put.status, 200, put.text);
    assert.equal(run.status, 202, run.text);

    // Not busy any more once every write that was waiting (background ones too) has had its next try.
    await waitFor(
      async () => (await http(`${server.url}/healthz`)).json?.store === undefined,
      5_000,
      '/healthz to stop saying busy',
    );
    const healthAfter = await http(`${server.url}/healthz`);
    assert.equal(healthAfter.status, 200, healthAfter.text);
    assert.deepEqual(healthAfter.json, { status: 'ok' });
  });
});

describe('a locked store, with a busy timeout shorter than the lock', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  before(async () => ({ server, auth } = await startWithApp(300)));
  after(async () => server?.close());

  it('answers writes 503 FERRY_STORE_BUSY with Retry-After while the lock is held', { timeout: 60_000 }, async () => {
    const events: string[] = [];
    const delay = eventLoopMonitor();
    const lock = await holdLock(path.join(server.dataDir, 'ferry.db'));
    const lockedAt = Date.now();
    let released = false;
    try {
      const [put, run] = await Promise.all([
        http(`${server.url}/v2/projects/${auth.projectId}/secrets/API_KEY`, {
          method: 'PUT',
          token: auth.token,
          body: { value: 'hunter2' },
        }),
        http(`${server.url}/v4/${auth.projectId}/noop/run?async=true`, {
          method: 'POST',
          token: auth.token,
          body: {},
        }),
      ]);
      events.push('writes answered');
      for (const res of [put, run]) {
        assert.equal(res.status, 503, res.text);
        assert.equal(res.json.error.code, 'FERRY_STORE_BUSY');
        assert.equal(res.headers.get('retry-after'), '1');
      }
      const health = await http(`${server.url}/healthz`);
      assert.equal(health.status, 200, health.text);
      assert.deepEqual(health.json, { status: 'ok', store: 'busy' });
      events.push('healthz answered');

      await sleep(Math.max(0, lockedAt + HOLD_MS - Date.now()));
      events.push('released');
      released = true;
      await lock.release();
    } finally {
      if (!released) await lock.release();
    }
    delay.disable();
    assert.deepEqual(events, ['writes answered', 'healthz answered', 'released']);
    const maxMs = delay.max / 1e6;
    assert.ok(maxMs < HOLD_MS / 2, `the event loop was blocked for ${maxMs} ms`);

    // Once the lock is gone the same writes succeed, and /healthz no longer says busy: as soon as the
    // writes that were waiting (background ones too: the node's lease renewal, the recorder) have had
    // their next try, at most 50 ms apart.
    await waitFor(
      async () => (await http(`${server.url}/healthz`)).json?.store === undefined,
      5_000,
      '/healthz to stop saying busy',
    );
    const health = await http(`${server.url}/healthz`);
    assert.deepEqual(health.json, { status: 'ok' });
    const put = await http(`${server.url}/v2/projects/${auth.projectId}/secrets/API_KEY`, {
      method: 'PUT',
      token: auth.token,
      body: { value: 'hunter2' },
    });
    assert.equal(put.status, 200, put.text);
  });
});

describe('the recorder on a locked store', () => {
  it('keeps a write that failed with FERRY_STORE_BUSY and writes it once the lock is gone', {
    timeout: 60_000,
  }, async () => {
    const dataDir = await tempDir();
    const store = await openSqliteStore({ dataDir, busyTimeoutMs: 200 });
    const logged: Array<{ msg?: string; err?: { code?: string } }> = [];
    const logger = createLogger({
      level: 'info',
      pretty: false,
      destination: { write: (line: string) => void logged.push(JSON.parse(line)) },
    });
    const recorder = createRunRecorder({ store, logger, limits: { retryFirstMs: 50, retryMaxMs: 200 } });
    try {
      const lock = await holdLock(path.join(dataDir, 'ferry.db'));
      const row = newRunRow({
        id: '01a20000-0000-7000-8000-0000000000b1',
        build: { projectId: 'p', appId: 'a', buildId: 'b' },
        fn: 'run',
        mode: 'sync',
        input: '{}',
      });
      recorder.start(row);
      recorder.finish(
        endRun(
          { id: row.id, webhookUrl: 'http://127.0.0.1:9/hook' },
          { kind: 'answered', statusCode: 200, runTimeMs: 1, result: { stored: null } },
        ),
      );
      await recorder.flush();
      const failed = logged.find((l) => l.msg?.startsWith('writing run records failed'));
      assert.ok(failed, 'the write failed under the lock');
      assert.equal(failed.err?.code, 'FERRY_STORE_BUSY');
      await lock.release();

      for (let i = 0; i < 100 && !logged.some((l) => l.msg === 'writing run records again'); i++) await sleep(50);
      assert.ok(
        logged.some((l) => l.msg === 'writing run records again'),
        'a retry wrote it',
      );
      const run = await store.selectFrom('runs').select('state').where('id', '=', row.id).executeTakeFirst();
      assert.equal(run?.state, 'success');
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

describe('the health probe', () => {
  it('answers promptly when the connection stays taken, and ok once it is free', { timeout: 30_000 }, async () => {
    const store = await openSqliteStore({ dataDir: await tempDir() });
    try {
      assert.equal(await probeStore(store, 1000), 'ok');
      let end: () => void = () => {};
      const ended = new Promise<void>((resolve) => (end = resolve));
      const events: string[] = [];
      // A transaction that keeps the one connection across an await, as a slow caller would.
      const held = store.transaction().execute(async (trx) => {
        await trx.selectFrom('projects').select('id').execute();
        events.push('transaction began');
        await ended;
      });
      for (let i = 0; i < 500 && events.length === 0; i++) await sleep(10);
      const probe = await probeStore(store, 200);
      events.push(`probe ${probe}`);
      end();
      await held;
      events.push('transaction ended');
      assert.deepEqual(events, ['transaction began', 'probe unresponsive', 'transaction ended']);
      assert.equal(await probeStore(store, 1000), 'ok');
    } finally {
      await store.destroy();
    }
  });
});
