/**
 * The TypeScript client (clients/typescript, `@ferry/client`, issue 45) against a real Ferry: a sync call,
 * a spawned run and its result, logs and cancel, a stream cut mid-way by a proxy on loopback and resumed
 * (every item once, in order, the first before the function yields its last), typed errors with Ferry's
 * codes, webhook verification of a real signed delivery, and the package as users get it: `npm pack` of
 * the folder, installed with `--offline` into an empty project, imported by name.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import {
  AuthError,
  Ferry,
  FerryError,
  NotFoundError,
  RunFailedError,
  verifyWebhook,
} from '../clients/typescript/src/index.js';
import { CLIENT_TEST_APP } from './helpers/client-app.js';
import { cuttingProxy } from './helpers/cutting-proxy.js';
import { deployFiles, REPO_ROOT, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const run = promisify(execFile);

describe('the TypeScript client (clients/typescript)', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  let ferry: Ferry;

  before(async () => {
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'tsclient', CLIENT_TEST_APP('tsclient'));
    receiver = await startReceiver();
    ferry = new Ferry({ url: server.url, token: auth.token, project: auth.projectId });
  });
  after(async () => {
    await receiver?.close();
    await server?.close();
  });

  it('calls a function, spawns a run and waits for its result, reads its logs, cancels another', async () => {
    const app = ferry.app('tsclient');
    assert.deepEqual(await app.call('run', { name: 'Ada' }), { message: 'Hello, Ada!' });
    const spawned = await app.spawn('run', { name: 'Bob' });
    assert.match(spawned.id, /^[0-9a-f-]{36}$/);
    assert.deepEqual(await spawned.result({ timeout: 60_000 }), { message: 'Hello, Bob!' });
    const logs = (await spawned.logs()).filter((l) => l.stream === 'stdout').map((l) => l.line);
    assert.deepEqual(logs, ['greeting Bob']);
    const slow = await app.spawn('slow');
    assert.equal((await slow.cancel()).state, 'cancelled');
    await assert.rejects(slow.result({ timeout: 30_000 }), (err: unknown) => err instanceof RunFailedError);
  });

  it('throws typed errors carrying Ferry’s codes', async () => {
    const bad = new Ferry({ url: server.url, token: 'not-a-token', project: auth.projectId });
    await assert.rejects(bad.app('tsclient').call('run'), (err: unknown) => {
      assert.ok(err instanceof AuthError, String(err));
      assert.match(err.code, /^FERRY_/);
      assert.equal(err.status, 401);
      return true;
    });
    await assert.rejects(ferry.app('tsclient').call('nope'), (err: unknown) => {
      assert.ok(err instanceof NotFoundError);
      assert.equal(err.code, 'FERRY_FUNCTION_NOT_FOUND');
      return true;
    });
    await assert.rejects(ferry.app('tsclient').call('fail'), (err: unknown) => {
      assert.ok(err instanceof RunFailedError && err instanceof FerryError);
      assert.equal(err.code, 'FERRY_FUNCTION_ERROR');
      assert.equal(err.details.type, 'TypeError');
      assert.ok(err.runId);
      return true;
    });
  });

  it('streams items as they come and resumes a cut connection without running anything twice', async () => {
    const proxy = await cuttingProxy(new URL(server.url));
    try {
      const viaProxy = new Ferry({ url: proxy.url, token: auth.token, project: auth.projectId });
      const items: number[] = [];
      for await (const item of viaProxy.app('tsclient').stream<{ i: number }>('count', { n: 6 })) items.push(item.i);
      assert.deepEqual(items, [0, 1, 2, 3, 4, 5], 'every item once, in order');
      assert.equal(proxy.resumes(), 1, 'the client resumed once, with Last-Event-ID');
    } finally {
      await proxy.close();
    }
  });

  it('verifies a real signed webhook delivery, and refuses a changed body or another secret', async () => {
    const secret = 'ts-client-secret';
    const spawned = await ferry
      .app('tsclient')
      .spawn('run', { name: 'hook' }, { webhook: `${receiver.url}/hook`, webhookSecret: secret });
    await spawned.result({ timeout: 60_000 });
    let delivery: Receiver['requests'][number] | undefined;
    for (let i = 0; i < 200 && !delivery; i++) {
      delivery = receiver.requests.find((r) => r.headers['x-request-id'] === spawned.id);
      if (!delivery) await new Promise((r) => setTimeout(r, 100));
    }
    assert.ok(delivery, 'a delivery within 20 s');
    assert.equal(verifyWebhook(secret, delivery.headers, delivery.body), true);
    assert.equal(verifyWebhook(secret, delivery.headers, Buffer.concat([delivery.body, Buffer.from(' ')])), false);
    assert.equal(verifyWebhook('another', delivery.headers, delivery.body), false);
    const stamp = Number(delivery.headers['x-service-webhook-timestamp']);
    assert.equal(verifyWebhook(secret, delivery.headers, delivery.body, { now: (stamp + 301) * 1000 }), false);
  });

  it('is a package: npm pack, installed offline into an empty project, imported by name', async () => {
    const work = await tempDir('ferry-tsclient-pack-');
    try {
      const { stdout } = await run(
        'npm',
        ['pack', '--json', '--pack-destination', work, path.join(REPO_ROOT, 'clients', 'typescript')],
        {
          timeout: 180_000,
          env: { ...process.env, npm_config_audit: 'false', npm_config_fund: 'false' },
        },
      );
      const [packed] = JSON.parse(stdout) as Array<{ filename: string; files: Array<{ path: string }> }>;
      assert.ok(
        packed!.files.some((f) => f.path === 'dist/index.js'),
        'the compiled client is in the tarball',
      );
      assert.ok(!packed!.files.some((f) => f.path.startsWith('src/')), 'only what users run');
      const project = path.join(work, 'project');
      await fs.mkdir(project);
      await fs.writeFile(path.join(project, 'package.json'), '{"name":"receiver","version":"1.0.0","type":"module"}');
      await run('npm', ['install', '--offline', '--no-audit', '--no-fund', path.join(work, packed!.filename)], {
        cwd: project,
        timeout: 180_000,
      });
      await fs.writeFile(
        path.join(project, 'check.mjs'),
        "import { Ferry, verifyWebhook } from '@ferry/client';\nimport { verifyWebhook as alone } from '@ferry/client/webhooks';\nconsole.log(JSON.stringify([typeof Ferry, typeof verifyWebhook, alone === verifyWebhook]));\n",
      );
      const check = await run(process.execPath, ['check.mjs'], { cwd: project, timeout: 60_000 });
      assert.deepEqual(JSON.parse(check.stdout), ['function', 'function', true]);
    } finally {
      await fs.rm(work, { recursive: true, force: true });
    }
  });
});
