import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, describe, it } from 'node:test';
import yauzl from 'yauzl';
import { type AppConfig, parseAppConfig } from '../src/apps/app-config.js';
import { MAX_FILES, packZip, selectFiles } from '../src/cli/pack.js';

const roots: string[] = [];
after(async () => {
  await Promise.all(roots.map((dir) => fs.rm(dir, { recursive: true, force: true })));
});

/** Makes a temp app folder holding `tree` (path -> content); every tree also gets a ferry.toml. */
async function makeApp(tree: Record<string, string | Buffer>): Promise<string> {
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-pack-test-'));
  roots.push(dir);
  const all: Record<string, string | Buffer> = { 'ferry.toml': '[app]\nname = "hello"\n', ...tree };
  for (const [rel, content] of Object.entries(all)) {
    const abs = path.join(dir, rel);
    await fs.mkdir(path.dirname(abs), { recursive: true });
    await fs.writeFile(abs, content);
  }
  return dir;
}

/** A config with the real defaults from app-config.ts, overriding only what a test names. */
function config(patterns: { include?: string[]; exclude?: string[] } = {}): AppConfig {
  const base = parseAppConfig('[app]\nname = "hello"\n');
  return { ...base, app: { ...base.app, ...patterns } };
}

async function select(dir: string, cfg: AppConfig = config()) {
  const skipped: [string, string][] = [];
  const files = await selectFiles(dir, cfg, { onSkip: (p, reason) => skipped.push([p, reason]) });
  return { paths: files.map((f) => f.path), files, skipped };
}

describe('selectFiles', () => {
  it('with the default patterns skips dotfiles, .git, node_modules, __pycache__ and .env', async () => {
    const dir = await makeApp({
      'main.ts': 'export default () => 1;',
      'lib/util.ts': 'export const x = 1;',
      '.env': 'SECRET=1',
      'sub/.env': 'SECRET=2',
      '.gitignore': 'dist',
      '.git/config': '[core]',
      'lib/vendored/.git/HEAD': 'ref',
      'node_modules/pkg/index.js': 'module.exports = 1;',
      '__pycache__/m.cpython-312.pyc': 'x',
      '.github/workflows/ci.yml': 'on: push',
    });
    const { paths, files } = await select(dir);
    assert.deepEqual(paths, ['ferry.toml', 'lib/util.ts', 'main.ts']);
    assert.equal(files.find((f) => f.path === 'main.ts')?.size, 'export default () => 1;'.length);
  });

  it('keeps secrets and node_modules out even when the excludes allow them, and says so', async () => {
    const dir = await makeApp({
      'main.ts': '',
      '.gitignore': 'dist',
      '.env': 'A=1',
      '.env.production': 'A=2',
      'config/.env': 'A=3',
      'certs/server.PEM': 'pem',
      'tls.key': 'key',
      '.npmrc': '//registry/:_authToken=x',
      '.pypirc': '[pypi]',
      id_rsa: 'key',
      'id_rsa.pub': 'pub',
      '.git/config': '[core]',
      'node_modules/pkg/index.js': '',
      'sub/node_modules/pkg/index.js': '',
    });
    const { paths, skipped } = await select(dir, config({ exclude: [] }));
    assert.deepEqual(paths, ['.gitignore', 'ferry.toml', 'main.ts']);
    const reported = skipped.map(([p]) => p).sort();
    assert.deepEqual(reported, [
      '.env',
      '.env.production',
      '.npmrc',
      '.pypirc',
      'certs/server.PEM',
      'config/.env',
      'id_rsa',
      'id_rsa.pub',
      'node_modules',
      'sub/node_modules',
      'tls.key',
    ]);
  });

  it('picks a secret file when an include pattern names it', async () => {
    const dir = await makeApp({ 'main.ts': '', '.env': 'A=1', '.env.production': 'A=2', 'config/.env': 'A=3' });
    const cfg = (include: string[]) => config({ include, exclude: ['node_modules/**'] });

    assert.deepEqual((await select(dir, cfg(['**/*', '.env.production']))).paths, [
      '.env.production',
      'ferry.toml',
      'main.ts',
    ]);
    assert.deepEqual((await select(dir, cfg(['**/*', 'config/.env']))).paths, ['config/.env', 'ferry.toml', 'main.ts']);
    // A broad pattern that merely matches is not a way of naming a secret.
    assert.deepEqual((await select(dir, cfg(['**/*', '*', '.*']))).paths, ['ferry.toml', 'main.ts']);
  });

  it('lets an include that names a file outright beat the excludes, and only that file', async () => {
    const dir = await makeApp({
      'main.ts': '',
      '.env.production': 'A=2',
      '.env': 'A=1',
      '.conf/app.ini': 'x=1',
      '.conf/other': 'y',
    });
    // Default excludes (".*" among them): the named files come along, their excluded neighbours do not.
    let { paths } = await select(dir, config({ include: ['**/*', '.env.production', '.conf/app.ini'] }));
    assert.deepEqual(paths, ['.conf/app.ini', '.env.production', 'ferry.toml', 'main.ts']);
    // A wildcard include does not beat an exclude.
    ({ paths } = await select(dir, config({ include: ['**/*', '.env*'] })));
    assert.deepEqual(paths, ['ferry.toml', 'main.ts']);
  });

  it('picks node_modules when an include pattern names it', async () => {
    const dir = await makeApp({
      'main.js': '',
      'node_modules/pkg/index.js': 'module.exports = 1;',
      'node_modules/pkg/package.json': '{}',
      'node_modules/.bin/tool': '',
    });
    const { paths } = await select(dir, config({ include: ['**/*', 'node_modules/**'], exclude: ['.*'] }));
    assert.deepEqual(paths, ['ferry.toml', 'main.js', 'node_modules/pkg/index.js', 'node_modules/pkg/package.json']);

    // Naming one package does not let `**/*` bring in the others.
    const one = await select(dir, config({ include: ['**/*', 'node_modules/pkg/index.js'], exclude: [] }));
    assert.deepEqual(one.paths, ['ferry.toml', 'main.js', 'node_modules/pkg/index.js']);
  });

  it('applies a custom exclude, pruning the folder it names without walking it', async () => {
    const dir = await makeApp({
      'main.ts': '',
      'tests/a.test.ts': '',
      'tests/deep/b.test.ts': '',
      'src/tests/kept.ts': '',
      'debug.log': '',
      'src/trace.log': '',
    });
    await fs.symlink(path.join(dir, 'main.ts'), path.join(dir, 'tests', 'link.ts'));
    const { paths, skipped } = await select(dir, config({ exclude: ['tests/**', '*.log'] }));
    // "tests/**" has a slash so it is anchored at the root; "*.log" has none so it matches at any depth.
    assert.deepEqual(paths, ['ferry.toml', 'main.ts', 'src/tests/kept.ts']);
    // The link inside tests/ would be reported had the walk gone in.
    assert.deepEqual(skipped, []);
  });

  it('applies a nested include pattern', async () => {
    const dir = await makeApp({
      'main.ts': '',
      'src/a.ts': '',
      'src/deep/er/b.ts': '',
      'src/readme.md': '',
      'other/c.ts': '',
    });
    const { paths } = await select(dir, config({ include: ['src/**/*.ts'] }));
    assert.deepEqual(paths, ['ferry.toml', 'src/a.ts', 'src/deep/er/b.ts']);
  });

  it('matches a slashless include at any depth', async () => {
    const dir = await makeApp({ 'a.py': '', 'pkg/b.py': '', 'pkg/c.txt': '' });
    const { paths } = await select(dir, config({ include: ['*.py'] }));
    assert.deepEqual(paths, ['a.py', 'ferry.toml', 'pkg/b.py']);
  });

  it('skips and reports symlinks without following them', async () => {
    const outside = await makeApp({ 'secret.txt': 'outside the app' });
    const dir = await makeApp({ 'main.ts': '', 'lib/real.ts': '' });
    await fs.symlink(path.join(dir, 'main.ts'), path.join(dir, 'alias.ts'));
    await fs.symlink(outside, path.join(dir, 'lib', 'outside'));
    await fs.symlink(path.join(dir, 'missing'), path.join(dir, 'dangling'));
    // Excluded by ".*": not worth a warning.
    await fs.symlink(outside, path.join(dir, '.venv'));

    const { paths, skipped } = await select(dir);
    assert.deepEqual(paths, ['ferry.toml', 'lib/real.ts', 'main.ts']);
    assert.deepEqual(skipped.map(([p]) => p).sort(), ['alias.ts', 'dangling', 'lib/outside']);
    for (const [, reason] of skipped) assert.match(reason, /symbolic link/);
  });

  it('sorts by path in code-unit order, whatever order the folder lists them in', async () => {
    const names = Array.from({ length: 40 }, (_, i) => `n${(i * 7919) % 97}.txt`);
    const dir = await makeApp(Object.fromEntries([...names, 'a/b', 'a-b', 'a.txt', 'B.txt'].map((n) => [n, ''])));
    const { paths } = await select(dir);
    assert.deepEqual(paths, [...paths].sort());
    assert.deepEqual(paths.slice(0, 4), ['B.txt', 'a-b', 'a.txt', 'a/b']);
  });

  it('always includes the root ferry.toml', async () => {
    const dir = await makeApp({ 'src/a.ts': '', 'sub/ferry.toml': '' });
    const { paths } = await select(dir, config({ include: ['src/**'], exclude: ['*.toml', 'ferry.toml'] }));
    assert.deepEqual(paths, ['ferry.toml', 'src/a.ts']);
  });

  it(`refuses more than ${MAX_FILES} files`, async () => {
    const dir = await makeApp({});
    await fs.mkdir(path.join(dir, 'many'));
    // ferry.toml is one of the MAX_FILES. Hard links are regular files to the walk and much cheaper to make.
    const source = path.join(dir, 'ferry.toml');
    for (let start = 0; start < MAX_FILES - 1; start += 500) {
      const batch = [];
      for (let i = start; i < Math.min(start + 500, MAX_FILES - 1); i++) {
        batch.push(fs.link(source, path.join(dir, 'many', `f${i}`)));
      }
      await Promise.all(batch);
    }
    assert.equal((await select(dir)).paths.length, MAX_FILES);

    await fs.writeFile(path.join(dir, 'one-too-many'), '');
    await assert.rejects(select(dir), /More than 10,000 files selected/);
  });
});

interface ZipEntry {
  data: Buffer;
  mode: number;
}

async function readZip(file: string): Promise<Map<string, ZipEntry>> {
  const zip = await yauzl.openPromise(file);
  const entries = new Map<string, ZipEntry>();
  for await (const entry of zip.eachEntry()) {
    const chunks: Buffer[] = [];
    for await (const chunk of await zip.openReadStreamPromise(entry)) chunks.push(chunk as Buffer);
    entries.set(entry.fileName, { data: Buffer.concat(chunks), mode: entry.externalFileAttributes >>> 16 });
  }
  return entries;
}

describe('packZip', () => {
  it('writes exactly the selected files with their bytes and exec bits', async () => {
    const big = randomBytes(3 * 1024 * 1024);
    const dir = await makeApp({
      'main.py': 'print("hi")\n',
      'bin/run.sh': '#!/bin/sh\necho hi\n',
      'data/blob.bin': big,
      'data/empty.txt': '',
      '.env': 'SECRET=1',
      'node_modules/x/index.js': '',
    });
    await fs.chmod(path.join(dir, 'bin/run.sh'), 0o755);
    await fs.chmod(path.join(dir, 'main.py'), 0o600);

    const files = await selectFiles(dir, config());
    const outDir = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-pack-out-'));
    roots.push(outDir);
    const out = path.join(outDir, 'app.zip');
    const { bytes } = await packZip(dir, files, out);

    assert.equal(bytes, (await fs.stat(out)).size);
    assert.ok(bytes < big.length + 10_000, 'the archive should be about the size of its contents');
    const entries = await readZip(out);
    assert.deepEqual([...entries.keys()].sort(), [
      'bin/run.sh',
      'data/blob.bin',
      'data/empty.txt',
      'ferry.toml',
      'main.py',
    ]);
    for (const file of files) {
      const entry = entries.get(file.path)!;
      assert.deepEqual(entry.data, await fs.readFile(path.join(dir, file.path)), file.path);
      assert.equal(entry.data.length, file.size, file.path);
    }
    assert.equal(entries.get('bin/run.sh')!.mode & 0o777, 0o755);
    assert.equal(entries.get('main.py')!.mode & 0o777, 0o644);
    assert.equal(entries.get('main.py')!.mode & 0o170000, 0o100000, 'entries are marked as regular files');
  });

  it('fails without leaving a partial archive when a file has gone', async () => {
    const dir = await makeApp({ 'main.py': '' });
    const files = await selectFiles(dir, config());
    await fs.rm(path.join(dir, 'main.py'));
    const out = path.join(dir, 'app.zip');
    await assert.rejects(packZip(dir, files, out), /ENOENT/);
    await assert.rejects(fs.stat(out), /ENOENT/);
  });
});
