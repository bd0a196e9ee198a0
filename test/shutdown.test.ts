/**
 * A bounded shutdown (issue 43, point 7), with real `ferry serve` processes on one data directory and a
 * function that sleeps 300 s:
 * - SIGTERM with FERRY_SHUTDOWN_GRACE_SECONDS=2 and three runs in flight (an async run of an app with
 *   `retry_interrupted`, an async and a sync run of an app without): the process exits 0 long before the
 *   runs would end, after saying so in order (the signal, the grace over and the runs interrupted,
 *   stopped). It wrote each run's interruption itself before exiting: the retried run is queued again for
 *   any node (not lost), the others ended `failure`, reason `interrupted`, and the sync caller got 502.
 *   The next start takes the queued run up (its second start) and finds nothing left to recover.
 * - A second signal exits at once, whatever the grace (300 s here); the run it left running is recovered
 *   by the next start as a dead process's is (`retry_interrupted`: a third start), and a last SIGTERM ends
 *   it for good (three starts is the most, runs/lifecycle.ts MAX_RUN_STARTS).
 * On PostgreSQL (test/postgres/) every process uses one fresh database.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { openStore } from '../src/store/index.js';
import { http as call, deployFiles, runCli, type ServeProcess, spawnServe, tempDir, waitFor } from './helpers/ferry.js';
import { createTestDatabase, type TestDatabase, testStoreKind } from './helpers/store.js';

const SLEEPER =
  'export async function run() { await new Promise((r) => setTimeout(r, 300_000)); return { woke: true }; }\n';

interface RunView {
  run_id: string;
  mode: string;
  state: string;
  reason: string | null;
  attempts: number;
  error: { code: string } | null;
}

/** Resolves with the exit code, or 'running' when the process has not exited within `ms`. */
async function exitWithin(serve: ServeProcess, signal: NodeJS.Signals, ms: number): Promise<number | null | 'running'> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'running'>((resolve) => {
    timer = setTimeout(() => resolve('running'), ms);
  });
  try {
    return await Promise.race([serve.stop(signal), late]);
  } finally {
    clearTimeout(timer);
  }
}

/** The index of the first line of `output` matching `pattern` (fails when none does). */
function lineOf(output: string, pattern: RegExp): number {
  const index = output.split('\n').findIndex((line) => pattern.test(line));
  assert.ok(index >= 0, `no line matches ${pattern}:\n${output.slice(-4000)}`);
  return index;
}

describe('shutdown', () => {
  let dataDir: string;
  let database: TestDatabase | undefined;
  let serve: ServeProcess | undefined;
  let auth: { projectId: string; token: string };
  const env: NodeJS.ProcessEnv = {};
  const start = async (graceSeconds: number) => {
    serve = await spawnServe(dataDir, { ...env, FERRY_SHUTDOWN_GRACE_SECONDS: String(graceSeconds) });
    return serve;
  };
  const url = () => serve!.url;
  const runOf = async (app: string, id: string): Promise<RunView> => {
    const res = await call(`${url()}/v2/projects/${auth.projectId}/apps/${app}/runs/${id}`, { token: auth.token });
    assert.equal(res.status, 200, res.text);
    return res.json;
  };
  const runs = async (app: string): Promise<RunView[]> =>
    (await call(`${url()}/v2/projects/${auth.projectId}/apps/${app}/runs?limit=50`, { token: auth.token })).json.runs;
  const callAsync = async (app: string): Promise<string> => {
    const res = await call(`${url()}/v4/${auth.projectId}/${app}/run?async=true`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 202, res.text);
    return res.json.run_id;
  };
  /** The record as the store has it, read with no server running. */
  const stored = async (id: string) => {
    const store = await openStore({ dataDir, databaseUrl: env.FERRY_DATABASE_URL });
    try {
      return await store
        .selectFrom('runs')
        .select(['state', 'owner', 'attempts', 'reason', 'error_code'])
        .where('id', '=', id)
        .executeTakeFirstOrThrow();
    } finally {
      await store.destroy();
    }
  };
  let retried = '';

  before(async () => {
    dataDir = await tempDir();
    if (testStoreKind() === 'postgres') {
      database = await createTestDatabase();
      env.FERRY_DATABASE_URL = database.url;
    }
    await start(2);
    const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], env);
    assert.equal(boot.code, 0, boot.stderr);
    const out = JSON.parse(boot.stdout) as { project_id: string; token: string };
    auth = { projectId: out.project_id, token: out.token };
    await deployFiles(serve!, auth, 'again', {
      'ferry.toml': '[app]\nname = "again"\nretry_interrupted = true\n',
      'main.ts': SLEEPER,
    });
    await deployFiles(serve!, auth, 'once', {
      'ferry.toml': '[app]\nname = "once"\n[scaling]\nmax_replicas = 2\n',
      'main.ts': SLEEPER,
    });
  });
  after(async () => {
    await serve?.stop('SIGKILL');
    await database?.drop();
  });

  it('SIGTERM: waits the grace, interrupts the runs still in flight, exits, and loses no async run', {
    timeout: 240_000,
  }, async () => {
    retried = await callAsync('again');
    const failed = await callAsync('once');
    // A sync caller waiting for its 300 s run (fetch's own timeout is far above the test's bounds).
    const syncAnswer = fetch(`${url()}/v4/${auth.projectId}/once/run`, {
      method: 'POST',
      headers: { authorization: `Bearer ${auth.token}`, 'content-type': 'application/json' },
      body: '{}',
      signal: AbortSignal.timeout(180_000),
    }).then(
      async (res) => ({ status: res.status, body: (await res.json()) as { error?: { code: string } } }),
      (err: unknown) => ({ status: 0, body: { error: { code: `no answer: ${String(err)}` } } }),
    );
    const sync = await waitFor(
      async () => {
        const [a, b] = await Promise.all([runOf('again', retried), runOf('once', failed)]);
        const s = (await runs('once')).find((r) => r.mode === 'sync' && r.state === 'running');
        return a.state === 'running' && b.state === 'running' && s ? s : undefined;
      },
      120_000,
      'the three runs to be running',
    );

    const server = serve!;
    const exited = await exitWithin(server, 'SIGTERM', 60_000);
    if (exited === 'running') await server.stop('SIGKILL');
    assert.notEqual(
      exited,
      'running',
      `still running 60 s after SIGTERM with a 2 s grace:\n${server.output().slice(-3000)}`,
    );
    assert.equal(exited, 0, server.output().slice(-3000));
    const output = server.output();
    const signalled = lineOf(output, /SIGTERM: shutting down \(runs in flight get up to 2 s/);
    const interrupted = lineOf(output, /the shutdown grace of 2 s is over: interrupting 3 run\(s\) still in progress/);
    const stopped = lineOf(output, /"msg":"stopped"/);
    assert.ok(signalled < interrupted && interrupted < stopped, 'signal, then the grace over, then stopped');

    const answer = await syncAnswer;
    assert.equal(answer.status, 502, JSON.stringify(answer.body));
    assert.equal(answer.body.error?.code, 'FERRY_REPLICA_DIED');

    // Written by the stopping process itself: nothing waits for a lease or the next start.
    const again = await stored(retried);
    assert.deepEqual(again, { state: 'queued', owner: null, attempts: 1, reason: null, error_code: null });
    for (const id of [failed, sync.run_id]) {
      const row = await stored(id);
      assert.equal(row.state, 'failure', id);
      assert.equal(row.reason, 'interrupted', id);
      assert.equal(row.error_code, 'FERRY_REPLICA_DIED', id);
    }

    // The next start takes the queued run up, and has nothing of the last process's to recover.
    await start(300);
    const restarted = await waitFor(
      async () => {
        const run = await runOf('again', retried);
        return run.state === 'running' ? run : undefined;
      },
      120_000,
      'the retried run to start again',
    );
    assert.equal(restarted.attempts, 2);
    assert.equal((await runOf('once', failed)).state, 'failure', 'an interrupted run stays ended');
    assert.doesNotMatch(serve!.output(), /marked failed \(interrupted\)/);
  });

  it('a second signal exits at once; the next start recovers the run it left', { timeout: 240_000 }, async () => {
    assert.ok(retried, 'the first test ran');
    const server = serve!;
    // Running its second start, under a 300 s grace.
    assert.equal((await runOf('again', retried)).state, 'running');
    server.child.kill('SIGTERM');
    await waitFor(
      async () => /SIGTERM: shutting down \(runs in flight get up to 300 s/.test(server.output()) || undefined,
      30_000,
      'the first signal to be taken',
    );
    const exited = await exitWithin(server, 'SIGINT', 60_000);
    if (exited === 'running') await server.stop('SIGKILL');
    assert.equal(exited, 1, `the second signal: ${server.output().slice(-3000)}`);
    assert.match(server.output(), /SIGINT again: exiting now/);
    assert.equal((await stored(retried)).state, 'running', 'left as a dead process leaves it');

    // The next start recovers it as a dead process's run: retry_interrupted starts it a third time.
    await start(2);
    const third = await waitFor(
      async () => {
        const run = await runOf('again', retried);
        return run.state === 'running' && run.attempts === 3 ? run : undefined;
      },
      120_000,
      'the third start',
    );
    assert.equal(third.attempts, 3);
    // Three starts is the most: interrupted once more, it ends.
    const last = serve!;
    const code = await exitWithin(last, 'SIGTERM', 60_000);
    if (code === 'running') await last.stop('SIGKILL');
    assert.equal(code, 0, last.output().slice(-3000));
    const row = await stored(retried);
    assert.equal(row.state, 'failure');
    assert.equal(row.reason, 'interrupted');
    assert.equal(row.attempts, 3);
  });
});
