/**
 * A run waiting for a replica when its app's build changes is served, never left behind (issue 43 point 4).
 *
 * The report: 40 async runs queued behind an app at its default scaling (2 replicas × 1) on a cluster, then
 * a redeploy; one run stayed `queued` for over 8.5 minutes, held by a live worker whose pool for the
 * replaced build still had it waiting and whose old replica had stopped 17 ms after the switch. A worker
 * there takes as many of the app's runs as its capacity (2) while it runs one replica (the other worker runs
 * the other): one run always waits in the pool. The draining pool stopped its replica when its run ended
 * instead of serving the run waiting behind it, and nothing moved that run to the new build's pool.
 *
 * Here one process is such a worker: FERRY_WORKER_MAX_REPLICAS=1 keeps one replica of the app while the
 * async worker has two of its runs in flight, so a run waits in the pool at every switch. The build is
 * switched five times while the backlog drains (four activations of the other build, then a deploy), and
 * every run must end `success`, each recording the build that answered it.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

const RUNS = 40;

function version(v: number): Record<string, string> {
  return {
    'ferry.toml': '[app]\nname = "backlog"\n',
    'main.ts': `export async function work({ n }: { n: number }) {\n  await new Promise((r) => setTimeout(r, 250));\n  return { n, version: ${v} };\n}\n`,
  };
}

describe('a redeploy under an async backlog', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const versionOf = new Map<string, number>();
  const logs: Array<Record<string, unknown>> = [];

  before(async () => {
    server = await startServer({
      env: { FERRY_WORKER_MAX_REPLICAS: '1' },
      log: { level: 'info', destination: { write: (line: string) => void logs.push(JSON.parse(line)) } },
    });
    auth = await server.bootstrap();
    for (const v of [1, 2]) versionOf.set((await deployFiles(server, auth, 'backlog', version(v))).id, v);
  });
  after(async () => {
    await server?.close();
  });

  it('leaves no run behind in the replaced build’s pool', async () => {
    const { store } = server.services;
    const ids: string[] = [];
    for (let n = 0; n < RUNS; n++) {
      const res = await http(`${server.url}/v4/${auth.projectId}/backlog/work?async=true`, {
        method: 'POST',
        token: auth.token,
        body: { n },
      });
      assert.equal(res.status, 202, res.text);
      ids.push(res.json.run_id);
    }
    const unfinished = async () =>
      (
        await store
          .selectFrom('runs')
          .select('id')
          .where('id', 'in', ids)
          .where('state', 'in', ['queued', 'running'])
          .execute()
      ).length;
    const builds = [...versionOf.keys()];
    const waitingAtSwitch: number[] = [];
    const switchTo = async (buildId: string) => {
      // A switch counts only while runs still wait: each one must find the backlog there.
      const left = await unfinished();
      assert.ok(left > 2, `runs still wait at switch ${waitingAtSwitch.length + 1} (${left} unfinished)`);
      const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/backlog/builds/${buildId}/activate`, {
        method: 'POST',
        token: auth.token,
      });
      assert.equal(res.status, 200, res.text);
      waitingAtSwitch.push(left);
    };
    // Each switch after some runs of the build before it have run (the async worker sends runs that wait
    // in the pool: with one replica allowed, one of the app's two runs in flight always waits).
    let done = RUNS - (await unfinished());
    for (const buildId of [builds[0]!, builds[1]!, builds[0]!, builds[1]!]) {
      await waitFor(async () => RUNS - (await unfinished()) >= done + 2, 60_000, 'two runs between switches');
      done = RUNS - (await unfinished());
      await switchTo(buildId);
    }
    // The fifth switch is a deploy of a new build, while the backlog still drains.
    const left = await unfinished();
    assert.ok(left > 2, `runs still wait at the deploy (${left} unfinished)`);
    const third = await deployFiles(server, auth, 'backlog', version(3));
    versionOf.set(third.id, 3);
    waitingAtSwitch.push(left);

    // Every run ends: the one waiting in a pool at each switch was served (by the new build).
    const rows = await waitFor(
      async () => {
        const r = await store
          .selectFrom('runs')
          .select(['id', 'state', 'result', 'build_id'])
          .where('id', 'in', ids)
          .execute();
        return r.every((x) => x.state !== 'queued' && x.state !== 'running') ? r : undefined;
      },
      120_000,
      `all ${RUNS} runs to end (switches with ${waitingAtSwitch.join(', ')} runs unfinished)`,
    );
    assert.deepEqual(
      rows.filter((r) => r.state !== 'success').map((r) => `${r.id} ${r.state}`),
      [],
      'every run succeeds',
    );
    // Each run records the build that answered it (a run handed to the new build's pool is that build's).
    for (const r of rows) {
      const result = JSON.parse(r.result ?? 'null') as { version: number };
      assert.equal(result.version, versionOf.get(r.build_id ?? ''), `run ${r.id}: its build_id answered it`);
    }
    assert.ok(new Set(rows.map((r) => r.build_id)).size >= 2, 'runs were served by more than one build');
    // The race was hit: at a switch, a run waited in the old build's pool and went to the new one.
    const handedOver = logs.filter((l) => l.msg === 'runs waiting for the replaced build go to the new one');
    assert.ok(handedOver.length >= 1, `runs were handed over at ${handedOver.length} of 5 switches`);
  });
});
