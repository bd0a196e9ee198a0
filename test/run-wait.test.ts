/**
 * Waiting for a result (issue 14, point 5) on one process: `GET .../runs/{run_id}?wait=N` answers when the
 * run ends, not when N runs out; a run still going after N is answered as it is; bad N is a coded 400; no
 * waiter is left behind; `ferry runs get --wait`.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir } from './helpers/ferry.js';

const SLEEPY = {
  'ferry.toml': '[app]\nname = "sleepy"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 8\n',
  'main.ts': `export async function run({ ms = 0 }: { ms?: number } = {}) {
  await new Promise((resolve) => setTimeout(resolve, ms));
  return { slept: ms };
}
`,
};

describe('waiting for a run to end', { timeout: 180_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const runs = () => `${server.url}/v2/projects/${auth.projectId}/apps/sleepy/runs`;
  const submit = async (ms: number) => {
    const res = await http(`${server.url}/v4/${auth.projectId}/sleepy/run?async=true`, {
      method: 'POST',
      token: auth.token,
      body: { ms },
    });
    assert.equal(res.status, 202, res.text);
    return res.json.run_id as string;
  };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'sleepy', SLEEPY);
  });

  after(async () => {
    await server?.close();
  });

  it('answers as soon as the run ends, long before the wait runs out', async () => {
    const runId = await submit(1500);
    const started = Date.now();
    const res = await http(`${runs()}/${runId}?wait=60`, { token: auth.token });
    const took = Date.now() - started;
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.state, 'success');
    assert.deepEqual(res.json.result, { slept: 1500 });
    // The run takes 1.5 s; the wait could take 60. A loaded machine may be slow, but not 40 s slow.
    assert.ok(took < 40_000, `answered after ${took} ms`);
    assert.equal(server.services.runWaiters.waiting, 0);
  });

  it('answers with the run as it is when the wait runs out first', async () => {
    const runId = await submit(30_000);
    const started = Date.now();
    const res = await http(`${runs()}/${runId}?wait=1`, { token: auth.token });
    assert.equal(res.status, 200, res.text);
    assert.ok(['queued', 'running'].includes(res.json.state), res.json.state);
    assert.ok(Date.now() - started >= 900, 'it waited');
    assert.equal(server.services.runWaiters.waiting, 0);
    // A finished run answers at once, whatever the wait.
    const done = await submit(0);
    const first = await http(`${runs()}/${done}?wait=60`, { token: auth.token });
    assert.equal(first.json.state, 'success');
    const t = Date.now();
    const again = await http(`${runs()}/${done}?wait=60`, { token: auth.token });
    assert.equal(again.json.state, 'success');
    assert.ok(Date.now() - t < 30_000);
    // The 30 s run is not needed any more: cancelled, so closing the server does not wait for it.
    const cancelled = await http(`${runs()}/${runId}/cancel`, { method: 'POST', token: auth.token });
    assert.ok([200, 202].includes(cancelled.status), cancelled.text);
  });

  it('refuses a wait that is not 0 to 60 seconds', async () => {
    const runId = await submit(0);
    for (const bad of ['61', '-1', 'abc', '1.5']) {
      const res = await http(`${runs()}/${runId}?wait=${bad}`, { token: auth.token });
      assert.equal(res.status, 400, `wait=${bad}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    }
  });

  it('ferry runs get --wait prints the run once it has ended', async () => {
    const runId = await submit(1000);
    const env = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: server.url,
      FERRY_TOKEN: auth.token,
      FERRY_PROJECT: auth.projectId,
    };
    const res = await runCli(['runs', 'get', 'sleepy', runId, '--wait', '30'], env);
    assert.equal(res.code, 0, res.stderr);
    assert.equal(JSON.parse(res.stdout).state, 'success');
    const bad = await runCli(['runs', 'get', 'sleepy', runId, '--wait', 'soon'], env);
    assert.equal(bad.code, 2);
  });
});
