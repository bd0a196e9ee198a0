/**
 * Uploaded ZIP archives, read without trusting them.
 *
 * Every rule (paths, links and devices, encryption, duplicates, entry count, expanded size, compression
 * ratio) is judged from the central directory alone, before a single byte is extracted. Extraction then
 * trusts nothing the headers say: it counts and checksums what actually comes out of each entry, writes only
 * new files inside the destination, and removes what it wrote when anything goes wrong.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { crc32 } from 'node:zlib';
import type { Entry, ZipFile } from 'yauzl';
import yauzl from 'yauzl';
import { FerryError } from '../errors.js';

export interface ZipLimits {
  maxEntries: number;
  maxUncompressedBytes: number;
  maxRatio: number;
  /**
   * The ratio (per entry, and of the whole archive: the sum of expanded sizes over the archive's size) is
   * only judged past this many expanded bytes, so tiny, very compressible files pass.
   */
  ratioMinBytes: number;
}

export const DEFAULT_ZIP_LIMITS: ZipLimits = {
  maxEntries: 10_000,
  maxUncompressedBytes: 1024 ** 3,
  maxRatio: 200,
  ratioMinBytes: 1024 ** 2,
};

export interface ZipFileEntry {
  path: string;
  size: number;
  compressed_size: number;
  /** 8 lowercase hex digits. */
  crc32: string;
  /** ISO 8601. */
  modified: string;
}

interface CheckedEntry {
  entry: Entry;
  path: string;
  isDir: boolean;
  label: string;
  executable: boolean;
}

interface Inspection {
  checked: CheckedEntry[];
  files: ZipFileEntry[];
  totalSize: number;
}

const S_IFMT = 0o170000;
const S_IFREG = 0o100000;
const S_IFDIR = 0o040000;
const S_IFLNK = 0o120000;
// "Version made by" hosts whose external attributes carry a Unix st_mode: Unix and OS X (Darwin).
const UNIX_HOSTS = new Set([3, 19]);
const DOS_EPOCH = '1980-01-01T00:00:00.000Z';
const MAX_LABEL_CHARS = 200;
/** NAME_MAX of Linux file systems: the longest file or folder name, in bytes. */
export const MAX_NAME_BYTES = 255;
/** The longest entry path taken, in bytes: well under PATH_MAX (4096) once below a build folder. */
export const MAX_PATH_BYTES = 1024;

/** Quotes an entry name for a message: control characters escaped so a hostile name cannot forge log lines. */
function quote(name: string): string {
  let out = '';
  for (const ch of name.length > MAX_LABEL_CHARS ? `${name.slice(0, MAX_LABEL_CHARS)}…` : name) {
    const code = ch.codePointAt(0) ?? 0;
    out += code < 0x20 || (code >= 0x7f && code < 0xa0) || ch === '"' ? `\\u${code.toString(16).padStart(4, '0')}` : ch;
  }
  return `"${out}"`;
}

function errorMessage(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** Errors from the operating system (disk full, permissions) are Ferry's problem, not the archive's. */
function isSystemError(err: unknown): boolean {
  return err instanceof Error && 'syscall' in err;
}

function isAbortError(err: unknown): boolean {
  return err instanceof Error && err.name === 'AbortError';
}

function unixMode(entry: Entry): number | null {
  return UNIX_HOSTS.has(entry.versionMadeBy >> 8) ? entry.externalFileAttributes >>> 16 : null;
}

/** Names are decoded here rather than by yauzl so that its own name checks never pre-empt ours. */
function decodeName(entry: Entry): string {
  // strictFileNames keeps backslashes, so `..\evil` is seen (and refused) as what Windows would make of it.
  return yauzl.getFileNameLowLevel(entry.generalPurposeBitFlag, entry.fileNameRaw, entry.extraFields, true);
}

/** Forward slashes, no empty or `.` components; a trailing slash marks a directory. */
function normalizeName(name: string): { path: string; isDir: boolean } {
  const slashed = name.replaceAll('\\', '/');
  const parts = slashed.split('/').filter((part) => part !== '' && part !== '.');
  return { path: parts.join('/'), isDir: slashed.endsWith('/') };
}

function checkName(name: string, label: string): { path: string; isDir: boolean } {
  if (name === '') throw new FerryError('FERRY_ZIP_PATH_TRAVERSAL', 'An archive entry has an empty name');
  if (name.includes('\0')) {
    throw new FerryError('FERRY_ZIP_PATH_TRAVERSAL', `Archive entry ${label} has a NUL character in its name`);
  }
  const slashed = name.replaceAll('\\', '/');
  if (slashed.startsWith('/') || /^[a-zA-Z]:/.test(slashed)) {
    throw new FerryError('FERRY_ZIP_ABSOLUTE_PATH', `Archive entry ${label} has an absolute path`);
  }
  if (slashed.split('/').includes('..')) {
    throw new FerryError('FERRY_ZIP_PATH_TRAVERSAL', `Archive entry ${label} leaves the archive folder`);
  }
  const normalized = normalizeName(name);
  if (normalized.path === '' && !normalized.isDir) {
    throw new FerryError('FERRY_ZIP_PATH_TRAVERSAL', `Archive entry ${label} has no file name`);
  }
  const long = normalized.path.split('/').find((part) => Buffer.byteLength(part) > MAX_NAME_BYTES);
  if (long !== undefined) {
    throw new FerryError(
      'FERRY_ZIP_PATH_TOO_LONG',
      `Archive entry ${label} has a name of ${Buffer.byteLength(long)} bytes; the limit is ${MAX_NAME_BYTES} bytes per file or folder name`,
    );
  }
  if (Buffer.byteLength(normalized.path) > MAX_PATH_BYTES) {
    throw new FerryError(
      'FERRY_ZIP_PATH_TOO_LONG',
      `Archive entry ${label} has a path of ${Buffer.byteLength(normalized.path)} bytes; the limit is ${MAX_PATH_BYTES} bytes`,
    );
  }
  return normalized;
}

function toFileEntry(entry: Entry, filePath: string): ZipFileEntry {
  let modified = DOS_EPOCH;
  try {
    // The DOS fields carry no time zone; UTC at least gives every server the same answer.
    const date = entry.getLastModDate({ timezone: 'UTC' });
    if (!Number.isNaN(date.getTime())) modified = date.toISOString();
  } catch {
    // An unreadable timestamp is not worth refusing an archive over.
  }
  return {
    path: filePath,
    size: entry.uncompressedSize,
    compressed_size: entry.compressedSize,
    crc32: (entry.crc32 >>> 0).toString(16).padStart(8, '0'),
    modified,
  };
}

async function openZip(file: string): Promise<ZipFile> {
  try {
    return await yauzl.openPromise(file, {
      lazyEntries: true,
      autoClose: false,
      decodeStrings: false,
      // Sizes are checked against the real data during extraction, with the entry named in the error.
      validateEntrySizes: false,
      strictFileNames: true,
    });
  } catch (err) {
    if (isSystemError(err)) throw err;
    throw new FerryError('FERRY_ZIP_CORRUPT', `The archive is not a readable ZIP file: ${errorMessage(err)}`, {
      cause: err,
    });
  }
}

/** The next central directory record, or null after the last; yauzl's read errors come back as FerryErrors. */
function nextEntry(zipfile: ZipFile, strict: boolean): Promise<Entry | null> {
  const number = zipfile.entriesRead + 1;
  return new Promise((resolve, reject) => {
    const stop = () => {
      zipfile.off('entry', onEntry);
      zipfile.off('end', onEnd);
      zipfile.off('error', onError);
    };
    const onEntry = (entry: Entry) => {
      stop();
      resolve(entry);
    };
    const onEnd = () => {
      stop();
      resolve(null);
    };
    const onError = (err: Error) => {
      stop();
      if (isSystemError(err)) return reject(err);
      // yauzl refuses strong encryption before handing the entry over, so its name is not known here.
      if (strict && /encryption/i.test(err.message)) {
        return reject(
          new FerryError('FERRY_ZIP_ENCRYPTED', `Archive entry number ${number} is encrypted`, { cause: err }),
        );
      }
      reject(
        new FerryError('FERRY_ZIP_CORRUPT', `Archive entry number ${number} cannot be read: ${err.message}`, {
          cause: err,
        }),
      );
    };
    zipfile.on('entry', onEntry);
    zipfile.on('end', onEnd);
    zipfile.on('error', onError);
    zipfile.readEntry();
  });
}

async function inspectOpen(zipfile: ZipFile, limits: ZipLimits, signal?: AbortSignal): Promise<Inspection> {
  if (zipfile.entryCount > limits.maxEntries) {
    throw new FerryError(
      'FERRY_ZIP_TOO_MANY_ENTRIES',
      `The archive has ${zipfile.entryCount} entries; the limit is ${limits.maxEntries}`,
    );
  }
  const checked: CheckedEntry[] = [];
  const files: ZipFileEntry[] = [];
  const seen = new Map<string, boolean>(); // path -> is a directory
  const impliedDirs = new Set<string>(); // every folder some entry sits in
  let totalSize = 0;

  for (;;) {
    signal?.throwIfAborted();
    const entry = await nextEntry(zipfile, true);
    if (!entry) break;
    const name = decodeName(entry);
    const label = quote(name);
    const { path: entryPath, isDir } = checkName(name, label);

    const mode = unixMode(entry);
    const type = (mode ?? 0) & S_IFMT;
    if (type === S_IFLNK) throw new FerryError('FERRY_ZIP_SYMLINK', `Archive entry ${label} is a symbolic link`);
    if (type !== 0 && type !== S_IFREG && type !== S_IFDIR) {
      throw new FerryError('FERRY_ZIP_SPECIAL_FILE', `Archive entry ${label} is a device, FIFO or socket`);
    }
    if (entry.generalPurposeBitFlag & 1) {
      throw new FerryError('FERRY_ZIP_ENCRYPTED', `Archive entry ${label} is encrypted`);
    }
    // A bare "./" names the archive root itself: nothing to create and nothing to collide with.
    if (isDir && entryPath === '') continue;

    if (seen.has(entryPath) || (!isDir && impliedDirs.has(entryPath))) {
      throw new FerryError('FERRY_ZIP_DUPLICATE_ENTRY', `Archive entry ${label} has the same path as another entry`);
    }
    const parts = entryPath.split('/');
    for (let i = 1; i < parts.length; i++) {
      const folder = parts.slice(0, i).join('/');
      if (seen.get(folder) === false) {
        throw new FerryError(
          'FERRY_ZIP_DUPLICATE_ENTRY',
          `Archive entry ${label} is inside "${folder}", which is a file in the same archive`,
        );
      }
      impliedDirs.add(folder);
    }
    seen.set(entryPath, isDir);

    if (!isDir) {
      if (entry.compressionMethod !== 0 && entry.compressionMethod !== 8) {
        throw new FerryError(
          'FERRY_ZIP_CORRUPT',
          `Archive entry ${label} uses compression method ${entry.compressionMethod}; only stored and deflated entries can be read`,
        );
      }
      if (entry.compressionMethod === 0 && entry.compressedSize !== entry.uncompressedSize) {
        throw new FerryError(
          'FERRY_ZIP_CORRUPT',
          `Archive entry ${label} is stored uncompressed but declares ${entry.compressedSize} bytes stored and ${entry.uncompressedSize} bytes expanded`,
        );
      }
      if (entry.compressedSize > zipfile.fileSize) {
        throw new FerryError('FERRY_ZIP_CORRUPT', `Archive entry ${label} claims more data than the archive holds`);
      }
      const size = entry.uncompressedSize;
      if (size > limits.ratioMinBytes && size / Math.max(entry.compressedSize, 1) > limits.maxRatio) {
        throw new FerryError(
          'FERRY_ZIP_RATIO',
          `Archive entry ${label} expands from ${entry.compressedSize} to ${size} bytes, more than ${limits.maxRatio} times`,
        );
      }
      totalSize += size;
      if (totalSize > limits.maxUncompressedBytes) {
        throw new FerryError(
          'FERRY_ZIP_TOO_LARGE',
          `Archive entry ${label} takes the expanded archive past the limit of ${limits.maxUncompressedBytes} bytes`,
        );
      }
      // The whole archive too: many entries just under ratioMinBytes each must not add up to a bomb.
      if (totalSize > limits.ratioMinBytes && totalSize / Math.max(zipfile.fileSize, 1) > limits.maxRatio) {
        throw new FerryError(
          'FERRY_ZIP_RATIO',
          `The archive (${zipfile.fileSize} bytes) expands to more than ${totalSize} bytes, more than ${limits.maxRatio} times its size`,
        );
      }
      files.push(toFileEntry(entry, entryPath));
    }
    checked.push({ entry, path: entryPath, isDir, label, executable: ((mode ?? 0) & 0o111) !== 0 });
  }

  if (files.length === 0) throw new FerryError('FERRY_ZIP_EMPTY', 'The archive has no files, only folders or nothing');
  return { checked, files, totalSize };
}

/** Reads only the central directory; checks every rule; returns the file entries (directories omitted) in archive order. */
export async function inspectZip(
  file: string,
  limits: ZipLimits = DEFAULT_ZIP_LIMITS,
): Promise<{ files: ZipFileEntry[]; totalSize: number }> {
  const zipfile = await openZip(file);
  try {
    const { files, totalSize } = await inspectOpen(zipfile, limits);
    return { files, totalSize };
  } finally {
    zipfile.close();
  }
}

/** Passes an entry's data through, failing as soon as it outgrows its declared size, and checks size and CRC at the end. */
function verifier(item: CheckedEntry): Transform {
  const declared = item.entry.uncompressedSize;
  let bytes = 0;
  let crc = 0;
  return new Transform({
    transform(chunk: Buffer, _encoding, callback) {
      bytes += chunk.length;
      // Stopping here, not at the end, is what keeps a bomb with a lying header from filling the disk.
      if (bytes > declared) {
        callback(
          new FerryError(
            'FERRY_ZIP_CORRUPT',
            `Archive entry ${item.label} holds more data than the ${declared} bytes its header declares`,
          ),
        );
        return;
      }
      crc = crc32(chunk, crc);
      callback(null, chunk);
    },
    flush(callback) {
      if (bytes !== declared) {
        callback(
          new FerryError(
            'FERRY_ZIP_CORRUPT',
            `Archive entry ${item.label} holds ${bytes} bytes but its header declares ${declared}`,
          ),
        );
      } else if (crc >>> 0 !== item.entry.crc32 >>> 0) {
        callback(new FerryError('FERRY_ZIP_CORRUPT', `Archive entry ${item.label} fails its CRC-32 check`));
      } else {
        callback();
      }
    },
  });
}

function extractionError(err: unknown, item: CheckedEntry): unknown {
  if (err instanceof FerryError || isAbortError(err)) return err;
  const code = (err as NodeJS.ErrnoException).code;
  // Only reachable when the file system folds names the archive keeps apart (case, Unicode normalization).
  if (code === 'EEXIST' || code === 'ENOTDIR' || code === 'EISDIR') {
    return new FerryError(
      'FERRY_ZIP_DUPLICATE_ENTRY',
      `Archive entry ${item.label} collides with another entry on this file system`,
      { cause: err },
    );
  }
  // The checks before extraction keep paths short; a file system with smaller limits still gets a 400.
  if (code === 'ENAMETOOLONG') {
    return new FerryError(
      'FERRY_ZIP_PATH_TOO_LONG',
      `Archive entry ${item.label} is too long a path for this file system`,
      {
        cause: err,
      },
    );
  }
  if (isSystemError(err)) return err;
  return new FerryError('FERRY_ZIP_CORRUPT', `Archive entry ${item.label} cannot be extracted: ${errorMessage(err)}`, {
    cause: err,
  });
}

/** inspectZip, then streams every file into destDir (which exists and is empty), removing what it wrote on failure. */
export async function extractZip(
  file: string,
  destDir: string,
  options: { limits?: ZipLimits; signal?: AbortSignal } = {},
): Promise<{ files: ZipFileEntry[]; totalSize: number }> {
  const { limits = DEFAULT_ZIP_LIMITS, signal } = options;
  signal?.throwIfAborted();
  const dest = path.resolve(destDir);
  const inside = dest.endsWith(path.sep) ? dest : dest + path.sep;
  // Only paths this call created, so a failure never removes anything that was already there.
  const created: string[] = [];

  const makeDir = async (dir: string) => {
    if (dir === dest) return;
    const first = await fs.mkdir(dir, { recursive: true, mode: 0o755 });
    if (first !== undefined) created.push(first);
  };

  const zipfile = await openZip(file);
  try {
    const { checked, files, totalSize } = await inspectOpen(zipfile, limits, signal);
    for (const item of checked) {
      signal?.throwIfAborted();
      const target = path.resolve(dest, ...item.path.split('/'));
      if (!target.startsWith(inside)) {
        throw new FerryError('FERRY_ZIP_PATH_TRAVERSAL', `Archive entry ${item.label} leaves the archive folder`);
      }
      try {
        if (item.isDir) {
          await makeDir(target);
          continue;
        }
        await makeDir(path.dirname(target));
        const mode = item.executable ? 0o755 : 0o644;
        // 'wx' fails rather than follow a link or replace a file that is already there.
        const handle = await fs.open(target, 'wx', mode);
        created.push(target);
        try {
          await handle.chmod(mode); // the umask must not decide whether an entry stays executable
          const source = await zipfile.openReadStreamPromise(item.entry);
          await pipeline(source, verifier(item), handle.createWriteStream(), { signal });
        } finally {
          await handle.close();
        }
      } catch (err) {
        throw extractionError(err, item);
      }
    }
    return { files, totalSize };
  } catch (err) {
    for (const written of created.reverse()) {
      await fs.rm(written, { recursive: true, force: true }).catch(() => {});
    }
    if (signal?.aborted) throw signal.reason;
    throw err;
  } finally {
    zipfile.close();
  }
}

/** For serving a stored archive's listing: central directory only, no limit checks; FERRY_ZIP_CORRUPT when it cannot be read. */
export async function listZip(file: string): Promise<ZipFileEntry[]> {
  const zipfile = await openZip(file);
  try {
    const files: ZipFileEntry[] = [];
    for (;;) {
      const entry = await nextEntry(zipfile, false);
      if (!entry) break;
      const { path: entryPath, isDir } = normalizeName(decodeName(entry));
      if (!isDir) files.push(toFileEntry(entry, entryPath));
    }
    return files;
  } finally {
    zipfile.close();
  }
}
