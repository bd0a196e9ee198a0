/**
 * The Node runtime (cortex: `main.ts`, `main.js`, `main.mjs`): built by ./builder.ts into one ES module,
 * run by the Node bootstrap (./bootstrap.ts, compiled to `dist/src/runtimes/node/bootstrap.js`) with
 * Ferry's own Node, speaking the frame protocol. Kept warm.
 */
import { fileURLToPath } from 'node:url';
import { HOST_ROOTFS, imageRootfs, type Runtime } from '../runtime.js';
import { createNodeBuilder } from './builder.js';

/** The compiled Node bootstrap; copied (read-only) into every Node replica's sandbox. */
export const NODE_BOOTSTRAP = fileURLToPath(new URL('./bootstrap.js', import.meta.url));

/** Node's heap gets three quarters of the memory limit, so a runaway heap fails clearly before the hard limit. */
const HEAP_SHARE = 0.75;

export const nodeRuntime: Runtime = {
  name: 'node',
  calls: 'frames',
  warm: { startupVariables: /^(NODE_|UV_|LD_|MALLOC_|GLIBC_|OPENSSL_)/ },
  defaultEntry: 'out/main.mjs',
  available: () => Promise.resolve(true),
  createBuilder: () => createNodeBuilder(),
  async launchRecipe({ resources, image }) {
    // On an image: Ferry's own Node, bound in with its libraries (sandbox/node-binding.ts).
    const rootfs = image ? await imageRootfs(image, image.record.config.workingDir) : HOST_ROOTFS;
    return {
      rootfs,
      // .mjs: alone in the sandbox, with no package.json beside it, the file must say it is an ES module.
      program: { host: NODE_BOOTSTRAP, sandbox: '/ferry/bootstrap.mjs' },
      // The heap size follows the memory limit, so a warm pool keeps one shape of resources.
      command: (bootstrap) => [
        ...rootfs.node,
        `--max-old-space-size=${Math.max(16, Math.floor(resources.memory * HEAP_SHARE))}`,
        bootstrap,
      ],
      env: { NODE_ENV: 'production' },
      overrides: {},
    };
  },
  startTimeoutMs: (_config, serverMs) => serverMs,
};
