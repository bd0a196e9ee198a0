/**
 * Invariant 5 end to end: a deployed function, running in its sandboxed replica, cannot read Ferry's data
 * directory or signing keys, another app's files or /root, nor kill a process outside its replica; and a
 * function that uses more than [resources].memory fails its run with FERRY_OUT_OF_MEMORY while the next
 * run gets a fresh replica. Needs bubblewrap (scripts/setup-system.sh installs it).
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

describe('replica isolation', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let otherBuild: string;
  const run = (app: string, fn: string, body: unknown = {}) =>
    http(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });

  before(async () => {
    server = await startServer();
    assert.ok(
      server.services.sandbox.bwrap,
      `bubblewrap is required for these tests: ${server.services.sandbox.reasons.join('; ')}`,
    );
    auth = await server.bootstrap();
    otherBuild = (
      await deployFiles(server, auth, 'neighbour', {
        'ferry.toml': '[app]\nname = "neighbour"\n',
        'main.ts': 'export const run = () => "secret neighbour code";',
      })
    ).id;
    await deployFiles(server, auth, 'spy', {
      'ferry.toml': '[app]\nname = "spy"\n[resources]\nmemory = 128\n',
      'main.ts': `
import fs from 'node:fs';
export function read({ file }: { file: string }) {
  try { return { ok: true, text: fs.readFileSync(file, 'utf8').slice(0, 100) }; } catch (e) { return { ok: false, code: (e as NodeJS.ErrnoException).code }; }
}
export function list({ dir }: { dir: string }) {
  try { return { ok: true, entries: fs.readdirSync(dir) }; } catch (e) { return { ok: false, code: (e as NodeJS.ErrnoException).code }; }
}
export function kill({ pid }: { pid: number }) {
  try { process.kill(pid, 'SIGKILL'); return { ok: true }; } catch (e) { return { ok: false, code: (e as NodeJS.ErrnoException).code }; }
}
export function whoami() { return { uid: process.getuid?.(), cwd: process.cwd(), pids: fs.readdirSync('/proc').filter((p) => /^\\d+$/.test(p)) }; }
export function hog({ mb }: { mb: number }) {
  const chunks: Buffer[] = [];
  for (let i = 0; i < mb; i++) chunks.push(Buffer.alloc(1024 * 1024, 1));
  return chunks.length;
}
export function heapHog() {
  const keep: number[][] = [];
  for (;;) keep.push(new Array(1_000_000).fill(Math.random()));
}
`,
    });
  });
  after(() => server.close());

  it("cannot read the data directory, the signing key, or another app's build", async () => {
    const data = server.dataDir;
    for (const file of [
      path.join(data, 'keys', 'jwt.key'),
      path.join(data, 'keys', 'secrets.key'),
      path.join(data, 'ferry.db'),
      path.join(data, 'builds', otherBuild, 'source', 'main.ts'),
      '/etc/shadow',
    ]) {
      const res = await run('spy', 'read', { file });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.result.ok, false, `${file} was readable: ${JSON.stringify(res.json.result)}`);
    }
    for (const dir of [data, path.join(data, 'builds'), '/root', '/home']) {
      const res = await run('spy', 'list', { dir });
      assert.equal(res.json.result.ok, false, `${dir} was listable: ${JSON.stringify(res.json.result)}`);
    }
    const own = await run('spy', 'read', { file: '/app/source/ferry.toml' });
    assert.equal(own.json.result.ok, true, 'its own build is readable');
  });

  it('runs as an unprivileged user in its own PID namespace and cannot kill a host process', async () => {
    const who = await run('spy', 'whoami');
    assert.equal(who.json.result.uid, 65534);
    assert.ok(who.json.result.pids.length <= 3, `sees host processes: ${who.json.result.pids}`);
    const victim = spawn('sleep', ['30'], { stdio: 'ignore' });
    try {
      const res = await run('spy', 'kill', { pid: victim.pid });
      assert.equal(res.json.result.ok, false);
      assert.equal(victim.exitCode, null);
      assert.equal(victim.signalCode, null, 'the host process is alive');
    } finally {
      victim.kill('SIGKILL');
    }
  });

  it('fails a run over the memory limit with FERRY_OUT_OF_MEMORY and replaces the replica', async () => {
    const res = await run('spy', 'hog', { mb: 400 });
    assert.equal(res.status, 502, res.text);
    assert.equal(res.json.error.code, 'FERRY_OUT_OF_MEMORY');
    const heap = await run('spy', 'heapHog');
    assert.equal(heap.status, 502, heap.text);
    assert.equal(heap.json.error.code, 'FERRY_OUT_OF_MEMORY');
    const next = await run('spy', 'hog', { mb: 16 });
    assert.equal(next.status, 200, next.text);
    assert.equal(next.json.result, 16);
  });
});
