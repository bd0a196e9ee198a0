/**
 * Prepares the process of one replica: the runtime's command (the Node bootstrap for cortex apps), the
 * environment (the project's secrets, the app's [env], Ferry's protocol variables, and nothing of the
 * server's own environment), and the sandbox around it (sandbox.ts).
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { findPython } from '../builds/builders/python.js';
import type { Store } from '../store/index.js';
import type { PoolBuild } from './pool.js';
import type { LaunchPlan } from './replica.js';
import { prepareLaunch, type SandboxCapabilities, sandboxPaths } from './sandbox.js';

/** The compiled Node bootstrap; bound read-only into every Node replica. */
export const NODE_BOOTSTRAP = fileURLToPath(new URL('../runtimes/cortex-node/bootstrap.js', import.meta.url));

/**
 * The Python bootstrap; bound read-only into every Python replica. The build compiles TypeScript only, so
 * from `dist/src/replicas/` this is the source file under `src/` (which the package ships); next to this
 * file's folder when run from the sources.
 */
export const PYTHON_BOOTSTRAP = firstExisting([
  fileURLToPath(new URL('../../../src/runtimes/cortex-python/bootstrap.py', import.meta.url)),
  fileURLToPath(new URL('../runtimes/cortex-python/bootstrap.py', import.meta.url)),
]);

export interface LauncherDeps {
  store: Store;
  buildsDir: string;
  /** Where replica socket folders are made (short: Unix socket paths are limited to 107 bytes). */
  runDir: string;
  sandbox: SandboxCapabilities;
  /** The project's secrets, decrypted, for the replica's environment. */
  secrets(projectId: string): Promise<Record<string, string>>;
}

/** Node's heap gets three quarters of the memory limit, so a runaway heap fails clearly before the hard limit. */
const HEAP_SHARE = 0.75;

export function createLauncher(deps: LauncherDeps) {
  return async function launch(build: PoolBuild, replicaId: string): Promise<LaunchPlan> {
    const row = await deps.store
      .selectFrom('builds')
      .select(['entry', 'runtime'])
      .where('id', '=', build.buildId)
      .executeTakeFirstOrThrow();
    if (row.runtime === 'python') return launchPython(deps, build, replicaId, row.entry);
    if (row.runtime !== 'node') throw new Error(`runtime ${row.runtime} is not supported by this server yet`);
    const buildDir = path.join(deps.buildsDir, build.buildId);
    const socketDir = path.join(deps.runDir, replicaId);
    await fs.mkdir(socketDir, { recursive: true, mode: 0o700 });
    // .mjs: alone in the sandbox, with no package.json beside it, the file must say it is an ES module.
    const layout = { buildDir, socketDir, runtimeFiles: [{ host: NODE_BOOTSTRAP, sandbox: '/ferry/bootstrap.mjs' }] };
    const paths = sandboxPaths(layout, deps.sandbox.bwrap !== null);
    const env: Record<string, string> = {
      ...(await deps.secrets(build.projectId)),
      ...build.config.env,
      PATH: '/usr/local/bin:/usr/bin:/bin',
      HOME: '/tmp',
      NODE_ENV: 'production',
      APP_NAME: build.appId,
      PROJECT_ID: build.projectId,
      BUILD_ID: build.buildId,
      FERRY_PROTOCOL: '1',
      FERRY_SOCKET: paths.socketPath,
      FERRY_ENTRY: `${paths.appDir}/${row.entry ?? 'out/main.mjs'}`,
    };
    const memoryMiB = build.config.resources.memory;
    const heapMiB = Math.max(16, Math.floor(memoryMiB * HEAP_SHARE));
    const prepared = await prepareLaunch(
      {
        ...layout,
        replicaId,
        memoryMiB,
        command: [process.execPath, `--max-old-space-size=${heapMiB}`, paths.runtimeFile(NODE_BOOTSTRAP)],
        env,
      },
      deps.sandbox,
    );
    return {
      spawn: () => prepared.spawn(['ignore', 'pipe', 'pipe']),
      socketPath: prepared.paths.hostSocketPath,
      sandboxed: prepared.sandboxed,
      wasOomKilled: () => prepared.wasOomKilled(),
      async cleanup() {
        await prepared.cleanup();
        await fs.rm(socketDir, { recursive: true, force: true });
      },
    };
  };
}

/** A Python replica (cortex runtime): the Python bootstrap on the interpreter builds use, with the same environment. */
async function launchPython(
  deps: LauncherDeps,
  build: PoolBuild,
  replicaId: string,
  entry: string | null,
): Promise<LaunchPlan> {
  const python = (await findPython()) ?? 'python3';
  const buildDir = path.join(deps.buildsDir, build.buildId);
  const socketDir = path.join(deps.runDir, replicaId);
  await fs.mkdir(socketDir, { recursive: true, mode: 0o700 });
  const layout = { buildDir, socketDir, runtimeFiles: [{ host: PYTHON_BOOTSTRAP, sandbox: '/ferry/bootstrap.py' }] };
  const paths = sandboxPaths(layout, deps.sandbox.bwrap !== null);
  const env: Record<string, string> = {
    ...(await deps.secrets(build.projectId)),
    ...build.config.env,
    PATH: '/usr/local/bin:/usr/bin:/bin',
    HOME: '/tmp',
    APP_NAME: build.appId,
    PROJECT_ID: build.projectId,
    BUILD_ID: build.buildId,
    FERRY_PROTOCOL: '1',
    FERRY_SOCKET: paths.socketPath,
    FERRY_ENTRY: `${paths.appDir}/${entry ?? 'source/main.py'}`,
    // The build folder is read-only in the sandbox; pip compiled the dependencies' bytecode at build time.
    PYTHONDONTWRITEBYTECODE: '1',
    PYTHONUNBUFFERED: '1',
  };
  const prepared = await prepareLaunch(
    {
      ...layout,
      replicaId,
      memoryMiB: build.config.resources.memory,
      command: [python, '-u', paths.runtimeFile(PYTHON_BOOTSTRAP)],
      env,
    },
    deps.sandbox,
  );
  return {
    spawn: () => prepared.spawn(['ignore', 'pipe', 'pipe']),
    socketPath: prepared.paths.hostSocketPath,
    sandboxed: prepared.sandboxed,
    wasOomKilled: () => prepared.wasOomKilled(),
    async cleanup() {
      await prepared.cleanup();
      await fs.rm(socketDir, { recursive: true, force: true });
    },
  };
}

function firstExisting(candidates: string[]): string {
  return candidates.find((file) => fsSync.existsSync(file)) ?? candidates[0]!;
}
