/**
 * The replica sandbox with real processes: bubblewrap isolation (files, environment, identity, PID
 * namespace), memory limits through a cgroup and through RLIMIT_DATA, and capability detection. A small
 * Node script (test/fixtures/sandbox-probe/probe.mjs) plays the replica from a temporary build folder
 * inside a fake data directory. The sandbox tests fail, not skip, when bubblewrap is missing.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import fs from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { sandboxWarnings } from '../src/cli/doctor.js';
import {
  detectSandbox,
  type PreparedLaunch,
  prepareLaunch,
  probeSandbox,
  type ReplicaProcess,
  type SandboxCapabilities,
  sandboxPaths,
} from '../src/sandbox/launch.js';

/** The repository root, found from this file whether it runs from test/ (tsx) or dist/test/. */
function repoRoot(): string {
  let dir = import.meta.dirname;
  while (!existsSync(path.join(dir, 'test', 'fixtures', 'sandbox-probe'))) {
    const parent = path.dirname(dir);
    if (parent === dir) throw new Error('cannot find test/fixtures/sandbox-probe');
    dir = parent;
  }
  return dir;
}

const PROBE = path.join(repoRoot(), 'test', 'fixtures', 'sandbox-probe', 'probe.mjs');
const TIMEOUT = 60_000;
const NODE = process.execPath;

interface ProbeResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
  /** The last JSON line the probe printed, if any. */
  json: Record<string, unknown> | undefined;
}

interface Attempt {
  ok: boolean;
  value?: unknown;
  code?: string;
}

interface Inspection {
  uid: number;
  gid: number;
  pid: number;
  cwd: string;
  env: Record<string, string>;
  pids: string[];
  fds: Attempt[];
  read: Record<string, Attempt>;
  list: Record<string, Attempt>;
  write: Record<string, Attempt>;
  kill: Record<string, Attempt>;
}

describe('replica sandbox', () => {
  let caps: SandboxCapabilities;
  let root: string;
  let dataDir: string;
  let keyFile: string;
  let buildA: string;
  let buildB: string;
  let otherSecret: string;
  let replicaCount = 0;
  const launches: PreparedLaunch[] = [];
  const children: ChildProcess[] = [];

  before(async () => {
    caps = await detectSandbox();
    root = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-sandbox-test-'));
    // The layout of a real data directory (src/data-dir.ts): 0700 root, keys 0600, one folder per build.
    dataDir = path.join(root, 'data');
    await fs.mkdir(path.join(dataDir, 'keys'), { recursive: true, mode: 0o700 });
    await fs.chmod(dataDir, 0o700);
    keyFile = path.join(dataDir, 'keys', 'jwt.key');
    await fs.writeFile(keyFile, 'TOP-SECRET-SIGNING-KEY', { mode: 0o600 });
    buildA = path.join(dataDir, 'builds', 'build-a');
    buildB = path.join(dataDir, 'builds', 'build-b');
    await fs.mkdir(buildA, { recursive: true, mode: 0o755 });
    await fs.mkdir(buildB, { recursive: true, mode: 0o755 });
    await fs.copyFile(PROBE, path.join(buildA, 'probe.mjs'));
    await fs.writeFile(path.join(buildA, 'data.txt'), 'own build file', { mode: 0o644 });
    otherSecret = path.join(buildB, 'secret.txt');
    await fs.writeFile(otherSecret, 'OTHER-APP-SECRET', { mode: 0o644 });
  });

  after(async () => {
    for (const child of children) {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    }
    for (const launch of launches) await launch.cleanup().catch(() => {});
    if (root) await fs.rm(root, { recursive: true, force: true });
  });

  function requireBwrap(): void {
    assert.ok(
      caps.bwrap,
      `bubblewrap is required for the sandbox tests (CI installs it: scripts/setup-system.sh, or apt-get install bubblewrap). ${caps.reasons.join('; ')}`,
    );
  }

  function requireCgroup(): void {
    assert.ok(caps.cgroup, `a writable memory cgroup is required for this test: ${caps.reasons.join('; ')}`);
  }

  async function prepare(
    withCaps: SandboxCapabilities,
    args: string[],
    options: { memoryMiB?: number; env?: Record<string, string> } = {},
  ): Promise<PreparedLaunch> {
    const replicaId = `test-${process.pid}-${++replicaCount}`;
    const layout = { buildDir: buildA, socketDir: path.join(dataDir, 'run', replicaId), runtimeFiles: [] };
    const paths = sandboxPaths(layout, withCaps.bwrap !== null);
    const prepared = await prepareLaunch(
      {
        ...layout,
        replicaId,
        command: [NODE, path.posix.join(paths.appDir, 'probe.mjs'), ...args],
        env: options.env ?? { PATH: '/usr/bin:/bin', FERRY_PROTOCOL: '1' },
        memoryMiB: options.memoryMiB ?? 256,
      },
      withCaps,
    );
    launches.push(prepared);
    return prepared;
  }

  function start(prepared: PreparedLaunch): ReplicaProcess {
    const replica = prepared.spawn();
    children.push(replica.child);
    return replica;
  }

  function finish(replica: ReplicaProcess): Promise<ProbeResult> {
    const { child } = replica;
    let stdout = '';
    let stderr = '';
    child.stdout?.setEncoding('utf8').on('data', (chunk: string) => {
      stdout += chunk;
    });
    child.stderr?.setEncoding('utf8').on('data', (chunk: string) => {
      stderr += chunk;
    });
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        child.kill('SIGKILL');
        reject(new Error(`the probe did not exit in time; stdout: ${stdout}; stderr: ${stderr}`));
      }, TIMEOUT - 5_000);
      child.on('error', reject);
      child.on('close', (code, signal) => {
        clearTimeout(timer);
        const last = stdout.trim().split('\n').at(-1);
        let json: Record<string, unknown> | undefined;
        try {
          json = last ? JSON.parse(last) : undefined;
        } catch {
          json = undefined;
        }
        resolve({ code, signal, stdout, stderr, json });
      });
    });
  }

  async function runProbe(prepared: PreparedLaunch): Promise<ProbeResult> {
    return finish(start(prepared));
  }

  async function inspect(
    withCaps: SandboxCapabilities,
    spec: { read?: string[]; list?: string[]; write?: string[]; kill?: number[] },
    env?: Record<string, string>,
  ): Promise<{ prepared: PreparedLaunch; report: Inspection }> {
    const prepared = await prepare(withCaps, ['inspect', JSON.stringify(spec)], env ? { env } : {});
    const result = await runProbe(prepared);
    assert.equal(result.code, 0, `probe failed: ${result.stderr}`);
    assert.ok(result.json, `no report from the probe: ${result.stdout} ${result.stderr}`);
    return { prepared, report: result.json as unknown as Inspection };
  }

  function denied(attempt: Attempt | undefined, what: string): void {
    assert.ok(attempt, `no result for ${what}`);
    assert.equal(attempt.ok, false, `${what} should fail inside the sandbox, got ${JSON.stringify(attempt.value)}`);
  }

  describe('capabilities', () => {
    it('detects bubblewrap, user namespaces and a writable memory cgroup on this machine', async () => {
      requireBwrap();
      assert.equal(caps.userNamespaces, true, caps.reasons.join('; '));
      requireCgroup();
      assert.ok(caps.cgroup && [1, 2].includes(caps.cgroup.version));
      assert.ok(existsSync(caps.cgroup.dir), `${caps.cgroup.dir} should exist`);
      // The probe child is gone again. Only this process's probes: the folder is shared, and a server
      // starting in another test file may be probing at this moment (CI, six files at a time).
      assert.deepEqual(
        readdirSync(caps.cgroup.dir).filter((name) => name.startsWith(`ferry-probe-${process.pid}-`)),
        [],
        'probe cgroups left behind',
      );
      assert.equal(await detectSandbox(), caps, 'detectSandbox() is cached');
    });

    it('reports no bubblewrap with FERRY_SANDBOX=off, and still finds the memory cgroup', async () => {
      const off = await probeSandbox({ ...process.env, FERRY_SANDBOX: 'off' });
      assert.equal(off.bwrap, null);
      assert.ok(
        off.reasons.some((reason) => reason.includes('FERRY_SANDBOX=off')),
        off.reasons.join('; '),
      );
      assert.deepEqual(off.cgroup, caps.cgroup);
    });
  });

  describe('isolation (bubblewrap)', () => {
    it('hides the data directory, other builds and /root; /app is its own build, read-only', {
      timeout: TIMEOUT,
    }, async () => {
      requireBwrap();
      // The host can read all of these: the sandbox is what stops the replica.
      assert.equal(await fs.readFile(keyFile, 'utf8'), 'TOP-SECRET-SIGNING-KEY');
      assert.equal(await fs.readFile(otherSecret, 'utf8'), 'OTHER-APP-SECRET');
      const rootEntries = await fs.readdir('/root');

      const { prepared, report } = await inspect(caps, {
        read: [keyFile, otherSecret, '/app/../build-b/secret.txt', '/app/data.txt', '/etc/shadow', '/etc/hostname'],
        list: [dataDir, path.dirname(buildA), '/root', '/home', '/app'],
        write: [
          '/app/data.txt',
          '/app/new.txt',
          '/tmp/scratch.txt',
          '/run/ferry/out.txt',
          '/usr/ferry-test',
          '/etc/ferry-test',
          '/ferry-root-test',
          '/dev/ferry-test',
          '/dev/shm/scratch.txt',
        ],
      });
      assert.equal(prepared.sandboxed, true);
      denied(report.read[keyFile], `reading the signing key ${keyFile}`);
      denied(report.read[otherSecret], 'reading another build');
      denied(report.read['/app/../build-b/secret.txt'], 'reading another build through /app/..');
      denied(report.list[dataDir], 'listing the data directory');
      denied(report.list[path.dirname(buildA)], 'listing the builds folder');
      denied(report.list['/home'], 'listing /home');
      const rootInside = report.list['/root'];
      assert.ok(
        rootInside && (!rootInside.ok || (rootInside.value as string[]).every((name) => !rootEntries.includes(name))),
        `/root must not show the host's files: ${JSON.stringify(rootInside)}`,
      );
      if (existsSync('/etc/shadow')) denied(report.read['/etc/shadow'], 'reading /etc/shadow');

      assert.deepEqual(report.read['/app/data.txt'], { ok: true, value: 'own build file' });
      assert.deepEqual(((report.list['/app']?.value ?? []) as string[]).sort(), ['data.txt', 'probe.mjs']);
      assert.equal(report.cwd, '/app');
      assert.equal(report.write['/app/data.txt']?.code, 'EROFS');
      assert.equal(report.write['/app/new.txt']?.code, 'EROFS');
      denied(report.write['/usr/ferry-test'], 'writing /usr');
      denied(report.write['/etc/ferry-test'], 'writing /etc');
      assert.deepEqual(report.write['/tmp/scratch.txt'], { ok: true });
      assert.deepEqual(report.write['/run/ferry/out.txt'], { ok: true });
      assert.deepEqual(report.write['/dev/shm/scratch.txt'], { ok: true });
      // The sandbox's root and /dev are read-only: only the sized tmpfs mounts take writes.
      assert.equal(report.write['/ferry-root-test']?.code, 'EROFS');
      assert.equal(report.write['/dev/ferry-test']?.code, 'EROFS');

      // No host folder is writable inside: the socket folder is a private tmpfs, not the host's socketDir.
      assert.equal(prepared.paths.hostSocketPath, null);
      assert.equal(existsSync(path.join(dataDir, 'run')), false, 'no host socket folder is made under bwrap');
      assert.equal(await fs.readFile(path.join(buildA, 'data.txt'), 'utf8'), 'own build file');
      assert.equal(existsSync('/tmp/scratch.txt'), false);
      // No descriptor of a host file leaks in (bwrap's status and environment pipes are closed).
      for (const fd of report.fds) {
        const target = String(fd.value ?? '');
        if (target.startsWith('/')) assert.match(target, /^\/(dev|proc|app|tmp|run\/ferry)\//, `fd open on ${target}`);
      }
    });

    it('serves on a socket in its private /run/ferry, reached through the sandbox init', {
      timeout: TIMEOUT,
    }, async () => {
      requireBwrap();
      const replicaId = `test-${process.pid}-${++replicaCount}`;
      const layout = { buildDir: buildA, socketDir: path.join(dataDir, 'run', replicaId), runtimeFiles: [] };
      const paths = sandboxPaths(layout, true);
      assert.equal(paths.socketPath, '/run/ferry/replica.sock');
      const prepared = await prepareLaunch(
        {
          ...layout,
          replicaId,
          command: [NODE, '/app/probe.mjs', 'listen', paths.socketPath],
          env: {},
          memoryMiB: 256,
        },
        caps,
      );
      launches.push(prepared);
      const replica = start(prepared);
      const done = finish(replica);
      const hostSocketPath = await replica.socketPath;
      assert.ok(hostSocketPath, 'bwrap reports the sandbox init, and with it the socket path');
      assert.match(hostSocketPath, /^\/proc\/\d+\/root\/run\/ferry\/replica\.sock$/);
      const greeting = await new Promise<string>((resolve, reject) => {
        const tryConnect = (attempt: number) => {
          const socket = net.connect(hostSocketPath);
          let text = '';
          socket.setEncoding('utf8');
          socket.on('data', (chunk: string) => {
            text += chunk;
          });
          socket.on('end', () => resolve(text));
          // Up to 30 s of attempts: idle, the sandboxed node listens within a second; a busy machine is slower.
          socket.on('error', (err) => {
            if (attempt > 1_200) reject(err);
            else setTimeout(() => tryConnect(attempt + 1), 25);
          });
        };
        tryConnect(0);
      });
      assert.equal(greeting, 'hello from the sandbox\n');
      const result = await done;
      assert.equal(result.code, 0, result.stderr);
      assert.equal(existsSync(layout.socketDir), false, 'no host folder for the socket');
    });

    it('gives the replica exactly the environment it was given', { timeout: TIMEOUT }, async () => {
      requireBwrap();
      process.env.FERRY_TEST_SERVER_SECRET = 'server-secret-value';
      try {
        const env = { PATH: '/usr/bin:/bin', APP_NAME: 'demo', DB_PASSWORD: 'app secret with spaces=and equals' };
        const { prepared, report } = await inspect(caps, {}, env);
        // bwrap sets PWD to the working folder, as a shell would.
        assert.deepEqual(report.env, { ...env, PWD: '/app' });
        assert.ok(
          !prepared.args.some((arg) => arg.includes('app secret')),
          'env values must not be on the command line',
        );
        assert.ok(prepared.bwrapArgs.includes('app secret with spaces=and equals'), 'they go through --args');
        // No host path at all on bwrap's command line (it is /proc/1/cmdline inside).
        const bwrapCommandLine = prepared.args.slice(prepared.args.indexOf(caps.bwrap!));
        assert.deepEqual(bwrapCommandLine.slice(0, 4), [caps.bwrap, '--args', '4', '--']);
        assert.deepEqual(bwrapCommandLine.slice(4), [NODE, '/app/probe.mjs', 'inspect', '{}']);
      } finally {
        delete process.env.FERRY_TEST_SERVER_SECRET;
      }
    });

    it('runs as uid 65534 in its own PID namespace and cannot kill host processes', { timeout: TIMEOUT }, async () => {
      requireBwrap();
      const sleeper = spawn('sleep', ['600'], { stdio: 'ignore' });
      children.push(sleeper);
      const hostPid = sleeper.pid!;
      assert.ok(hostPid > 0);
      const { report } = await inspect(caps, { kill: [hostPid, 1] });
      assert.equal(report.uid, 65534);
      assert.equal(report.gid, 65534);
      const killed = report.kill[String(hostPid)];
      assert.equal(killed?.ok, false, `kill(${hostPid}) from inside should fail`);
      assert.ok(['ESRCH', 'EPERM'].includes(String(killed?.code)), `kill failed with ${killed?.code}`);
      assert.ok(!report.pids.includes(String(hostPid)), 'the host process is visible in /proc');
      assert.ok(
        report.pids.every((pid) => Number(pid) < 10),
        `only the sandbox's own processes: ${report.pids.join(' ')}`,
      );
      // Still alive.
      assert.doesNotThrow(() => process.kill(hostPid, 0));
      assert.equal(sleeper.exitCode, null);
      assert.equal(sleeper.signalCode, null);
      sleeper.kill('SIGKILL');
    });

    it('delivers SIGTERM to the replica itself, so it can stop gracefully', { timeout: TIMEOUT }, async () => {
      requireBwrap();
      const prepared = await prepare(caps, ['wait-term']);
      const replica = start(prepared);
      const done = finish(replica);
      await new Promise<void>((resolve) => {
        replica.child.stdout?.on('data', (chunk: Buffer | string) => {
          if (String(chunk).includes('"ready"')) resolve();
        });
      });
      assert.equal(replica.kill('SIGTERM'), true);
      const result = await done;
      assert.match(result.stdout, /"got":"SIGTERM"/, result.stderr);
      assert.equal(result.code, 0);
      assert.equal(replica.kill('SIGTERM'), false, 'nothing left to signal');
    });
  });

  describe('memory limits', () => {
    it('kills a replica over its cgroup limit and reports the OOM kill; cleanup removes the cgroup', {
      timeout: TIMEOUT,
    }, async () => {
      requireBwrap();
      requireCgroup();
      const prepared = await prepare(caps, ['alloc', '300'], { memoryMiB: 128 });
      assert.equal(prepared.memoryLimit, 'cgroup');
      assert.ok(prepared.cgroupDir && existsSync(prepared.cgroupDir), 'the replica cgroup exists');
      const result = await runProbe(prepared);
      assert.ok(result.code !== 0 || result.signal !== null, `should be killed: ${result.stdout}`);
      assert.equal(result.json?.allocatedMiB, undefined, 'the allocation must not complete');
      assert.equal(await prepared.wasOomKilled(), true);
      await prepared.cleanup();
      assert.equal(existsSync(prepared.cgroupDir), false, 'cleanup removes the cgroup');
      assert.equal(await prepared.wasOomKilled(), true, 'still known after cleanup');
      await prepared.cleanup();
    });

    it('writes the process and CPU limits into the replica cgroup; cleanup removes every folder', {
      timeout: TIMEOUT,
    }, async () => {
      requireBwrap();
      requireCgroup();
      const replicaId = `test-${process.pid}-${++replicaCount}`;
      const prepared = await prepareLaunch(
        {
          buildDir: buildA,
          socketDir: path.join(dataDir, 'run', replicaId),
          runtimeFiles: [],
          replicaId,
          command: [NODE, '/app/probe.mjs', 'inspect', '{}'],
          env: {},
          memoryMiB: 128,
          maxProcesses: 42,
          cpu: 0.5,
        },
        caps,
      );
      launches.push(prepared);
      assert.equal(prepared.processLimit, 'cgroup');
      assert.equal(prepared.cpuLimit, 'cgroup');
      const { pids, cpu } = prepared.cgroupDirs;
      assert.ok(pids && cpu);
      assert.equal((await fs.readFile(path.join(pids, 'pids.max'), 'utf8')).trim(), '42');
      const quota =
        caps.cgroup!.version === 2
          ? (await fs.readFile(path.join(cpu, 'cpu.max'), 'utf8')).trim()
          : `${(await fs.readFile(path.join(cpu, 'cpu.cfs_quota_us'), 'utf8')).trim()} ${(await fs.readFile(path.join(cpu, 'cpu.cfs_period_us'), 'utf8')).trim()}`;
      assert.equal(quota, '50000 100000');
      const result = await runProbe(prepared);
      assert.equal(result.code, 0, result.stderr);
      await prepared.cleanup();
      for (const dir of Object.values(prepared.cgroupDirs)) assert.equal(existsSync(dir), false, `${dir} removed`);
    });

    it('lets the same allocation complete under a 512 MiB limit', { timeout: TIMEOUT }, async () => {
      requireBwrap();
      requireCgroup();
      const prepared = await prepare(caps, ['alloc', '300'], { memoryMiB: 512 });
      const result = await runProbe(prepared);
      assert.equal(result.code, 0, result.stderr);
      assert.equal(result.json?.allocatedMiB, 300);
      assert.equal(await prepared.wasOomKilled(), false);
      await prepared.cleanup();
      assert.equal(existsSync(prepared.cgroupDir!), false);
    });
  });

  describe('fallbacks', () => {
    it('without bubblewrap, runs a plain process with host paths and the given environment', {
      timeout: TIMEOUT,
    }, async () => {
      const plain: SandboxCapabilities = { ...caps, bwrap: null };
      const env = { PATH: '/usr/bin:/bin', APP_NAME: 'demo' };
      const { prepared, report } = await inspect(plain, { read: [path.join(buildA, 'data.txt')] }, env);
      assert.equal(prepared.sandboxed, false);
      assert.equal(prepared.paths.appDir, buildA);
      assert.equal(
        prepared.socketPathInside,
        path.join(dataDir, 'run', `test-${process.pid}-${replicaCount}`, 'replica.sock'),
      );
      assert.equal(report.cwd, buildA);
      assert.deepEqual(report.env, { ...env, PWD: buildA });
      assert.deepEqual(report.read[path.join(buildA, 'data.txt')], { ok: true, value: 'own build file' });
    });

    it('without writable cgroups, `ferry serve` and `ferry doctor` warn loudly that processes and CPU are not limited', () => {
      const none: SandboxCapabilities = { ...caps, cgroup: null };
      const warnings = sandboxWarnings(none);
      assert.ok(
        warnings.some((w) => w.includes('NO PROCESS AND NO CPU LIMIT') && w.includes('[resources].max_processes')),
        warnings.join('\n'),
      );
      assert.ok(
        warnings.some((w) => w.includes('RLIMIT_DATA')),
        warnings.join('\n'),
      );
      assert.deepEqual(sandboxWarnings(caps), [], 'none on this machine, where all three are writable');
    });

    it('without a memory cgroup, limits memory with RLIMIT_DATA through prlimit', { timeout: TIMEOUT }, async () => {
      assert.ok(caps.prlimit, `prlimit (util-linux) is required for this test: ${caps.reasons.join('; ')}`);
      const noCgroup: SandboxCapabilities = { ...caps, bwrap: null, cgroup: null };
      const small = await prepare(noCgroup, ['alloc', '300'], { memoryMiB: 128 });
      assert.equal(small.memoryLimit, 'rlimit');
      assert.equal(small.cgroupDir, null);
      const failed = await runProbe(small);
      assert.ok(failed.code !== 0 || failed.signal !== null, `should fail: ${failed.stdout}`);
      assert.equal(failed.json?.allocatedMiB, undefined);
      assert.equal(await small.wasOomKilled(), false, 'no cgroup, no OOM record');

      const large = await prepare(noCgroup, ['alloc', '300'], { memoryMiB: 512 });
      const passed = await runProbe(large);
      assert.equal(passed.code, 0, passed.stderr);
      assert.equal(passed.json?.allocatedMiB, 300);
    });
  });
});
