/**
 * Day-two operations (issue 14, points 2 and 3) on one process: roll back to an earlier build under load
 * with no failed call (API and `ferry rollback` / `ferry builds activate`), the builds list marking the
 * active build, a later deploy becoming active again; and scaling without a build (`PATCH .../apps/{app}`,
 * `ferry apps scale`): min_replicas up starts replicas with no new build, max_replicas down stops the idle
 * ones, a new replica_concurrency replaces the replicas, bad values are refused as ferry.toml refuses them,
 * and the override outlives a deploy until reset.
 */
import assert from 'node:assert/strict';
import { Readable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { receiveBuild } from '../src/builds/upload.js';
import { lockApp } from '../src/store/active-build.js';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';

function version(v: number, scaling = 'max_replicas = 2\nreplica_concurrency = 4\n'): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "ver"\n\n[scaling]\n${scaling}`,
    'main.ts': `export async function run() { await new Promise((r) => setTimeout(r, 20)); return { version: ${v} }; }\n`,
  };
}

describe('roll back and scale without a build', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let cliEnv: NodeJS.ProcessEnv;
  const builds: string[] = [];
  const base = () => `${server.url}/v2/projects/${auth.projectId}/apps/ver`;
  const call = () =>
    http(`${server.url}/v4/${auth.projectId}/ver/run`, { method: 'POST', token: auth.token, body: {} });
  const liveReplicas = () =>
    server.services.replicas
      .pools()
      .filter((p) => p.build.appId === 'ver' && !p.isDraining)
      .reduce((n, p) => n + [...p.replicas].filter((r) => r.state === 'ready').length, 0);

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    cliEnv = {
      HOME: await tempDir('ferry-home-'),
      FERRY_URL: server.url,
      FERRY_TOKEN: auth.token,
      FERRY_PROJECT: auth.projectId,
    };
    for (const v of [1, 2]) builds.push((await deployFiles(server, auth, 'ver', version(v))).id);
  });

  after(async () => {
    await server?.close();
  });

  it('rolls back to the earlier build under load with no failed call, and a new deploy is active again', async () => {
    assert.deepEqual((await call()).json.result, { version: 2 });
    // Calls in a loop (bounded: at most 2,000 calls or 60 s) through the activate.
    const seen: number[] = [];
    const failures: string[] = [];
    let stop = false;
    const runLoop = async () => {
      const end = Date.now() + 60_000;
      for (let i = 0; i < 1000 && !stop && Date.now() < end; i++) {
        const res = await call();
        if (res.status !== 200) failures.push(`${res.status} ${res.text}`);
        else seen.push(res.json.result.version);
      }
    };
    // Two callers at once: at most one call of each was sent before the activate answered.
    const loops = [runLoop(), runLoop()];
    await waitFor(async () => seen.length >= 10, 30_000, 'calls before the rollback');
    const activated = await http(`${base()}/builds/${builds[0]}/activate`, { method: 'POST', token: auth.token });
    assert.equal(activated.status, 200, activated.text);
    assert.equal(activated.json.active, true);
    const at = seen.length;
    // Every call sent after the activate answered runs the old build (the first two after may predate it).
    await waitFor(async () => seen.length >= at + 20, 30_000, 'calls after the rollback');
    stop = true;
    await Promise.all(loops);
    assert.deepEqual(failures, [], 'no call fails during a rollback');
    assert.ok(
      seen.slice(at + 2).every((v) => v === 1),
      `after the activate only version 1 answers: ${seen.slice(at)}`,
    );

    const list = await http(`${base()}/builds`, { token: auth.token });
    const flags = Object.fromEntries(list.json.builds.map((b: { id: string; active: boolean }) => [b.id, b.active]));
    assert.deepEqual(flags, { [builds[0]!]: true, [builds[1]!]: false });
    assert.equal((await http(base(), { token: auth.token })).json.active_build_id, builds[0]);

    // `ferry builds activate` (app found from the build id) and `ferry rollback`.
    const activate = await runCli(['builds', 'activate', builds[1]!, '--json'], cliEnv);
    assert.equal(activate.code, 0, activate.stderr);
    assert.equal(JSON.parse(activate.stdout).active, true);
    assert.deepEqual((await call()).json.result, { version: 2 });
    const rollback = await runCli(['rollback', 'ver', '--json'], cliEnv);
    assert.equal(rollback.code, 0, rollback.stderr);
    assert.deepEqual(JSON.parse(rollback.stdout), { app: 'ver', from: builds[1], to: builds[0] });
    assert.deepEqual((await call()).json.result, { version: 1 });
    const none = await runCli(['rollback', 'ver'], cliEnv);
    assert.equal(none.code, 1);
    assert.match(none.stderr, /no ready build older than its active build/);
    const table = await runCli(['builds', 'list', 'ver'], cliEnv);
    assert.match(table.stdout, new RegExp(`${builds[0]}\\s+ready\\s+yes`));

    // A new deploy becomes active again.
    builds.push((await deployFiles(server, auth, 'ver', version(3))).id);
    assert.deepEqual((await call()).json.result, { version: 3 });
  });

  it('refuses to activate a build that is not ready, or is not there', async () => {
    const failed = await deployFiles(
      server,
      auth,
      'ver',
      { 'ferry.toml': '[app]\nname = "ver"\n', 'main.ts': 'export function run( {' },
      { expect: 'failed' },
    );
    const res = await http(`${base()}/builds/${failed.id}/activate`, { method: 'POST', token: auth.token });
    assert.equal(res.status, 409, res.text);
    assert.equal(res.json.error.code, 'FERRY_BUILD_NOT_READY');
    const missing = await http(`${base()}/builds/00000000-0000-7000-8000-000000000000/activate`, {
      method: 'POST',
      token: auth.token,
    });
    assert.equal(missing.status, 404);
    assert.deepEqual((await call()).json.result, { version: 3 });
  });

  it('a build that becomes ready after a newer one is active stays inactive, and is not announced as activated', async () => {
    // Issue 29's named bug: the pipeline kept the newer build active, but `build.activated` was published
    // for the older one anyway. An older build is received but not queued, a newer one is deployed and
    // becomes active, and only then is the older one built.
    const { services } = server;
    const files = (v: number) => ({
      'ferry.toml': '[app]\nname = "late"\n',
      'main.ts': `export function run() { return { version: ${v} }; }\n`,
    });
    const receive = async (v: number) =>
      receiveBuild(
        {
          store: services.store,
          artifacts: services.artifacts,
          tmpDir: services.dataDir.tmp,
          buildsDir: services.dataDir.builds,
          maxUploadBytes: services.config.maxUploadBytes,
          zipLimits: services.config.zipLimits,
          owner: services.node.id,
        },
        auth.projectId,
        'late',
        Readable.from(await zipFiles(files(v))),
      );
    const older = await receive(1);
    const newer = await deployFiles(server, auth, 'late', files(2));
    assert.ok(older.id < newer.id, 'build ids are time-ordered');
    const lateBase = `${server.url}/v2/projects/${auth.projectId}/apps/late`;
    assert.equal((await http(lateBase, { token: auth.token })).json.active_build_id, newer.id);

    const announced: string[] = [];
    const stop = services.changes.subscribe((event) => {
      if (event.type === 'build.activated' && event.appId === 'late') announced.push(event.buildId);
    });
    try {
      // Builds of an app run one after the other: the newest is built (and announced) only once the older
      // one's build has ended, announcement included.
      const newest = await receive(3);
      services.pipeline.enqueue(older);
      services.pipeline.enqueue(newest);
      await waitFor(async () => announced.includes(newest.id), 60_000, 'the newest build announced');
      const built = (await http(`${lateBase}/builds/${older.id}`, { token: auth.token })).json;
      assert.equal(built.state, 'ready', JSON.stringify(built));
      assert.equal(built.active, false);
      assert.deepEqual(announced, [newest.id], 'no build.activated for the build that did not become active');
      assert.equal((await http(lateBase, { token: auth.token })).json.active_build_id, newest.id);
      const res = await http(`${server.url}/v4/${auth.projectId}/late/run`, { method: 'POST', token: auth.token });
      assert.deepEqual(res.json.result, { version: 3 });
    } finally {
      stop();
    }
  });

  it('an activation waits for a delete of the build that holds the app, and then finds the build gone', async () => {
    // A delete holds the app's row (src/store/active-build.ts) from its "not the active build" check to its
    // commit. An activation of that build sent meanwhile must wait, then answer 404: it must never point
    // the app at a build the delete removed.
    const doomed = builds[0]!;
    const activeBefore = (await http(base(), { token: auth.token })).json.active_build_id;
    let release!: () => void;
    const held = new Promise<void>((resolve) => {
      release = resolve;
    });
    let locked!: () => void;
    const lockTaken = new Promise<void>((resolve) => {
      locked = resolve;
    });
    const deleting = server.services.store.transaction().execute(async (trx) => {
      const app = await lockApp(trx, auth.projectId, 'ver');
      assert.notEqual(app?.active_build_id, doomed);
      locked();
      await held;
      await trx.deleteFrom('build_log_lines').where('build_id', '=', doomed).execute();
      await trx.deleteFrom('builds').where('id', '=', doomed).execute();
    });
    await lockTaken;
    const events: string[] = [];
    const activating = http(`${base()}/builds/${doomed}/activate`, { method: 'POST', token: auth.token }).then(
      (res) => {
        events.push('activate answered');
        return res;
      },
    );
    await new Promise((resolve) => setTimeout(resolve, 500));
    events.push('delete commits');
    release();
    await deleting;
    const res = await activating;
    assert.deepEqual(events, ['delete commits', 'activate answered']);
    assert.equal(res.status, 404, res.text);
    assert.equal(res.json.error.code, 'FERRY_BUILD_NOT_FOUND');
    const app = (await http(base(), { token: auth.token })).json;
    assert.equal(app.active_build_id, activeBefore);
    assert.deepEqual((await call()).json.result, { version: 3 });
  });

  it('scales without a build: min up starts replicas, max down stops them, bad values are refused', async () => {
    const patch = (body: unknown) => http(base(), { method: 'PATCH', token: auth.token, body });
    // Bad input, with ferry.toml's wording.
    const bad = await patch({ scaling: { max_replicas: 0 } });
    assert.equal(bad.status, 400, bad.text);
    assert.equal(bad.json.error.code, 'FERRY_SCALING_INVALID');
    assert.match(bad.json.error.message, /^scaling\.max_replicas: /);
    const unknown = await patch({ scaling: { replicas: 3 } });
    assert.equal(unknown.status, 400);
    assert.match(unknown.json.error.message, /scaling\.replicas: is not a known key/);
    const crossed = await patch({ scaling: { min_replicas: 3 } });
    assert.equal(crossed.status, 400);
    assert.match(crossed.json.error.message, /min_replicas: 3 is more than scaling\.max_replicas \(2\)/);
    assert.equal((await patch({ scale: 1 })).status, 400);
    assert.equal((await patch({ scaling: 'big' })).status, 400);

    // min_replicas 0 -> 2: two replicas start with no new build.
    const buildsBefore = (await http(`${base()}/builds`, { token: auth.token })).json.builds.length;
    const up = await patch({ scaling: { min_replicas: 2, max_replicas: 3 } });
    assert.equal(up.status, 200, up.text);
    assert.deepEqual(up.json.scaling_override, { min_replicas: 2, max_replicas: 3 });
    assert.equal(up.json.scaling.min_replicas, 2);
    await waitFor(async () => liveReplicas() >= 2, 60_000, 'two replicas after min_replicas 2');
    assert.equal((await http(`${base()}/builds`, { token: auth.token })).json.builds.length, buildsBefore);

    // `ferry apps scale`: max 1 and min 1: the idle replica above the maximum stops.
    const scaled = await runCli(['apps', 'scale', 'ver', '--min', '1', '--max', '1', '--json'], cliEnv);
    assert.equal(scaled.code, 0, scaled.stderr);
    assert.deepEqual(JSON.parse(scaled.stdout).scaling_override, { min_replicas: 1, max_replicas: 1 });
    await waitFor(async () => liveReplicas() === 1, 60_000, 'one replica after max_replicas 1');
    const wrong = await runCli(['apps', 'scale', 'ver', '--min', 'lots'], cliEnv);
    assert.equal(wrong.code, 2);

    // A deploy keeps the override (its ferry.toml says max 2, min 0).
    builds.push((await deployFiles(server, auth, 'ver', version(4))).id);
    const app = (await http(base(), { token: auth.token })).json;
    assert.equal(app.scaling.min_replicas, 1);
    assert.equal(app.scaling.max_replicas, 1);
    await waitFor(async () => liveReplicas() === 1, 60_000, 'the minimum kept on the new build');
    // The stats show the limits in force (the override), not the build's ferry.toml.
    const stats = (await http(`${base()}/stats`, { token: auth.token })).json;
    assert.deepEqual([stats.replicas.min, stats.replicas.max], [1, 1]);
    assert.deepEqual((await call()).json.result, { version: 4 });

    // A new replica_concurrency replaces the replicas; calls keep working.
    const conc = await patch({ scaling: { replica_concurrency: 8 } });
    assert.equal(conc.status, 200, conc.text);
    assert.equal(conc.json.scaling.replica_concurrency, 8);
    assert.deepEqual((await call()).json.result, { version: 4 });
    const pool = server.services.replicas.pools().find((p) => p.build.appId === 'ver' && !p.isDraining);
    assert.equal(pool?.build.config.scaling.replica_concurrency, 8);

    // --reset: the build's ferry.toml applies again (min 0: replicas go after cooldown, not tested here).
    const reset = await runCli(['apps', 'scale', 'ver', '--reset', '--json'], cliEnv);
    assert.equal(reset.code, 0, reset.stderr);
    const after = JSON.parse(reset.stdout);
    assert.equal(after.scaling_override, null);
    assert.equal(after.scaling.max_replicas, 2);
    assert.equal(after.scaling.replica_concurrency, 4);
  });
});

describe('min_replicas under the node’s cap (FERRY_WORKER_MAX_REPLICAS)', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const app = (name: string) => ({
    'ferry.toml': `[app]\nname = "${name}"\n\n[scaling]\nmin_replicas = 1\nmax_replicas = 1\ncooldown = 1\n`,
    'main.ts': `export function run() { return { app: ${JSON.stringify(name)} }; }\n`,
  });
  const live = (name?: string) =>
    server.services.replicas
      .pools()
      .filter((p) => name === undefined || p.build.appId === name)
      .reduce((n, p) => n + p.liveReplicas, 0);

  before(async () => {
    server = await startServer({ env: { FERRY_WORKER_MAX_REPLICAS: '1' } });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
  });

  it('keeps the cap over two apps’ minimums, and starts the waiting minimum once the slot frees', async () => {
    await deployFiles(server, auth, 'first', app('first'));
    await waitFor(async () => live('first') === 1, 60_000, 'the minimum of first');
    // The second app's minimum finds the node full: it waits, and the cap holds.
    await deployFiles(server, auth, 'second', app('second'));
    const pool = await waitFor(
      async () => server.services.replicas.pools().find((p) => p.build.appId === 'second'),
      60_000,
      'the pool of second',
    );
    assert.equal(pool.liveReplicas, 0);
    assert.equal(live(), 1, 'one replica over all apps, as FERRY_WORKER_MAX_REPLICAS says');
    // The first app's minimum goes to 0: its idle replica stops after its cooldown, and the second app's
    // minimum starts in the freed slot with no call.
    const down = await http(`${server.url}/v2/projects/${auth.projectId}/apps/first`, {
      method: 'PATCH',
      token: auth.token,
      body: { scaling: { min_replicas: 0 } },
    });
    assert.equal(down.status, 200, down.text);
    await waitFor(async () => live('second') === 1, 60_000, 'the minimum of second in the freed slot');
    assert.equal(live('first'), 0);
    assert.equal(live(), 1);
  });
});
