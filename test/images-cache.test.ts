/**
 * The node's image cache (src/images/image-cache.ts): bounded by bytes, least recently used evicted
 * first, never an image in use (pinned); when the pinned images leave no room the new one is refused
 * (FERRY_IMAGE_CACHE_FULL) and removed; two acquires of one digest share one fill; the entries and their
 * order of use survive a restart, and an unpack a crash interrupted is cleaned away. `ferry doctor` shows
 * the cache's use and whether images can be built and run here.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { createImageCache } from '../src/images/image-cache.js';
import { runCli, tempDir } from './helpers/ferry.js';

const digest = (c: string) => `sha256:${c.repeat(64)}`;
const A = digest('a');
const B = digest('b');
const C = digest('c');
const D = digest('d');

/** A fill that writes `bytes` bytes into the root and counts its calls. */
function filler(bytes: number, calls: { n: number }) {
  return async (rootfs: string) => {
    calls.n += 1;
    await fs.writeFile(path.join(rootfs, 'data'), Buffer.alloc(bytes));
    return { bytes, meta: { size: bytes } };
  };
}

describe('images: the node cache', () => {
  let work: string;
  before(async () => {
    work = await tempDir('ferry-image-cache-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it('evicts the least recently used image, never a pinned one', async () => {
    let clock = 1_000;
    const dir = path.join(work, 'lru');
    const cache = await createImageCache({ dir, maxBytes: 100, now: () => clock++ });
    const calls = { n: 0 };
    (await cache.acquire(A, filler(40, calls))).release();
    (await cache.acquire(B, filler(40, calls))).release();
    (await cache.acquire(A, filler(40, calls))).release(); // A used again: B is now the oldest
    assert.equal(calls.n, 2, 'A was not unpacked twice');
    const c = await cache.acquire(C, filler(40, calls));
    assert.deepEqual(
      cache.usage().images.map((i) => i.digest),
      [C, A],
      'B, least recently used, went',
    );
    assert.equal(await fs.stat(path.join(dir, 'b'.repeat(64))).catch(() => 'gone'), 'gone');

    // A and C pinned: D cannot fit without evicting one, so it is refused and nothing pinned goes.
    const a = await cache.acquire(A, filler(40, calls));
    await assert.rejects(cache.acquire(D, filler(40, calls)), { code: 'FERRY_IMAGE_CACHE_FULL' });
    assert.deepEqual(
      cache
        .usage()
        .images.map((i) => i.digest)
        .sort(),
      [A, C],
    );
    assert.ok(cache.usage().bytes <= 100);
    assert.deepEqual(
      (await fs.readdir(dir)).sort(),
      ['a'.repeat(64), 'c'.repeat(64)],
      'the refused image left nothing',
    );
    assert.equal(await cache.remove(A), false, 'a pinned image is not removed');

    // Releasing C (the older use once A was acquired again) lets D in, and C is the one evicted.
    c.release();
    const d = await cache.acquire(D, filler(40, calls));
    assert.deepEqual(
      cache
        .usage()
        .images.map((i) => i.digest)
        .sort(),
      [A, D],
    );
    assert.equal(await fs.readFile(path.join(d.image.rootfs, 'data')).then((b) => b.length), 40);
    assert.equal(
      await fs.readFile(path.join(a.image.rootfs, 'data')).then((b) => b.length),
      40,
      'the pinned image is intact',
    );
    a.release();
    a.release(); // a second release does nothing
    assert.equal(cache.usage().images.find((i) => i.digest === A)?.pins, 0);
    d.release();
    assert.equal(await cache.remove(A), true);
  });

  it('refuses an image larger than the whole bound', async () => {
    const cache = await createImageCache({ dir: path.join(work, 'huge'), maxBytes: 100 });
    await assert.rejects(cache.acquire(A, filler(101, { n: 0 })), { code: 'FERRY_IMAGE_CACHE_FULL' });
    assert.deepEqual(await fs.readdir(path.join(work, 'huge')), []);
  });

  it('shares one fill between two acquires of one digest; a failed fill leaves nothing', async () => {
    const cache = await createImageCache({ dir: path.join(work, 'shared'), maxBytes: 1000 });
    const calls = { n: 0 };
    const [one, two] = await Promise.all([cache.acquire(A, filler(10, calls)), cache.acquire(A, filler(10, calls))]);
    assert.equal(calls.n, 1);
    assert.equal(one.image.rootfs, two.image.rootfs);
    assert.equal(cache.usage().images[0]?.pins, 2);
    await assert.rejects(
      cache.acquire(B, async (rootfs) => {
        await fs.writeFile(path.join(rootfs, 'half'), 'x');
        throw new Error('unpack failed');
      }),
      /unpack failed/,
    );
    assert.deepEqual(await fs.readdir(path.join(work, 'shared')), ['a'.repeat(64)]);
  });

  it('keeps its entries and their order of use across a restart, and cleans an interrupted unpack', async () => {
    const dir = path.join(work, 'restart');
    let clock = Date.now() - 60_000;
    const first = await createImageCache({ dir, maxBytes: 100, now: () => (clock += 1000) });
    (await first.acquire(A, filler(40, { n: 0 }))).release();
    (await first.acquire(B, filler(40, { n: 0 }))).release();
    await first.close(); // the use stamps are written in the background
    await fs.mkdir(path.join(dir, '.partial-cccccccccccc-0011223344ff', 'rootfs'), { recursive: true });
    const second = await createImageCache({ dir, maxBytes: 100 });
    assert.deepEqual(
      second.usage().images.map((i) => i.digest),
      [B, A],
    );
    assert.ok(!(await fs.readdir(dir)).some((n) => n.startsWith('.partial-')), 'the interrupted unpack is gone');
    const calls = { n: 0 };
    (await second.acquire(C, filler(40, calls))).release();
    assert.deepEqual(
      second
        .usage()
        .images.map((i) => i.digest)
        .sort(),
      [B, C],
      'A, the oldest use before the restart, went',
    );
    assert.equal(second.peek(B)?.meta.size, 40);
  });

  it('ferry doctor shows whether images can run and be built here, and the cache’s use', async () => {
    const dataDir = path.join(work, 'doctor-data');
    const cache = await createImageCache({
      dir: path.join(dataDir, 'images', 'unpacked'),
      maxBytes: 100 * 1024 * 1024,
    });
    (await cache.acquire(A, filler(3 * 1024 * 1024, { n: 0 }))).release();
    await cache.close();
    const env = { FERRY_DATA_DIR: dataDir, FERRY_IMAGE_CACHE_MIB: '100', FERRY_URL: 'http://127.0.0.1:9' };
    const json = await runCli(['doctor', '--json'], env);
    const images = JSON.parse(json.stdout).images;
    assert.deepEqual(images.cache, { dir: dataDir, bytes: 3 * 1024 * 1024, images: 1, max_bytes: 100 * 1024 * 1024 });
    assert.equal(typeof images.canRun, 'boolean');
    assert.equal(images.canBuild, images.canRun, 'builds need the sandbox only (Ferry writes the layers)');
    const text = await runCli(['doctor'], env);
    assert.match(text.stdout, /Images +can run: (yes|no); can build: (yes|no)/);
    // Deploys take every kind of image step (issue 43): the report once said they did not.
    assert.match(text.stdout, /\[image\] base images, apt and run steps and Dockerfiles, built at deploy/);
    assert.doesNotMatch(text.stdout, /not yet taken by deploys/);
    assert.match(text.stdout, /cache: 1 unpacked, 3 MiB of 100 MiB/);
  });
});
