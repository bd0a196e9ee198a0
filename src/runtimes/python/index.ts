/**
 * The Python runtime (cortex: `main.py`): checked and its requirements installed by ./builder.ts, run by
 * the Python bootstrap (./bootstrap.py, shipped as source) with the interpreter builds use
 * (./interpreter.ts), speaking the frame protocol. Kept warm where an interpreter is found.
 */
import fsSync from 'node:fs';
import { fileURLToPath } from 'node:url';
import { HOST_ROOTFS, imageRootfs, type Runtime } from '../runtime.js';
import { createPythonBuilder } from './builder.js';
import { findPython } from './interpreter.js';

/**
 * The Python bootstrap; copied (read-only) into every Python replica's sandbox. The build compiles
 * TypeScript only, so from `dist/src/runtimes/python/` this is the source file under `src/` (which the
 * package ships); next to this file when run from the sources.
 */
export const PYTHON_BOOTSTRAP = firstExisting([
  fileURLToPath(new URL('../../../../src/runtimes/python/bootstrap.py', import.meta.url)),
  fileURLToPath(new URL('./bootstrap.py', import.meta.url)),
]);

export const pythonRuntime: Runtime = {
  name: 'python',
  calls: 'frames',
  warm: { startupVariables: /^(PYTHON|LD_|MALLOC_|GLIBC_|LANG$|LC_|OPENSSL_)/ },
  defaultEntry: 'source/main.py',
  // Builds and replicas need the same interpreter; without one, Python apps fail to build anyway.
  available: async () => (await findPython()) !== null,
  createBuilder: () => createPythonBuilder(),
  async launchRecipe({ image }) {
    // On an image: the image's own python3, found by the build (FERRY_IMAGE_NO_PYTHON when it has none).
    // Else the interpreter builds use, so installed packages match.
    const python = image ? (image.record.python ?? 'python3') : ((await findPython()) ?? 'python3');
    return {
      rootfs: image ? await imageRootfs(image, image.record.config.workingDir) : HOST_ROOTFS,
      program: { host: PYTHON_BOOTSTRAP, sandbox: '/ferry/bootstrap.py' },
      command: (bootstrap) => [python, '-u', bootstrap],
      // The build folder is read-only in the sandbox; pip compiled the dependencies' bytecode at build time.
      env: { PYTHONDONTWRITEBYTECODE: '1', PYTHONUNBUFFERED: '1' },
      overrides: {},
    };
  },
  startTimeoutMs: (_config, serverMs) => serverMs,
};

function firstExisting(candidates: string[]): string {
  return candidates.find((file) => fsSync.existsSync(file)) ?? candidates[0]!;
}
