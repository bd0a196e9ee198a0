/**
 * The Python interpreter of this server: the one Python replicas run and Python builds use, so compiled
 * extensions and the bytecode pip writes match it. The launch recipe (./index.ts) decides with it which
 * interpreter a replica runs; the builder (./builder.ts) builds with it; `ferry doctor` reports it.
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { findInImage, resolveInRoot } from '../../images/rootfs-path.js';

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

/**
 * The `python3` of an image (`[image]`) and its version, found without running anything of the image:
 * the command on the image's PATH, its version from the file it links to (`python3 -> python3.12`) or,
 * failing that, from the standard library folder beside it (`/usr/lib/python3.12/os.py`). Null when the
 * image has no python3.
 */
export async function findImagePython(
  root: string,
  searchPath: readonly string[],
): Promise<{ path: string; version: [number, number] | null } | null> {
  const found = await findInImage(root, 'python3', searchPath);
  if (!found) return null;
  const real = await resolveInRoot(root, found);
  const named = /^python(\d+)\.(\d+)$/.exec(path.basename(real ?? ''));
  if (named) return { path: found, version: [Number(named[1]), Number(named[2])] };
  let best: [number, number] | null = null;
  for (const lib of ['/usr/local/lib', '/usr/lib']) {
    const dir = await resolveInRoot(root, lib);
    const names = dir ? await fs.readdir(dir).catch(() => [] as string[]) : [];
    for (const name of names) {
      const match = /^python3\.(\d+)$/.exec(name);
      if (!match || !(await resolveInRoot(root, `${lib}/${name}/os.py`))) continue;
      const version: [number, number] = [3, Number(match[1])];
      if (!best || version[1] > best[1]) best = version;
    }
  }
  return { path: found, version: best };
}
