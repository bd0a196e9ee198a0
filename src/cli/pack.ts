/**
 * Packing an app folder for `ferry deploy`: picks the files `ferry.toml`'s `app.include` / `app.exclude`
 * select, then streams them into a ZIP archive for upload.
 *
 * Besides the user's patterns, a few guards keep an upload from leaking what almost nobody means to ship:
 * `.git` folders and links are never packed, and `node_modules` and secret-looking files (`.env`, keys,
 * registry credentials) only when an include pattern names them.
 */
import { createReadStream, createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pipeline } from 'node:stream/promises';
import picomatch from 'picomatch';
import yazl from 'yazl';
import type { AppConfig } from '../apps/app-config.js';

export interface PackedFile {
  /** Relative to the app folder, with `/` separators whatever the platform (it is the name inside the ZIP). */
  path: string;
  size: number;
}

export interface SelectOptions {
  /** Told about each path left out for a reason the user may not expect, so the CLI can warn. */
  onSkip?: (path: string, reason: string) => void;
}

/** Above this, the folder is almost surely not what the user meant to deploy (a virtualenv, a build cache...). */
export const MAX_FILES = 10_000;

const ROOT_CONFIG = 'ferry.toml';

interface Pattern {
  test: (relPath: string) => boolean;
  /** The pattern's last path segment, which is what decides whether it names a secret file. */
  base: string;
  namesNodeModules: boolean;
}

function compile(pattern: string): Pattern {
  // Patterns are relative to the app folder; "./x" and "/x" are common ways of saying so.
  let text = pattern.replace(/^(\.\/|\/)+/, '');
  if (text.endsWith('/')) text += '**';
  const match = picomatch(text, { dot: true });
  // Like .gitignore: a pattern without a slash (".*", "*.log") names a basename at any depth.
  const test = text.includes('/') ? match : (relPath: string) => match(relPath) || match(path.posix.basename(relPath));
  return { test, base: text.slice(text.lastIndexOf('/') + 1), namesNodeModules: text.includes('node_modules') };
}

interface SecretKind {
  isSecret: (name: string) => boolean;
  /** Whether a pattern's last segment spells this kind out rather than just happening to match it. */
  namedBy: (patternBase: string) => boolean;
}

// Compared in lower case: "SERVER.PEM" leaks just as well as "server.pem".
const SECRET_KINDS: SecretKind[] = [
  { isSecret: (n) => n === '.env' || n.startsWith('.env.'), namedBy: (b) => b.startsWith('.env') },
  { isSecret: (n) => n.endsWith('.pem'), namedBy: (b) => b.endsWith('.pem') },
  { isSecret: (n) => n.endsWith('.key'), namedBy: (b) => b.endsWith('.key') },
  { isSecret: (n) => n === '.npmrc', namedBy: (b) => b.startsWith('.npmrc') },
  { isSecret: (n) => n === '.pypirc', namedBy: (b) => b.startsWith('.pypirc') },
  { isSecret: (n) => n.startsWith('id_rsa'), namedBy: (b) => b.startsWith('id_rsa') },
];

function secretKindOf(name: string): SecretKind | undefined {
  const lower = name.toLowerCase();
  return SECRET_KINDS.find((kind) => kind.isSecret(lower));
}

function byPath(a: PackedFile, b: PackedFile): number {
  // Code-unit order, not locale order, so the archive is the same on every machine.
  return a.path < b.path ? -1 : a.path > b.path ? 1 : 0;
}

/**
 * Walks `dir` and returns the files that `config.app.include` / `config.app.exclude` select, sorted by path.
 *
 * A file is selected when it matches an include pattern and neither it nor any folder above it matches an
 * exclude pattern (so `dist/**` prunes `dist` without walking it). On top of that:
 * - `ferry.toml` at the root is always selected, since the server reads it from the archive;
 * - `.git` is never selected, nor anything that is not a regular file or folder (links are not followed);
 * - `node_modules` only when a matching include pattern contains `node_modules`, and secret-looking files
 *   (`.env`, `.env.*`, `*.pem`, `*.key`, `.npmrc`, `.pypirc`, `id_rsa*`) only when a matching include
 *   pattern's last segment spells them out (`.env.production`, `config/.env`, `*.pem`); the default
 *   catch-all include never does.
 *
 * @throws Error when more than {@link MAX_FILES} files are selected.
 * @example
 *   const files = await selectFiles(dir, config, { onSkip: (p, why) => console.warn(`skipped ${p} (${why})`) });
 */
export async function selectFiles(dir: string, config: AppConfig, options: SelectOptions = {}): Promise<PackedFile[]> {
  const includes = config.app.include.map(compile);
  const excludes = config.app.exclude.map(compile);
  const anyNamesNodeModules = includes.some((p) => p.namesNodeModules);
  // An include that names a file outright (no wildcard) beats the exclude list: `include = [".env.production"]`
  // means "upload this one", even though the default exclude `.*` covers it.
  const literals = new Set(
    config.app.include.filter((p) => !/[*?[\]{}!()]/.test(p)).map((p) => p.replace(/^(\.\/|\/)+/, '')),
  );
  const literalUnder = (relDir: string) => [...literals].some((l) => l.startsWith(`${relDir}/`));
  const picked: string[] = [];
  const skip = (relPath: string, reason: string) => options.onSkip?.(relPath, reason);

  const pick = (relPath: string) => {
    // Checked while walking so a huge folder fails fast instead of after a full walk.
    if (picked.length >= MAX_FILES) {
      throw new Error(
        `More than ${MAX_FILES.toLocaleString('en-US')} files selected in ${dir}; Ferry will not pack that many. ` +
          'Narrow app.include or extend app.exclude in ferry.toml (is a virtualenv or build folder being packed?).',
      );
    }
    picked.push(relPath);
  };

  const walk = async (relDir: string, excludedAbove = false): Promise<void> => {
    const entries = await fs.readdir(relDir === '' ? dir : path.join(dir, ...relDir.split('/')), {
      withFileTypes: true,
    });
    for (const entry of entries) {
      const name = entry.name;
      const relPath = relDir === '' ? name : `${relDir}/${name}`;
      if (relDir === '' && name === ROOT_CONFIG && entry.isFile()) {
        pick(relPath);
        continue;
      }
      // Whatever its type: in worktrees and submodules `.git` is a file pointing elsewhere.
      if (name === '.git') continue;
      const excluded = excludedAbove || excludes.some((p) => p.test(relPath));
      if (excluded && !literals.has(relPath) && !(entry.isDirectory() && literalUnder(relPath))) continue;

      if (entry.isDirectory()) {
        if (name === 'node_modules' && !anyNamesNodeModules) {
          skip(relPath, 'node_modules; name it in app.include to upload it');
          continue;
        }
        await walk(relPath, excluded);
      } else if (entry.isFile()) {
        const matching = includes.filter((p) => p.test(relPath));
        if (matching.length === 0) continue;
        // `**/*` reaching into node_modules/ through an explicit folder does not make every package explicit.
        if (relPath.split('/').includes('node_modules') && !matching.some((p) => p.namesNodeModules)) continue;
        const secret = secretKindOf(name);
        if (secret && !matching.some((p) => secret.namedBy(p.base.toLowerCase()))) {
          skip(relPath, 'looks like a secret; name it in app.include to upload it');
          continue;
        }
        pick(relPath);
      } else if (entry.isSymbolicLink()) {
        // Following links could pack files from outside the app folder, or loop forever.
        skip(relPath, 'symbolic link, not followed');
      } else {
        skip(relPath, 'not a regular file');
      }
    }
  };

  await walk('');
  // Stat in parallel: one at a time is several times slower on a large folder.
  const files = await Promise.all(
    picked.map(async (relPath) => ({
      path: relPath,
      size: (await fs.lstat(path.join(dir, ...relPath.split('/')))).size,
    })),
  );
  return files.sort(byPath);
}

/**
 * Writes a ZIP archive of `files` (from {@link selectFiles}) to `outFile`, streaming it file by file so
 * neither the archive nor more than one input is open in memory at once. Permissions are normalized to
 * 0644, or 0755 for files with an exec bit, so scripts stay runnable. On failure `outFile` is removed.
 *
 * @returns The size of the written archive in bytes.
 */
export async function packZip(dir: string, files: PackedFile[], outFile: string): Promise<{ bytes: number }> {
  // Stat everything first: a failure here must not leave yazl holding an already opened input.
  const inputs = await Promise.all(
    files.map(async (file) => {
      const realPath = path.join(dir, ...file.path.split('/'));
      const stats = await fs.lstat(realPath);
      if (!stats.isFile()) throw new Error(`${file.path} is no longer a regular file`);
      return { file, realPath, stats };
    }),
  );

  const zip = new yazl.ZipFile();
  // yazl reports input errors on the ZipFile, not on its output stream, so the pipeline alone would hang.
  // Inputs are read one at a time, in order, so the last one opened is the one an error is about.
  let current = '';
  const failed = new Promise<never>((_, reject) =>
    zip.on('error', (err: Error) => reject(new Error(`Packing ${current} failed: ${err.message}`, { cause: err }))),
  );
  failed.catch(() => {});
  for (const { file, realPath, stats } of inputs) {
    const mode = stats.mode & 0o111 ? 0o100755 : 0o100644;
    // Passing the size makes yazl fail loudly if the file changes while it is being packed.
    zip.addReadStreamLazy(file.path, { size: stats.size, mtime: stats.mtime, mode }, (cb) => {
      current = file.path;
      const input = createReadStream(realPath);
      // yazl does not listen for errors on lazily added streams; unheard, one would crash the process.
      input.on('error', (err) => zip.emit('error', err));
      cb(null, input);
    });
  }
  zip.end();

  const out = createWriteStream(outFile);
  try {
    await Promise.race([pipeline(zip.outputStream, out), failed]);
    return { bytes: out.bytesWritten };
  } catch (err) {
    out.destroy();
    await fs.rm(outFile, { force: true });
    throw err;
  }
}
