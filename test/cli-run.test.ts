/**
 * `ferry run` in every mode (src/cli/run-call.ts, issue 45 point 1), against a real server, as a person
 * types it: arguments from `-d`, a file and standard input; `--stream` printing each item as it arrives
 * (the first is printed while the function has not yielded its last), resumed when cut, and `--sse`; `--async` (the run id,
 * `--json` exactly the 202 body, `--wait` the result); `--webhook` signed with FERRY_WEBHOOK_SECRET or
 * `--webhook-secret-stdin`; `--idempotency-key`; and exit codes: 0 for success, 1 for a failed run, 2 for
 * bad flags.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { verifyWebhook } from '../src/webhooks/signature.js';
import { CLIENT_TEST_APP } from './helpers/client-app.js';
import { cuttingProxy } from './helpers/cutting-proxy.js';
import { deployFiles, FERRY_BIN, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

interface Ran {
  code: number | null;
  stdout: string;
  stderr: string;
  /** Whether the process was still running when its first stdout line came. */
  aliveAtFirstLine: boolean;
}

describe('ferry run: every mode from the command line', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  let work: string;

  before(async () => {
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'cli-run', {
      ...CLIENT_TEST_APP('cli-run'),
      'main.ts': `${CLIENT_TEST_APP('cli-run')['main.ts']}
export async function* slowCount() {
  yield 'first';
  await new Promise((r) => setTimeout(r, 3000));
  yield { then: 'second' };
}
`,
    });
    receiver = await startReceiver();
    work = await tempDir('ferry-cli-run-');
  });
  after(async () => {
    await receiver?.close();
    await server?.close();
    await fs.rm(work, { recursive: true, force: true });
  });

  function ferry(args: string[], options: { stdin?: string; env?: Record<string, string> } = {}): Promise<Ran> {
    return new Promise((resolve, reject) => {
      const child = spawn(process.execPath, [FERRY_BIN, ...args], {
        env: {
          PATH: process.env.PATH,
          HOME: work,
          FERRY_URL: server.url,
          FERRY_TOKEN: auth.token,
          FERRY_PROJECT: auth.projectId,
          ...options.env,
        },
        stdio: ['pipe', 'pipe', 'pipe'],
      });
      let stdout = '';
      let stderr = '';
      let aliveAtFirstLine = false;
      child.stdout.on('data', (d: Buffer) => {
        if (!stdout.includes('\n') && `${stdout}${d}`.includes('\n')) aliveAtFirstLine = child.exitCode === null;
        stdout += d;
      });
      child.stderr.on('data', (d: Buffer) => (stderr += d));
      child.stdin.end(options.stdin ?? '');
      const timer = setTimeout(() => child.kill('SIGKILL'), 120_000);
      child.on('error', reject);
      child.on('close', (code) => {
        clearTimeout(timer);
        resolve({ code, stdout, stderr, aliveAtFirstLine });
      });
    });
  }

  it('takes the arguments from -d, from a file, and from standard input', async () => {
    const inline = await ferry(['run', 'cli-run', '-d', '{"name":"Ada"}']);
    assert.equal(inline.code, 0, inline.stderr);
    assert.deepEqual(JSON.parse(inline.stdout), { message: 'Hello, Ada!' });
    const file = path.join(work, 'input.json');
    await fs.writeFile(file, '{"name":"File"}');
    const fromFile = await ferry(['run', 'cli-run', 'run', '-d', `@${file}`]);
    assert.deepEqual(JSON.parse(fromFile.stdout), { message: 'Hello, File!' });
    const fromStdin = await ferry(['run', 'cli-run', '-d', '-'], { stdin: '{"name":"Stdin"}\n' });
    assert.equal(fromStdin.code, 0, fromStdin.stderr);
    assert.deepEqual(JSON.parse(fromStdin.stdout), { message: 'Hello, Stdin!' });
    const bad = await ferry(['run', 'cli-run', '-d', '[1,2]']);
    assert.equal(bad.code, 2);
    assert.match(bad.stderr, /-d must be a JSON object/);
  });

  it('--stream prints each item as it arrives (the first before the function yields its last); --sse the raw lines', async () => {
    const streamed = await ferry(['run', 'cli-run', 'slowCount', '--stream']);
    assert.equal(streamed.code, 0, streamed.stderr);
    assert.equal(streamed.stdout, 'first\n{"then":"second"}\n');
    assert.equal(streamed.aliveAtFirstLine, true, 'the first item was printed while the run was still going');
    const raw = await ferry(['run', 'cli-run', 'count', '--stream', '--sse', '-d', '{"n":2}']);
    assert.equal(raw.code, 0, raw.stderr);
    assert.match(raw.stdout, /^id: [0-9a-f-]{36}:1\ndata: \{"i":0\}\n\nid: [0-9a-f-]{36}:2\ndata: \{"i":1\}\n/m);
  });

  it('--stream resumes a connection cut mid-way with Last-Event-ID: every item once, in order', async () => {
    const proxy = await cuttingProxy(new URL(server.url));
    try {
      const streamed = await ferry(['run', 'cli-run', 'count', '--stream', '-d', '{"n":6}'], {
        env: { FERRY_URL: proxy.url },
      });
      assert.equal(streamed.code, 0, streamed.stderr);
      assert.deepEqual(
        streamed.stdout
          .trim()
          .split('\n')
          .map((l) => JSON.parse(l).i),
        [0, 1, 2, 3, 4, 5],
      );
      assert.equal(proxy.resumes(), 1);
    } finally {
      await proxy.close();
    }
  });

  it('--async prints the run id, --json exactly the 202 body, --wait the result; an idempotency key repeats the run', async () => {
    const plain = await ferry(['run', 'cli-run', '--async', '-d', '{"name":"A"}']);
    assert.equal(plain.code, 0, plain.stderr);
    assert.match(plain.stdout, /^[0-9a-f-]{36}\n$/);
    const json = await ferry(['run', 'cli-run', '--async', '--json', '--idempotency-key', 'k-1']);
    assert.deepEqual(Object.keys(JSON.parse(json.stdout)), ['run_id']);
    const again = await ferry(['run', 'cli-run', '--async', '--json', '--idempotency-key', 'k-1']);
    assert.equal(JSON.parse(again.stdout).run_id, JSON.parse(json.stdout).run_id);
    const waited = await ferry(['run', 'cli-run', '--async', '--wait', '-d', '{"name":"W"}']);
    assert.equal(waited.code, 0, waited.stderr);
    assert.deepEqual(JSON.parse(waited.stdout), { message: 'Hello, W!' });
  });

  it('exits 1 when the run fails, in every mode, and 2 for flags that do not go together', async () => {
    for (const args of [[], ['--async', '--wait'], ['--stream']]) {
      const failed = await ferry(['run', 'cli-run', 'fail', ...args]);
      assert.equal(failed.code, 1, `${args.join(' ')}: ${failed.stderr}`);
      assert.match(failed.stderr, /broke on purpose/);
    }
    assert.equal((await ferry(['run', 'cli-run', '--stream', '--async'])).code, 2);
    assert.equal((await ferry(['run', 'cli-run', '--wait'])).code, 2);
  });

  it('--webhook posts the result, signed with FERRY_WEBHOOK_SECRET or a secret read from stdin', async () => {
    for (const [how, env, extra, stdin] of [
      ['env', { FERRY_WEBHOOK_SECRET: 'from-env' }, [], ''],
      ['stdin', {}, ['--webhook-secret-stdin'], 'from-stdin\n'],
    ] as const) {
      const started = await ferry(['run', 'cli-run', '--async', '--webhook', `${receiver.url}/${how}`, ...extra], {
        env,
        stdin,
      });
      assert.equal(started.code, 0, started.stderr);
      const runId = started.stdout.trim();
      let delivery: Receiver['requests'][number] | undefined;
      for (let i = 0; i < 300 && !delivery; i++) {
        delivery = receiver.requests.find((r) => r.headers['x-request-id'] === runId);
        if (!delivery) await new Promise((r) => setTimeout(r, 100));
      }
      assert.ok(delivery, `a delivery for ${how}`);
      const secret = how === 'env' ? 'from-env' : 'from-stdin';
      assert.equal(verifyWebhook(secret, delivery.headers, delivery.body), true, `signed with the ${how} secret`);
    }
  });
});
