/**
 * Unpacking image layers as untrusted input (src/images/unpack.ts): layers made here with tar-stream,
 * one attack each, every one refused with FERRY_IMAGE_LAYER_UNSAFE and nothing written outside the root:
 * a `../` path; an absolute path; a link planted by one entry (absolute, or climbing with `..`) that a
 * later entry, of the same layer or of the next, would write through; a hard link to a host file; a
 * device node; a FIFO. Set-id and sticky bits are dropped. Whiteouts remove what lower layers left (an
 * opaque folder keeps what its own layer writes), gzip layers are read as gzip whatever their media
 * type, and the size and entry bounds hold.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { gzipSync } from 'node:zlib';
import { FerryError } from '../src/errors.js';
import { unpackLayers } from '../src/images/unpack.js';
import { tempDir } from './helpers/ferry.js';
import { layer } from './helpers/tar-layer.js';

const LIMITS = { maxBytes: 16 * 1024 * 1024, maxEntries: 10_000 };

describe('images: unpacking layers as untrusted input', () => {
  let work: string;
  let n = 0;
  /** A fresh root inside a fresh folder, with a sibling file that must never change. */
  async function fresh(): Promise<{ root: string; outside: string }> {
    const dir = path.join(work, `case-${++n}`);
    await fs.mkdir(path.join(dir, 'root'), { recursive: true });
    await fs.writeFile(path.join(dir, 'outside.txt'), 'untouched');
    return { root: path.join(dir, 'root'), outside: path.join(dir, 'outside.txt') };
  }
  async function unpack(root: string, layers: Buffer[], limits = LIMITS) {
    return unpackLayers(
      root,
      layers.map((bytes) => () => Readable.from([bytes])),
      limits,
    );
  }
  async function refused(layers: Buffer[], pattern: RegExp, code = 'FERRY_IMAGE_LAYER_UNSAFE') {
    const { root, outside } = await fresh();
    await assert.rejects(unpack(root, layers), (err: unknown) => {
      assert.ok(err instanceof FerryError, String(err));
      assert.equal(err.code, code, err.message);
      assert.match(err.message, pattern);
      assert.ok(!err.message.includes(work), 'no host path in the message');
      return true;
    });
    assert.equal(await fs.readFile(outside, 'utf8'), 'untouched');
    return root;
  }

  before(async () => {
    work = await tempDir('ferry-unpack-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it('unpacks files, folders, links and hard links; drops set-id and sticky bits', async () => {
    const { root } = await fresh();
    const result = await unpack(root, [
      gzipSync(
        await layer([
          { name: 'bin/', type: 'directory' },
          { name: 'bin/tool', content: 'tool', mode: 0o4755 },
          { name: 'bin/group-tool', content: 'g', mode: 0o2755 },
          { name: 'tmp/', type: 'directory', mode: 0o1777 },
          { name: 'bin/link', type: 'symlink', linkname: '/bin/tool' },
          { name: 'bin/hard', type: 'link', linkname: 'bin/tool' },
          { name: './etc/readonly/', type: 'directory', mode: 0o555 },
        ]),
      ),
      await layer([{ name: 'etc/readonly/later', content: 'a later layer fills a read-only folder' }]),
    ]);
    assert.equal(result.bytes, 'tool'.length + 1 + 'a later layer fills a read-only folder'.length);
    assert.equal((await fs.stat(path.join(root, 'bin/tool'))).mode & 0o7777, 0o755, 'setuid dropped');
    assert.equal((await fs.stat(path.join(root, 'bin/group-tool'))).mode & 0o7777, 0o755, 'setgid dropped');
    assert.equal((await fs.stat(path.join(root, 'tmp'))).mode & 0o7777, 0o777, 'sticky dropped');
    assert.equal(await fs.readlink(path.join(root, 'bin/link')), '/bin/tool', 'links are kept as text');
    assert.equal((await fs.stat(path.join(root, 'bin/hard'))).ino, (await fs.stat(path.join(root, 'bin/tool'))).ino);
    assert.equal((await fs.stat(path.join(root, 'etc/readonly'))).mode & 0o777, 0o555);
    assert.equal(
      await fs.readFile(path.join(root, 'etc/readonly/later'), 'utf8'),
      'a later layer fills a read-only folder',
    );
    await fs.chmod(path.join(root, 'etc/readonly'), 0o755);
  });

  it('refuses a path that climbs out with ..', async () => {
    await refused([await layer([{ name: '../outside.txt', content: 'overwritten' }])], /leaves the root/);
    await refused([await layer([{ name: 'a/../../outside.txt', content: 'overwritten' }])], /leaves the root/);
  });

  it('refuses an absolute path', async () => {
    await refused([await layer([{ name: '/tmp/ferry-absolute', content: 'x' }])], /absolute path/);
  });

  it('refuses an entry written through a link a former entry planted, in the same layer or the next', async () => {
    const dir = path.join(work, 'escape-target');
    await fs.mkdir(dir, { recursive: true });
    // Absolute target, same layer.
    await refused(
      [
        await layer([
          { name: 'etc', type: 'symlink', linkname: dir },
          { name: 'etc/passwd', content: 'owned' },
        ]),
      ],
      /passes through the symbolic link "etc"/,
    );
    // Absolute target, next layer.
    await refused(
      [
        await layer([{ name: 'usr', type: 'symlink', linkname: dir }]),
        await layer([{ name: 'usr/lib/evil', content: 'x' }]),
      ],
      /layer 2: .*symbolic link "usr"/,
    );
    // Relative target climbing out.
    await refused(
      [
        await layer([
          { name: 'up', type: 'symlink', linkname: '../..' },
          { name: 'up/outside.txt', content: 'x' },
        ]),
      ],
      /symbolic link "up"/,
    );
    // A hard link naming a path through such a link (it would link a host file into the image).
    await refused(
      [
        await layer([
          { name: 'h', type: 'symlink', linkname: '/etc' },
          { name: 'shadow', type: 'link', linkname: 'h/shadow' },
        ]),
      ],
      /symbolic link "h"/,
    );
    assert.deepEqual(await fs.readdir(dir), [], 'nothing was written through a link');
  });

  it('refuses a hard link to anything but a file unpacked before it', async () => {
    await refused([await layer([{ name: 'shadow', type: 'link', linkname: '../outside.txt' }])], /leaves the root/);
    await refused([await layer([{ name: 'x', type: 'link', linkname: 'missing' }])], /not a file unpacked before it/);
  });

  it('refuses device nodes and FIFOs', async () => {
    await refused(
      [
        await layer([
          { name: 'dev/', type: 'directory' },
          { name: 'dev/mem', type: 'character-device' },
        ]),
      ],
      /device node/,
    );
    await refused([await layer([{ name: 'disk', type: 'block-device' }])], /device node/);
    await refused([await layer([{ name: 'pipe', type: 'fifo' }])], /FIFO/);
  });

  it('applies whiteouts: a removed file, and an opaque folder that keeps its own layer’s entries', async () => {
    const { root } = await fresh();
    await unpack(root, [
      await layer([
        { name: 'etc/', type: 'directory' },
        { name: 'etc/gone', content: 'lower' },
        { name: 'etc/kept', content: 'lower' },
        { name: 'opt/', type: 'directory' },
        { name: 'opt/old', content: 'lower' },
      ]),
      await layer([
        { name: 'etc/.wh.gone', content: '' },
        { name: 'opt/', type: 'directory' },
        { name: 'opt/new', content: 'upper' },
        { name: 'opt/.wh..wh..opq', content: '' },
      ]),
    ]);
    assert.deepEqual((await fs.readdir(path.join(root, 'etc'))).sort(), ['kept']);
    assert.deepEqual(await fs.readdir(path.join(root, 'opt')), ['new']);
    await refused([await layer([{ name: '.wh...', content: '' }])], /leaves the root|malformed/);
  });

  it('bounds the unpacked bytes and the entries', async () => {
    const big = await layer([{ name: 'big', content: 'x'.repeat(4096) }]);
    const { root } = await fresh();
    await assert.rejects(unpack(root, [big], { maxBytes: 1024, maxEntries: 100 }), { code: 'FERRY_IMAGE_TOO_LARGE' });
    const many = await layer(Array.from({ length: 20 }, (_, i) => ({ name: `f${i}`, content: '' })));
    const other = await fresh();
    await assert.rejects(unpack(other.root, [many], { maxBytes: 1024, maxEntries: 10 }), {
      code: 'FERRY_IMAGE_TOO_LARGE',
    });
  });

  it('refuses a zstd layer as unsupported and garbage as unsafe', async () => {
    const zstd = Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]);
    const { root } = await fresh();
    await assert.rejects(unpack(root, [zstd]), { code: 'FERRY_IMAGE_UNSUPPORTED' });
    await refused(
      [Buffer.from('this is not a tar archive, just some text that is long enough '.repeat(20))],
      /not a readable tar/,
    );
  });
});
