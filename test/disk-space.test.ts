/**
 * Disk space, part by part (issue 43, point 3): what a write refused for lack of space answers
 * (src/disk-space.ts `isStorageFull`, http/answer.ts: 507 FERRY_STORAGE_FULL with Retry-After, never 500),
 * the SQLite store keeping a failed transaction's own error when SQLite rolled it back itself (no
 * "cannot rollback" masking SQLITE_FULL), and the watch of the data folder's free space that closes
 * intake under FERRY_MIN_FREE_MIB and opens it again. Real errors from a real tmpfs where one can be had
 * (the tests run as root), a statfs of the test's own for the watch's rules.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { createDiskSpace, isStorageFull, type SpaceStats } from '../src/disk-space.js';
import { FerryError } from '../src/errors.js';
import { answer, workerErrorLine } from '../src/http/answer.js';
import { createWorkerApi } from '../src/http/worker-api.js';
import { createMetrics } from '../src/metrics.js';
import { openSqliteStore } from '../src/store/sqlite.js';
import { http, waitFor } from './helpers/ferry.js';
import { type SmallDisk, smallDisk } from './helpers/small-disk.js';

describe('a write refused for lack of space is answered 507 FERRY_STORAGE_FULL', () => {
  let disk: SmallDisk;
  before(async () => {
    disk = await smallDisk(2);
  });
  after(() => disk.close());

  it('a real ENOSPC from a file write, bare, as a cause, or wrapped in FERRY_INTERNAL', async () => {
    await disk.fill();
    const enospc = await fs.writeFile(path.join(disk.root, 'more'), Buffer.alloc(64 * 1024)).then(
      () => assert.fail('the write should fail: the disk is full'),
      (err: unknown) => err,
    );
    assert.equal((enospc as NodeJS.ErrnoException).code, 'ENOSPC');
    for (const err of [
      enospc,
      new Error('storing the upload failed', { cause: enospc }),
      new FerryError('FERRY_INTERNAL', undefined, { cause: enospc }),
      new AggregateError([new Error('other'), enospc]),
    ]) {
      const answered = answer(err, { runId: 'r1' });
      assert.equal(answered.status, 507, String(err));
      assert.equal(JSON.parse(answered.body).error.code, 'FERRY_STORAGE_FULL');
      assert.equal(JSON.parse(answered.body).run_id, 'r1');
      assert.ok(Number(answered.headers['retry-after']) > 0, 'Retry-After');
      assert.ok(!answered.body.includes('ENOSPC'), 'the body says nothing of the cause');
      // The worker protocol carries the same answer to a gateway.
      const line = workerErrorLine(err);
      assert.deepEqual([line.status, line.error.code], [507, 'FERRY_STORAGE_FULL']);
      assert.equal(line.headers['retry-after'], answered.headers['retry-after']);
    }
    await disk.unfill();
  });

  it('the stores’ codes: SQLITE_FULL, PostgreSQL’s 53100, EDQUOT; a coded error of its own is kept', () => {
    const sqlite = Object.assign(new Error('database or disk is full'), { code: 'SQLITE_FULL' });
    const pg = Object.assign(new Error('could not extend file'), { code: '53100', severity: 'ERROR' });
    const edquot = Object.assign(new Error('quota'), { code: 'UNKNOWN', errno: -122 });
    for (const err of [sqlite, pg, edquot]) {
      assert.ok(isStorageFull(err), err.message);
      assert.equal(answer(err).status, 507, err.message);
    }
    // A volume's own size (413) and other codes stay what they are, and so does an unrelated failure.
    const volumeFull = new FerryError('FERRY_VOLUME_FULL', undefined, {
      cause: Object.assign(new Error(), { code: 'ENOSPC' }),
    });
    assert.equal(answer(volumeFull).status, 413);
    assert.equal(answer(Object.assign(new Error('x'), { code: 'SQLITE_CONSTRAINT' })).status, 500);
    assert.equal(answer(Object.assign(new Error('x'), { code: '23505' })).status, 500);
  });
});

describe('the SQLite store keeps a transaction’s own error when SQLite rolled it back itself', () => {
  let disk: SmallDisk;
  before(async () => {
    disk = await smallDisk(8);
  });
  after(() => disk.close());

  it('a transaction that meets a full disk fails with SQLITE_FULL, not "cannot rollback", and the store goes on', async () => {
    const data = path.join(disk.root, 'data');
    await fs.mkdir(data);
    const store = await openSqliteStore({ dataDir: data });
    try {
      await disk.fill();
      const big = 'x'.repeat(256 * 1024);
      let failure: unknown;
      // SQLite may find room in pages it has already: a few transactions may still commit.
      for (let i = 0; i < 64 && failure === undefined; i++) {
        await store
          .transaction()
          .execute(async (trx) => {
            await trx
              .insertInto('projects')
              .values({ id: `p-${i}`, name: `full-${i}-${big}`, created_at: new Date().toISOString() })
              .execute();
          })
          .catch((err: unknown) => {
            failure = err;
          });
      }
      assert.ok(failure !== undefined, 'a transaction failed on the full disk');
      assert.equal((failure as { code?: string }).code, 'SQLITE_FULL', String(failure));
      assert.doesNotMatch(String(failure), /cannot rollback/);
      assert.equal(answer(failure).status, 507);
      await disk.unfill();
      // The connection is usable again: no transaction left open, writes go through.
      await store
        .insertInto('projects')
        .values({ id: 'p-after', name: 'after', created_at: new Date().toISOString() })
        .execute();
      const row = await store.selectFrom('projects').select('id').where('id', '=', 'p-after').executeTakeFirst();
      assert.equal(row?.id, 'p-after');
    } finally {
      await store.destroy();
    }
  });
});

describe('the watch of the data folder’s free space (createDiskSpace)', () => {
  const MiB = 1024 * 1024;
  /** A filesystem of 100 MiB with `free` MiB available, as statfs says it. */
  const fsWith = (free: () => number) => async (): Promise<SpaceStats> => ({
    bsize: 4096,
    blocks: (100 * MiB) / 4096,
    bavail: Math.floor((free() * MiB) / 4096),
  });
  const quiet = () => {
    const lines: string[] = [];
    return {
      lines,
      logger: {
        warn: (_o: unknown, msg?: string) => void lines.push(`warn ${msg}`),
        info: (_o: unknown, msg?: string) => void lines.push(`info ${msg}`),
      },
    };
  };

  it('is low under the threshold, refuses intake with a coded 507, and opens again when space returns', async () => {
    let free = 80;
    const log = quiet();
    const space = createDiskSpace({
      dir: '/x',
      minFreeBytes: 64 * MiB,
      logger: log.logger,
      statfs: fsWith(() => free),
    });
    await space.look();
    assert.equal(space.low, false);
    assert.deepEqual(space.last && [space.last.freeBytes, space.last.totalBytes], [80 * MiB, 100 * MiB]);
    free = 63;
    await space.look();
    assert.equal(space.low, true);
    const refused = space.intakeRefused();
    assert.equal(refused.code, 'FERRY_STORAGE_FULL');
    assert.equal(refused.status, 507);
    assert.ok(Number(refused.headers['retry-after']) > 0);
    assert.match(log.lines.join('\n'), /warn .*under FERRY_MIN_FREE_MIB \(64 MiB\)/);
    free = 64;
    await space.look();
    assert.equal(space.low, false);
    assert.match(log.lines.at(-1) ?? '', /^info .*accepted/);
  });

  it('keeps its flag while statfs fails (one warning), and never closes intake with a threshold of 0', async () => {
    let fail = false;
    const log = quiet();
    const space = createDiskSpace({
      dir: '/x',
      minFreeBytes: 64 * MiB,
      logger: log.logger,
      statfs: async () => {
        if (fail) throw Object.assign(new Error('EIO'), { code: 'EIO' });
        return fsWith(() => 1)();
      },
    });
    await space.look();
    assert.equal(space.low, true);
    fail = true;
    await space.look();
    await space.look();
    assert.equal(space.low, true);
    assert.equal(log.lines.filter((l) => l.includes('cannot read')).length, 1);

    const never = createDiskSpace({ dir: '/x', minFreeBytes: 0, logger: log.logger, statfs: fsWith(() => 0) });
    await never.look();
    assert.equal(never.low, false);
  });

  it('looks again on its own: the flag follows the disk within a few polls, both ways', async () => {
    let free = 80;
    const space = createDiskSpace({
      dir: '/x',
      minFreeBytes: 64 * MiB,
      logger: quiet().logger,
      statfs: fsWith(() => free),
      pollMs: 20,
    });
    space.start();
    try {
      await waitFor(async () => space.last !== null, 5000, 'the first look');
      assert.equal(space.low, false);
      free = 10;
      await waitFor(async () => space.low, 5000, 'intake to close');
      free = 90;
      await waitFor(async () => !space.low, 5000, 'intake to open again');
    } finally {
      space.close();
    }
  });

  it('reads a real filesystem: a tmpfs filled past the threshold is low, and not once emptied', async () => {
    const disk = await smallDisk(16);
    try {
      const space = createDiskSpace({ dir: disk.root, minFreeBytes: 4 * MiB, logger: quiet().logger });
      await space.look();
      assert.equal(space.low, false);
      assert.ok(space.last && space.last.totalBytes === 16 * MiB, `total ${space.last?.totalBytes}`);
      await disk.fill();
      await space.look();
      assert.equal(space.low, true);
      await disk.unfill();
      await space.look();
      assert.equal(space.low, false);
    } finally {
      await disk.close();
    }
  });
});

describe('a worker’s internal listener answers /readyz too', () => {
  it('503 naming storage while its data folder is low, 200 otherwise, without a cluster token', async () => {
    const space = { low: false };
    const api = createWorkerApi({
      builds: {} as never,
      storeHealth: async () => 'ok',
      space,
      invoker: {} as never,
      auth: { verify: () => undefined } as never,
      metrics: createMetrics({ node: 'disk-worker', role: 'worker' }),
      refreshGauges: () => {},
      logger: { error() {}, warn() {}, info() {}, debug() {} } as never,
      maxBodyBytes: 1024,
    });
    await new Promise<void>((resolve) => api.server.listen(0, '127.0.0.1', resolve));
    try {
      const url = `http://127.0.0.1:${(api.server.address() as AddressInfo).port}/readyz`;
      assert.deepEqual((await http(url)).json, { status: 'ready', role: 'worker' });
      space.low = true;
      const low = await http(url);
      assert.deepEqual([low.status, low.json], [503, { status: 'unavailable', reason: 'storage' }]);
    } finally {
      await api.close();
    }
  });
});
