/**
 * Prepares the process of one replica: the runtime's command (the Node bootstrap for cortex apps), the
 * environment (the app's [env], the project's secrets, Ferry's protocol variables and nothing of the
 * server's own environment), and the sandbox around it.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Store } from '../store/index.js';
import type { PoolBuild } from './pool.js';
import type { LaunchPlan } from './replica.js';

export const NODE_BOOTSTRAP = fileURLToPath(new URL('../runtimes/cortex-node/bootstrap.js', import.meta.url));

export interface LauncherDeps {
  store: Store;
  buildsDir: string;
  /** Where replica socket folders are made (short: Unix socket paths are limited to 107 bytes). */
  runDir: string;
  /** The project's secrets, decrypted, for the replica's environment. */
  secrets(projectId: string): Promise<Record<string, string>>;
}

export function createLauncher(deps: LauncherDeps) {
  return async function launch(build: PoolBuild, replicaId: string): Promise<LaunchPlan> {
    const row = await deps.store
      .selectFrom('builds')
      .select(['entry', 'runtime'])
      .where('id', '=', build.buildId)
      .executeTakeFirstOrThrow();
    const buildDir = path.join(deps.buildsDir, build.buildId);
    const socketDir = path.join(deps.runDir, replicaId);
    await fs.mkdir(socketDir, { recursive: true, mode: 0o700 });
    const socketPath = path.join(socketDir, 'replica.sock');
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
      FERRY_SOCKET: socketPath,
      FERRY_ENTRY: path.join(buildDir, row.entry ?? 'out/main.mjs'),
    };
    const heapMiB = Math.max(16, Math.floor(build.config.resources.memory * 0.75));
    return {
      file: process.execPath,
      args: [`--max-old-space-size=${heapMiB}`, NODE_BOOTSTRAP],
      env,
      cwd: buildDir,
      socketPath,
      sandboxed: false,
      wasOomKilled: async () => false,
      cleanup: async () => {
        await fs.rm(socketDir, { recursive: true, force: true });
      },
    };
  };
}
