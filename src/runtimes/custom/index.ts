/**
 * The custom runtime (`runtime = "custom"`: the user brings their own HTTP server): checked by
 * ./builder.ts, run by the supervisor (./supervisor.ts, compiled to
 * `dist/src/runtimes/custom/supervisor.js`) with Ferry's own Node. The supervisor starts the user's server,
 * gates the replica's socket on the readiness check, forwards the socket to the server's port and runs the
 * health checks; calls reach it as proxied HTTP, WebSockets as a tunnel. Not kept warm.
 */
import net from 'node:net';
import { fileURLToPath } from 'node:url';
import type { AppConfig } from '../../apps/app-config.js';
import { HOST_ROOTFS, imageRootfs, type Runtime } from '../runtime.js';
import { createCustomBuilder } from './builder.js';

/** The compiled supervisor; copied (read-only) into every custom replica's sandbox. */
export const CUSTOM_SUPERVISOR = fileURLToPath(new URL('./supervisor.js', import.meta.url));

export const customRuntime: Runtime = {
  name: 'custom',
  calls: 'http',
  warm: null,
  defaultEntry: 'source',
  available: () => Promise.resolve(true),
  createBuilder: () => createCustomBuilder(),
  async launchRecipe({ build, entry, sandboxed, image }) {
    if (!build) throw new Error('a custom replica is started for its app only');
    const custom = build.config.runtime.custom;
    if (!custom) throw new Error(`build ${build.buildId} has no [runtime.custom] section`);
    // On an image, the build settled the command and port (the image's ENTRYPOINT/CMD and EXPOSE when
    // ferry.toml names none); the image's program starts in its WORKDIR, ferry.toml's in the app folder.
    const settled = image?.record.custom;
    const entrypoint = settled?.entrypoint ?? custom.entrypoint;
    if (entrypoint === undefined) throw new Error(`build ${build.buildId} has no entrypoint`);
    // In its own network namespace every replica has the configured port to itself; without the sandbox
    // replicas share the host's network, so each gets a free port instead (PORT says which).
    const port = sandboxed ? (settled?.port ?? custom.port) : await freePort();
    const rootfs = image
      ? await imageRootfs(image, settled?.fromImage ? image.record.config.workingDir : undefined)
      : HOST_ROOTFS;
    return {
      rootfs,
      program: { host: CUSTOM_SUPERVISOR, sandbox: '/ferry/supervisor.mjs' },
      // The supervisor itself needs little; the memory limit covers the whole sandbox, the user's server too.
      command: (supervisor) => [...rootfs.node, '--max-old-space-size=64', supervisor],
      env: {},
      overrides: supervisorEnv(custom, entrypoint, port),
      // The user's server starts in the app folder as uploaded (unless the image's WORKDIR, above).
      cwd: entry,
    };
  },
  // A custom server gets its own start_timeout (the supervisor enforces it), plus time to start the sandbox.
  startTimeoutMs: (config, serverMs) =>
    config.runtime.custom ? config.runtime.custom.start_timeout * 1000 + serverMs : serverMs,
};

/** The variables the supervisor reads (and removes before starting the user's server). */
function supervisorEnv(
  custom: NonNullable<AppConfig['runtime']['custom']>,
  entrypoint: string | string[],
  port: number,
): Record<string, string> {
  return {
    PORT: String(port),
    FERRY_CUSTOM_ENTRYPOINT: JSON.stringify(entrypoint),
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
