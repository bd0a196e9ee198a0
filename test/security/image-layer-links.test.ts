/**
 * Image layers that plant a link where a folder was, so that the unpacker's deferred work (an opaque
 * whiteout emptying its folder at the layer's end, the folder modes set at the very end) would act on a
 * host folder through it (issue 43, point 1). As root, `a/`, `a/.wh..wh..opq`, `a -> /host/folder` emptied
 * the host folder, and `b/` (0777), `b -> /other/folder` made that folder 0777; a Dockerfile's
 * `RUN mkdir /a && chmod 777 /a` then `RUN rm -rf /a && ln -s /host/folder /a` did the second through the
 * built image's two layers.
 *
 * Here the unpacker (src/images/unpack.ts) is run in-process, with no sandbox around it, so that each
 * defence of its own is proven: both reproductions, then a generated sweep of one- and two-layer images
 * over a few names (folder, file, links out of the root absolute and relative, hard links out, whiteouts,
 * opaque whiteouts, mode changes), each asserting that a canary tree beside the root is unchanged
 * (content, mode, owner, times) and that nothing was made beside it. test/security/unpack-sandbox.test.ts
 * proves the sandbox the server runs it in.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { FerryError } from '../../src/errors.js';
import { unpackLayers } from '../../src/images/unpack.js';
import { canaryState, makeCanary } from '../helpers/canary.js';
import { tempDir } from '../helpers/ferry.js';
import { type LayerEntry, layer, linksOverFolders } from '../helpers/tar-layer.js';

const LIMITS = { maxBytes: 16 * 1024 * 1024, maxEntries: 10_000 };

describe('security: image layers cannot reach the host through links they plant', () => {
  let work: string;
  let n = 0;
  before(async () => {
    work = await tempDir('ferry-layer-links-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  /** A case folder holding `root` (empty) and `canary` (a small tree that must never change). */
  async function fresh(): Promise<{ dir: string; root: string; canary: string }> {
    const dir = path.join(work, `case-${++n}`);
    await fs.mkdir(path.join(dir, 'root'), { recursive: true });
    const canary = await makeCanary(path.join(dir, 'canary'));
    return { dir, root: path.join(dir, 'root'), canary };
  }

  /** Unpacks; a refusal (FERRY_IMAGE_*) is a fine outcome, any other error is not. */
  async function unpackEither(root: string, layers: Buffer[], owner?: { first: number; count: number }) {
    try {
      await unpackLayers(
        root,
        layers.map((bytes) => () => Readable.from([bytes])),
        LIMITS,
        owner ? { owner } : {},
      );
      return 'unpacked';
    } catch (err) {
      assert.ok(err instanceof FerryError, `only a coded refusal: ${String(err)}`);
      assert.match(err.code, /^FERRY_IMAGE_/);
      return err.code;
    }
  }

  async function assertUntouched(c: { dir: string; canary: string }, before: string, what: string) {
    assert.equal(await canaryState(c.canary), before, `the canary tree changed: ${what}`);
    assert.deepEqual(
      (await fs.readdir(c.dir)).sort(),
      ['canary', 'root'],
      `something was made beside the root: ${what}`,
    );
  }

  it('an opaque whiteout whose folder a later entry turned into a link empties nothing of the host', async () => {
    const c = await fresh();
    const before = await canaryState(c.canary);
    await unpackEither(c.root, [await layer(linksOverFolders(c.canary))]);
    await assertUntouched(c, before, 'the base image reproduction');
    assert.equal(await fs.readlink(path.join(c.root, 'a')), c.canary, 'the link itself is kept, as text');
  });

  it("a folder's mode is never set through the link a later layer put in its place (a Dockerfile's two RUN lines)", async () => {
    for (const owner of [undefined, { first: 0, count: 65_536 }]) {
      const c = await fresh();
      const before = await canaryState(c.canary);
      await unpackEither(
        c.root,
        [
          // RUN mkdir /a && chmod 777 /a
          await layer([{ name: 'a/', type: 'directory', mode: 0o777 }]),
          // RUN rm -rf /a && ln -s /host/folder /a, as the step's diff writes it
          await layer([
            { name: '.wh.a', content: '' },
            { name: 'a', type: 'symlink', linkname: path.join(c.canary, 'd') },
          ]),
        ],
        owner,
      );
      await assertUntouched(c, before, `the Dockerfile reproduction${owner ? ' (with owners)' : ''}`);
    }
  });

  it('no one- or two-layer image over a few names changes anything outside the root (generated)', async () => {
    const cases = generatedCases();
    let unpacked = 0;
    // One canary for every case: a case that changed it fails the test there and then.
    const c = await fresh();
    const before = await canaryState(c.canary);
    for (const layers of cases) {
      await fs.rm(c.root, { recursive: true, force: true });
      await fs.mkdir(c.root);
      const what = JSON.stringify(layers.map((entries) => entries.map(label)));
      const built = await Promise.all(
        layers.map((entries) =>
          layer(entries.map((e) => (e.linkname ? { ...e, linkname: e.linkname.replace('@CANARY', c.canary) } : e))),
        ),
      );
      if ((await unpackEither(c.root, built)) === 'unpacked') unpacked++;
      await assertUntouched(c, before, what);
    }
    // The sweep is worth something only if most images are unpacked rather than refused at once.
    assert.ok(unpacked > cases.length / 4, `${unpacked} of ${cases.length} cases unpacked`);
  });
});

/** Entries over the names `a`, `a/x` and `b`: each kind of thing an attacker may put at a path. */
function entriesFor(name: string): LayerEntry[] {
  const depth = name.split('/').length;
  const up = `${'../'.repeat(depth)}canary`;
  const list: LayerEntry[] = [
    { name: `${name}/`, type: 'directory' },
    { name: `${name}/`, type: 'directory', mode: 0o777 },
    { name: `${name}/`, type: 'directory', mode: 0o500 },
    { name, content: 'file' },
    { name, content: 'file', mode: 0o777 },
    { name, type: 'symlink', linkname: '@CANARY' },
    { name, type: 'symlink', linkname: '@CANARY/d' },
    { name, type: 'symlink', linkname: up },
    { name, type: 'link', linkname: `${up}/f` },
    { name, type: 'link', linkname: 'b' },
    { name: path.posix.join(path.posix.dirname(name), `.wh.${path.posix.basename(name)}`), content: '' },
    { name: `${name}/.wh..wh..opq`, content: '' },
  ];
  return list;
}

const POOL: LayerEntry[] = ['a', 'a/x', 'b'].flatMap(entriesFor);

function label(e: LayerEntry): string {
  const what = e.type === 'symlink' ? `->${e.linkname}` : e.type === 'link' ? `=>${e.linkname}` : (e.type ?? 'file');
  return `${e.name} ${what}${e.mode !== undefined ? ` ${e.mode.toString(8)}` : ''}`;
}

/** A small deterministic generator (mulberry32), so that a failing case is the same on every run. */
function random(seed: number): () => number {
  let a = seed;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Every one-layer image of one or two entries, then seeded samples of longer and of two-layer images. */
function generatedCases(): LayerEntry[][][] {
  const cases: LayerEntry[][][] = [];
  for (const first of POOL) {
    cases.push([[first]]);
    for (const second of POOL) cases.push([[first, second]]);
  }
  const next = random(43);
  const pick = () => POOL[Math.floor(next() * POOL.length)]!;
  const run = (min: number, max: number) => Array.from({ length: min + Math.floor(next() * (max - min + 1)) }, pick);
  for (let i = 0; i < 300; i++) cases.push([run(3, 6)]);
  for (let i = 0; i < 500; i++) cases.push([run(1, 4), run(1, 4)]);
  return cases;
}
