/**
 * The Node builder against real esbuild and real npm, in temporary folders (fixtures are copied, never
 * built in place). npm never reaches the network: dependencies are vendored `file:` packages, or a local
 * server that never answers when a test needs npm to hang.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { describe, it } from 'node:test';
import { pathToFileURL } from 'node:url';
import { parseAppConfig } from '../src/apps/app-config.js';
import { BuildFailedError } from '../src/builds/build-failed.js';
import type { Builder } from '../src/builds/builder.js';
import { selectBuilder } from '../src/runtimes/index.js';
import { createNodeBuilder } from '../src/runtimes/node/builder.js';
import { inputsOutsideApp } from '../src/runtimes/node/esbuild-agent.js';
import { detectSandbox } from '../src/sandbox/launch.js';
import {
  assertFailed,
  assertReady,
  buildHarness,
  processesIn,
  processesWithArgs,
  shareTestNetwork,
  unsandboxed,
  type Workspace,
  waitUntilGone,
} from './helpers/builds.js';

const TIMEOUT = 60_000;
/**
 * How long a cancelled build may take to end after the abort. Idle, npm ends well under a second after it;
 * esbuild only notices a cancel between its phases, so the big parse below runs to its end first (about
 * 1 s idle, 7 s seen with a load average of 14 on 2 cores). Generous on purpose: what proves that a cancel
 * landed is the abort reason plus no process left (npm would otherwise wait minutes on a registry that never
 * answers) or no main.mjs (esbuild would otherwise finish and write it); the bound only keeps a cancel that
 * hangs from passing, and the test's own timeout stays above it.
 */
const CANCEL_BOUND_MS = 30_000;

const h = buildHarness('node', () => createNodeBuilder());
const { workspace, runBuild } = h;

async function importBundle(ws: Workspace): Promise<Record<string, unknown>> {
  return (await import(pathToFileURL(path.join(ws.outputDir, 'main.mjs')).href)) as Record<string, unknown>;
}

describe('node builder: bundling', () => {
  it('bundles a TypeScript app with a local import into an importable main.mjs', { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-ts');
    const outcome = await runBuild(ws);
    const result = assertReady(outcome);

    // functions: the public exports found by esbuild without running the module (private _names left out).
    assert.deepEqual(result, { runtime: 'node', entry: 'out/main.mjs', functions: ['run'] });
    assert.ok(outcome.lines.includes('Entry: main.ts'), outcome.lines.join('\n'));
    assert.ok(
      outcome.lines.some((l) => /^Bundle: main\.mjs, [\d.]+ (B|KiB|MiB)$/.test(l)),
      outcome.lines.join('\n'),
    );
    assert.ok(!outcome.lines.some((l) => l.startsWith('Running npm')), 'no package.json, so no npm');
    await fs.access(path.join(ws.outputDir, 'main.mjs.map'));
    assert.match(await fs.readFile(path.join(ws.outputDir, 'main.mjs'), 'utf8'), /sourceMappingURL=main\.mjs\.map/);

    const mod = await importBundle(ws);
    assert.equal(typeof mod.run, 'function');
    const run = mod.run as (input: { name: string }) => unknown;
    // `dir` comes from the app's own `const __dirname = ...`, which must survive next to the banner.
    assert.deepEqual(run({ name: 'x' }), { message: 'Hello, X!', dir: ws.outputDir });
  });

  it('fails on a syntax error and logs the file and line', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-broken"\n',
      'main.ts': "import { helper } from './helper.js';\nexport const run = () => helper();\n",
      'helper.ts': 'export function helper() {\n  return 1 +;\n}\n',
    });
    const outcome = await runBuild(ws);
    const error = assertFailed(outcome, /^Bundling failed: helper\.ts:2:\d+: /);
    assert.match(error.message, /Unexpected ";"/);
    assert.ok(
      outcome.lines.some((l) => /^helper\.ts:2:\d+: Unexpected ";"$/.test(l)),
      outcome.lines.join('\n'),
    );
  });

  it('fails on an unresolvable import and logs it', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-unresolved"\n',
      'main.mjs': "import x from 'not-installed';\nexport const run = () => x;\n",
    });
    const outcome = await runBuild(ws);
    assertFailed(outcome, /^Bundling failed: main\.mjs:1:\d+: Could not resolve "not-installed"/);
    assert.ok(outcome.lines.includes('Entry: main.mjs'));
  });

  it('refuses an import that leads out of the app folder, also through a link', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-outside"\n',
      'main.js': "import text from './secret.txt' with { type: 'text' };\nexport const run = () => text;\n",
    });
    // A host file beside the build (as another build's files or the server's keys are), reached by a link.
    const secret = path.join(ws.root, 'host-secret.txt');
    await fs.writeFile(secret, 'HOST-SECRET-BYTES\n');
    await fs.symlink(secret, path.join(ws.sourceDir, 'secret.txt'));
    const outcome = await runBuild(ws);
    const error = assertFailed(outcome, /^Bundling failed: main\.js:1:\d+: FERRY_BUILD_IMPORT_OUTSIDE_APP: /);
    assert.match(error.message, /import "\.\/secret\.txt" in main\.js/);
    assert.deepEqual(await fs.readdir(ws.outputDir), []);

    const climbing = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-outside"\n',
      'main.js': "import text from '../host-secret.txt' with { type: 'text' };\nexport const run = () => text;\n",
    });
    await fs.writeFile(path.join(climbing.root, 'host-secret.txt'), 'HOST-SECRET-BYTES\n');
    assertFailed(
      await runBuild(climbing),
      /FERRY_BUILD_IMPORT_OUTSIDE_APP: import "\.\.\/host-secret\.txt" in main\.js/,
    );
  });

  it('fails clearly when there is no entry file', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-empty"\n',
      'index.ts': 'export const run = () => 1;\n',
    });
    const outcome = await runBuild(ws);
    assertFailed(
      outcome,
      /^No entry file: expected main\.ts, main\.js or main\.mjs \(TypeScript\/JavaScript\) or main\.py \(Python\) at the archive root$/,
    );
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
  });

  it('uses app.entry from ferry.toml, and fails when that file is missing', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-pick"\nentry = "main.mjs"\n',
      'main.ts': 'export const run = () => "ts";\n',
      'main.mjs': 'export const run = () => "mjs";\n',
    });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(outcome.lines.includes('Entry: main.mjs'));
    assert.equal(((await importBundle(ws)).run as () => string)(), 'mjs');

    const missing = await workspace(null, {
      'ferry.toml': '[app]\nname = "node-pick"\nentry = "main.js"\n',
      'main.ts': 'export const run = () => "ts";\n',
    });
    assertFailed(await runBuild(missing), /main\.js/);
  });
});

/**
 * Files esbuild reads that no checked import names (issue 30): a glob import's matches, a source map
 * comment's map, a tsconfig.json's `extends`. Each runs in the build sandbox and, with FERRY_SANDBOX=off,
 * as a plain process (there the app's folder is the host's and every host file is within reach).
 */
for (const mode of ['sandboxed', 'unsandboxed'] as const) {
  describe(`node builder: files outside the app (${mode})`, () => {
    const caps = () => (mode === 'sandboxed' ? detectSandbox() : unsandboxed());
    /** `dir` (a host folder the sandbox shows too: /etc, /proc) relative to the app folder as the step sees it. */
    const up = (ws: Workspace, dir: string) => path.relative(mode === 'sandboxed' ? '/app/source' : ws.sourceDir, dir);
    const build = async (ws: Workspace) => runBuild(ws, { caps: await caps() });

    it('runs in the mode it names', async () => {
      assert.equal((await caps()).bwrap !== null, mode === 'sandboxed', 'bubblewrap is needed for the sandboxed runs');
    });

    it('refuses a glob import whose matches are host files (/etc/host*, /proc/self/mount*)', {
      timeout: TIMEOUT,
    }, async () => {
      for (const [dir, prefix] of [
        ['/etc', 'host'],
        ['/proc/self', 'mount'],
      ] as const) {
        const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "node-glob"\n' });
        const glob = `${up(ws, dir)}/${prefix}`;
        await fs.writeFile(
          path.join(ws.sourceDir, 'main.js'),
          `export async function run({ n }) {\n  return (await import(\`${glob}\${n}\`, { with: { type: 'text' } })).default;\n}\n`,
        );
        const outcome = await build(ws);
        assertFailed(
          outcome,
          /^Bundling failed: main\.js:2:\d+: FERRY_BUILD_IMPORT_OUTSIDE_APP: this import matches a file outside/,
        );
        // Nothing was written (the old bundle held the files), and the matches are not named.
        assert.deepEqual(await fs.readdir(ws.outputDir), []);
        const log = outcome.lines.join('\n');
        assert.doesNotMatch(log, /hostname|mountinfo/, log);
        // One message, however many files matched.
        assert.equal(outcome.lines.filter((l) => l.includes('FERRY_BUILD_IMPORT_OUTSIDE_APP')).length, 1, log);
      }
    });

    it('still bundles a glob import inside the app, and refuses a match that is a link out of it', {
      timeout: TIMEOUT,
    }, async () => {
      const files = {
        'ferry.toml': '[app]\nname = "node-glob"\n',
        'main.js': `export async function run({ n }) {\n  return (await import(\`./data/\${n}.txt\`, { with: { type: 'text' } })).default;\n}\n`,
        'data/a.txt': 'APP-TEXT-A\n',
        'data/b.txt': 'APP-TEXT-B\n',
      };
      const ws = await workspace(null, files);
      assertReady(await build(ws));
      const run = (await importBundle(ws)).run as (input: { n: string }) => Promise<string>;
      assert.equal(await run({ n: 'b' }), 'APP-TEXT-B\n');

      const linked = await workspace(null, files);
      const secret = path.join(linked.root, 'host-secret.txt');
      await fs.writeFile(secret, 'HOST-SECRET-BYTES\n');
      await fs.symlink(mode === 'sandboxed' ? '/etc/hostname' : secret, path.join(linked.sourceDir, 'data', 'c.txt'));
      assertFailed(await build(linked), /FERRY_BUILD_IMPORT_OUTSIDE_APP/);
      assert.deepEqual(await fs.readdir(linked.outputDir), []);
    });

    it('refuses a source map comment that leads outside the app, however it is spelled', {
      timeout: TIMEOUT,
    }, async () => {
      const spellings = (ws: Workspace) => [
        `${up(ws, '/etc')}/hostname`,
        '/etc/hostname',
        'file:///etc/hostname',
        `${up(ws, '/etc').replaceAll('/', '%2F')}%2Fhostname`,
        `${up(ws, '/etc').replaceAll('.', '%2e')}/hostname`,
      ];
      const count = spellings(await workspace(null)).length;
      for (let i = 0; i < count; i++) {
        const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "node-map"\n' });
        const url = spellings(ws)[i]!;
        await fs.writeFile(
          path.join(ws.sourceDir, 'main.js'),
          `export const run = () => 1;\n//# sourceMappingURL=${url}\n`,
        );
        const outcome = await build(ws);
        assertFailed(
          outcome,
          /^Bundling failed: FERRY_BUILD_FILE_OUTSIDE_APP: the source map comment .* in main\.js leads outside/,
        );
        assert.deepEqual(await fs.readdir(ws.outputDir), []);
      }
    });

    it("never puts a host source map's sources into the bundle's map", { timeout: TIMEOUT }, async () => {
      const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "node-map"\n' });
      // Another build's map, say. In the sandbox nothing of the kind is within reach: /etc/hostname stands in.
      const hostMap = mode === 'sandboxed' ? '/etc/hostname' : path.join(ws.root, 'other.js.map');
      await fs.writeFile(
        path.join(ws.root, 'other.js.map'),
        JSON.stringify({ version: 3, sources: ['other.ts'], sourcesContent: ['HOST-SOURCE-BYTES'], mappings: 'AAAA' }),
      );
      await fs.writeFile(
        path.join(ws.sourceDir, 'main.js'),
        `export const run = () => 1;\n//# sourceMappingURL=${path.relative(mode === 'sandboxed' ? '/app/source' : ws.sourceDir, hostMap)}\n`,
      );
      const outcome = await build(ws);
      assertFailed(outcome, /FERRY_BUILD_FILE_OUTSIDE_APP/);
      for (const file of await fs.readdir(ws.outputDir)) {
        assert.ok(!(await fs.readFile(path.join(ws.outputDir, file), 'utf8')).includes('HOST-SOURCE-BYTES'), file);
      }

      // A map of the app's own still counts.
      const own = await workspace(null, {
        'ferry.toml': '[app]\nname = "node-map"\n',
        'main.js': 'export const run = () => 1;\n//# sourceMappingURL=maps/main.js.map\n',
        'maps/main.js.map': JSON.stringify({
          version: 3,
          sources: ['../original.ts'],
          sourcesContent: ['APP-SOURCE-BYTES'],
          mappings: 'AAAA',
        }),
      });
      assertReady(await build(own));
      assert.match(await fs.readFile(path.join(own.outputDir, 'main.mjs.map'), 'utf8'), /APP-SOURCE-BYTES/);
    });

    it('names a host file a tsconfig.json extends, but never quotes it', { timeout: TIMEOUT }, async () => {
      const hostname = (await fs.readFile('/etc/hostname', 'utf8')).trim();
      assert.ok(hostname.length > 0);
      for (const extend of ['/etc/hostname', `${'../'.repeat(12)}etc/hostname`]) {
        const ws = await workspace(null, {
          'ferry.toml': '[app]\nname = "node-tsconfig"\n',
          'main.ts': 'export const run = (): number => 1;\n',
          'tsconfig.json': JSON.stringify({ extends: extend }),
        });
        const outcome = await build(ws);
        const error = assertFailed(
          outcome,
          /^Bundling failed: FERRY_BUILD_FILE_OUTSIDE_APP: esbuild read \S*etc\/hostname, which is outside the app folder/,
        );
        const log = [error.message, ...outcome.lines].join('\n');
        // esbuild's own message was `Unexpected "<the file's first word>" in JSON`.
        assert.ok(!log.includes(`"${hostname.split(/\s/)[0]}"`), log);
        assert.doesNotMatch(log, /in JSON/, log);
      }
      if (mode === 'unsandboxed') {
        // A host file only a plain process sees, with a word that cannot be in the log by chance.
        const ws = await workspace(null, {
          'ferry.toml': '[app]\nname = "node-tsconfig"\n',
          'main.ts': 'export const run = (): number => 1;\n',
          'tsconfig.json': JSON.stringify({ extends: '../host.json' }),
        });
        await fs.writeFile(path.join(ws.root, 'host.json'), 'HOSTWORD-7d1c rest of a secret file\n');
        const outcome = await build(ws);
        const error = assertFailed(outcome, /FERRY_BUILD_FILE_OUTSIDE_APP: esbuild read \.\.\/host\.json/);
        assert.ok(![error.message, ...outcome.lines].join('\n').includes('HOSTWORD'), outcome.lines.join('\n'));
      }
    });
  });
}

describe('esbuild agent: the last check of the inputs', () => {
  it("names every input of the metafile outside the app, whatever esbuild's hooks did", async () => {
    const ws = await workspace(null, { 'main.js': '', 'node_modules/x/index.js': '' });
    const input = { bytes: 1, imports: [] };
    const inputs = {
      'main.js': input,
      'node_modules/x/index.js': input,
      [`${path.relative(ws.sourceDir, '/etc')}/hostname`]: input,
      [`file:${path.relative(ws.sourceDir, '/proc/self')}/mountinfo`]: input,
      'dataurl:data:text/plain,x': input,
    };
    assert.deepEqual(inputsOutsideApp({ inputs }, ws.sourceDir), [
      `${path.relative(ws.sourceDir, '/etc')}/hostname`,
      `${path.relative(ws.sourceDir, '/proc/self')}/mountinfo`,
    ]);
  });
});

describe('node builder: dependencies', () => {
  it('runs npm ci with a lock file and bundles the installed dependency', { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-local-dep');
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(
      outcome.lines.includes('Running npm ci --omit=dev --ignore-scripts --no-audit --no-fund'),
      outcome.lines.join('\n'),
    );
    assert.ok(outcome.lines.some((l) => /Install scripts are not run/.test(l)));
    assert.ok(outcome.lines.includes('Entry: main.js'));
    await fs.access(path.join(ws.sourceDir, 'node_modules', 'left'));
    // The build's own cache (the pipeline removes it when the build ends): no build shares another's.
    await fs.access(path.join(h.cacheDir, 'builds', 'b_test', 'npm'));

    // The bundle must stand alone: remove the sources and node_modules before loading it.
    await fs.rm(ws.sourceDir, { recursive: true });
    const run = (await importBundle(ws)).run as (input: { text: string }) => unknown;
    // `depDir` is the CommonJS package's __dirname, provided by the banner (the bundle's folder).
    assert.deepEqual(run({ text: 'ab' }), { padded: '....ab', depDir: 'out' });
  });

  it('runs npm install without a lock file', { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-local-dep');
    await fs.rm(path.join(ws.sourceDir, 'package-lock.json'));
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(
      outcome.lines.includes('Running npm install --omit=dev --ignore-scripts --no-audit --no-fund --no-package-lock'),
      outcome.lines.join('\n'),
    );
    await assert.rejects(fs.access(path.join(ws.sourceDir, 'package-lock.json')), 'no lock file is written');
    const run = (await importBundle(ws)).run as (input: { text: string }) => unknown;
    assert.deepEqual(run({ text: 'abc' }), { padded: '...abc', depDir: 'out' });
  });

  it("fails when npm fails, with npm's output in the log", { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-bad-dep');
    const outcome = await runBuild(ws);
    assertFailed(outcome, /^npm install failed \(exit code [1-9]\d*\)$/);
    assert.ok(
      outcome.lines.some((l) => l.startsWith('npm error') && l.includes('does-not-exist.tgz')),
      outcome.lines.join('\n'),
    );
    assert.ok(!outcome.lines.some((l) => l.startsWith('Bundling')), 'no bundling after a failed install');
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
  });

  it("gives npm a minimal environment, never the server's", { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-ts', { 'package.json': '{"name":"x","version":"1.0.0"}\n' });
    const fakeNpm = path.join(path.dirname(ws.sourceDir), 'fake-npm.sh');
    await fs.writeFile(fakeNpm, '#!/bin/sh\necho "args: $*"\nenv\n', { mode: 0o755 });
    process.env.FERRY_TEST_SECRET = 'top-secret-value';
    try {
      const outcome = await runBuild(ws, { builder: createNodeBuilder({ npmCommand: fakeNpm }) });
      assertReady(outcome);
      const log = outcome.lines.join('\n');
      assert.ok(!log.includes('top-secret-value'), log);
      // Sandboxed, npm sees the build's cache at /app/cache and the system's PATH; without bwrap, the host paths.
      const sandboxed = (await detectSandbox()).bwrap !== null;
      const cache = sandboxed ? '/app/cache' : path.join(h.cacheDir, 'builds', 'b_test');
      assert.ok(outcome.lines.includes(`HOME=${cache}/home`), log);
      assert.ok(outcome.lines.includes(`npm_config_cache=${cache}/npm`), log);
      assert.ok(outcome.lines.includes('npm_config_update_notifier=false'), log);
      assert.ok(outcome.lines.includes('npm_config_loglevel=warn'), log);
      const searchPath = outcome.lines.find((l) => l.startsWith('PATH='))?.slice('PATH='.length) ?? '';
      assert.ok(!searchPath.split(':').some((dir) => dir.startsWith(sandboxed ? '/app' : ws.root)), searchPath);
      if (sandboxed) assert.ok(outcome.lines.includes('PWD=/app/source'), log);
      // No dependencies: no note about skipped install scripts.
      assert.ok(!log.includes('Install scripts are not run'), log);
    } finally {
      delete process.env.FERRY_TEST_SECRET;
    }
  });
});

describe('node builder: cancellation', () => {
  it('kills a real npm that is waiting on the registry, promptly and completely', { timeout: TIMEOUT }, async () => {
    const controller = new AbortController();
    const reason = new Error('cancelled');
    let abortedAt = 0;
    // A registry that accepts the request and never answers: npm is surely mid-install when we abort.
    const registry = http.createServer(() => {
      if (abortedAt === 0) {
        abortedAt = Date.now();
        controller.abort(reason);
      }
    });
    await new Promise<void>((resolve) => registry.listen(0, '127.0.0.1', resolve));
    const port = (registry.address() as AddressInfo).port;
    try {
      const ws = await workspace('node-ts', {
        'package.json': '{"name":"x","version":"1.0.0","dependencies":{"left-pad":"1.3.0"}}\n',
        '.npmrc': `registry=http://127.0.0.1:${port}/\nfetch-retries=0\n`,
      });
      const outcome = await runBuild(ws, { signal: controller.signal, network: shareTestNetwork() });
      assert.ok(abortedAt > 0, `npm never asked the registry; log:\n${outcome.lines.join('\n')}`);
      assert.equal(outcome.error, reason, `expected the abort reason, got ${String(outcome.error)}`);
      const afterAbort = Date.now() - abortedAt;
      assert.ok(afterAbort < CANCEL_BOUND_MS, `took ${afterAbort} ms after the abort`);
      assert.deepEqual(await processesIn(ws.sourceDir), [], 'no npm process left behind');
      assert.deepEqual(await fs.readdir(ws.outputDir), []);
    } finally {
      registry.closeAllConnections();
      await new Promise<void>((resolve) => registry.close(() => resolve()));
    }
  });

  it("kills npm's whole process group", { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-ts', { 'package.json': '{"name":"x","version":"1.0.0"}\n' });
    const fakeNpm = path.join(path.dirname(ws.sourceDir), 'fake-npm.sh');
    // A child of npm (like git or node-gyp) that would outlive npm if only npm were killed. Its unusual
    // argument finds it from the host, whose pids differ from the sandbox's.
    const marker = String(5000 + Math.floor(Math.random() * 4000));
    await fs.writeFile(fakeNpm, `#!/bin/sh\nsleep ${marker} &\necho started\nwait\n`, { mode: 0o755 });
    const controller = new AbortController();
    let found: number[] = [];
    const outcome = await runBuild(ws, {
      builder: createNodeBuilder({ npmCommand: fakeNpm }),
      signal: controller.signal,
      onLog: (line) => {
        if (line !== 'started') return;
        void (async () => {
          // Bounded: the sleep is surely running within a few seconds of the echo after it.
          for (let i = 0; i < 100 && found.length === 0; i++) {
            found = await processesWithArgs(['sleep', marker]);
            if (found.length === 0) await new Promise((r) => setTimeout(r, 50));
          }
          controller.abort();
        })();
      },
    });
    assert.ok(found.length > 0, `the sleep was never seen running; log:\n${outcome.lines.join('\n')}`);
    assert.ok(outcome.error instanceof Error && outcome.error.name === 'AbortError', String(outcome.error));
    assert.ok(!(outcome.error instanceof BuildFailedError));
    assert.ok(outcome.ms < CANCEL_BOUND_MS, `took ${outcome.ms} ms`);
    // Killed with the sandbox; the kernel may still be finishing its exit when the build returns.
    await waitUntilGone(found);
    assert.deepEqual(await processesWithArgs(['sleep', marker]), []);
  });

  it('stops during bundling', { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-local-dep');
    const controller = new AbortController();
    const reason = new Error('server stopping');
    const outcome = await runBuild(ws, {
      signal: controller.signal,
      onLog: (line) => {
        if (line.startsWith('Bundling ')) controller.abort(reason);
      },
    });
    assert.ok(
      outcome.lines.some((l) => l.startsWith('Bundling ')),
      outcome.lines.join('\n'),
    );
    assert.equal(outcome.error, reason, `expected the abort reason, got ${String(outcome.error)}`);
    assert.ok(!outcome.lines.some((l) => l.startsWith('Bundle: ')), 'the bundle step did not finish');
  });

  it('cancels esbuild in the middle of a slow bundle', { timeout: TIMEOUT }, async (t) => {
    // Big enough that esbuild needs about a second, so the abort lands while rebuild() is running.
    const lines = Array.from({ length: 200_000 }, (_, i) => `export const v${i} = ${i} * 2 + Math.random();`);
    const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "node-big"\n', 'main.js': lines.join('\n') });
    const controller = new AbortController();
    const reason = new Error('cancelled');
    let abortedAt = 0;
    const outcome = await runBuild(ws, {
      signal: controller.signal,
      onLog: (line) => {
        if (!line.startsWith('Bundling ')) return;
        setTimeout(() => {
          abortedAt = Date.now();
          controller.abort(reason);
        }, 100);
      },
    });
    assert.equal(outcome.error, reason, `expected the abort reason, got ${String(outcome.error)}`);
    const afterAbort = Date.now() - abortedAt;
    t.diagnostic(`the build ended ${afterAbort} ms after the abort`);
    assert.ok(afterAbort < CANCEL_BOUND_MS, `took ${afterAbort} ms after the abort`);
    // The proof that the cancel landed inside esbuild: it writes nothing for a cancelled build, while a
    // finished-then-discarded one would leave main.mjs.
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
  });

  it('does nothing when already cancelled', { timeout: TIMEOUT }, async () => {
    const ws = await workspace('node-local-dep');
    const outcome = await runBuild(ws, { signal: AbortSignal.abort() });
    assert.ok(outcome.error instanceof Error && outcome.error.name === 'AbortError', String(outcome.error));
    assert.deepEqual(outcome.lines, []);
    await assert.rejects(fs.access(path.join(ws.sourceDir, 'node_modules')));
  });
});

describe('selectBuilder', () => {
  const node: Builder = { name: 'node', build: async () => ({ runtime: 'node', entry: 'out/main.mjs' }) };
  const python: Builder = { name: 'python', build: async () => ({ runtime: 'python', entry: 'out/main.py' }) };
  const custom: Builder = { name: 'custom', build: async () => ({ runtime: 'custom', entry: 'source' }) };

  async function dirWith(...names: string[]): Promise<string> {
    const ws = await workspace(null, Object.fromEntries(names.map((n) => [n, ''])));
    return ws.sourceDir;
  }

  it('picks node for Node entries and when nothing is there yet', async () => {
    const config = parseAppConfig('[app]\nname = "a"\n');
    assert.equal(selectBuilder(config, await dirWith('main.ts'), { node, python }), node);
    assert.equal(selectBuilder(config, await dirWith('README.md'), { node, python }), node);
  });

  it('fails naming both entries when a Node entry and main.py are there without app.entry', async () => {
    const config = parseAppConfig('[app]\nname = "a"\n');
    for (const nodeEntry of ['main.ts', 'main.js']) {
      const dir = await dirWith(nodeEntry, 'main.py');
      assert.throws(
        () => selectBuilder(config, dir, { node, python }),
        (err: unknown) => {
          assert.ok(err instanceof BuildFailedError);
          assert.match(err.message, new RegExp(`Both ${nodeEntry.replace('.', '\\.')} and main\\.py .*entry = `));
          return true;
        },
      );
    }
  });

  it('picks python for main.py, named or found', async () => {
    const found = parseAppConfig('[app]\nname = "a"\n');
    assert.equal(selectBuilder(found, await dirWith('main.py'), { node, python }), python);
    const named = parseAppConfig('[app]\nname = "a"\nentry = "main.py"\n');
    assert.equal(selectBuilder(named, await dirWith('main.ts', 'main.py'), { node, python }), python);
    const nodeNamed = parseAppConfig('[app]\nname = "a"\nentry = "main.ts"\n');
    assert.equal(selectBuilder(nodeNamed, await dirWith('main.py'), { node, python }), node);
  });

  it('picks custom for the custom runtime', async () => {
    const config = parseAppConfig('[app]\nname = "a"\nruntime = "custom"\n[runtime.custom]\nentrypoint = "./server"\n');
    assert.equal(selectBuilder(config, await dirWith('main.ts'), { node, custom }), custom);
  });

  it('fails clearly when the needed builder is not on this server', async () => {
    const py = parseAppConfig('[app]\nname = "a"\n');
    const pyDir = await dirWith('main.py');
    assert.throws(
      () => selectBuilder(py, pyDir, { node }),
      (err: unknown) => {
        assert.ok(err instanceof BuildFailedError);
        assert.match(err.message, /Python runtime is not available/);
        return true;
      },
    );
    const cu = parseAppConfig('[app]\nname = "a"\nruntime = "custom"\n[runtime.custom]\nentrypoint = "./server"\n');
    assert.throws(() => selectBuilder(cu, pyDir, { node, python }), /custom runtime is not available/);
  });
});
