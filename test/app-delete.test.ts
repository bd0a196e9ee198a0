/**
 * Deleting an app (issue 14, point 1) on one process, beyond test/housekeeping.test.ts: a sync call and a
 * stream in flight finish while new calls get 404 at once; an app deployed again under the same name is a
 * fresh app (an Idempotency-Key used by the old app names none of its runs); `ferry apps delete` refuses
 * without --yes when it cannot ask, asks on a terminal (typing the name deletes, anything else does not),
 * and --yes --json prints what went.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import {
  deployFiles,
  FERRY_BIN,
  http,
  runCli,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';
import { streamRequest } from './helpers/stream.js';

function app(name: string, version = 1): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "${name}"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 2\n`,
    'main.ts': `const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
export async function run({ ms = 0 }: { ms?: number } = {}) {
  await sleep(ms);
  return { version: ${version}, slept: ms };
}
export async function* ticks({ n = 3, ms = 500 }: { n?: number; ms?: number } = {}) {
  for (let i = 0; i < n; i++) {
    await sleep(ms);
    yield { tick: i, version: ${version} };
  }
}
`,
  };
}

/** The replicas' views of a build (hard links under <tmp>/ferry-view-*, sandbox/views.ts). */
function viewsOf(buildId: string): string[] {
  return readdirSync(os.tmpdir())
    .filter((n) => n.startsWith('ferry-view-'))
    .map((n) => path.join(os.tmpdir(), n, buildId))
    .filter((p) => existsSync(p));
}

/** Runs `ferry <args>` on a pseudo-terminal (script(1)), typing `input` once it asks; resolves with its output. */
function runCliOnTerminal(
  args: string[],
  env: NodeJS.ProcessEnv,
  input: string,
): Promise<{ code: number | null; output: string }> {
  const command = [process.execPath, FERRY_BIN, ...args].map((a) => `'${a.replaceAll("'", "'\\''")}'`).join(' ');
  return new Promise((resolve, reject) => {
    const child = spawn('script', ['-qec', command, '/dev/null'], {
      env: { PATH: process.env.PATH, ...env },
      stdio: ['pipe', 'pipe', 'pipe'],
    });
    let output = '';
    let typed = false;
    const onData = (d: Buffer) => {
      output += d;
      if (!typed && output.includes('Type the app name to confirm')) {
        typed = true;
        child.stdin.write(`${input}\r`);
      }
    };
    child.stdout.on('data', onData);
    child.stderr.on('data', onData);
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`ferry ${args.join(' ')} on a terminal timed out:\n${output}`));
    }, 60_000);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, output });
    });
  });
}

describe('deleting an app', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let cliEnv: NodeJS.ProcessEnv;
  const appUrl = (name: string) => `${server.url}/v2/projects/${auth.projectId}/apps/${name}`;
  const call = (name: string, body: unknown = {}, fn = 'run') =>
    http(`${server.url}/v4/${auth.projectId}/${name}/${fn}`, { method: 'POST', token: auth.token, body });
  const submit = async (name: string, ms: number, key: string) => {
    const res = await http(`${server.url}/v4/${auth.projectId}/${name}/run?async=true`, {
      method: 'POST',
      token: auth.token,
      body: { ms },
      headers: { 'idempotency-key': key },
    });
    assert.equal(res.status, 202, res.text);
    return res.json.run_id as string;
  };
  const runState = async (name: string, id: string) =>
    (await http(`${appUrl(name)}/runs/${id}`, { token: auth.token })).json?.state as string | undefined;

  before(async () => {
    // These tests follow build views (<tmp>/ferry-view-*/<build id>); a replica from the warm pool runs
    // from a slot of its own instead (test/security/warm-pool.test.ts), so the pool is off here.
    server = await startServer({ env: { FERRY_WARM_POOL: '0' } });
    auth = await server.bootstrap();
    cliEnv = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: server.url,
      FERRY_TOKEN: auth.token,
      FERRY_PROJECT: auth.projectId,
    };
  });

  after(async () => {
    await server?.close();
  });

  it('lets a sync call and a stream in flight finish, refuses new calls at once, then stops its replicas', async () => {
    const build = await deployFiles(server, auth, 'busy', app('busy'));
    const sync = call('busy', { ms: 6000 });
    const stream = streamRequest(`${server.url}/v4/${auth.projectId}/busy/ticks`, auth.token, { n: 4, ms: 1500 });
    await waitFor(
      async () => {
        const runs = (await http(`${appUrl('busy')}/runs`, { token: auth.token })).json.runs as Array<{
          state: string;
        }>;
        return runs.filter((r) => r.state === 'running').length === 2;
      },
      30_000,
      'both calls to be running',
    );

    if (server.services.sandbox.bwrap) assert.ok(viewsOf(build.id).length > 0, 'sandboxed replicas run from a view');
    const res = await http(appUrl('busy'), { method: 'DELETE', token: auth.token });
    assert.equal(res.status, 200, res.text);
    const refused = await call('busy');
    assert.equal(refused.status, 404, refused.text);
    assert.equal(refused.json.error.code, 'FERRY_APP_NOT_FOUND');

    const answered = await sync;
    assert.equal(answered.status, 200, answered.text);
    assert.deepEqual(answered.json.result, { version: 1, slept: 6000 });
    const streamed = await stream;
    assert.equal(streamed.status, 200);
    const text = streamed.arrivals.map((a) => a.text).join('');
    for (let i = 0; i < 4; i++) assert.ok(text.includes(`"tick":${i}`), `tick ${i} arrived:\n${text}`);
    assert.match(text, /\n: end \{.*"state":"success"\}\n\n$/);

    await waitFor(
      async () => server.services.replicas.pools().every((p) => p.build.appId !== 'busy' || p.replicas.size === 0),
      30_000,
      'its replicas to stop',
    );
    await waitFor(
      async () => !existsSync(path.join(server.dataDir, 'builds', build.id)),
      30_000,
      'its build folder to go once its replicas stopped',
    );
    await waitFor(async () => viewsOf(build.id).length === 0, 30_000, 'its replicas’ view of the build to go');
  });

  it('deploys an app of the same name afresh: none of the old runs, nor their Idempotency-Keys, carry over', async () => {
    await deployFiles(server, auth, 'reborn', app('reborn', 1));
    const finished = await submit('reborn', 0, 'key-finished');
    await waitFor(async () => (await runState('reborn', finished)) === 'success', 30_000, 'the finished run');
    const running = await submit('reborn', 8000, 'key-running');
    await waitFor(async () => (await runState('reborn', running)) === 'running', 30_000, 'the running run');
    // The only replica has room for two: the third waits in the queue.
    const second = await submit('reborn', 8000, 'key-second');
    await waitFor(async () => (await runState('reborn', second)) === 'running', 30_000, 'the second running run');
    const queued = await submit('reborn', 0, 'key-queued');
    assert.equal(await runState('reborn', queued), 'queued');

    const res = await http(appUrl('reborn'), { method: 'DELETE', token: auth.token });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.runs_cancelled, 1);

    await deployFiles(server, auth, 'reborn', app('reborn', 2));
    for (const [key, old] of [
      ['key-finished', finished],
      ['key-running', running],
      ['key-queued', queued],
    ] as const) {
      const again = await submit('reborn', 0, key);
      assert.notEqual(again, old, `${key}: the new app's run is a new run`);
      await waitFor(async () => (await runState('reborn', again)) === 'success', 30_000, `the new run of ${key}`);
      const run = (await http(`${appUrl('reborn')}/runs/${again}`, { token: auth.token })).json;
      assert.equal(run.result.version, 2);
      // The same key again names the new app's run.
      assert.equal(await submit('reborn', 0, key), again);
    }
    const runs = (await http(`${appUrl('reborn')}/runs`, { token: auth.token })).json.runs as Array<{ id: string }>;
    assert.equal(runs.length, 3, 'only the new app’s runs show');
    for (const old of [finished, running, second, queued]) {
      assert.equal((await http(`${appUrl('reborn')}/runs/${old}`, { token: auth.token })).status, 404);
    }
  });

  it('ferry apps delete: refuses without --yes when it cannot ask, asks on a terminal, and --yes --json', async () => {
    await deployFiles(server, auth, 'asked', app('asked'));
    const refused = await runCli(['apps', 'delete', 'asked'], cliEnv);
    assert.equal(refused.code, 2, refused.stderr);
    assert.match(refused.stderr, /pass --yes/);
    assert.equal((await http(appUrl('asked'), { token: auth.token })).status, 200, 'not deleted');

    // On a terminal: a wrong answer deletes nothing; typing the name deletes it.
    const wrong = await runCliOnTerminal(['apps', 'delete', 'asked'], cliEnv, 'nope');
    assert.equal(wrong.code, 1, wrong.output);
    assert.match(wrong.output, /Not deleted/);
    assert.equal((await http(appUrl('asked'), { token: auth.token })).status, 200, 'not deleted');
    const typed = await runCliOnTerminal(['apps', 'delete', 'asked'], cliEnv, 'asked');
    assert.equal(typed.code, 0, typed.output);
    assert.match(typed.output, /Deleted asked: 1 build/);
    assert.equal((await http(appUrl('asked'), { token: auth.token })).status, 404);

    await deployFiles(server, auth, 'forced', app('forced'));
    const forced = await runCli(['apps', 'delete', 'forced', '--yes', '--json'], cliEnv);
    assert.equal(forced.code, 0, forced.stderr);
    assert.deepEqual(JSON.parse(forced.stdout), {
      app_id: 'forced',
      deleted: true,
      builds_deleted: 1,
      runs_cancelled: 0,
      runs_deleted: 0,
    });
    const missing = await runCli(['apps', 'delete', 'forced', '--yes'], cliEnv);
    assert.equal(missing.code, 1, missing.stderr);
    assert.match(missing.stderr, /FERRY_APP_NOT_FOUND|No app/);
  });
});
