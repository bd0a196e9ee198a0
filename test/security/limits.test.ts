/**
 * Issue 10, items 3 and 4, as attacks through the real server on real sandboxed replicas: an app tries to
 * take more memory than it has through the sandbox's writable places (/tmp, /dev/shm, /, /run/ferry), more
 * processes and CPU than it has, to keep burning CPU after its run timed out, to upload a ZIP bomb spread
 * over many small entries, and to learn host paths from /proc. Each test fails if its limit stops holding.
 * Fixture apps: test/fixtures/security/. Needs bubblewrap and writable memory, pids and cpu cgroups (root on
 * CI: scripts/setup-system.sh).
 */
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { Replica } from '../../src/replicas/replica.js';
import { zipFiles } from '../helpers/app-zip.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, waitFor } from '../helpers/ferry.js';

const FIXTURES = path.join(REPO_ROOT, 'test', 'fixtures', 'security');
const MiB = 1024 * 1024;

async function fixtureFiles(name: string): Promise<Record<string, string>> {
  const dir = path.join(FIXTURES, name);
  const files: Record<string, string> = {};
  for (const file of await fs.readdir(dir)) files[file] = await fs.readFile(path.join(dir, file), 'utf8');
  return files;
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

describe('security: resource limits and host leaks', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const run = (app: string, fn: string, body: unknown = {}) =>
    http(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });

  before(async () => {
    server = await startServer();
    const caps = server.services.sandbox;
    assert.ok(caps.bwrap, `bubblewrap is required for these tests: ${caps.reasons.join('; ')}`);
    for (const controller of ['memory', 'pids', 'cpu'] as const) {
      assert.ok(caps.cgroup?.controllers[controller], `a writable ${controller} cgroup is required: ${caps.reasons}`);
    }
    auth = await server.bootstrap();
    for (const app of ['limits-fill', 'limits-busy', 'limits-spinner', 'leak-python']) {
      await deployFiles(server, auth, app, await fixtureFiles(app));
    }
  });
  after(() => server?.close());

  /** The run either failed inside (an error, not 200 MiB written) or its replica was OOM-killed. */
  function assertBounded(res: Awaited<ReturnType<typeof run>>, dir: string, limitMiB: number): void {
    if (res.status === 200) {
      const result = res.json.result as { ok: boolean; code?: string; written: Record<string, number> };
      assert.equal(result.ok, false, `writing to ${dir} should fail: ${JSON.stringify(result)}`);
      assert.ok((result.written[dir] ?? 0) <= limitMiB, `${result.written[dir]} MiB written to ${dir}`);
    } else {
      assert.equal(res.status, 502, res.text);
      assert.equal(res.json.error.code, 'FERRY_OUT_OF_MEMORY', res.text);
    }
  }

  describe('memory, tmpfs included', () => {
    for (const dir of ['/dev/shm', '/tmp', '/']) {
      it(`a 64 MiB app cannot write 200 MiB to ${dir}`, async () => {
        const res = await run('limits-fill', 'fill', { targets: [{ dir, mb: 200 }] });
        assertBounded(res, dir, 64);
      });
    }

    it('the root of the sandbox takes no writes at all', async () => {
      const res = await run('limits-fill', 'fill', { targets: [{ dir: '/', mb: 1 }] });
      assert.equal(res.status, 200, res.text);
      assert.deepEqual(res.json.result, { ok: false, code: 'EROFS', written: { '/': 0 } });
    });

    it('tmpfs pages count against the memory cgroup: 40 MiB in /tmp plus 40 MiB in /dev/shm do not fit in 64', async () => {
      // Each write alone fits its tmpfs (sized at the memory limit); only the cgroup can refuse the sum.
      const alone = await run('limits-fill', 'fill', { targets: [{ dir: '/tmp', mb: 8 }] });
      assert.equal(alone.status, 200, alone.text);
      assert.deepEqual(alone.json.result, { ok: true, written: { '/tmp': 8 } });
      const both = await run('limits-fill', 'fill', {
        targets: [
          { dir: '/tmp', mb: 40 },
          { dir: '/dev/shm', mb: 40 },
        ],
      });
      assert.notEqual(both.status === 200 && both.json.result.ok, true, `80 MiB of tmpfs fit: ${both.text}`);
      assertBounded(both, '/dev/shm', 40);
    });

    it('the socket folder /run/ferry takes no file of 1 MiB', async () => {
      const res = await run('limits-fill', 'fill', { targets: [{ dir: '/run/ferry', mb: 1 }] });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.result.ok, false, JSON.stringify(res.json.result));
      assert.equal(res.json.result.code, 'ENOSPC');
      assert.equal(res.json.result.written['/run/ferry'], 0);
    });
  });

  it('a fork bomb of 2,000 processes stops at max_processes (64)', async () => {
    const res = await run('limits-busy', 'forkBomb', { n: 2000 });
    assert.equal(res.status, 200, res.text);
    const { tasks, sleeping, stdout } = res.json.result as { tasks: number; sleeping: number; stdout: string };
    assert.ok(tasks <= 64, `${tasks} tasks in the sandbox (limit 64)`);
    assert.ok(sleeping < 64, `${sleeping} processes started`);
    assert.doesNotMatch(stdout, /started 2000/);
    // The replica still serves.
    const after = await run('limits-busy', 'burn', { ms: 10 });
    assert.equal(after.status, 200, after.text);
  });

  it('cpu = 0.25 is a quota: a 2-second busy loop gets well under one core', async () => {
    const res = await run('limits-busy', 'burn', { ms: 2000 });
    assert.equal(res.status, 200, res.text);
    const { cpuMs, wallMs } = res.json.result as { cpuMs: number; wallMs: number };
    assert.ok(wallMs >= 2000, `${wallMs}`);
    assert.ok(cpuMs < 0.6 * wallMs, `got ${cpuMs} ms of CPU in ${wallMs} ms`);
    // On a loaded machine an unlimited loop may get less than 0.6 of a core too: the kernel's own record
    // of the quota is what cannot pass without it.
    const pool = server.services.replicas.pools().find((p) => p.build.appId === 'limits-busy');
    const [replica] = [...(pool?.replicas ?? [])];
    assert.ok(replica, 'the replica that ran the loop');
    const { cgroup } = server.services.sandbox;
    const dir = path.join(cgroup!.controllers.cpu!, `ferry-${replica.id}`);
    const quota =
      cgroup!.version === 2
        ? readFileSync(path.join(dir, 'cpu.max'), 'utf8').trim()
        : `${readFileSync(path.join(dir, 'cpu.cfs_quota_us'), 'utf8').trim()} ${readFileSync(path.join(dir, 'cpu.cfs_period_us'), 'utf8').trim()}`;
    assert.equal(quota, '25000 100000');
  });

  it('a run that times out ends `timeout`, and its replica is killed before another grace period passes', async () => {
    const ping = await run('limits-spinner', 'ping');
    assert.equal(ping.status, 200, ping.text);
    const pool = server.services.replicas.pools().find((p) => p.build.appId === 'limits-spinner');
    assert.ok(pool);
    const replicas: Replica[] = [...pool.replicas];
    assert.equal(replicas.length, 1);
    const replica = replicas[0]!;
    const pid = replica.pid!;
    const pidsCgroup = path.join(server.services.sandbox.cgroup!.controllers.pids!, `ferry-${replica.id}`);
    assert.ok(existsSync(pidsCgroup), `${pidsCgroup} exists while the replica runs`);

    const res = await run('limits-spinner', 'spin');
    const timedOutAt = Date.now();
    assert.equal(res.status, 504, res.text);
    assert.equal(res.json.error.code, 'FERRY_RUN_TIMEOUT');
    const runs = await http(`${server.url}/v2/projects/${auth.projectId}/apps/limits-spinner/runs?state=timeout`, {
      token: auth.token,
    });
    assert.equal(runs.status, 200, runs.text);
    assert.equal(runs.json.runs.length, 1, runs.text);

    // The grace period is 10 s: the old behaviour (SIGKILL one grace period after the timeout) fails this.
    await waitFor(async () => (!isAlive(pid) ? true : undefined), 8_500, 'the timed-out replica to be killed');
    assert.ok(Date.now() - timedOutAt < 10_000);
    await waitFor(
      async () => {
        if (!existsSync(pidsCgroup)) return true;
        const procs = readFileSync(path.join(pidsCgroup, 'cgroup.procs'), 'utf8').trim();
        return procs === '' ? true : undefined;
      },
      5_000,
      'nothing left in the replica cgroup',
    );
    const next = await run('limits-spinner', 'ping');
    assert.equal(next.status, 200, next.text);
  });

  it('a ZIP bomb of 1,000 entries of 1 MiB of zeros is refused with FERRY_ZIP_RATIO', async () => {
    const zeros = Buffer.alloc(MiB);
    const files: Record<string, string | Buffer> = {
      'ferry.toml': '[app]\nname = "bomb"\n',
      'main.ts': 'export const run = () => 1;',
    };
    for (let i = 0; i < 1000; i++) files[`data/${i}.bin`] = zeros;
    const zip = await zipFiles(files);
    assert.ok(zip.length < 5 * MiB, `the archive is small (${zip.length} bytes)`);
    const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/bomb/builds`, {
      method: 'POST',
      token: auth.token,
      body: zip,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 400, res.text);
    assert.equal(res.json.error.code, 'FERRY_ZIP_RATIO');
  });

  describe('nothing of the host leaks into the sandbox', () => {
    for (const [runtime, app] of [
      ['TypeScript', 'limits-busy'],
      ['Python', 'leak-python'],
    ] as const) {
      it(`${runtime}: /proc/1/cmdline, /proc/self/mountinfo and the environment name neither the data dir nor the install path`, async () => {
        const res = await run(app, 'inspect');
        assert.equal(res.status, 200, res.text);
        const seen = res.json.result as Record<string, unknown>;
        assert.match(String(seen.initCmdline), /bwrap --args 4 --/, 'the sandbox init is bwrap, options piped');
        assert.match(String(seen.mountinfo), / \/app /, 'the mount table was read');
        const dataDir = await fs.realpath(server.dataDir);
        for (const [what, text] of Object.entries(seen)) {
          const body = typeof text === 'string' ? text : JSON.stringify(text);
          for (const hostPath of new Set([server.dataDir, dataDir, REPO_ROOT])) {
            assert.ok(!body.includes(hostPath), `${what} shows ${hostPath}:\n${body}`);
          }
        }
      });
    }
  });
});
