/**
 * The runtimes behind one interface (src/runtimes/): each build's runtime is chosen once by the name its
 * builder recorded, and its capabilities and launch recipe say what differs: how calls reach a replica,
 * whether it is kept warm, which interpreter runs which in-sandbox program, the custom supervisor's
 * variables, the start timeout. Fast: nothing is started.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import type { PoolBuild } from '../src/replicas/pool.js';
import { RUNTIMES, runtimeNamed, runtimeOf } from '../src/runtimes/index.js';
import { findPython } from '../src/runtimes/python/interpreter.js';

const cortex = parseAppConfig('[app]\nname = "hello"\n');
const custom = parseAppConfig(
  '[app]\nname = "server"\nruntime = "custom"\n[runtime.custom]\nentrypoint = ["node", "server.js"]\nport = 9000\nstart_timeout = 7\n',
);
const customBuild: PoolBuild = { projectId: 'p', appId: 'server', buildId: 'b1', runtime: 'custom', config: custom };

describe('runtimes', () => {
  it('is chosen by the build’s runtime, and an unknown one is refused as before', () => {
    assert.equal(runtimeOf({ runtime: 'node' }), RUNTIMES.node);
    assert.equal(runtimeOf({ runtime: 'python' }), RUNTIMES.python);
    assert.equal(runtimeOf(customBuild), RUNTIMES.custom);
    assert.throws(() => runtimeNamed('ruby'), /runtime ruby is not supported by this server yet/);
    assert.throws(() => runtimeNamed(null), /not supported/);
    assert.throws(() => runtimeNamed('toString'), /not supported/);
  });

  it('says how calls reach a replica and which runtimes are kept warm', () => {
    assert.deepEqual(
      Object.values(RUNTIMES).map((r) => [r.name, r.calls, r.warm !== null]),
      [
        ['node', 'frames', true],
        ['python', 'frames', true],
        ['custom', 'http', false],
      ],
    );
    assert.ok(RUNTIMES.node.warm?.startupVariables.test('NODE_OPTIONS'));
    assert.ok(RUNTIMES.python.warm?.startupVariables.test('PYTHONPATH'));
    assert.ok(!RUNTIMES.python.warm?.startupVariables.test('NODE_OPTIONS'));
  });

  it('gives a custom server its own start timeout on top of the server’s', () => {
    assert.equal(RUNTIMES.custom.startTimeoutMs(custom, 10_000), 17_000);
    assert.equal(RUNTIMES.node.startTimeoutMs(cortex, 10_000), 10_000);
  });

  it('Node: the compiled bootstrap, on the host’s root filesystem, heap from the memory limit', async () => {
    const recipe = await RUNTIMES.node.launchRecipe({
      entry: RUNTIMES.node.defaultEntry,
      resources: { cpu: 1, memory: 512, max_processes: 256 },
      sandboxed: true,
    });
    assert.equal(recipe.rootfs.kind, 'host');
    assert.ok(fs.existsSync(recipe.program.host), recipe.program.host);
    assert.equal(recipe.program.sandbox, '/ferry/bootstrap.mjs');
    assert.deepEqual(recipe.command('/ferry/bootstrap.mjs'), [
      process.execPath,
      '--max-old-space-size=384',
      '/ferry/bootstrap.mjs',
    ]);
    assert.deepEqual(recipe.overrides, {});
    assert.equal(recipe.cwd, undefined);
  });

  it('Python: the bootstrap source, run by the interpreter builds use', async () => {
    const recipe = await RUNTIMES.python.launchRecipe({
      entry: RUNTIMES.python.defaultEntry,
      resources: { cpu: 1, memory: 1024, max_processes: 256 },
      sandboxed: true,
    });
    assert.ok(fs.existsSync(recipe.program.host), recipe.program.host);
    assert.ok(recipe.program.host.endsWith('src/runtimes/python/bootstrap.py'));
    assert.deepEqual(recipe.command('/ferry/bootstrap.py'), [
      (await findPython()) ?? 'python3',
      '-u',
      '/ferry/bootstrap.py',
    ]);
    assert.equal(await RUNTIMES.python.available(), (await findPython()) !== null);
  });

  it('custom: the supervisor with the app’s settings, in the app folder; a free port without a sandbox', async () => {
    const resources = custom.resources;
    const sandboxed = await RUNTIMES.custom.launchRecipe({
      build: customBuild,
      entry: 'source',
      resources,
      sandboxed: true,
    });
    assert.ok(fs.existsSync(sandboxed.program.host), sandboxed.program.host);
    assert.equal(sandboxed.cwd, 'source');
    assert.equal(sandboxed.overrides.PORT, '9000');
    assert.equal(sandboxed.overrides.FERRY_CUSTOM_ENTRYPOINT, '["node","server.js"]');
    assert.equal(sandboxed.overrides.FERRY_CUSTOM_START_TIMEOUT_MS, '7000');
    const shared = await RUNTIMES.custom.launchRecipe({
      build: customBuild,
      entry: 'source',
      resources,
      sandboxed: false,
    });
    assert.ok(Number(shared.overrides.PORT) > 0);
    await assert.rejects(
      RUNTIMES.custom.launchRecipe({ entry: 'source', resources, sandboxed: true }),
      /started for its app only/,
    );
  });
});
