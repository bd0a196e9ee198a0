/**
 * Retention and deleting builds (issue 14, point 6) on one process, beyond test/housekeeping.test.ts:
 * the settings are checked at start (a bad value stops `ferry serve` with a message naming it); the first
 * pass comes soon after start, not only after the interval; failed builds older than the kept ready ones
 * go, newer ones stay; two passes at once delete and count each build once; a build deleted (by hand or by
 * retention) while a replica still runs it keeps its files until that replica stops, so its run in flight
 * finishes (a Python function importing a module of its build after the delete); its published copy,
 * archive and the replicas' view of it (hard links that would keep the space taken) go.
 */
import assert from 'node:assert/strict';
import { existsSync, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { RETENTION_FIRST_SECONDS } from '../src/apps/retention-timers.js';
import { deployFiles, http, spawnServe, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';

function pyApp(name: string, version: number): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "${name}"\n\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 4\n`,
    'late.py': `VALUE = "late ${version}"\n`,
    'main.py': `import time


def run(ms: int = 0):
    time.sleep(ms / 1000)
    # Imported only now: the build's files must still be there when the run ends.
    import late

    return {"version": ${version}, "late": late.VALUE}
`,
  };
}

function tsApp(name: string, version: number, broken = false): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "${name}"\n`,
    'main.ts': broken ? 'export function run( {\n' : `export function run() {\n  return { version: ${version} };\n}\n`,
  };
}

function metric(text: string, name: string, reason?: string): number {
  const line = text
    .split('\n')
    .find(
      (l) => (l.startsWith(`${name}{`) || l.startsWith(`${name} `)) && (!reason || l.includes(`reason="${reason}"`)),
    );
  return line ? Number(line.split(' ').at(-1)) : 0;
}

/** The replicas' views of a build (hard links under <tmp>/ferry-view-*), whichever server made them. */
function viewsOf(buildId: string): string[] {
  return readdirSync(os.tmpdir())
    .filter((n) => n.startsWith('ferry-view-'))
    .map((n) => path.join(os.tmpdir(), n, buildId))
    .filter((p) => existsSync(p));
}

describe('retention settings at start', { timeout: 120_000 }, () => {
  for (const [name, value] of [
    ['FERRY_KEEP_BUILDS', 'ten'],
    ['FERRY_KEEP_BUILDS', '-1'],
    ['FERRY_RUN_RETENTION_DAYS', '1.5'],
    ['FERRY_RETENTION_INTERVAL_SECONDS', '-1'],
  ] as const) {
    it(`refuses to start with ${name}=${value}, naming it`, async () => {
      const dataDir = await tempDir();
      await assert.rejects(spawnServe(dataDir, { [name]: value }), (err: Error) => {
        assert.match(err.message, /exited with [1-9]/);
        assert.ok(err.message.includes(`${name} must be a whole number`), err.message);
        assert.ok(err.message.includes(`"${value}"`), err.message);
        return true;
      });
    });
  }
});

describe('retention and deleting builds', { timeout: 400_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const appUrl = (name: string) => `${server.url}/v2/projects/${auth.projectId}/apps/${name}`;
  const call = (name: string, body: unknown = {}) =>
    http(`${server.url}/v4/${auth.projectId}/${name}/run`, { method: 'POST', token: auth.token, body });
  const buildDir = (id: string) => path.join(server.dataDir, 'builds', id);
  const buildIds = async (name: string) =>
    ((await http(`${appUrl(name)}/builds`, { token: auth.token })).json.builds as Array<{ id: string }>)
      .map((b) => b.id)
      .sort();
  const metrics = async () => (await http(`${server.url}/metrics`)).text;
  const startedAt = Date.now();

  before(async () => {
    // The default interval (600 s): the first pass must come soon after start all the same.
    // These tests follow build views (<tmp>/ferry-view-*/<build id>); a replica from the warm pool runs
    // from a slot of its own instead (test/security/warm-pool.test.ts), so the pool is off here.
    server = await startServer({ env: { FERRY_KEEP_BUILDS: '2', FERRY_WARM_POOL: '0' } });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
  });

  it('runs the first pass soon after start', async () => {
    await waitFor(
      async () => metric(await metrics(), 'ferry_retention_passes_total') >= 1,
      (RETENTION_FIRST_SECONDS + 60) * 1000,
      'the first retention pass',
    );
    assert.ok(Date.now() - startedAt < 300_000, 'long before the interval (600 s)');
  });

  it('deletes failed builds older than the kept ready ones, keeps newer ones, and counts each build once', async () => {
    const failedOld = await deployFiles(server, auth, 'mixed', tsApp('mixed', 0, true), { expect: 'failed' });
    const ready: string[] = [];
    for (const v of [1, 2, 3]) ready.push((await deployFiles(server, auth, 'mixed', tsApp('mixed', v))).id);
    const failedNew = await deployFiles(server, auth, 'mixed', tsApp('mixed', 4, true), { expect: 'failed' });
    const before = metric(await metrics(), 'ferry_builds_deleted_total', 'retention');

    // Two passes at once (as two processes of a fleet may run them): each build is deleted and counted once.
    await Promise.all([server.services.retention(), server.services.retention()]);
    assert.deepEqual(await buildIds('mixed'), [ready[1]!, ready[2]!, failedNew.id].sort());
    assert.equal((await http(`${appUrl('mixed')}/builds/${failedOld.id}`, { token: auth.token })).status, 404);
    assert.equal((await http(`${appUrl('mixed')}/builds/${ready[0]}`, { token: auth.token })).status, 404);
    assert.equal(existsSync(buildDir(ready[0]!)), false);
    assert.equal(await server.services.artifacts.localPath(ready[0]!), undefined);
    assert.equal(await server.services.artifacts.localPath(failedOld.id), undefined);
    assert.equal(metric(await metrics(), 'ferry_builds_deleted_total', 'retention') - before, 2);
    assert.deepEqual((await call('mixed')).json.result, { version: 3 });
    // A pass with nothing to do deletes nothing more.
    await server.services.retention();
    assert.equal(metric(await metrics(), 'ferry_builds_deleted_total', 'retention') - before, 2);
  });

  it('lets a run in flight on a build deleted by hand finish: its files go once its replica stops', async () => {
    const old = await deployFiles(server, auth, 'pyhand', pyApp('pyhand', 1));
    const first = await call('pyhand');
    assert.deepEqual(first.json.result, { version: 1, late: 'late 1' }, first.text);
    const views = viewsOf(old.id);
    const inFlight = call('pyhand', { ms: 8000 });
    await waitFor(
      async () =>
        (
          (await http(`${appUrl('pyhand')}/runs?state=running`, { token: auth.token })).json.runs as Array<{
            build_id: string;
          }>
        ).some((r) => r.build_id === old.id),
      30_000,
      'the long run on the old build',
    );
    // A new build becomes active: the old build's replica drains (it finishes the run in flight).
    await deployFiles(server, auth, 'pyhand', pyApp('pyhand', 2));
    const res = await http(`${appUrl('pyhand')}/builds/${old.id}`, { method: 'DELETE', token: auth.token });
    assert.equal(res.status, 200, res.text);
    assert.equal(await server.services.artifacts.localPath(old.id), undefined, 'the archive goes at once');
    assert.ok(existsSync(buildDir(old.id)), 'the folder stays while a replica runs the build');

    const answered = await inFlight;
    assert.equal(answered.status, 200, answered.text);
    assert.deepEqual(answered.json.result, { version: 1, late: 'late 1' });
    await waitFor(async () => !existsSync(buildDir(old.id)), 30_000, 'the old build folder to go');
    await waitFor(async () => viewsOf(old.id).length === 0, 30_000, 'its replicas’ view to go');
    if (server.services.sandbox.bwrap) assert.ok(views.length > 0, 'sandboxed replicas ran from a view');
    assert.deepEqual((await call('pyhand')).json.result, { version: 2, late: 'late 2' });
  });

  it('lets a run in flight on a build deleted by retention finish; the active build is never deleted', async () => {
    const builds: string[] = [];
    builds.push((await deployFiles(server, auth, 'pyret', pyApp('pyret', 1))).id);
    const inFlight = call('pyret', { ms: 10_000 });
    await waitFor(
      async () =>
        (
          (await http(`${appUrl('pyret')}/runs?state=running`, { token: auth.token })).json.runs as Array<{
            build_id: string;
          }>
        ).some((r) => r.build_id === builds[0]),
      60_000,
      'the long run on the first build',
    );
    for (const v of [2, 3]) builds.push((await deployFiles(server, auth, 'pyret', pyApp('pyret', v))).id);
    await server.services.retention();
    assert.deepEqual(await buildIds('pyret'), [builds[1]!, builds[2]!].sort());
    const answered = await inFlight;
    assert.equal(answered.status, 200, answered.text);
    assert.deepEqual(answered.json.result, { version: 1, late: 'late 1' });
    await waitFor(async () => !existsSync(buildDir(builds[0]!)), 30_000, 'the first build folder to go');

    const active = (await http(appUrl('pyret'), { token: auth.token })).json.active_build_id;
    assert.equal(active, builds[2]);
    const deleteActive = await http(`${appUrl('pyret')}/builds/${active}`, { method: 'DELETE', token: auth.token });
    assert.equal(deleteActive.status, 409, deleteActive.text);
    assert.equal(deleteActive.json.error.code, 'FERRY_BUILD_ACTIVE');
    const m = await metrics();
    assert.ok(metric(m, 'ferry_builds_deleted_total', 'retention') >= 3);
    assert.ok(metric(m, 'ferry_builds_deleted_total', 'deleted') >= 1);
    assert.ok(metric(m, 'ferry_bytes_freed_total', 'retention') > 0);
  });
});
