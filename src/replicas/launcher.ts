/**
 * Prepares the process of one replica: the runtime's command (the Node or Python bootstrap), the
 * environment (the project's secrets, the app's [env], Ferry's protocol variables, and nothing of the
 * server's own environment), and the sandbox around it (sandbox/launch.ts).
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { findPython } from '../builds/builders/python.js';
import { prepareLaunch, type SandboxCapabilities, sandboxPaths } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import type { BuildViews } from '../sandbox/views.js';
import type { Store } from '../store/index.js';
import type { Volumes } from '../volumes/volumes.js';
import type { PoolBuild } from './pool.js';
import type { LaunchPlan } from './replica.js';

/** The compiled Node bootstrap; copied (read-only) into every Node replica's sandbox. */
export const NODE_BOOTSTRAP = fileURLToPath(new URL('../runtimes/cortex-node/bootstrap.js', import.meta.url));

/**
 * The Python bootstrap; copied (read-only) into every Python replica's sandbox. The build compiles TypeScript only, so
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
  /** Where sandboxed replicas find their build (a path that does not name the data directory; sandbox/views.ts). */
  views?: BuildViews;
  /** Gives each replica a network namespace of its own (acquired before spawn, released in cleanup). */
  network: SandboxNetwork;
  /** Makes `<buildsDir>/<build>` complete here, from the artifacts folder when another process built it. */
  ensureLocal?: (buildId: string) => Promise<void>;
  /** The project's secrets, decrypted, for the replica's environment. */
  secrets(projectId: string): Promise<Record<string, string>>;
  /** The app's `[[volumes]]`, mounted on this machine, as binds and groups (volumes/volumes.ts). */
  volumes?: Pick<Volumes, 'forLaunch'>;
}

/**
 * The custom runtime's supervisor; copied (read-only) into every custom replica's sandbox. It starts the user's server,
 * gates the replica's socket on the readiness check, forwards the socket to the server's port, and runs
 * the health checks (src/runtimes/custom/supervisor.ts).
 */
export const CUSTOM_SUPERVISOR = fileURLToPath(new URL('../runtimes/custom/supervisor.js', import.meta.url));

/** Node's heap gets three quarters of the memory limit, so a runaway heap fails clearly before the hard limit. */
const HEAP_SHARE = 0.75;

/** What differs between runtimes: the bootstrap copied into the sandbox, the command, a few variables. */
export interface RuntimeLaunch {
  bootstrap: { host: string; sandbox: string };
  defaultEntry: string;
  /** The command; Node's heap size follows the memory limit, so a warm pool keeps one shape of resources. */
  command(bootstrapPath: string, resources: PoolBuild['config']['resources']): Promise<string[]>;
  env: Record<string, string>;
  /** Custom runtime: its variables, and the app folder as working folder. */
  custom?: true;
}

export const RUNTIMES: Readonly<Record<string, RuntimeLaunch>> = {
  node: {
    // .mjs: alone in the sandbox, with no package.json beside it, the file must say it is an ES module.
    bootstrap: { host: NODE_BOOTSTRAP, sandbox: '/ferry/bootstrap.mjs' },
    defaultEntry: 'out/main.mjs',
    command: async (bootstrap, resources) => [
      process.execPath,
      `--max-old-space-size=${Math.max(16, Math.floor(resources.memory * HEAP_SHARE))}`,
      bootstrap,
    ],
    env: { NODE_ENV: 'production' },
  },
  python: {
    bootstrap: { host: PYTHON_BOOTSTRAP, sandbox: '/ferry/bootstrap.py' },
    defaultEntry: 'source/main.py',
    // The interpreter builds use, so installed packages match.
    command: async (bootstrap) => [(await findPython()) ?? 'python3', '-u', bootstrap],
    // The build folder is read-only in the sandbox; pip compiled the dependencies' bytecode at build time.
    env: { PYTHONDONTWRITEBYTECODE: '1', PYTHONUNBUFFERED: '1' },
  },
  custom: {
    bootstrap: { host: CUSTOM_SUPERVISOR, sandbox: '/ferry/supervisor.mjs' },
    defaultEntry: 'source',
    // The supervisor itself needs little; the memory limit covers the whole sandbox, the user's server too.
    command: async (bootstrap) => [process.execPath, '--max-old-space-size=64', bootstrap],
    env: {},
    custom: true,
  },
};

/** The variables the supervisor reads (and removes before starting the user's server). */
function customEnv(build: PoolBuild, port: number): Record<string, string> {
  const custom = build.config.runtime.custom;
  if (!custom) throw new Error(`build ${build.buildId} has no [runtime.custom] section`);
  return {
    PORT: String(port),
    FERRY_CUSTOM_ENTRYPOINT: JSON.stringify(custom.entrypoint),
    FERRY_CUSTOM_READYCHECK: custom.readycheck_endpoint,
    FERRY_CUSTOM_HEALTHCHECK: custom.healthcheck_endpoint,
    FERRY_CUSTOM_START_TIMEOUT_MS: String(custom.start_timeout * 1000),
    FERRY_CUSTOM_HEALTH_INTERVAL_MS: String(custom.healthcheck_interval * 1000),
  };
}

/** A port nothing listens on now (for custom replicas without a network namespace of their own). */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

export function createLauncher(deps: LauncherDeps) {
  return async function launch(build: PoolBuild, replicaId: string): Promise<LaunchPlan> {
    const row = await deps.store
      .selectFrom('builds')
      .select(['entry', 'runtime'])
      .where('id', '=', build.buildId)
      .executeTakeFirstOrThrow();
    const runtime = row.runtime ? RUNTIMES[row.runtime] : undefined;
    if (!runtime) throw new Error(`runtime ${row.runtime} is not supported by this server yet`);
    await deps.ensureLocal?.(build.buildId);
    const buildDir =
      deps.sandbox.bwrap !== null && deps.views
        ? await deps.views.viewOf(build.buildId)
        : path.join(deps.buildsDir, build.buildId);
    // Used only without bwrap: a sandboxed replica's socket is in its own private tmpfs.
    const socketDir = path.join(deps.runDir, replicaId);
    const layout = { buildDir, socketDir, runtimeFiles: [runtime.bootstrap] };
    const paths = sandboxPaths(layout, deps.sandbox.bwrap !== null);
    const sandboxed = deps.sandbox.bwrap !== null;
    let custom: Record<string, string> = {};
    if (runtime.custom) {
      // In its own network namespace every replica has the configured port to itself; without the sandbox
      // replicas share the host's network, so each gets a free port instead (PORT says which).
      custom = customEnv(build, sandboxed ? build.config.runtime.custom!.port : await freePort());
    }
    const env: Record<string, string> = {
      ...replicaEnvironment(build, runtime, await deps.secrets(build.projectId), paths, row.entry),
      ...custom,
    };
    // Mounted on this machine before the sandbox starts; refused (never unbounded) without the sandbox.
    const volumes = (await deps.volumes?.forLaunch(build.projectId, build.config)) ?? { binds: [], groups: [] };
    const lease = sandboxed ? await deps.network.acquire(replicaId) : null;
    let prepared: Awaited<ReturnType<typeof prepareLaunch>>;
    try {
      prepared = await prepareLaunch(
        {
          ...layout,
          replicaId,
          memoryMiB: build.config.resources.memory,
          maxProcesses: build.config.resources.max_processes,
          cpu: build.config.resources.cpu,
          command: await runtime.command(paths.runtimeFile(runtime.bootstrap.host), build.config.resources),
          env,
          ...(volumes.binds.length > 0 ? { volumes: volumes.binds, groups: volumes.groups } : {}),
          ...(lease ? { network: lease } : {}),
          ...(runtime.custom ? { cwd: row.entry ?? runtime.defaultEntry } : {}),
        },
        deps.sandbox,
      );
    } catch (err) {
      await lease?.release();
      throw err;
    }
    return {
      spawn: () => prepared.spawn(['ignore', 'pipe', 'pipe']),
      sandboxed: prepared.sandboxed,
      wasOomKilled: () => prepared.wasOomKilled(),
      async cleanup() {
        await prepared.cleanup();
        await lease?.release();
        await fs.rm(socketDir, { recursive: true, force: true });
      },
    };
  };
}

/** Ferry's own variables of every replica: the base of a warm sandbox's environment too (warm-pool.ts). */
export function baseEnvironment(runtime: RuntimeLaunch, socketPath: string): Record<string, string> {
  return {
    PATH: '/usr/local/bin:/usr/bin:/bin',
    HOME: '/tmp',
    ...runtime.env,
    FERRY_PROTOCOL: '1',
    FERRY_SOCKET: socketPath,
  };
}

/**
 * A replica's environment: the project's secrets, the app's [env], then Ferry's variables (which win). A
 * warm sandbox is given the same at load (warm-pool.ts), so an app cannot tell how its replica started.
 */
export function replicaEnvironment(
  build: PoolBuild,
  runtime: RuntimeLaunch,
  secrets: Record<string, string>,
  paths: { socketPath: string; appDir: string },
  entry: string | null,
): Record<string, string> {
  const base = baseEnvironment(runtime, paths.socketPath);
  return {
    ...secrets,
    ...build.config.env,
    PATH: base.PATH!,
    HOME: base.HOME!,
    ...runtime.env,
    APP_NAME: build.appId,
    PROJECT_ID: build.projectId,
    BUILD_ID: build.buildId,
    FERRY_PROTOCOL: '1',
    FERRY_SOCKET: paths.socketPath,
    FERRY_ENTRY: `${paths.appDir}/${entry ?? runtime.defaultEntry}`,
  };
}

function firstExisting(candidates: string[]): string {
  return candidates.find((file) => fsSync.existsSync(file)) ?? candidates[0]!;
}
