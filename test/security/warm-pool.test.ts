/**
 * The warm pool (src/replicas/warm-pool.ts, FERRY_WARM_POOL) under invariant 5: a warm sandbox knows no
 * app (no files at /app, no app variables, no secrets) until one claims it; once claimed it serves that
 * app's build for life: a second load is refused, it never goes back to the pool, another app never gets
 * it, and an app that scaled to zero gets a new one. The first run on it is recorded as a cold start, its
 * logs are the run's, and what it prints outside runs is its app's log. Shutdown leaves nothing running.
 * Needs bubblewrap (scripts/setup-system.sh installs it).
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { resolveServerConfig } from '../../src/config.js';
import { deployFiles, http as request, startServer, type TestServer, waitFor } from '../helpers/ferry.js';

/** The host pids of every process under `pid`. */
function descendants(pid: number): number[] {
  const out: number[] = [];
  const queue = [pid];
  while (queue.length > 0) {
    const next = queue.shift()!;
    let children: string[] = [];
    try {
      children = fs.readFileSync(`/proc/${next}/task/${next}/children`, 'utf8').trim().split(/\s+/).filter(Boolean);
    } catch {
      // gone
    }
    for (const c of children) {
      out.push(Number(c));
      queue.push(Number(c));
    }
  }
  return out;
}

/** The bootstrap process of a sandbox whose host-side pid is `pid` (not bwrap, whose arguments name it too). */
function bootstrapPid(pid: number): number {
  const found = descendants(pid).find((p) => {
    try {
      const argv = fs.readFileSync(`/proc/${p}/cmdline`, 'utf8').split('\0');
      return !argv[0]!.endsWith('bwrap') && argv.some((a) => a.startsWith('/ferry/bootstrap'));
    } catch {
      return false;
    }
  });
  assert.ok(found !== undefined, `no bootstrap process under ${pid}`);
  return found;
}

/** The host folder bound at /app in the sandbox of `pid` (the source of the bind, from its mountinfo). */
function slotOf(pid: number): string {
  const mount = fs
    .readFileSync(`/proc/${pid}/mountinfo`, 'utf8')
    .split('\n')
    .find((l) => l.split(' ')[4] === '/app');
  assert.ok(mount, 'a folder is bound at /app');
  const slot = mount.split(' ')[3]!;
  assert.match(slot, /\/ferry-view-[^/]+\/warm\.[A-Za-z0-9_-]+$/, 'a warm slot in the views folder');
  return slot;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** One request to a replica's own socket, as the server reaches it (through the sandbox's /proc root). */
function onSocket(
  socketPath: string,
  method: string,
  path: string,
  body?: string,
): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath, method, path, headers: { 'content-type': 'application/json' } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => (text += d));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, text }));
    });
    req.on('error', reject);
    req.end(body);
  });
}

const NODE_APP = (name: string, extra = '') => ({
  'ferry.toml': `[app]\nname = "${name}"\n[scaling]\nmin_replicas = 0\nmax_replicas = 1\ncooldown = ${extra.includes('cooldown0') ? 0 : 60}\n[env]\nONLY_${name.toUpperCase().replace(/-/g, '_')} = "${name}-value"\n`,
  'main.ts': `
import fs from 'node:fs';
import { randomUUID } from 'node:crypto';
const token = randomUUID();
console.log('${name} loaded at import');
export async function hold({ ms }: { ms: number }) {
  await new Promise((resolve) => setTimeout(resolve, ms));
  return true;
}
export function whoami() {
  console.log('${name} run line');
  const env: Record<string, string | undefined> = {};
  for (const [k, v] of Object.entries(process.env)) env[k] = v;
  return { token, files: fs.readdirSync('/app/source').sort(), env, cwd: process.cwd() };
}
`,
});

describe('warm pool', () => {
  let server: TestServer;
  let first: { projectId: string; token: string };
  let second: { projectId: string; token: string };
  const run = (auth: { projectId: string; token: string }, app: string, fn: string, body: unknown = {}) =>
    request(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });
  const record = (auth: { projectId: string; token: string }, app: string, runId: string) =>
    request(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}`, { token: auth.token });
  const warmIds = () => new Set(server.services.warmPool!.list().map((w) => w.id));
  const replicaIds = (app: string) =>
    server.services.replicas
      .pools()
      .filter((p) => p.build.appId === app)
      .flatMap((p) => [...p.replicas].map((r) => r.id));
  /** The replicas that printed "<app> loaded at import" (at their start), oldest first. */
  const loadedBy = (projectId: string, app: string) =>
    server.services.appLog
      .read(projectId, app, 0, 1000)
      .filter((l) => l.line === `${app} loaded at import`)
      .map((l) => l.replica);
  const waitWarm = () =>
    waitFor(
      async () => {
        const stats = server.services.warmPool!.stats();
        return stats.node.ready >= 1 && stats.python.ready >= 1;
      },
      60_000,
      'a ready warm sandbox of each runtime',
    );
  /** Every replica id that was ever served from the pool to an app. */
  const claimed = new Set<string>();

  before(async () => {
    server = await startServer({ env: { FERRY_WARM_POOL: '1' } });
    assert.ok(
      server.services.sandbox.bwrap,
      `bubblewrap is required for these tests: ${server.services.sandbox.reasons.join('; ')}`,
    );
    assert.ok(server.services.warmPool, 'the warm pool is on (FERRY_WARM_POOL=1, sandboxed)');
    first = await server.bootstrap('first');
    second = await server.bootstrap('second');
    const put = await request(`${server.url}/v2/projects/${first.projectId}/secrets/FIRST_SECRET`, {
      method: 'PUT',
      token: first.token,
      body: { value: 'only-for-the-first-project' },
    });
    assert.ok(put.status === 200 || put.status === 201, put.text);
    await deployFiles(server, first, 'alpha', NODE_APP('alpha'));
    await deployFiles(server, second, 'beta', NODE_APP('beta', 'cooldown0'));
    await deployFiles(server, first, 'pyapp', {
      'ferry.toml': '[app]\nname = "pyapp"\n[env]\nONLY_PY = "py-value"\n',
      'main.py': `
import asyncio, os, uuid
TOKEN = str(uuid.uuid4())
async def _setup():
    return 'ran asyncio.run at import'
SETUP = asyncio.run(_setup())
print('pyapp loaded at import')
def whoami():
    print('pyapp run line')
    return {"token": TOKEN, "files": sorted(os.listdir('/app/source')), "env": dict(os.environ), "setup": SETUP, "cwd": os.getcwd()}
`,
    });
    await deployFiles(server, first, 'broken', {
      'ferry.toml': '[app]\nname = "broken"\n',
      'main.ts': 'export const run = () => 1;\nthrow new Error("kaboom at warm load");\n',
    });
  });
  after(() => server?.close());

  it('keeps warm sandboxes that see no app files and have no app environment', async () => {
    await waitWarm();
    const warm = server.services.warmPool!.list();
    assert.ok(warm.some((w) => w.runtime === 'node') && warm.some((w) => w.runtime === 'python'));
    for (const w of warm) {
      assert.ok(w.pid, 'the sandbox has a process');
      const pid = bootstrapPid(w.pid);
      assert.deepEqual(fs.readdirSync(`/proc/${pid}/root/app`), [], `${w.runtime} warm sandbox sees no files at /app`);
      const environ = fs.readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').filter(Boolean);
      const names = environ.map((e) => e.slice(0, e.indexOf('=')));
      assert.ok(names.includes('FERRY_WARM'), names.join(','));
      for (const forbidden of ['APP_NAME', 'PROJECT_ID', 'BUILD_ID', 'FERRY_ENTRY', 'FIRST_SECRET', 'ONLY_ALPHA']) {
        assert.ok(!names.includes(forbidden), `${w.runtime} warm sandbox has ${forbidden} before any claim`);
      }
      assert.ok(!environ.join('\n').includes('only-for-the-first-project'), 'no secret value');
      // The same isolation as any replica: uid 65534 inside its own user namespace.
      const uidMap = fs.readFileSync(`/proc/${pid}/uid_map`, 'utf8').trim().split(/\s+/);
      assert.equal(uidMap[0], '65534');
    }
  });

  it("hands a warm sandbox to one app's build for life, with that app's files and environment only", async () => {
    await waitWarm();
    const before = warmIds();
    const res = await run(first, 'alpha', 'whoami');
    assert.equal(res.status, 200, res.text);
    const [alphaReplica] = replicaIds('alpha');
    assert.ok(alphaReplica && before.has(alphaReplica), 'alpha got a warm sandbox');
    claimed.add(alphaReplica);
    const alpha = res.json.result;
    assert.deepEqual(alpha.files, ['ferry.toml', 'main.ts']);
    assert.equal(alpha.env.APP_NAME, 'alpha');
    assert.equal(alpha.env.ONLY_ALPHA, 'alpha-value');
    assert.equal(alpha.env.FIRST_SECRET, 'only-for-the-first-project');
    assert.equal(alpha.env.FERRY_WARM, undefined, 'the warm marker is gone: the environment is as for a cold start');
    assert.equal(alpha.cwd, '/app');
    assert.equal(
      (await record(first, 'alpha', res.json.run_id)).json.cold_start,
      true,
      'the first run is a cold start',
    );
    const logs = await request(`${server.url}/v2/projects/${first.projectId}/apps/alpha/runs/${res.json.run_id}/logs`, {
      token: first.token,
    });
    assert.ok(
      logs.json.lines.some((l: { line: string }) => l.line === 'alpha run line'),
      logs.text,
    );
    const appLog = server.services.appLog.read(first.projectId, 'alpha', 0, 1000).map((l) => l.line);
    assert.ok(appLog.includes('alpha loaded at import'), `import output is the app's log: ${appLog.join(' | ')}`);

    // A second load is refused: the sandbox is alpha's for life.
    const replica = [...server.services.replicas.pools().find((p) => p.build.appId === 'alpha')!.replicas][0]!;
    const socket = `/proc/${bootstrapPid(replica.pid!)}/root/run/ferry/replica.sock`;
    const again = await onSocket(
      socket,
      'POST',
      '/_ferry/load',
      JSON.stringify({ entry: '/app/out/main.mjs', env: {} }),
    );
    assert.equal(again.status, 409, again.text);
    const health = await onSocket(socket, 'GET', '/_ferry/health');
    assert.deepEqual(JSON.parse(health.text).functions.sort(), ['hold', 'whoami']);
    const rerun = await run(first, 'alpha', 'whoami');
    assert.equal(rerun.json.result.token, alpha.token, 'the same replica, still alpha');

    // Another app, in another project, gets another sandbox that saw nothing of alpha.
    await waitWarm();
    const beforeBeta = warmIds();
    assert.ok(!beforeBeta.has(alphaReplica), "alpha's sandbox is not back in the pool");
    const b = await run(second, 'beta', 'whoami');
    assert.equal(b.status, 200, b.text);
    // From the app log, not the pool: with cooldown 0 the replica may already be stopping.
    const betaReplica = loadedBy(second.projectId, 'beta').at(-1);
    assert.ok(betaReplica && beforeBeta.has(betaReplica), 'beta got a warm sandbox');
    assert.notEqual(betaReplica, alphaReplica);
    claimed.add(betaReplica);
    const beta = b.json.result;
    assert.notEqual(beta.token, alpha.token);
    assert.deepEqual(beta.files, ['ferry.toml', 'main.ts']);
    assert.equal(beta.env.APP_NAME, 'beta');
    for (const name of ['ONLY_ALPHA', 'FIRST_SECRET']) assert.equal(beta.env[name], undefined, `beta sees ${name}`);
    assert.ok(!JSON.stringify(beta.env).includes('only-for-the-first-project'));
    const betaLog = server.services.appLog.read(second.projectId, 'beta', 0, 1000).map((l) => l.line);
    assert.ok(!betaLog.some((l) => l.includes('alpha')), `nothing of alpha in beta's log: ${betaLog.join(' | ')}`);
  });

  it('gives a scaled-to-zero app a new sandbox, never its old one', async () => {
    // beta has cooldown 0: its replica stops within a few reaper ticks once idle; a run in flight holds it.
    // With the pool full, the replica is a warm sandbox (or the one the last test claimed, still up).
    await waitWarm();
    const holding = run(second, 'beta', 'hold', { ms: 3000 });
    const replica = await waitFor(
      async () =>
        [...(server.services.replicas.pools().find((p) => p.build.appId === 'beta')?.replicas ?? [])].find(
          (r) => r.state === 'ready' && r.inflight > 0,
        ),
      30_000,
      'a replica of beta running a run',
    );
    assert.ok(replica.pid);
    const slot = slotOf(bootstrapPid(replica.pid));
    assert.ok(fs.existsSync(path.join(slot, 'source', 'main.ts')), 'the slot holds the build while the replica runs');
    assert.equal((await holding).status, 200);
    await replica.exited;
    await waitFor(async () => replicaIds('beta').length === 0, 30_000, "beta's replica to stop");
    assert.equal(fs.existsSync(slot), false, 'the slot is removed when its sandbox has exited');
    await waitWarm();
    for (const id of claimed) assert.ok(!warmIds().has(id), `claimed sandbox ${id} is back in the pool`);
    const res = await run(second, 'beta', 'whoami');
    assert.equal(res.status, 200, res.text);
    const fresh = loadedBy(second.projectId, 'beta').at(-1);
    assert.ok(fresh && !claimed.has(fresh), 'a sandbox never used before');
    assert.equal((await record(second, 'beta', res.json.run_id)).json.cold_start, true);
  });

  it('loads a Python app into a warm Python sandbox, asyncio.run at import included', async () => {
    await waitWarm();
    const before = warmIds();
    const res = await run(first, 'pyapp', 'whoami');
    assert.equal(res.status, 200, res.text);
    const [replica] = replicaIds('pyapp');
    assert.ok(replica && before.has(replica), 'pyapp got a warm sandbox');
    const result = res.json.result;
    assert.equal(result.setup, 'ran asyncio.run at import');
    assert.deepEqual(result.files, ['ferry.toml', 'main.py']);
    assert.equal(result.env.APP_NAME, 'pyapp');
    assert.equal(result.env.ONLY_PY, 'py-value');
    assert.equal(result.env.FIRST_SECRET, 'only-for-the-first-project');
    assert.equal(result.env.FERRY_WARM, undefined);
    assert.equal(result.cwd, '/app');
    assert.equal((await record(first, 'pyapp', res.json.run_id)).json.cold_start, true);
    const logs = await request(`${server.url}/v2/projects/${first.projectId}/apps/pyapp/runs/${res.json.run_id}/logs`, {
      token: first.token,
    });
    assert.ok(
      logs.json.lines.some((l: { line: string }) => l.line === 'pyapp run line'),
      logs.text,
    );
    const appLog = server.services.appLog.read(first.projectId, 'pyapp', 0, 1000).map((l) => l.line);
    assert.ok(appLog.includes('pyapp loaded at import'), appLog.join(' | '));
  });

  it('reports an app that fails to load in a warm sandbox as a failed start, with its error', async () => {
    await waitWarm();
    const res = await run(first, 'broken', 'run');
    assert.ok(res.status >= 500, res.text);
    assert.match(res.text, /kaboom at warm load/);
    const appLog = server.services.appLog.read(first.projectId, 'broken', 0, 1000).map((l) => l.line);
    assert.ok(
      appLog.some((l) => /failed to start/.test(l)),
      `the app log tells the start failed: ${appLog.join(' | ')}`,
    );
  });
});

describe('warm pool shutdown', () => {
  it('stops every warm sandbox and removes its folder when the server stops', async () => {
    const server = await startServer({ env: { FERRY_WARM_POOL: '2' } });
    let closed = false;
    try {
      await waitFor(
        async () => {
          const stats = server.services.warmPool!.stats();
          return stats.node.ready === 2 && stats.python.ready === 2;
        },
        90_000,
        'two ready warm sandboxes per runtime',
      );
      const pids = server.services.warmPool!.list().flatMap((w) => [w.pid!, ...descendants(w.pid!)]);
      const slots = server.services.warmPool!.list().map((w) => slotOf(bootstrapPid(w.pid!)));
      assert.equal(pids.length >= 4, true);
      await server.close();
      closed = true;
      // The outer bwrap's exit ends a replica's stop; its sandbox's own processes may take a moment more.
      await waitFor(async () => pids.every((pid) => !alive(pid)), 15_000, 'the warm sandboxes to end');
      for (const slot of slots) assert.equal(fs.existsSync(slot), false, `slot ${slot} outlived the server`);
    } finally {
      if (!closed) await server.close();
    }
  });
});

describe('FERRY_WARM_POOL', () => {
  it('defaults to 1, takes 0 to turn the pool off, and refuses what is not a count from 0 to 64', () => {
    assert.equal(resolveServerConfig({}, {}).warmPool, 1);
    assert.equal(resolveServerConfig({}, { FERRY_WARM_POOL: '0' }).warmPool, 0);
    assert.equal(resolveServerConfig({}, { FERRY_WARM_POOL: '3' }).warmPool, 3);
    for (const bad of ['-1', '65', '1.5', 'many']) {
      assert.throws(() => resolveServerConfig({}, { FERRY_WARM_POOL: bad }), /FERRY_WARM_POOL/);
    }
  });

  it('keeps no warm pool when it is 0', async () => {
    const server = await startServer({ env: { FERRY_WARM_POOL: '0' } });
    try {
      assert.equal(server.services.warmPool, undefined);
    } finally {
      await server.close();
    }
  });
});
