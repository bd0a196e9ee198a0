/**
 * A pure-Python wheel made by hand for tests: the tests have no package index (so no setuptools to build
 * a source package with), and pip installs a wheel from a path without one.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { zipFiles } from './app-zip.js';
import { REPO_ROOT } from './ferry.js';

/** The source of the `leftpad` package the fixtures install. */
export const LEFTPAD_SOURCE = path.join(REPO_ROOT, 'test', 'fixtures', 'python-deps', 'vendor', 'leftpad');
export const LEFTPAD_WHEEL = 'leftpad-1.0.0-py3-none-any.whl';

/** Packs `<sourceDir>/<package>/*.py` into the bytes of a `py3-none-any` wheel. */
export async function buildWheel(sourceDir: string, name: string, version: string): Promise<Buffer> {
  const files: Record<string, string | Buffer> = {};
  for (const file of await fs.readdir(path.join(sourceDir, name))) {
    if (file.endsWith('.py')) files[`${name}/${file}`] = await fs.readFile(path.join(sourceDir, name, file));
  }
  const info = `${name}-${version}.dist-info`;
  files[`${info}/METADATA`] = `Metadata-Version: 2.1\nName: ${name}\nVersion: ${version}\n`;
  files[`${info}/WHEEL`] = 'Wheel-Version: 1.0\nGenerator: ferry-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n';
  // RECORD may leave hashes out; pip does not check them.
  files[`${info}/RECORD`] = `${[...Object.keys(files), `${info}/RECORD`].map((f) => `${f},,`).join('\n')}\n`;
  return zipFiles(files);
}

export function leftpadWheel(): Promise<Buffer> {
  return buildWheel(LEFTPAD_SOURCE, 'leftpad', '1.0.0');
}
