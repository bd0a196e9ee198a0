/**
 * Invariants 1 and 2 under a real crash: a `ferry serve` process accepts 200 async runs carrying webhooks,
 * is killed with SIGKILL while they are queued and running, and starts again. Every accepted run must
 * reach a terminal state and every run's webhook must be delivered at least once. On PostgreSQL
 * (test/postgres/) both processes and the CLI use one fresh database.
 */
import assert from 'node:assert/strict';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { http as call, REPO_ROOT, runCli, type ServeProcess, spawnServe, tempDir, waitFor } from './helpers/ferry.js';
import { createTestDatabase, type TestDatabase, testStoreKind } from './helpers/store.js';

const RUNS = 200;

describe('durability across SIGKILL', () => {
  let dataDir: string;
  let serve: ServeProcess;
  let receiver: http.Server;
  let hookUrl: string;
  const delivered = new Map<string, { status_code: number; error?: { code: string } }>();
  let database: TestDatabase | undefined;
  const env: NodeJS.ProcessEnv = { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' };

  before(async () => {
    dataDir = await tempDir();
    if (testStoreKind() === 'postgres') {
      database = await createTestDatabase();
      env.FERRY_DATABASE_URL = database.url;
    }
    receiver = http.createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => chunks.push(c));
      req.on('end', () => {
        const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
        delivered.set(body.run_id, body);
        res.writeHead(200).end('ok');
      });
    });
    await new Promise<void>((r) => receiver.listen(0, '127.0.0.1', r));
    hookUrl = `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/hook`;
    serve = await spawnServe(dataDir, env);
  });
  after(async () => {
    await serve?.stop('SIGKILL');
    receiver.close();
    await database?.drop();
  });

  it('finishes every accepted run and delivers every webhook after a crash', { timeout: 240_000 }, async () => {
    const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], env);
    assert.equal(boot.code, 0, boot.stderr);
    const { project_id: projectId, token } = JSON.parse(boot.stdout);
    const cliEnv = { FERRY_URL: serve.url, FERRY_TOKEN: token, FERRY_PROJECT: projectId };
    const app = await tempDir('ferry-app-');
    const fs = await import('node:fs/promises');
    await fs.writeFile(
      path.join(app, 'ferry.toml'),
      '[app]\nname = "durable"\n[scaling]\nmax_replicas = 2\nreplica_concurrency = 4\n',
    );
    await fs.writeFile(
      path.join(app, 'main.ts'),
      'export async function run({ i }: { i: number }) { await new Promise((r) => setTimeout(r, 150)); return { i }; }\n',
    );
    const deployed = await runCli(['deploy', app, '--json'], cliEnv);
    assert.equal(deployed.code, 0, deployed.stderr);
    assert.ok(REPO_ROOT);

    const runIds: string[] = [];
    const hook = encodeURIComponent(hookUrl);
    for (let start = 0; start < RUNS; start += 50) {
      const batch = await Promise.all(
        Array.from({ length: 50 }, (_, k) =>
          call(`${serve.url}/v4/${projectId}/durable/run?async=true&webhookEndpoint=${hook}`, {
            method: 'POST',
            token,
            body: { i: start + k },
          }),
        ),
      );
      for (const res of batch) {
        assert.equal(res.status, 202, res.text);
        runIds.push(res.json.run_id);
      }
    }
    // Let some runs finish and some start, then crash.
    await waitFor(async () => delivered.size >= 5 || undefined, 30_000, 'the first deliveries');
    const beforeCrash = delivered.size;
    const deliveredBeforeCrash = new Set(delivered.keys());
    await serve.stop('SIGKILL');
    assert.ok(beforeCrash < RUNS, 'the crash came while runs were still queued or running');

    serve = await spawnServe(dataDir, env);
    const terminal = new Set(['success', 'failure', 'timeout', 'cancelled']);
    const states = await waitFor(
      async () => {
        const rows: Array<{ run_id: string; state: string; reason: string | null; started_at: string | null }> = [];
        let before = '';
        for (;;) {
          const page = await call(
            `${serve.url}/v2/projects/${projectId}/apps/durable/runs?limit=500${before ? `&before=${before}` : ''}`,
            { token },
          );
          rows.push(...page.json.runs);
          if (!page.json.next_before) break;
          before = page.json.next_before;
        }
        return rows.length === RUNS && rows.every((r) => terminal.has(r.state)) ? rows : undefined;
      },
      180_000,
      'every run to reach a terminal state',
    );
    assert.deepEqual(new Set(states.map((r) => r.run_id)), new Set(runIds));
    // Only runs in flight at the crash failed: each had started, and none had ended (its end, committed
    // with its webhook, would have been delivered). Queued runs all ran. How many were in flight depends
    // on the machine's load (a run that returned but whose end was not yet committed is in flight too), so
    // the bound is on which runs, not on how many.
    const interrupted = states.filter((r) => r.state === 'failure');
    // The restarted server's errors and warnings, for a failure's message.
    const problems = () =>
      serve
        .output()
        .split('\n')
        .filter((line) => /"level":(40|50|60)/.test(line))
        .slice(-20)
        .join('\n');
    for (const r of interrupted) {
      assert.equal(r.reason, 'interrupted', `${JSON.stringify(r)}\n${problems()}`);
      assert.ok(r.started_at !== null, `a run that never started was interrupted: ${JSON.stringify(r)}`);
      assert.ok(!deliveredBeforeCrash.has(r.run_id), `a run that had ended was interrupted: ${JSON.stringify(r)}`);
    }
    const succeeded = states.filter((r) => r.state === 'success').length;
    assert.equal(
      succeeded + interrupted.length,
      RUNS,
      `every run succeeded or was interrupted: ${succeeded} success, ${interrupted.length} interrupted`,
    );
    assert.ok(interrupted.length < RUNS - beforeCrash, `${interrupted.length} interrupted, ${beforeCrash} ended`);

    await waitFor(async () => runIds.every((id) => delivered.has(id)) || undefined, 120_000, 'every webhook delivered');
    for (const r of states) {
      const body = delivered.get(r.run_id)!;
      assert.equal(body.status_code === 200, r.state === 'success', `${r.run_id}: ${JSON.stringify(body)}`);
    }
  });
});
