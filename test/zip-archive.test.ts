import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { describe, it } from 'node:test';
import { crc32 } from 'node:zlib';
import yazl from 'yazl';
import { DEFAULT_ZIP_LIMITS, extractZip, inspectZip, listZip, type ZipLimits } from '../src/builds/zip-archive.js';
import { type ErrorCode, FerryError } from '../src/errors.js';
import { makeZip, type RawZipEntry } from './helpers/raw-zip.js';

const MiB = 1024 * 1024;

interface Sandbox {
  root: string;
  zip: string;
  dest: string;
}

/** A temp folder holding `archive.zip` and an empty `out/`, removed afterwards. */
async function withSandbox(archive: Buffer, fn: (box: Sandbox) => Promise<void>): Promise<void> {
  const root = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-zip-'));
  try {
    const box = { root, zip: path.join(root, 'archive.zip'), dest: path.join(root, 'out') };
    await fs.writeFile(box.zip, archive);
    await fs.mkdir(box.dest);
    await fn(box);
  } finally {
    await fs.rm(root, { recursive: true, force: true });
  }
}

function isFerryError(code: ErrorCode, ...mentions: string[]) {
  return (err: unknown) => {
    assert.ok(err instanceof FerryError, `expected a FerryError, got ${String(err)}`);
    assert.equal(err.code, code, err.message);
    for (const text of mentions) assert.ok(err.message.includes(text), `"${err.message}" should mention ${text}`);
    return true;
  };
}

/** Extraction must leave `out/` empty and write nothing next to it. */
async function assertNothingWritten(box: Sandbox): Promise<void> {
  assert.deepEqual((await fs.readdir(box.root)).sort(), ['archive.zip', 'out']);
  assert.deepEqual(await fs.readdir(box.dest), []);
}

/** inspectZip and extractZip must both refuse, naming the entry, and extraction must leave nothing behind. */
async function assertRefused(
  entries: RawZipEntry[] | Buffer,
  code: ErrorCode,
  mentions: string[],
  limits: ZipLimits = DEFAULT_ZIP_LIMITS,
): Promise<void> {
  const archive = Buffer.isBuffer(entries) ? entries : makeZip(entries);
  await withSandbox(archive, async (box) => {
    await assert.rejects(inspectZip(box.zip, limits), isFerryError(code, ...mentions));
    await assert.rejects(extractZip(box.zip, box.dest, { limits }), isFerryError(code, ...mentions));
    await assertNothingWritten(box);
  });
}

async function yazlZip(build: (zip: yazl.ZipFile) => void): Promise<Buffer> {
  const zip = new yazl.ZipFile();
  build(zip);
  zip.end();
  const chunks: Buffer[] = [];
  for await (const chunk of zip.outputStream) chunks.push(Buffer.from(chunk as Buffer));
  return Buffer.concat(chunks);
}

describe('zip-archive: a good archive', () => {
  const mtime = new Date('2025-03-04T05:06:07.000Z');
  const contents: Array<{ name: string; data: Buffer; mode: number; compress: boolean }> = [
    { name: 'ferry.toml', data: Buffer.from('[app]\nname = "demo"\n'), mode: 0o100644, compress: true },
    {
      name: 'src/index.ts',
      data: Buffer.from('export default () => "hi";\n'.repeat(50)),
      mode: 0o100644,
      compress: true,
    },
    { name: 'src/lib/deep/util.js', data: Buffer.from([0, 1, 2, 255, 254, 10, 13]), mode: 0o100644, compress: false },
    { name: 'bin/run.sh', data: Buffer.from('#!/bin/sh\necho run\n'), mode: 0o100755, compress: true },
  ];

  async function goodArchive(): Promise<Buffer> {
    return yazlZip((zip) => {
      zip.addEmptyDirectory('src/', { mtime });
      for (const c of contents) zip.addBuffer(c.data, c.name, { mtime, mode: c.mode, compress: c.compress });
      zip.addEmptyDirectory('empty/', { mtime });
    });
  }

  it('extracts byte for byte, with the exec bit, and reports the files in archive order', async () => {
    await withSandbox(await goodArchive(), async (box) => {
      const result = await extractZip(box.zip, box.dest);
      assert.deepEqual(
        result.files.map((f) => f.path),
        contents.map((c) => c.name),
      );
      assert.equal(
        result.totalSize,
        contents.reduce((n, c) => n + c.data.length, 0),
      );
      for (const c of contents) {
        const file = path.join(box.dest, ...c.name.split('/'));
        assert.deepEqual(await fs.readFile(file), c.data, c.name);
        assert.equal((await fs.stat(file)).mode & 0o777, c.mode === 0o100755 ? 0o755 : 0o644, c.name);
      }
      assert.ok((await fs.stat(path.join(box.dest, 'empty'))).isDirectory());
      assert.deepEqual((await fs.readdir(box.dest)).sort(), ['bin', 'empty', 'ferry.toml', 'src']);
      assert.deepEqual((await fs.readdir(box.root)).sort(), ['archive.zip', 'out']);
    });
  });

  it('lists and inspects the same entries with sizes, CRC-32 and dates', async () => {
    await withSandbox(await goodArchive(), async (box) => {
      const listed = await listZip(box.zip);
      assert.deepEqual(
        listed.map((f) => [f.path, f.size, f.crc32, f.modified]),
        contents.map((c) => [c.name, c.data.length, crc32(c.data).toString(16).padStart(8, '0'), mtime.toISOString()]),
      );
      const stored = listed.find((f) => f.path === 'src/lib/deep/util.js');
      assert.equal(stored?.compressed_size, 7);
      const big = listed.find((f) => f.path === 'src/index.ts');
      assert.ok(big && big.compressed_size < big.size, 'deflated entry should be smaller');
      for (const f of listed) assert.match(f.crc32, /^[0-9a-f]{8}$/);
      const inspected = await inspectZip(box.zip);
      assert.deepEqual(inspected.files, listed);
    });
  });

  it('normalizes "./" prefixes, doubled slashes and backslashes', async () => {
    const archive = makeZip([
      { name: './a/./b.txt', data: 'b' },
      { name: 'dir\\file.txt', data: 'f', mode: 0o100755 },
      { name: 'x//y.txt', data: 'y', method: 'deflate' },
    ]);
    await withSandbox(archive, async (box) => {
      const { files } = await extractZip(box.zip, box.dest);
      assert.deepEqual(
        files.map((f) => f.path),
        ['a/b.txt', 'dir/file.txt', 'x/y.txt'],
      );
      assert.equal(await fs.readFile(path.join(box.dest, 'dir', 'file.txt'), 'utf8'), 'f');
      assert.equal((await fs.stat(path.join(box.dest, 'dir', 'file.txt'))).mode & 0o777, 0o755);
      assert.equal(await fs.readFile(path.join(box.dest, 'x', 'y.txt'), 'utf8'), 'y');
      assert.deepEqual(
        (await listZip(box.zip)).map((f) => f.path),
        ['a/b.txt', 'dir/file.txt', 'x/y.txt'],
      );
    });
  });

  it('lets small, very compressible files through the ratio rule', async () => {
    await withSandbox(
      makeZip([{ name: 'zeros.bin', data: Buffer.alloc(512 * 1024), method: 'deflate' }]),
      async (box) => {
        const { files } = await extractZip(box.zip, box.dest);
        assert.ok(files[0]!.size / files[0]!.compressed_size > DEFAULT_ZIP_LIMITS.maxRatio);
        assert.equal((await fs.stat(path.join(box.dest, 'zeros.bin'))).size, 512 * 1024);
      },
    );
  });
});

describe('zip-archive: unreadable archives', () => {
  it('refuses garbage, an empty file and a truncated archive as FERRY_ZIP_CORRUPT', async () => {
    const good = await yazlZip((zip) => zip.addBuffer(Buffer.from('hello'), 'a.txt'));
    for (const bytes of [
      Buffer.from('this is not a zip file at all'),
      Buffer.alloc(0),
      good.subarray(0, good.length - 10),
    ]) {
      await withSandbox(bytes, async (box) => {
        await assert.rejects(inspectZip(box.zip), isFerryError('FERRY_ZIP_CORRUPT'));
        await assert.rejects(listZip(box.zip), isFerryError('FERRY_ZIP_CORRUPT'));
        await assert.rejects(extractZip(box.zip, box.dest), isFerryError('FERRY_ZIP_CORRUPT'));
        await assertNothingWritten(box);
      });
    }
  });

  it('refuses a central directory that runs past the end of the file', async () => {
    const archive = makeZip([{ name: 'a.txt', data: 'a' }]);
    // Claim a second entry that is not there.
    const end = archive.length - 22;
    archive.writeUInt16LE(2, end + 8);
    archive.writeUInt16LE(2, end + 10);
    await assertRefused(archive, 'FERRY_ZIP_CORRUPT', ['number 2']);
  });

  it('refuses a stored entry whose two sizes disagree before extracting anything', async () => {
    await assertRefused(
      [
        { name: 'ok.txt', data: 'fine' },
        { name: 'liar.txt', data: 'short', declaredSize: 5000 },
      ],
      'FERRY_ZIP_CORRUPT',
      ['"liar.txt"'],
    );
  });
});

describe('zip-archive: refusal rules', () => {
  it('too many entries, judged from the count alone', async () => {
    const entries = [{ name: 'a.txt' }, { name: 'b.txt' }, { name: 'c.txt' }];
    await assertRefused(entries, 'FERRY_ZIP_TOO_MANY_ENTRIES', ['3 entries', 'limit is 2'], {
      ...DEFAULT_ZIP_LIMITS,
      maxEntries: 2,
    });
    await withSandbox(makeZip(entries), async (box) => {
      const { files } = await inspectZip(box.zip, { ...DEFAULT_ZIP_LIMITS, maxEntries: 3 });
      assert.equal(files.length, 3);
    });
  });

  it('absolute paths, pointing right next to the destination', async () => {
    await withSandbox(Buffer.alloc(0), async (box) => {
      const outside = path.join(box.root, 'escaped.txt');
      await fs.writeFile(
        box.zip,
        makeZip([
          { name: 'fine.txt', data: 'ok' },
          { name: outside, data: 'pwned' },
        ]),
      );
      await assert.rejects(extractZip(box.zip, box.dest), isFerryError('FERRY_ZIP_ABSOLUTE_PATH', `"${outside}"`));
      await assertNothingWritten(box);
    });
    for (const name of [
      '/etc/ferry-evil.txt',
      'C:/evil.txt',
      'c:evil.txt',
      '\\evil.txt',
      '\\\\server\\share\\evil.txt',
    ]) {
      await assertRefused(
        [
          { name: 'fine.txt', data: 'ok' },
          { name, data: 'pwned' },
        ],
        'FERRY_ZIP_ABSOLUTE_PATH',
        [`"${name}"`],
      );
    }
  });

  it('path traversal with "..", also through backslashes and directories', async () => {
    for (const name of [
      '../evil.txt',
      'a/../../evil.txt',
      '..\\evil.txt',
      'a\\..\\..\\evil.txt',
      'a/b/../c.txt',
      '../',
    ]) {
      await assertRefused(
        [
          { name: 'fine.txt', data: 'ok' },
          { name, data: 'pwned' },
        ],
        'FERRY_ZIP_PATH_TRAVERSAL',
        [`"${name}"`, 'leaves the archive folder'],
      );
    }
    await assertRefused(
      [
        { name: 'fine.txt', data: 'ok' },
        { name: '../evil.txt', data: 'x' },
      ],
      'FERRY_ZIP_PATH_TRAVERSAL',
      ['Archive entry "../evil.txt" leaves the archive folder'],
    );
  });

  it('empty names, NUL characters and names with no file part', async () => {
    await assertRefused([{ name: 'fine.txt' }, { name: '' }], 'FERRY_ZIP_PATH_TRAVERSAL', ['empty name']);
    await assertRefused([{ name: 'fine.txt' }, { name: 'a\0b.txt' }], 'FERRY_ZIP_PATH_TRAVERSAL', [
      '"a\\u0000b.txt"',
      'NUL',
    ]);
    await assertRefused([{ name: 'fine.txt' }, { name: './.' }], 'FERRY_ZIP_PATH_TRAVERSAL', ['"./."']);
  });

  it('names over 255 bytes and paths over 1024 bytes, before extraction (the file system would say ENAMETOOLONG)', async () => {
    await assertRefused([{ name: 'fine.txt' }, { name: `${'n'.repeat(300)}.txt` }], 'FERRY_ZIP_PATH_TOO_LONG', [
      'name of 304 bytes',
    ]);
    // 128 two-byte characters: 256 bytes, though only 128 characters.
    await assertRefused([{ name: `${'é'.repeat(128)}` }], 'FERRY_ZIP_PATH_TOO_LONG', ['256 bytes']);
    const deep = Array.from({ length: 50 }, () => 'd'.repeat(100)).join('/');
    await assertRefused([{ name: 'fine.txt' }, { name: `${deep}/x.txt` }], 'FERRY_ZIP_PATH_TOO_LONG', ['path of']);
  });

  it('symbolic links', async () => {
    await assertRefused(
      [
        { name: 'fine.txt', data: 'ok' },
        { name: 'link', data: '/etc/passwd', mode: 0o120777 },
      ],
      'FERRY_ZIP_SYMLINK',
      ['"link"'],
    );
  });

  it('devices, FIFOs and sockets', async () => {
    const kinds = { chr: 0o020644, blk: 0o060644, fifo: 0o010644, sock: 0o140755 };
    for (const [name, mode] of Object.entries(kinds)) {
      await assertRefused(
        [
          { name: 'fine.txt', data: 'ok' },
          { name, mode },
        ],
        'FERRY_ZIP_SPECIAL_FILE',
        [`"${name}"`],
      );
    }
  });

  it('encrypted entries', async () => {
    await assertRefused(
      [
        { name: 'fine.txt', data: 'ok' },
        { name: 'secret.txt', data: 'xxxxxxxxxxxxsecret', flags: 1 },
      ],
      'FERRY_ZIP_ENCRYPTED',
      ['"secret.txt"'],
    );
    // yauzl rejects strong encryption itself, before the entry (and its name) is handed over.
    await assertRefused(
      [
        { name: 'fine.txt', data: 'ok' },
        { name: 'strong.txt', data: 'xxxx', flags: 0x41 },
      ],
      'FERRY_ZIP_ENCRYPTED',
      ['number 2'],
    );
  });

  it('duplicate paths, including after normalization and file-versus-folder clashes', async () => {
    const cases: Array<[RawZipEntry[], string]> = [
      [
        [
          { name: 'a.txt', data: '1' },
          { name: 'a.txt', data: '2' },
        ],
        '"a.txt"',
      ],
      [
        [
          { name: 'a.txt', data: '1' },
          { name: './a.txt', data: '2' },
        ],
        '"./a.txt"',
      ],
      [
        [
          { name: 'a/b.txt', data: '1' },
          { name: 'a\\b.txt', data: '2' },
        ],
        '"a\\b.txt"',
      ],
      [[{ name: 'a', data: '1' }, { name: 'a/' }], '"a/"'],
      [[{ name: 'a/' }, { name: 'a', data: '1' }], '"a"'],
      [
        [
          { name: 'a', data: '1' },
          { name: 'a/b.txt', data: '2' },
        ],
        '"a/b.txt"',
      ],
      [
        [
          { name: 'a/b.txt', data: '1' },
          { name: 'a', data: '2' },
        ],
        '"a"',
      ],
    ];
    for (const [entries, mention] of cases) await assertRefused(entries, 'FERRY_ZIP_DUPLICATE_ENTRY', [mention]);
  });

  it('an archive that expands past the size limit, named at the entry that crosses it', async () => {
    const limits = { ...DEFAULT_ZIP_LIMITS, maxUncompressedBytes: 100 };
    const entries = [
      { name: 'one.bin', data: Buffer.alloc(60, 1) },
      { name: 'two.bin', data: Buffer.alloc(60, 2) },
    ];
    await assertRefused(entries, 'FERRY_ZIP_TOO_LARGE', ['"two.bin"', '100 bytes'], limits);
    await withSandbox(makeZip(entries), async (box) => {
      const { totalSize } = await inspectZip(box.zip, { ...limits, maxUncompressedBytes: 120 });
      assert.equal(totalSize, 120);
    });
  });

  it('a zip bomb: 50 MiB of zeros deflated', async () => {
    await assertRefused(
      [
        { name: 'fine.txt', data: 'ok' },
        { name: 'bomb.bin', data: Buffer.alloc(50 * MiB), method: 'deflate' },
      ],
      'FERRY_ZIP_RATIO',
      ['"bomb.bin"'],
    );
  });

  it('a zip bomb spread over many entries of 1 MiB, none over the per-entry threshold', async () => {
    const entries = Array.from({ length: 20 }, (_, i) => ({
      name: `part-${i}.bin`,
      data: Buffer.alloc(MiB),
      method: 'deflate' as const,
    }));
    await assertRefused(entries, 'FERRY_ZIP_RATIO', ['The archive', 'more than 200 times']);
    // The same entries pass when the whole-archive ratio is not what stops them: proof it is that check.
    await withSandbox(makeZip(entries), async (box) => {
      const { totalSize } = await inspectZip(box.zip, { ...DEFAULT_ZIP_LIMITS, maxRatio: 100_000 });
      assert.equal(totalSize, 20 * MiB);
    });
  });

  it('an archive with only folders, or nothing at all', async () => {
    await assertRefused([{ name: 'a/' }, { name: 'a/b/' }], 'FERRY_ZIP_EMPTY', []);
    await assertRefused([], 'FERRY_ZIP_EMPTY', []);
  });
});

describe('zip-archive: data that does not match its central directory', () => {
  it('a CRC-32 mismatch in the second file fails extraction and removes the first', async () => {
    const archive = makeZip([
      { name: 'first/a.txt', data: 'all good here' },
      { name: 'second/b.txt', data: 'this will be damaged' },
    ]);
    const at = archive.indexOf('this will be damaged');
    archive[at] = 'T'.charCodeAt(0);
    await withSandbox(archive, async (box) => {
      const { files } = await inspectZip(box.zip);
      assert.equal(files.length, 2, 'the central directory itself is fine');
      await assert.rejects(
        extractZip(box.zip, box.dest),
        isFerryError('FERRY_ZIP_CORRUPT', '"second/b.txt"', 'CRC-32'),
      );
      await assertNothingWritten(box);
    });
  });

  it('a deflated entry that holds more data than declared', async () => {
    const archive = makeZip([
      { name: 'fine.txt', data: 'ok' },
      { name: 'liar.bin', data: Buffer.alloc(100_000, 7), method: 'deflate', declaredSize: 1000 },
    ]);
    await withSandbox(archive, async (box) => {
      await inspectZip(box.zip);
      await assert.rejects(
        extractZip(box.zip, box.dest),
        isFerryError('FERRY_ZIP_CORRUPT', '"liar.bin"', 'more data than the 1000 bytes'),
      );
      await assertNothingWritten(box);
    });
  });

  it('a deflated entry that holds less data than declared', async () => {
    const archive = makeZip([
      { name: 'fine.txt', data: 'ok' },
      { name: 'short.txt', data: 'only a little', method: 'deflate', declaredSize: 5000 },
    ]);
    await withSandbox(archive, async (box) => {
      await assert.rejects(extractZip(box.zip, box.dest), isFerryError('FERRY_ZIP_CORRUPT', '"short.txt"', '5000'));
      await assertNothingWritten(box);
    });
  });

  it('a bomb that hides behind a small declared size is cut off, not written out', async () => {
    const archive = makeZip([
      { name: 'bomb.bin', data: Buffer.alloc(50 * MiB), method: 'deflate', declaredSize: 4096 },
    ]);
    await withSandbox(archive, async (box) => {
      await inspectZip(box.zip);
      await assert.rejects(
        extractZip(box.zip, box.dest),
        isFerryError('FERRY_ZIP_CORRUPT', '"bomb.bin"', 'more data than the 4096 bytes'),
      );
      await assertNothingWritten(box);
    });
  });
});

describe('zip-archive: extraction safety', () => {
  it('never overwrites a file already in the destination, and removes only what it wrote', async () => {
    const archive = makeZip([
      { name: 'new/one.txt', data: 'one' },
      { name: 'keep.txt', data: 'from the archive' },
    ]);
    await withSandbox(archive, async (box) => {
      await fs.writeFile(path.join(box.dest, 'keep.txt'), 'already here');
      await assert.rejects(extractZip(box.zip, box.dest), isFerryError('FERRY_ZIP_DUPLICATE_ENTRY', '"keep.txt"'));
      assert.deepEqual(await fs.readdir(box.dest), ['keep.txt']);
      assert.equal(await fs.readFile(path.join(box.dest, 'keep.txt'), 'utf8'), 'already here');
    });
  });

  it('honours an AbortSignal and leaves nothing behind', async () => {
    const archive = makeZip([
      { name: 'a/one.txt', data: 'one' },
      { name: 'b/two.txt', data: 'two' },
    ]);
    await withSandbox(archive, async (box) => {
      const controller = new AbortController();
      const reason = new Error('cancelled');
      controller.abort(reason);
      await assert.rejects(extractZip(box.zip, box.dest, { signal: controller.signal }), (err) => err === reason);
      await assertNothingWritten(box);
    });
  });

  it('stops when aborted mid-way and removes the files already written', async () => {
    const archive = makeZip([
      { name: 'a/one.txt', data: 'one' },
      // Incompressible and large enough that extraction is still busy when the abort lands.
      { name: 'b/two.bin', data: randomBytes(32 * MiB) },
      { name: 'c/three.txt', data: 'three' },
    ]);
    await withSandbox(archive, async (box) => {
      const controller = new AbortController();
      const reason = new Error('stop');
      const watcher = setInterval(() => {
        fs.stat(path.join(box.dest, 'a', 'one.txt')).then(
          () => controller.abort(reason),
          () => {},
        );
      }, 1);
      try {
        await assert.rejects(extractZip(box.zip, box.dest, { signal: controller.signal }), (err) => err === reason);
      } finally {
        clearInterval(watcher);
      }
      await assertNothingWritten(box);
    });
  });
});
