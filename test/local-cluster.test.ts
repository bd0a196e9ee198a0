/**
 * scripts/local-cluster.sh as a new user runs it (docs/scaling-out.md, "Trying it on one machine"): start
 * brings up 2 gateways and 2 workers on PostgreSQL and NATS, a deploy through one gateway is callable
 * through the other, status lists them, and stop leaves nothing running. Its own folder, ports, database
 * and cluster name; all removed at the end.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, describe, it } from 'node:test';
import pg from 'pg';
import { http, REPO_ROOT, tempDir } from './helpers/ferry.js';
import { ADMIN_DATABASE_URL } from './helpers/fleet.js';
import { deleteClusterStreams, freePort } from './helpers/nats.js';

const SCRIPT = path.join(REPO_ROOT, 'scripts', 'local-cluster.sh');

/** Runs the script as the docs do, by its path (so it must be executable). */
function script(args: string[], env: NodeJS.ProcessEnv = {}): Promise<{ code: number; out: string }> {
  return new Promise((resolve) => {
    const child = spawn(SCRIPT, args, {
      env: { ...process.env, FERRY_LOCAL_ADMIN_URL: ADMIN_DATABASE_URL, ...env },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let out = '';
    child.stdout.on('data', (d: Buffer) => {
      out += d.toString('utf8');
    });
    child.stderr.on('data', (d: Buffer) => {
      out += d.toString('utf8');
    });
    const timer = setTimeout(() => child.kill('SIGKILL'), 180_000);
    child.once('exit', (code) => {
      clearTimeout(timer);
      resolve({ code: code ?? 1, out });
    });
  });
}

/**
 * A base port whose gateway (N, N+1) and worker (N+1001, N+1002) ports are all free now, all four below
 * the kernel's ephemeral range: a port in that range can be taken by any connection or `listen(0)` on the
 * machine between this check and the script's servers binding it (seen once: "Port 35146 … is already in
 * use" while other tests ran).
 */
async function basePort(): Promise<number> {
  const range = await fs.readFile('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').catch(() => '32768 60999');
  const ephemeralLow = Number(range.trim().split(/\s+/)[0]) || 32_768;
  const low = 10_000;
  const span = ephemeralLow - 1003 - low;
  if (span <= 0) throw new Error(`no room below the ephemeral port range (${range.trim()})`);
  for (let i = 0; i < 50; i++) {
    const base = low + ((await freePort()) % span);
    const ports = [base, base + 1, base + 1001, base + 1002];
    const free = await Promise.all(ports.map((p) => portFree(p)));
    if (free.every(Boolean)) return base;
  }
  throw new Error('no free base port found');
}

async function portFree(port: number): Promise<boolean> {
  const net = await import('node:net');
  return new Promise((resolve) => {
    const srv = net.createServer();
    srv.once('error', () => resolve(false));
    srv.listen(port, '127.0.0.1', () => srv.close(() => resolve(true)));
  });
}

describe('scripts/local-cluster.sh', { timeout: 400_000 }, () => {
  const name = `t${process.pid}${randomBytes(2).toString('hex')}`;
  let dir = '';
  let args: string[] = [];

  after(
    async () => {
      if (args.length > 0) await script(['stop', ...args]);
      const client = new pg.Client({ connectionString: ADMIN_DATABASE_URL });
      await client.connect();
      await client.query(`DROP DATABASE IF EXISTS "ferry_${name}" WITH (FORCE)`);
      await client.end();
      await deleteClusterStreams(name);
      if (dir) await fs.rm(dir, { recursive: true, force: true });
    },
    { timeout: 120_000 },
  );

  it('checks the servers it is told to use, not 127.0.0.1:5432 and :4222', async () => {
    const scratch = await tempDir('ferry-local-cluster-servers-');
    try {
      const closed = await freePort();
      // PostgreSQL elsewhere (a closed port here): named in the error, and the local services left alone.
      const pgElsewhere = await script(['start', '--dir', scratch, '--name', `${name}x`], {
        FERRY_LOCAL_ADMIN_URL: `postgres://postgres@127.0.0.1:${closed}/postgres`,
        FERRY_NATS_URL: `nats://127.0.0.1:${closed}`,
      });
      assert.notEqual(pgElsewhere.code, 0, pgElsewhere.out);
      assert.doesNotMatch(pgElsewhere.out, /start-services|5432|4222/, pgElsewhere.out);
      assert.match(
        pgElsewhere.out,
        new RegExp(`PostgreSQL does not answer at postgres://postgres@127\\.0\\.0\\.1:${closed}/`),
      );
      // The machine's PostgreSQL reached by another name, NATS elsewhere: only NATS is named, 4222 untouched.
      const natsElsewhere = await script(['start', '--dir', scratch, '--name', `${name}x`], {
        FERRY_LOCAL_ADMIN_URL: ADMIN_DATABASE_URL.replace('127.0.0.1', 'localhost'),
        FERRY_NATS_URL: `nats://127.0.0.1:${closed},localhost:${closed}`,
      });
      assert.notEqual(natsElsewhere.code, 0, natsElsewhere.out);
      assert.doesNotMatch(natsElsewhere.out, /start-services|4222/, natsElsewhere.out);
      assert.match(natsElsewhere.out, /NATS does not answer at nats:\/\/127\.0\.0\.1:/);
    } finally {
      await fs.rm(scratch, { recursive: true, force: true });
    }
  });

  it('starts 2 gateways and 2 workers, serves a deploy through either gateway, and stops them all', async () => {
    dir = await tempDir('ferry-local-cluster-');
    const base = await basePort();
    args = ['--dir', dir, '--base-port', String(base), '--name', name];
    const started = await script(['start', ...args]);
    assert.equal(started.code, 0, started.out);
    assert.match(started.out, /2 gateways|gateways {2}http/);
    const boot = JSON.parse(await fs.readFile(path.join(dir, 'bootstrap.json'), 'utf8')) as {
      project_id: string;
      token: string;
    };
    const gateways = [`http://127.0.0.1:${base}`, `http://127.0.0.1:${base + 1}`];
    for (const g of gateways) assert.equal((await http(`${g}/healthz`)).status, 200);
    const view = await http(`${gateways[0]}/v2/cluster`, { token: boot.token });
    assert.deepEqual((view.json.nodes as Array<{ role: string }>).map((n) => n.role).sort(), [
      'gateway',
      'gateway',
      'worker',
      'worker',
    ]);

    // A deploy through gateway 1, a call through gateway 2, as the script tells the user to.
    const { zipFiles } = await import('./helpers/app-zip.js');
    const files: Record<string, string> = {};
    for (const f of ['ferry.toml', 'main.ts']) {
      files[f] = await fs.readFile(path.join(REPO_ROOT, 'examples', 'hello', f), 'utf8');
    }
    const upload = await http(`${gateways[0]}/v2/projects/${boot.project_id}/apps/hello/builds`, {
      method: 'POST',
      token: boot.token,
      body: await zipFiles(files),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(upload.status, 201, upload.text);
    let result: unknown;
    for (let i = 0; i < 600 && result === undefined; i++) {
      const res = await http(`${gateways[1]}/v4/${boot.project_id}/hello/run`, {
        method: 'POST',
        token: boot.token,
        body: { name: 'local' },
      });
      if (res.status === 200) result = res.json.result;
      else await new Promise((r) => setTimeout(r, 200));
    }
    assert.deepEqual(result, { message: 'Hello, local!' });

    const status = await script(['status', ...args]);
    assert.equal(status.code, 0, status.out);
    assert.equal((status.out.match(/ up$/gm) ?? []).length, 4, status.out);

    const pids = await Promise.all(
      ['gateway-1', 'gateway-2', 'worker-1', 'worker-2'].map(async (n) =>
        Number(await fs.readFile(path.join(dir, n, 'serve.pid'), 'utf8')),
      ),
    );
    const stopped = await script(['stop', ...args]);
    assert.equal(stopped.code, 0, stopped.out);
    assert.match(stopped.out, /stopped 4 process/);
    for (const pid of pids) {
      assert.throws(() => process.kill(pid, 0), `process ${pid} is gone`);
    }
    for (const g of gateways) await assert.rejects(http(`${g}/healthz`));
  });
});
