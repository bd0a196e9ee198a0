/**
 * A server whose data folder runs out of space (issue 43, point 3), end to end on SQLite: a real server
 * with its data folder on a small tmpfs (the tests run as root), a real app, the disk filled by a file
 * beside the data folder.
 *
 * - FERRY_MIN_FREE_MIB=0, the disk filled to 6 MiB free: async calls with 256 KiB inputs answer 202
 *   while there is room, then 507 FERRY_STORAGE_FULL with Retry-After, never 500 (the reproduction: 235 of
 *   300 answered 500, SQLite's own rollback masked by Ferry's); an upload 507 too; once the file is
 *   removed, calls are accepted again and every accepted run ends `success`.
 * - FERRY_MIN_FREE_MIB=32, the disk filled to under it: `/readyz` answers 503 naming `storage` (and
 *   `/healthz` 200), new runs of every mode and uploads answer 507 before writing anything, a run accepted
 *   before still ends, `ferry doctor` says so; once space returns `/readyz` answers 200 and calls are
 *   accepted (within a poll of the watch, a second; asserted with a generous bound).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, type Response, runCli, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { type SmallDisk, smallDisk } from './helpers/small-disk.js';

const MiB = 1024 * 1024;
const APP = {
  'ferry.toml': '[app]\nname = "echo"\n',
  'main.ts':
    'export async function run({ n = 0, ms = 0 }) { await new Promise((r) => setTimeout(r, ms)); return { n }; }\n',
};

/** Asserts a refusal for lack of space: 507, the code, Retry-After (and the run id on the run endpoint). */
function assertStorageFull(res: Response, what: string): void {
  assert.equal(res.status, 507, `${what}: ${res.status} ${res.text}`);
  assert.equal(res.json?.error?.code, 'FERRY_STORAGE_FULL', `${what}: ${res.text}`);
  assert.ok(Number(res.headers.get('retry-after')) > 0, `${what}: Retry-After ${res.headers.get('retry-after')}`);
}

describe('a data folder that fills up, FERRY_MIN_FREE_MIB=0', () => {
  let disk: SmallDisk;
  let server: TestServer | undefined;
  let auth: { projectId: string; token: string };
  const log: string[] = [];

  before(async () => {
    disk = await smallDisk(48);
    server = await startServer({
      dataDir: disk.data,
      env: { FERRY_MIN_FREE_MIB: '0' },
      log: { level: 'warn', destination: { write: (line: string) => void log.push(line) } },
    });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'echo', APP);
  });
  after(async () => {
    await server?.close();
    await disk?.close();
  });

  it('answers 507 FERRY_STORAGE_FULL with Retry-After when a write meets the full disk, never 500, and every accepted run ends once space returns', async () => {
    const call = (n: number) =>
      http(`${server!.url}/v4/${auth.projectId}/echo/run?async=true`, {
        method: 'POST',
        token: auth.token,
        body: { n, pad: 'x'.repeat(256 * 1024) },
      });
    // A little room left, as in the reproduction: the first calls are accepted, then the disk is full.
    await disk.fill(6 * MiB);
    const accepted: string[] = [];
    let refused = 0;
    // As the reproduction did: calls ten at a time (one group commit) until the disk refuses them all.
    for (let batch = 0; batch < 30; batch++) {
      const answers = await Promise.all(Array.from({ length: 10 }, (_, i) => call(batch * 10 + i)));
      for (const res of answers) {
        if (res.status === 202) accepted.push(res.json.run_id);
        else {
          assertStorageFull(res, 'an async call on a full disk');
          // Nothing was stored: the answer names no run (issue 43 point 9), the request keeps its id.
          assert.equal(res.json.run_id, undefined);
          assert.ok(res.headers.get('x-request-id'));
          refused += 1;
        }
      }
      if (answers.every((res) => res.status === 507)) break;
    }
    assert.ok(refused > 0, `no call was refused (${accepted.length} accepted)`);
    assert.ok(accepted.length > 0, 'calls were accepted while there was room');

    // An upload is a write to the data folder too (the last bytes taken first: its files are small).
    await disk.fill();
    const upload = await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/builds`, {
      method: 'POST',
      token: auth.token,
      body: await zipFiles(APP),
      headers: { 'content-type': 'application/zip' },
    });
    assertStorageFull(upload, 'an upload on a full disk');
    assert.equal((await http(`${server!.url}/healthz`)).status, 200);
    assert.ok(!log.join('').includes('cannot rollback'), 'no ROLLBACK error masked the cause');
    assert.ok(!log.join('').includes('"FERRY_INTERNAL"'), 'no internal error');

    await disk.unfill();
    const again = await waitFor(
      async () => {
        const res = await call(1000);
        return res.status === 202 ? res : undefined;
      },
      30_000,
      'a call accepted once space is back',
    );
    accepted.push(again.json.run_id);
    for (const runId of accepted) {
      const run = await waitFor(
        async () => {
          const res = await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/runs/${runId}?wait=5`, {
            token: auth.token,
          });
          return ['queued', 'running'].includes(res.json.state) ? undefined : res.json;
        },
        90_000,
        `run ${runId} to end`,
      );
      assert.equal(run.state, 'success', JSON.stringify(run));
    }
  });
});

describe('FERRY_MIN_FREE_MIB stops intake before the disk is full', () => {
  let disk: SmallDisk;
  let server: TestServer | undefined;
  let auth: { projectId: string; token: string };

  before(async () => {
    disk = await smallDisk(96);
    // With a run listener: its load balancer asks it /readyz too.
    server = await startServer({ dataDir: disk.data, runPort: 0, env: { FERRY_MIN_FREE_MIB: '32' } });
    auth = await server.bootstrap();
    // A daily schedule, for `ferry schedules trigger` (a tick of its own would be skipped the same way).
    await deployFiles(server, auth, 'echo', {
      ...APP,
      'ferry.toml': '[app]\nname = "echo"\n[[schedules]]\nname = "daily"\ncron = "0 3 * * *"\n',
    });
  });
  after(async () => {
    await server?.close();
    await disk?.close();
  });

  it('refuses new runs and uploads with 507 and Retry-After, /readyz says storage, accepted runs end, and intake reopens', async () => {
    const run = (mode: 'sync' | 'async', body: object) =>
      http(`${server!.url}/v4/${auth.projectId}/echo/run${mode === 'async' ? '?async=true' : ''}`, {
        method: 'POST',
        token: auth.token,
        body,
      });
    assert.deepEqual((await http(`${server!.url}/readyz`)).json, { status: 'ready' });
    // Accepted before the disk fills: it must still end while intake is closed (15 s: far longer than
    // filling the disk and the watch's next look take).
    const slow = await run('async', { n: 1, ms: 15_000 });
    assert.equal(slow.status, 202, slow.text);

    await disk.fill(16 * MiB);
    const notReady = await waitFor(
      async () => {
        const res = await http(`${server!.url}/readyz`);
        return res.status === 503 ? res : undefined;
      },
      10_000,
      '/readyz to say storage',
    );
    assert.deepEqual(notReady.json, { status: 'unavailable', reason: 'storage' });
    const onRunPort = await http(`${server!.runUrl}/readyz`);
    assert.deepEqual([onRunPort.status, onRunPort.json], [503, { status: 'unavailable', reason: 'storage' }]);
    assert.equal((await http(`${server!.url}/healthz`)).status, 200, 'the process itself is healthy');
    const during = await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/runs/${slow.json.run_id}`, {
      token: auth.token,
    });
    assert.ok(['queued', 'running'].includes(during.json.state), `accepted run already ${during.json.state}`);

    assertStorageFull(await run('async', { n: 2 }), 'an async call under the threshold');
    assertStorageFull(await run('sync', { n: 3 }), 'a sync call under the threshold');
    const trigger = await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/schedules/daily/trigger`, {
      method: 'POST',
      token: auth.token,
    });
    assertStorageFull(trigger, 'a schedule triggered under the threshold');
    const upload = await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/builds`, {
      method: 'POST',
      token: auth.token,
      body: await zipFiles(APP),
      headers: { 'content-type': 'application/zip' },
    });
    assertStorageFull(upload, 'an upload under the threshold');
    // Reads still answer.
    assert.equal(
      (await http(`${server!.url}/v2/projects/${auth.projectId}/apps/echo/runs`, { token: auth.token })).status,
      200,
    );

    const ended = await waitFor(
      async () => {
        const res = await http(
          `${server!.url}/v2/projects/${auth.projectId}/apps/echo/runs/${slow.json.run_id}?wait=5`,
          {
            token: auth.token,
          },
        );
        return ['queued', 'running'].includes(res.json.state) ? undefined : res.json;
      },
      60_000,
      'the accepted run to end',
    );
    assert.equal(ended.state, 'success', JSON.stringify(ended));
    assert.equal((await http(`${server!.url}/readyz`)).status, 503, 'intake still closed when it ended');

    const doctor = await runCli(['doctor'], { FERRY_DATA_DIR: disk.data, FERRY_MIN_FREE_MIB: '32' });
    assert.match(
      doctor.stdout,
      /Data folder +.*: \d+\.\d MiB free of [\d.]+ GiB; UNDER FERRY_MIN_FREE_MIB \(32\.0 MiB\)/,
    );
    const report = JSON.parse(
      (await runCli(['doctor', '--json'], { FERRY_DATA_DIR: disk.data, FERRY_MIN_FREE_MIB: '32' })).stdout,
    );
    assert.equal(report.storage.low, true);
    assert.equal(report.storage.min_free_bytes, 32 * MiB);
    assert.equal(report.storage.total_bytes, 96 * MiB);

    await disk.unfill();
    const ready = await waitFor(
      async () => {
        const res = await http(`${server!.url}/readyz`);
        return res.status === 200 ? res : undefined;
      },
      10_000,
      '/readyz to answer 200 again',
    );
    assert.deepEqual(ready.json, { status: 'ready' });
    assert.equal((await http(`${server!.runUrl}/readyz`)).status, 200);
    const back = await run('async', { n: 4 });
    assert.equal(back.status, 202, back.text);
    const sync = await run('sync', { n: 5 });
    assert.equal(sync.status, 200, sync.text);
    assert.deepEqual(sync.json.result, { n: 5 });
  });
});
