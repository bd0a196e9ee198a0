/**
 * The Python interpreter of this server: the one Python replicas run and Python builds use, so compiled
 * extensions and the bytecode pip writes match it. The launch recipe (./index.ts) decides with it which
 * interpreter a replica runs; the builder (./builder.ts) builds with it; `ferry doctor` reports it.
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';

/**
 * Interpreters tried in order. The system's come first: a replica's sandbox shows `/usr` but not, say, a
 * pyenv under /root, so an interpreter found on PATH is only a fallback (it works without the sandbox).
 */
const SYSTEM_PYTHONS = ['/usr/bin/python3', '/usr/local/bin/python3'];

let pythonLookup: Promise<string | null> | undefined;

/** The absolute path of the `python3` replicas and builds run, or null when there is none (looked up once). */
export function findPython(): Promise<string | null> {
  pythonLookup ??= lookUpPython(process.env.PATH ?? '');
  return pythonLookup;
}

async function lookUpPython(searchPath: string): Promise<string | null> {
  const candidates = [
    ...SYSTEM_PYTHONS,
    ...searchPath
      .split(':')
      .filter((dir) => path.isAbsolute(dir))
      .map((dir) => path.join(dir, 'python3')),
  ];
  for (const candidate of candidates) {
    try {
      await fs.access(candidate, fsSync.constants.X_OK);
      if ((await fs.stat(candidate)).isFile()) return candidate;
    } catch {
      // not here
    }
  }
  return null;
}
