/**
 * Picks the builder for an app from its `ferry.toml` and the files in its archive, and creates the
 * builders this server offers.
 */
import fs from 'node:fs';
import path from 'node:path';
import { type AppConfig, entryConflict } from '../../apps/app-config.js';
import { createCustomBuilder } from './custom.js';
import { createNodeBuilder, NODE_ENTRIES } from './node.js';
import { createPythonBuilder } from './python.js';
import { type Builder, BuildFailedError } from './types.js';

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

export function createDefaultBuilders(): Builders {
  return { node: createNodeBuilder(), python: createPythonBuilder(), custom: createCustomBuilder() };
}
