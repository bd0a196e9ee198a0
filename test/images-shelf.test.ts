/**
 * images/image-shelf.ts: an image put on the shelf by one node is fetched by another into an empty layout,
 * every blob verified (issue 26, point 4), on both shelves: the JetStream object store of a real NATS
 * (127.0.0.1:4222, a bucket of this test's own) and a shared folder. A blob changed on the shelf is refused
 * (FERRY_IMAGE_DIGEST_MISMATCH) and not kept; a removed image goes with the blobs no kept image needs.
 * A fetch counts what it did (blobs, bytes, hashing time), for the image store's log line.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { connect, type NatsConnection } from '@nats-io/transport-node';
import {
  createFolderImageShelf,
  createNatsImageShelf,
  type ImageShelf,
  openImagesBucket,
} from '../src/images/image-shelf.js';
import { blobPath, parseManifest, readIndexEntry, readJsonBlob, sha256, writeBlob } from '../src/images/oci-layout.js';
import { tempDir } from './helpers/ferry.js';
import { deleteClusterStreams, NATS_URL } from './helpers/nats.js';
import { makeBaseImage, requireImageTools } from './helpers/registry.js';

const MAX = 64 * 1024 * 1024;

async function fileBlobs(layout: string, digest: string): Promise<string[]> {
  const manifest = parseManifest(await readJsonBlob(layout, digest));
  return [manifest.config.digest, ...manifest.layers.map((l) => l.digest)];
}

describe('the image shelf', () => {
  let dir: string;
  let layout: string;
  let digest: string;
  let other: string;
  let nc: NatsConnection;
  const cluster = `SHELF${randomBytes(4).toString('hex')}`;

  before(async () => {
    await requireImageTools();
    dir = await tempDir('ferry-shelf-');
    const a = await makeBaseImage(path.join(dir, 'a'), { files: { '/etc/marker': 'a' } });
    layout = a.layout;
    digest = (await readIndexEntry(layout, a.tag)).digest;
    // A second image: the same layers, another config (as a rebuild with a changed ENV makes).
    const manifest = JSON.parse((await readJsonBlob(layout, digest)).toString('utf8'));
    const config = JSON.parse((await readJsonBlob(layout, manifest.config.digest)).toString('utf8'));
    config.config = { ...config.config, Env: [...(config.config?.Env ?? []), 'SECOND=1'] };
    const configBytes = Buffer.from(JSON.stringify(config));
    manifest.config = { ...manifest.config, digest: sha256(configBytes), size: configBytes.length };
    const manifestBytes = Buffer.from(JSON.stringify(manifest));
    other = sha256(manifestBytes);
    await writeBlob(layout, { digest: manifest.config.digest, size: configBytes.length }, [configBytes], MAX);
    await writeBlob(layout, { digest: other, size: manifestBytes.length }, [manifestBytes], MAX);
    nc = await connect({ servers: NATS_URL, timeout: 5000 });
  });
  after(async () => {
    await nc?.close();
    await deleteClusterStreams(cluster).catch(() => undefined);
    await fs.rm(dir, { recursive: true, force: true });
  });

  interface Made {
    shelf: ImageShelf;
    /** Replaces the blob's bytes on the shelf. */
    corrupt: (digest: string) => Promise<void>;
    /** Whether the shelf stores the blob. */
    holds: (digest: string) => Promise<boolean>;
  }
  const shelves: Array<[string, () => Promise<Made>]> = [
    [
      'JetStream object store',
      async () => {
        const bucket = `${cluster}_images`;
        const os = await openImagesBucket(nc, bucket);
        return {
          shelf: createNatsImageShelf(async () => os),
          // Another blob's bytes under this blob's name: the store's own digest matches what was put,
          // so only Ferry's check against the manifest's descriptor can catch it.
          async corrupt(d) {
            const bytes = Buffer.from('not the layer you are looking for');
            await os.put({ name: `blobs/sha256/${d.slice(7)}` }, new Blob([bytes]).stream());
          },
          async holds(d) {
            const info = await os.info(`blobs/sha256/${d.slice(7)}`);
            return info !== null && !info.deleted;
          },
        };
      },
    ],
    [
      'shared folder',
      async () => {
        const folder = path.join(dir, 'shelf');
        return {
          shelf: createFolderImageShelf(folder),
          async corrupt(d) {
            await fs.writeFile(path.join(folder, 'blobs', 'sha256', d.slice(7)), 'not the layer you are looking for');
          },
          holds: (d) =>
            fs
              .stat(path.join(folder, 'blobs', 'sha256', d.slice(7)))
              .then(() => true)
              .catch(() => false),
        };
      },
    ],
  ];

  for (const [name, make] of shelves) {
    describe(name, () => {
      it('ships an image to an empty layout, verified; says false for an image it does not have', async () => {
        const { shelf } = await make();
        assert.equal(await shelf.has(digest), false);
        await shelf.put(layout, digest);
        await shelf.put(layout, digest); // idempotent
        assert.equal(await shelf.has(digest), true);
        const target = path.join(dir, `fetched-${randomBytes(3).toString('hex')}`);
        const stats = { blobs: 0, bytes: 0, hashMs: 0 };
        assert.equal(await shelf.fetch(digest, target, { tag: 'image', maxBytes: MAX, stats }), true);
        assert.equal((await readIndexEntry(target, 'image')).digest, digest);
        let bytes = (await fs.stat(blobPath(layout, digest))).size;
        for (const blob of await fileBlobs(layout, digest)) {
          assert.deepEqual(await fs.readFile(blobPath(target, blob)), await fs.readFile(blobPath(layout, blob)));
          bytes += (await fs.stat(blobPath(layout, blob))).size;
        }
        // What the image store logs when it fetches from the shelf: every blob, the manifest among them.
        assert.equal(stats.blobs, (await fileBlobs(layout, digest)).length + 1);
        assert.equal(stats.bytes, bytes);
        assert.ok(stats.hashMs >= 0 && Number.isFinite(stats.hashMs));
        const unknown = `sha256:${'0'.repeat(64)}`;
        assert.equal(await shelf.fetch(unknown, path.join(dir, 'none'), { tag: 'image', maxBytes: MAX }), false);
      });

      it('refuses a blob that does not match its descriptor, keeping none of it', async () => {
        const { shelf, corrupt } = await make();
        await shelf.put(layout, digest);
        const layer = parseManifest(await readJsonBlob(layout, digest)).layers.at(-1)!.digest;
        await corrupt(layer);
        const target = path.join(dir, `tampered-${randomBytes(3).toString('hex')}`);
        await assert.rejects(shelf.fetch(digest, target, { tag: 'image', maxBytes: MAX }), {
          code: 'FERRY_IMAGE_DIGEST_MISMATCH',
        });
        await assert.rejects(fs.stat(blobPath(target, layer)), { code: 'ENOENT' });
        await assert.rejects(fs.stat(path.join(target, 'index.json')), { code: 'ENOENT' });
        // Put back (the shelf only adds what it lacks: remove, then put again).
        await shelf.remove([digest], []);
        await shelf.put(layout, digest);
      });

      it('removes an image with the blobs no kept image needs', async () => {
        const { shelf, holds } = await make();
        await shelf.put(layout, digest);
        await shelf.put(layout, other);
        const mine = await fileBlobs(layout, digest);
        const theirs = new Set(await fileBlobs(layout, other));
        assert.ok(
          mine.some((b) => theirs.has(b)),
          'the two images share a layer',
        );
        assert.ok(
          mine.some((b) => !theirs.has(b)),
          'and differ in another',
        );
        await shelf.remove([digest], [other]);
        assert.equal(await shelf.has(digest), false);
        assert.equal(await shelf.has(other), true);
        for (const blob of mine) assert.equal(await holds(blob), theirs.has(blob), blob);
        // The kept image still fetches whole.
        const target = path.join(dir, `kept-${randomBytes(3).toString('hex')}`);
        assert.equal(await shelf.fetch(other, target, { tag: 'image', maxBytes: MAX }), true);
        await shelf.remove([other], []);
        assert.equal(await shelf.has(other), false);
        for (const blob of theirs) assert.equal(await holds(blob), false, blob);
      });
    });
  }
});
