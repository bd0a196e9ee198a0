/**
 * Build views (src/sandbox/views.ts): the folder a sandbox binds at /app is a hard-link copy of the
 * build outside the data directory, so the sandbox's mountinfo does not name the data directory.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { once } from 'node:events';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { createBuildViews } from '../src/sandbox/views.js';

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

  it('links the views in <data>/staging when no folder outside the data directory is on its file system', async () => {
    const data = path.join(root, 'data');
    const views = await createBuildViews({ buildsDir, candidates: [data, '/proc'], othersRead: true });
    try {
      assert.equal(views.reason, null);
      const view = await views.viewOf('b1');
      assert.equal(path.dirname(path.dirname(view)), path.join(data, 'staging'));
      const original = await fs.stat(path.join(buildsDir, 'b1', 'out', 'deep', 'data.txt'));
      assert.equal((await fs.stat(path.join(view, 'out', 'deep', 'data.txt'))).ino, original.ino, 'a hard link');
      // Sandboxes' uids pass through the data directory and staging/ (never list them).
      assert.equal((await fs.stat(data)).mode & 0o777, 0o711);
      assert.equal((await fs.stat(path.join(data, 'staging'))).mode & 0o777, 0o711);
    } finally {
      await views.close();
      await fs.rm(path.join(data, 'staging'), { recursive: true, force: true });
      await fs.chmod(data, 0o700);
    }
  });

  it('binds the build itself, and says why, when no folder outside the data directory is on its file system and <data>/staging cannot be made', async () => {
    const blocked = path.join(root, 'data', 'staging');
    await fs.writeFile(blocked, 'not a folder');
    const views = await createBuildViews({ buildsDir, candidates: [path.join(root, 'data'), '/proc'] });
    try {
      assert.match(String(views.reason), /bind build folders directly/);
      assert.equal(await views.viewOf('b1'), path.join(buildsDir, 'b1'));
    } finally {
      await views.close();
      await fs.rm(blocked);
    }
  });

  describe('the views folders of servers that are gone', () => {
    const children: ChildProcess[] = [];
    after(() => {
      for (const child of children) child.kill('SIGKILL');
    });

    /** A real process that makes its views folder in `parent`, views build b1, and waits; resolves with the folder. */
    async function server(parent: string): Promise<{ child: ChildProcess; folder: string }> {
      const module = new URL('../src/sandbox/views.js', import.meta.url).href;
      const script = `
        const { createBuildViews } = await import(${JSON.stringify(module)});
        const views = await createBuildViews({ buildsDir: ${JSON.stringify(buildsDir)}, candidates: [${JSON.stringify(parent)}] });
        const view = await views.viewOf('b1');
        process.stdout.write(JSON.stringify({ view }) + '\\n');
        setInterval(() => {}, 1000);
      `;
      const child = spawn(process.execPath, ['--input-type=module', '-e', script], {
        stdio: ['ignore', 'pipe', 'inherit'],
      });
      children.push(child);
      let out = '';
      for await (const chunk of child.stdout as AsyncIterable<Buffer>) {
        out += chunk.toString();
        if (out.includes('\n')) break;
      }
      const { view } = JSON.parse(out) as { view: string };
      return { child, folder: path.dirname(view) };
    }

    it("removes a killed server's folder at the next start and leaves live, foreign and linked ones alone", async () => {
      const parent = path.join(root, 'tmp');
      await fs.mkdir(parent);
      const dead = await server(parent);
      const live = await server(parent);
      assert.notEqual(dead.folder, live.folder);
      dead.child.kill('SIGKILL');
      await once(dead.child, 'exit');
      assert.ok((await fs.readdir(dead.folder)).includes('b1'), 'a killed server leaves its folder behind');

      // The live server's pid with another start time: that pid was reused, its server is gone.
      const liveOwner = JSON.parse(await fs.readFile(path.join(live.folder, '.owner'), 'utf8')) as { pid: number };
      const reused = path.join(parent, 'ferry-view-reused');
      await fs.mkdir(reused);
      await fs.writeFile(path.join(reused, '.owner'), JSON.stringify({ pid: liveOwner.pid, start: '1' }));
      // No .owner: not known to be a server's; a link: never followed or removed.
      const foreign = path.join(parent, 'ferry-view-foreign');
      await fs.mkdir(foreign);
      await fs.writeFile(path.join(foreign, 'keep.txt'), 'mine');
      const target = path.join(root, 'elsewhere');
      await fs.mkdir(target);
      await fs.writeFile(path.join(target, '.owner'), JSON.stringify({ pid: dead.child.pid, start: null }));
      await fs.symlink(target, path.join(parent, 'ferry-view-link'));

      const views = await createBuildViews({ buildsDir, candidates: [parent] });
      try {
        assert.equal(await views.swept, 2);
        const left = await fs.readdir(parent);
        assert.ok(!left.includes(path.basename(dead.folder)), "the killed server's folder is removed");
        assert.ok(!left.includes('ferry-view-reused'), 'a folder of a reused pid is removed');
        assert.ok(left.includes(path.basename(live.folder)), "a live server's folder is left");
        assert.ok((await fs.readdir(live.folder)).includes('b1'), 'and its views too');
        assert.equal(await fs.readFile(path.join(foreign, 'keep.txt'), 'utf8'), 'mine');
        assert.ok(left.includes('ferry-view-link'), 'a link is left');
        assert.ok((await fs.readdir(target)).includes('.owner'), 'and what it points to');
        // The original build is untouched by removing a view of it.
        assert.equal(await fs.readFile(path.join(buildsDir, 'b1', 'out', 'deep', 'data.txt'), 'utf8'), 'data');
      } finally {
        await views.close();
      }
    });
  });
});
