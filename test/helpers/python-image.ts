/**
 * The machine's own Python (Debian's python3), as the files a test image needs to run it: the interpreter,
 * its standard library (without the parts no function or install needs) and the shared libraries it and
 * its extension modules link. For makeBaseImage and makeDebianBaseImage's `copy` and `links`.
 */
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);

/** The host's Python. */
export const HOST_PYTHON = '/usr/bin/python3';

/** Parts of the standard library an install and a function never need: left out of the test's image. */
const STDLIB_LEFT_OUT = new Set([
  '__pycache__',
  'test',
  'tests',
  'idle_test',
  'site-packages',
  'dist-packages',
  'idlelib',
  'tkinter',
  'turtledemo',
  'ensurepip',
  'pydoc_data',
]);

/** The shared libraries `files` link (ldd), each with the path the loader finds it at. */
export async function sharedLibraries(files: string[]): Promise<string[]> {
  const libs = new Set<string>();
  for (const file of files) {
    const { stdout } = await run('ldd', [file]).catch(() => ({ stdout: '' }));
    for (const match of stdout.matchAll(/(?:=>\s+)?(\/\S+)\s+\(0x/g)) libs.add(match[1]!);
  }
  return [...libs];
}

export interface HostPythonFiles {
  /** The interpreter's file name: `python3.11`. */
  version: string;
  copy: Array<{ from: string; to: string; filter?: (source: string) => boolean }>;
  /** `usr/bin/python3` → the versioned interpreter. */
  links: Record<string, string>;
}

/**
 * What an image needs to run the host's python3 at /usr/bin/python3; `leaveOut` names more standard
 * library folders to leave out (a function-only image needs no `distutils`, an image that builds packages
 * does).
 */
export async function hostPythonFiles(leaveOut: string[] = []): Promise<HostPythonFiles> {
  const real = await fs.realpath(HOST_PYTHON);
  const version = path.basename(real);
  const stdlib = `/usr/lib/${version}`;
  const dynload = path.join(stdlib, 'lib-dynload');
  const extensions = (await fs.readdir(dynload)).map((name) => path.join(dynload, name));
  const libs = await sharedLibraries([real, ...extensions]);
  return {
    version,
    copy: [
      { from: real, to: `usr/bin/${version}` },
      {
        from: stdlib,
        to: stdlib.slice(1),
        filter: (source) =>
          !STDLIB_LEFT_OUT.has(path.basename(source)) &&
          !leaveOut.includes(path.basename(source)) &&
          !source.includes('/config-3'),
      },
      ...libs.map((lib) => ({ from: lib, to: lib.slice(1) })),
    ],
    links: { 'usr/bin/python3': version },
  };
}
