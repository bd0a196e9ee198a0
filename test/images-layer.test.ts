/**
 * The layer writer (src/images/layer-writer.ts) on the entries a build step's diff makes: empty files,
 * given as a stream or not at all (pip writes `REQUESTED`, an empty file, into every install), and
 * whiteouts (empty files too) end their entry, and the layer, instead of waiting for a body forever; the
 * tar read back holds each entry with its bytes.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { after, describe, it } from 'node:test';
import { gunzipSync } from 'node:zlib';
import tar from 'tar-stream';
import { LayerWriter } from '../src/images/layer-writer.js';
import { blobPath, initLayout } from '../src/images/oci-layout.js';
import { tempDir } from './helpers/ferry.js';

async function entriesOf(gz: Buffer): Promise<Array<{ name: string; type: string; body: string }>> {
  const out: Array<{ name: string; type: string; body: string }> = [];
  const extract = tar.extract();
  const done = new Promise<void>((resolve, reject) => {
    extract.on('entry', (header, stream, next) => {
      const chunks: Buffer[] = [];
      stream.on('data', (c: unknown) => {
        chunks.push(c as Buffer);
      });
      stream.on('end', () => {
        out.push({ name: header.name, type: header.type ?? 'file', body: Buffer.concat(chunks).toString() });
        next();
      });
    });
    extract.on('finish', resolve);
    extract.on('error', reject);
  });
  extract.end(gunzipSync(gz));
  await done;
  return out;
}

describe('images: layer writer', () => {
  const made: string[] = [];
  after(async () => {
    for (const dir of made) await fs.rm(dir, { recursive: true, force: true });
  });

  it('ends empty files (streamed or bodiless) and whiteouts, and keeps the bytes of the others', async () => {
    const dir = await tempDir('pyimg-layer-');
    made.push(dir);
    const layout = path.join(dir, 'layout');
    await initLayout(layout);
    const writer = LayerWriter.open(layout);
    const common = { mode: 0o644, uid: 0, gid: 0, mtime: new Date(0) };
    const within = <T>(p: Promise<T>, what: string) =>
      Promise.race([
        p,
        new Promise<never>((_, reject) => setTimeout(() => reject(new Error(`${what} never ended`)), 30_000).unref()),
      ]);
    await within(writer.add({ ...common, name: 'dir', type: 'directory', mode: 0o755 }), 'a folder');
    await within(
      writer.add({ ...common, name: 'dir/REQUESTED', type: 'file', size: 0 }, Readable.from([])),
      'an empty streamed file',
    );
    await within(writer.add({ ...common, name: 'dir/.wh.gone', type: 'file', size: 0 }), 'a whiteout');
    await within(
      writer.add({ ...common, name: 'dir/data', type: 'file', size: 5 }, Readable.from([Buffer.from('hello')])),
      'a file',
    );
    const written = await within(writer.finish(layout), 'the layer');
    assert.equal(written.entries, 4);
    const entries = await entriesOf(await fs.readFile(blobPath(layout, written.descriptor.digest)));
    assert.deepEqual(entries, [
      { name: 'dir/', type: 'directory', body: '' },
      { name: 'dir/REQUESTED', type: 'file', body: '' },
      { name: 'dir/.wh.gone', type: 'file', body: '' },
      { name: 'dir/data', type: 'file', body: 'hello' },
    ]);
  });
});
