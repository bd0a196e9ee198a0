/**
 * `ferry volumes` (issue 27) against a real server: create, list, ls, rm, delete with --json, and `cp` both
 * ways with a folder of files that includes a 1 GiB file of real (not sparse) data, streamed: the CLI's
 * and the server's resident memory, sampled from /proc while it copies, stay under 200 MiB.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { createReadStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { FERRY_BIN, runCli, type ServeProcess, spawnServe, tempDir } from './helpers/ferry.js';

const MIB = 1024 * 1024;
const LIMIT_BYTES = 200 * MIB;

async function rssOf(pid: number | 'self'): Promise<number> {
  const status = await fs.readFile(`/proc/${pid}/status`, 'utf8').catch(() => '');
  const kb = Number(/VmRSS:\s+(\d+) kB/.exec(status)?.[1] ?? 0);
  return kb * 1024;
}

async function sha256(file: string): Promise<string> {
  const hash = createHash('sha256');
  for await (const chunk of createReadStream(file, { highWaterMark: 4 * MIB })) hash.update(chunk as Buffer);
  return hash.digest('hex');
}

/** Runs the CLI, sampling its and the server's (`ferry serve`, pid `serverPid`) resident memory every 50 ms. */
function runSampled(args: string[], env: NodeJS.ProcessEnv, serverPid: number) {
  return new Promise<{ code: number | null; stdout: string; stderr: string; cliPeak: number; serverPeak: number }>(
    (resolve, reject) => {
      const child = spawn(process.execPath, [FERRY_BIN, ...args], {
        env: { PATH: process.env.PATH, ...env },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let stdout = '';
      let stderr = '';
      let cliPeak = 0;
      let serverPeak = 0;
      child.stdout.on('data', (d: Buffer) => (stdout += d));
      child.stderr.on('data', (d: Buffer) => (stderr += d));
      const timer = setInterval(() => {
        void rssOf(child.pid!).then((n) => (cliPeak = Math.max(cliPeak, n)));
        void rssOf(serverPid).then((n) => (serverPeak = Math.max(serverPeak, n)));
      }, 50);
      child.on('error', reject);
      child.on('close', (code) => {
        clearInterval(timer);
        resolve({ code, stdout, stderr, cliPeak, serverPeak });
      });
    },
  );
}

describe('ferry volumes (CLI)', () => {
  // A `ferry serve` of its own: the server's memory is its process's alone, not the test runner's as well.
  let server: ServeProcess;
  let env: NodeJS.ProcessEnv;
  let work: string;
  let dataDir: string;

  before(async () => {
    dataDir = await tempDir('ferry-volcli-data-');
    server = await spawnServe(dataDir);
    const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], {});
    assert.equal(boot.code, 0, boot.stderr);
    const { project_id: projectId, token } = JSON.parse(boot.stdout);
    work = await tempDir('ferry-volcli-');
    env = { HOME: work, FERRY_URL: server.url, FERRY_TOKEN: token, FERRY_PROJECT: projectId };
  });

  after(async () => {
    await server?.stop();
    await fs.rm(work, { recursive: true, force: true });
  });

  it('creates and lists volumes, with --json', async () => {
    const created = await runCli(['volumes', 'create', 'weights', '--size', '1200MiB', '--json'], env);
    assert.equal(created.code, 0, created.stderr);
    assert.deepEqual((({ name, size_mib }) => ({ name, size_mib }))(JSON.parse(created.stdout)), {
      name: 'weights',
      size_mib: 1200,
    });
    const bad = await runCli(['volumes', 'create', 'x', '--size', 'lots'], env);
    assert.equal(bad.code, 2);
    const list = await runCli(['volumes', 'list', '--json'], env);
    const volumes = JSON.parse(list.stdout);
    assert.equal(volumes.length, 1);
    assert.equal(volumes[0].name, 'weights');
    assert.ok(volumes[0].used_bytes >= 0);
    const table = await runCli(['volumes', 'list'], env);
    assert.match(table.stdout, /weights\s+1\.2 GiB/);
  });

  it('ferry doctor shows the use `ferry volumes list` shows, read by the same function (issue 43)', async () => {
    const src = path.join(work, 'probe');
    await fs.mkdir(src, { recursive: true });
    await fs.writeFile(path.join(src, 'data.bin'), randomBytes(5 * MIB));
    const up = await runCli(['volumes', 'cp', src, 'weights:/', '--json'], env);
    assert.equal(up.code, 0, up.stderr);
    const listed = async () => {
      const list = await runCli(['volumes', 'list', '--json'], env);
      assert.equal(list.code, 0, list.stderr);
      return JSON.parse(list.stdout)[0].used_bytes as number;
    };
    const before = await listed();
    // The doctor reads the data folder offline (the server mounted the image, so it reads it where it is).
    const doctor = await runCli(['doctor', '--json'], { ...env, FERRY_DATA_DIR: dataDir });
    assert.equal(doctor.code, 0, doctor.stderr);
    const after = await listed();
    const [volume] = JSON.parse(doctor.stdout).volumes.volumes as Array<{
      name: string;
      used_bytes: number | null;
      allocated_bytes: number | null;
      mounted_here: boolean;
    }>;
    assert.equal(volume?.name, 'weights');
    assert.equal(volume.mounted_here, true);
    assert.ok(before >= 5 * MIB, `${before}`);
    // Before, the doctor gave the image's allocated blocks (metadata and journal too): 68.4 MiB against 60.0.
    assert.ok(
      volume.used_bytes === before || volume.used_bytes === after,
      `doctor ${volume.used_bytes}, volumes list ${before} then ${after}`,
    );
    assert.equal(typeof volume.allocated_bytes, 'number', 'the image’s size on disk is still told, apart');
    const text = await runCli(['doctor'], { ...env, FERRY_DATA_DIR: dataDir });
    const line =
      /\/weights: ([\d.]+) MiB used of 1200\.0 MiB \(the image takes [\d.]+ MiB on disk\), mounted here/.exec(
        text.stdout,
      );
    assert.ok(line, text.stdout);
    assert.ok(
      [before, after].some((used) => (used / MIB).toFixed(1) === line[1]),
      `doctor says ${line[1]} MiB, volumes list ${before} then ${after} bytes`,
    );
    const rm = await runCli(['volumes', 'rm', 'weights:/probe', '-r', '--json'], env);
    assert.equal(rm.code, 0, rm.stderr);
  });

  it('copies a folder with a 1 GiB file up and down, streamed (CLI and server under 200 MiB)', async () => {
    const src = path.join(work, 'model');
    await fs.mkdir(path.join(src, 'tokenizer'), { recursive: true });
    await fs.writeFile(path.join(src, 'config.json'), '{"layers": 2}');
    await fs.writeFile(path.join(src, 'tokenizer', 'vocab.txt'), 'a\nb\nc\n');
    // Real data, every block written (not a sparse file): 1 GiB of a repeated random MiB.
    const block = randomBytes(MIB);
    const big = await fs.open(path.join(src, 'weights.bin'), 'w');
    for (let i = 0; i < 1024; i++) await big.write(block);
    await big.close();
    assert.equal((await fs.stat(path.join(src, 'weights.bin'))).blocks * 512, 1024 * MIB);

    const up = await runSampled(['volumes', 'cp', src, 'weights:/', '--json'], env, server.child.pid!);
    assert.equal(up.code, 0, up.stderr);
    const upResult = JSON.parse(up.stdout);
    assert.equal(upResult.files.length, 3);
    assert.equal(upResult.bytes, 1024 * MIB + 13 + 6);
    assert.ok(up.cliPeak > 0 && up.cliPeak < LIMIT_BYTES, `CLI peak ${up.cliPeak}`);
    assert.ok(up.serverPeak < LIMIT_BYTES, `server peak ${up.serverPeak}`);
    console.log(
      `1 GiB upload: CLI peak ${(up.cliPeak / MIB).toFixed(0)} MiB, server peak ${(up.serverPeak / MIB).toFixed(0)} MiB`,
    );

    const ls = await runCli(['volumes', 'ls', 'weights:/model', '--json'], env);
    assert.deepEqual(
      JSON.parse(ls.stdout).entries.map((e: { name: string; type: string }) => `${e.name}:${e.type}`),
      ['config.json:file', 'tokenizer:folder', 'weights.bin:file'],
    );

    const dest = path.join(work, 'back');
    const down = await runSampled(['volumes', 'cp', 'weights:/model', dest, '--json'], env, server.child.pid!);
    assert.equal(down.code, 0, down.stderr);
    assert.ok(down.cliPeak > 0 && down.cliPeak < LIMIT_BYTES, `CLI peak ${down.cliPeak}`);
    assert.ok(down.serverPeak < LIMIT_BYTES, `server peak ${down.serverPeak}`);
    assert.equal(await fs.readFile(path.join(dest, 'tokenizer', 'vocab.txt'), 'utf8'), 'a\nb\nc\n');
    assert.equal(await sha256(path.join(dest, 'weights.bin')), await sha256(path.join(src, 'weights.bin')));
    // No partial files left.
    assert.deepEqual((await fs.readdir(dest)).sort(), ['config.json', 'tokenizer', 'weights.bin']);

    // Restartable: again with --skip-existing copies nothing.
    const again = await runCli(['volumes', 'cp', src, 'weights:/', '--skip-existing', '--json'], env);
    assert.equal(again.code, 0, again.stderr);
    assert.equal(JSON.parse(again.stdout).skipped, 3);
    await fs.rm(path.join(src, 'weights.bin'));
    await fs.rm(path.join(dest, 'weights.bin'));
  });

  it('removes files and folders, and deletes the volume', async () => {
    const rmFolder = await runCli(['volumes', 'rm', 'weights:/model/tokenizer'], env);
    assert.notEqual(rmFolder.code, 0);
    assert.match(rmFolder.stderr, /recursive|FERRY_VOLUME_PATH_CONFLICT/);
    const rmR = await runCli(['volumes', 'rm', 'weights:/model', '-r', '--json'], env);
    assert.equal(rmR.code, 0, rmR.stderr);
    const ls = await runCli(['volumes', 'ls', 'weights', '--json'], env);
    assert.deepEqual(JSON.parse(ls.stdout).entries, []);
    const del = await runCli(['volumes', 'delete', 'weights', '--json'], env);
    assert.equal(del.code, 0, del.stderr);
    assert.deepEqual(JSON.parse(del.stdout), { name: 'weights', deleted: true });
  });
});
