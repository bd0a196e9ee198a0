/**
 * Build views (src/replicas/build-view.ts): the folder a sandbox binds at /app is a hard-link copy of the
 * build outside the data directory, so the sandbox's mountinfo does not name the data directory.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { createBuildViews } from '../src/replicas/build-view.js';

describe('build views', () => {
  let root: string;
  let buildsDir: string;

  before(async () => {
    root = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-view-test-'));
    buildsDir = path.join(root, 'data', 'builds');
    const build = path.join(buildsDir, 'b1');
    await fs.mkdir(path.join(build, 'out', 'deep'), { recursive: true });
    await fs.writeFile(path.join(build, 'out', 'main.mjs'), 'export const run = () => 1;');
    await fs.writeFile(path.join(build, 'out', 'deep', 'data.txt'), 'data');
    await fs.symlink('main.mjs', path.join(build, 'out', 'link.mjs'));
  });
  after(() => fs.rm(root, { recursive: true, force: true }));

  it('links every file of the build into a folder outside the data directory', async () => {
    const views = await createBuildViews({ buildsDir, candidates: [root] });
    try {
      assert.equal(views.reason, null);
      const view = await views.viewOf('b1');
      assert.ok(!view.startsWith(path.join(root, 'data')), `${view} is outside the data directory`);
      assert.equal(path.basename(view), 'b1');
      assert.equal(await views.viewOf('b1'), view, 'made once');
      const original = await fs.stat(path.join(buildsDir, 'b1', 'out', 'deep', 'data.txt'));
      const linked = await fs.stat(path.join(view, 'out', 'deep', 'data.txt'));
      assert.equal(linked.ino, original.ino, 'a hard link, not a copy');
      assert.equal(await fs.readlink(path.join(view, 'out', 'link.mjs')), 'main.mjs');
      await assert.rejects(views.viewOf('missing'), { code: 'ENOENT' });
      await assert.rejects(views.viewOf('../b1'), /Invalid build id/);
    } finally {
      await views.close();
    }
    assert.deepEqual((await fs.readdir(root)).sort(), ['data'], 'close removes the views');
  });

  it('binds the build itself, and says why, when no folder outside the data directory is on its file system', async () => {
    const views = await createBuildViews({ buildsDir, candidates: [path.join(root, 'data'), '/proc'] });
    try {
      assert.match(String(views.reason), /bind build folders directly/);
      assert.equal(await views.viewOf('b1'), path.join(buildsDir, 'b1'));
    } finally {
      await views.close();
    }
  });
});
