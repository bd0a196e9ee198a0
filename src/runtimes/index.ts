/**
 * The runtimes this server offers, and the two places one is chosen: for a build being made, from the
 * app's `ferry.toml` and the files in its archive (`selectBuilder`); for everything after, from the build's
 * runtime as its builder recorded it (`runtimeOf`). Every difference between runtimes is then a call on
 * the `Runtime` (runtime.ts).
 */
import fs from 'node:fs';
import path from 'node:path';
import { type AppConfig, entryConflict } from '../apps/app-config.js';
import { BuildFailedError } from '../builds/build-failed.js';
import type { Builder } from '../builds/builder.js';
import { customRuntime } from './custom/index.js';
import { NODE_ENTRIES } from './node/builder.js';
import { nodeRuntime } from './node/index.js';
import { pythonRuntime } from './python/index.js';
import type { Runtime, RuntimeName } from './runtime.js';

export type { LaunchRecipe, LaunchTarget, Runtime, RuntimeName } from './runtime.js';

export const RUNTIMES: Readonly<Record<RuntimeName, Runtime>> = {
  node: nodeRuntime,
  python: pythonRuntime,
  custom: customRuntime,
};

/** The runtime named `name` (a build's `runtime`); throws for a name this server does not know. */
export function runtimeNamed(name: string | null): Runtime {
  const runtime = name !== null && Object.hasOwn(RUNTIMES, name) ? RUNTIMES[name as RuntimeName] : undefined;
  if (!runtime) throw new Error(`runtime ${name} is not supported by this server yet`);
  return runtime;
}

/** The runtime of a build (`PoolBuild.runtime`, from `builds.runtime`): chosen once, asked everywhere. */
export function runtimeOf(build: { runtime: string | null }): Runtime {
  return runtimeNamed(build.runtime);
}

export interface Builders {
  node: Builder;
  python?: Builder;
  custom?: Builder;
}

/**
 * The builder for an app: `custom` for the custom runtime; for cortex, `python` when the entry is `main.py`
 * (named in ferry.toml, or the only entry present), otherwise `node`, which reports a missing entry itself.
 * A Node entry beside `main.py` without `app.entry` fails the build, naming both.
 */
export function selectBuilder(config: AppConfig, sourceDir: string, builders: Builders): Builder {
  if (config.app.runtime === 'custom') {
    if (!builders.custom) throw new BuildFailedError('The custom runtime is not available on this server yet');
    return builders.custom;
  }
  if (usesPython(config, sourceDir)) {
    if (!builders.python) throw new BuildFailedError('The Python runtime is not available on this server yet');
    return builders.python;
  }
  return builders.node;
}

function usesPython(config: AppConfig, sourceDir: string): boolean {
  const conflict = entryConflict(config, (name) => isFile(path.join(sourceDir, name)));
  if (conflict) throw new BuildFailedError(conflict);
  const entry = config.app.entry;
  if (entry !== undefined) return entry === 'main.py';
  // Same precedence as the Node builder's own lookup: a Node entry wins over main.py.
  if (NODE_ENTRIES.some((name) => isFile(path.join(sourceDir, name)))) return false;
  return isFile(path.join(sourceDir, 'main.py'));
}

function isFile(file: string): boolean {
  try {
    return fs.statSync(file).isFile();
  } catch {
    return false;
  }
}

/** Every runtime's builder, as the server builds with them. */
export function createDefaultBuilders(): Builders {
  return {
    node: RUNTIMES.node.createBuilder(),
    python: RUNTIMES.python.createBuilder(),
    custom: RUNTIMES.custom.createBuilder(),
  };
}
