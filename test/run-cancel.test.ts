/**
 * Cancelling runs (issue 14, point 4) on one process, both runtimes: a queued async run ends `cancelled`
 * and never starts; a running TypeScript function sees its AbortSignal and a running async Python function
 * gets asyncio.CancelledError and a plain def sees ferry_run.context().cancelled, while another run on the same replica is not disturbed and the replica stays;
 * a function that ignores the cancel has its replica stopped after FERRY_CANCEL_GRACE_SECONDS; the slot is
 * free again; the webhook carries the cancelled state; a finished run answers 409; `ferry runs cancel`.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const TS_APP = {
  'ferry.toml': '[app]\nname = "cancelme"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 4\n',
  'main.ts': `export async function run({ ms = 0 }: { ms?: number }, { signal }: { signal: AbortSignal }) {
  return await new Promise((resolve, reject) => {
    const timer = setTimeout(() => resolve({ slept: ms }), ms);
    signal.addEventListener('abort', () => {
      clearTimeout(timer);
      console.log('saw abort: ' + (signal.reason as Error).name);
      reject(signal.reason);
    });
  });
}

export async function stubborn({ ms = 0 }: { ms?: number }) {
  await new Promise((resolve) => setTimeout(resolve, ms));
  return { slept: ms };
}
`,
};

const SINGLE = {
  'ferry.toml': '[app]\nname = "single"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n',
  'main.ts': `export async function run({ ms = 0 }: { ms?: number }, { signal }: { signal: AbortSignal }) {
  console.log('started');
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(timer); resolve(undefined); });
  });
  return { slept: ms };
}
`,
};

const PY_APP = {
  'ferry.toml': '[app]\nname = "pycancel"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 4\n',
  'main.py': `import asyncio

import ferry_run


async def run(ms=0):
    try:
        await asyncio.sleep(ms / 1000)
        return {"slept": ms}
    except asyncio.CancelledError:
        print("saw cancel")
        raise


def plain(ms=0):
    # A plain def runs in a thread: it looks at the run's cancel flag instead.
    ctx = ferry_run.context()
    if ctx.wait_cancelled(ms / 1000):
        print("plain saw cancel " + ctx.run_id)
        return {"stopped": True}
    return {"slept": ms}
`,
};

describe('cancelling runs', { timeout: 300_000 }, () => {
  let server: TestServer;
  let receiver: Receiver;
  let auth: { projectId: string; token: string };
  const runsOf = (app: string) => `${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs`;
  const submit = async (app: string, fn: string, body: unknown, webhook = false) => {
    const hook = webhook ? `&webhookEndpoint=${encodeURIComponent(`${receiver.url}/hook`)}` : '';
    const res = await http(`${server.url}/v4/${auth.projectId}/${app}/${fn}?async=true${hook}`, {
      method: 'POST',
      token: auth.token,
      body,
    });
    assert.equal(res.status, 202, res.text);
    return res.json.run_id as string;
  };
  const getRun = async (app: string, id: string) => (await http(`${runsOf(app)}/${id}`, { token: auth.token })).json;
  const untilRunning = (app: string, id: string) =>
    waitFor(async () => (await getRun(app, id)).state === 'running', 60_000, `run ${id} running`);
  const cancel = (app: string, id: string) =>
    http(`${runsOf(app)}/${id}/cancel`, { method: 'POST', token: auth.token });
  const replicaIds = (app: string) =>
    server.services.replicas
      .pools()
      .filter((p) => p.build.appId === app)
      .flatMap((p) => [...p.replicas].filter((r) => r.state === 'ready').map((r) => r.id));

  before(async () => {
    receiver = await startReceiver();
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8', FERRY_CANCEL_GRACE_SECONDS: '2' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'cancelme', TS_APP);
    await deployFiles(server, auth, 'single', SINGLE);
    await deployFiles(server, auth, 'pycancel', PY_APP);
  });

  after(async () => {
    await server?.close();
    await receiver?.close();
  });

  it('tells a running TypeScript function, leaves the other run on its replica alone, and sends the webhook', async () => {
    const id = await submit('cancelme', 'run', { ms: 60_000 }, true);
    await untilRunning('cancelme', id);
    const [replica] = replicaIds('cancelme');
    // Another run on the same replica, under way while the first is cancelled.
    const other = http(`${server.url}/v4/${auth.projectId}/cancelme/run`, {
      method: 'POST',
      token: auth.token,
      body: { ms: 1500 },
    });
    const res = await cancel('cancelme', id);
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'cancelled');
    assert.equal(res.json.error.code, 'FERRY_RUN_CANCELLED');
    assert.equal(res.json.reason, 'cancelled');
    const otherRes = await other;
    assert.equal(otherRes.status, 200, otherRes.text);
    assert.deepEqual(otherRes.json.result, { slept: 1500 });
    // The function saw the abort (its own log line), and its replica is the same one, still serving.
    const logs = await http(`${runsOf('cancelme')}/${id}/logs`, { token: auth.token });
    assert.ok(
      logs.json.lines.some((l: { line: string }) => l.line === 'saw abort: AbortError'),
      JSON.stringify(logs.json.lines),
    );
    assert.deepEqual(replicaIds('cancelme'), [replica]);
    // The webhook carries the cancelled state.
    const [delivery] = await receiver.waitForRequests(1, 30_000);
    const payload = JSON.parse(delivery!.body.toString('utf8'));
    assert.equal(payload.run_id, id);
    assert.equal(payload.state, 'cancelled');
    assert.equal(payload.error.code, 'FERRY_RUN_CANCELLED');
    // A finished run cannot be cancelled; an unknown one is not found.
    const again = await cancel('cancelme', id);
    assert.equal(again.status, 409);
    assert.equal(again.json.error.code, 'FERRY_RUN_FINISHED');
    assert.equal((await cancel('cancelme', '01a20bd5-2d74-72e0-9ad8-52788bca559a')).status, 404);
  });

  it('ends a queued run that never starts, and frees the slot of a cancelled running one', async () => {
    const running = await submit('single', 'run', { ms: 60_000 });
    await untilRunning('single', running);
    const queued = await submit('single', 'run', { ms: 0 });
    assert.equal((await getRun('single', queued)).state, 'queued');
    const res = await cancel('single', queued);
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'cancelled');
    // The slot's only run is still going: the queued one never started then.
    assert.equal((await getRun('single', running)).state, 'running');
    // Cancel the running one: the one slot is free again at once for a sync call.
    assert.equal((await cancel('single', running)).json.state, 'cancelled');
    const next = await http(`${server.url}/v4/${auth.projectId}/single/run`, {
      method: 'POST',
      token: auth.token,
      body: { ms: 0 },
    });
    assert.equal(next.status, 200, next.text);
    const after = await getRun('single', queued);
    assert.equal(after.state, 'cancelled');
    assert.equal(after.started_at, null, 'the queued run never started');
    assert.equal(after.attempts, 0);
    const lines = (await http(`${runsOf('single')}/${queued}/logs`, { token: auth.token })).json.lines;
    assert.deepEqual(
      lines.filter((l: { stream: string }) => l.stream !== 'system'),
      [],
    );
  });

  it('stops the replica of a function that does not return within the cancel grace', async () => {
    const id = await submit('cancelme', 'stubborn', { ms: 120_000 });
    await untilRunning('cancelme', id);
    const [replica] = replicaIds('cancelme');
    const res = await cancel('cancelme', id);
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'cancelled');
    assert.match(res.json.error.message, /did not return within 2 s, so its replica was stopped/);
    // The next call is served (by a new replica).
    const next = await http(`${server.url}/v4/${auth.projectId}/cancelme/run`, {
      method: 'POST',
      token: auth.token,
      body: { ms: 0 },
    });
    assert.equal(next.status, 200, next.text);
    await waitFor(async () => !replicaIds('cancelme').includes(replica!), 30_000, 'the old replica to be gone');
  });

  it('cancels an async Python function with asyncio.CancelledError', async () => {
    const id = await submit('pycancel', 'run', { ms: 60_000 });
    await untilRunning('pycancel', id);
    const [replica] = replicaIds('pycancel');
    const res = await cancel('pycancel', id);
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'cancelled');
    const logs = await http(`${runsOf('pycancel')}/${id}/logs`, { token: auth.token });
    assert.ok(
      logs.json.lines.some((l: { line: string }) => l.line === 'saw cancel'),
      JSON.stringify(logs.json.lines),
    );
    assert.deepEqual(replicaIds('pycancel'), [replica], 'the replica was not stopped');
    const next = await http(`${server.url}/v4/${auth.projectId}/pycancel/run`, {
      method: 'POST',
      token: auth.token,
      body: { ms: 0 },
    });
    assert.equal(next.status, 200, next.text);
  });

  it('tells a plain Python def through ferry_run.context(), which returns in time and keeps its replica', async () => {
    const id = await submit('pycancel', 'plain', { ms: 60_000 });
    await untilRunning('pycancel', id);
    const [replica] = replicaIds('pycancel');
    const res = await cancel('pycancel', id);
    assert.ok([200, 202].includes(res.status), res.text);
    await waitFor(async () => (await getRun('pycancel', id)).state === 'cancelled', 30_000, 'the run to end cancelled');
    await waitFor(
      async () =>
        (await http(`${runsOf('pycancel')}/${id}/logs`, { token: auth.token })).json.lines.some(
          (l: { line: string }) => l.line === `plain saw cancel ${id}`,
        ),
      30_000,
      'the function to see the cancel',
    );
    // Past the cancel grace (2 s here): the function returned in time, so its replica was left alone.
    await new Promise((resolve) => setTimeout(resolve, 4_000));
    assert.deepEqual(replicaIds('pycancel'), [replica], 'the replica was not stopped');
  });

  it('ferry runs cancel cancels a run', async () => {
    const id = await submit('cancelme', 'run', { ms: 60_000 });
    await untilRunning('cancelme', id);
    const env = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: server.url,
      FERRY_TOKEN: auth.token,
      FERRY_PROJECT: auth.projectId,
    };
    const res = await runCli(['runs', 'cancel', 'cancelme', id, '--json'], env);
    assert.equal(res.code, 0, res.stderr);
    assert.equal(JSON.parse(res.stdout).state, 'cancelled');
    const twice = await runCli(['runs', 'cancel', 'cancelme', id], env);
    assert.equal(twice.code, 1);
    assert.match(twice.stderr, /already finished/);
  });
});
