/**
 * The data directory: its layout, the single-server lock, and the secret key files in it.
 *
 * Layout:
 *   ferry.db (+ -wal, -shm)   the SQLite store
 *   serve.lock                 pid of the `ferry serve` that owns this directory
 *   server.json                {"pid", "url"} of that server while it listens (for `ferry admin`)
 *   keys/jwt.key               token signing key (0600)
 *   keys/secrets.key           key that encrypts project secrets at rest (0600)
 *   artifacts/<build>.zip      uploaded archives, as uploaded
 *   archive-cache/<build>.zip  with --nats-url: the archives this process received or fetched from NATS
 *   builds/<build>/            extracted sources (source/) and builder output (out/)
 *   cache/                     package-manager caches shared by builds
 *   tmp/                       uploads in progress
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';

export interface DataDir {
  root: string;
  keys: string;
  artifacts: string;
  builds: string;
  cache: string;
  tmp: string;
}

/** Creates the data directory and its folders (0700: nothing in it is for other users). */
export function prepareDataDir(root: string): DataDir {
  const abs = path.resolve(root);
  const dir: DataDir = {
    root: abs,
    keys: path.join(abs, 'keys'),
    artifacts: path.join(abs, 'artifacts'),
    builds: path.join(abs, 'builds'),
    cache: path.join(abs, 'cache'),
    tmp: path.join(abs, 'tmp'),
  };
  fs.mkdirSync(abs, { recursive: true, mode: 0o700 });
  for (const sub of [dir.keys, dir.artifacts, dir.builds, dir.cache, dir.tmp]) {
    fs.mkdirSync(sub, { recursive: true, mode: 0o700 });
  }
  return dir;
}

/**
 * The keys folder (`--keys-dir`, default `<data-dir>/keys`), created 0700 when missing. Several processes
 * of a fleet point at one shared folder so they sign and decrypt with the same keys.
 */
export function prepareKeysDir(dir: string): string {
  fs.mkdirSync(dir, { recursive: true, mode: 0o700 });
  return dir;
}

/** The artifacts folder (`--artifacts-dir`, default `<data-dir>/artifacts`), created 0700 when missing. */
export function prepareArtifactsDir(dir: string): string {
  fs.mkdirSync(dir, { recursive: true, mode: 0o700 });
  return dir;
}

/**
 * Reads a 32-byte key file, creating it with mode 0600 when missing. Two processes starting at once
 * (serve and admin bootstrap) agree on one key: creation is exclusive, and the loser reads the winner's.
 */
export function loadOrCreateKey(file: string): Buffer {
  try {
    const fd = fs.openSync(file, 'wx', 0o600);
    try {
      const key = randomBytes(32);
      fs.writeSync(fd, key.toString('base64url'));
      fs.fsyncSync(fd);
      return key;
    } finally {
      fs.closeSync(fd);
    }
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
  }
  for (let i = 0; i < 50; i++) {
    const text = fs.readFileSync(file, 'utf8').trim();
    if (text.length > 0) {
      const key = Buffer.from(text, 'base64url');
      if (key.length !== 32) throw new Error(`Key file ${file} is damaged (expected 32 bytes)`);
      return key;
    }
    // The creator is between open and write; give it a moment.
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10);
  }
  throw new Error(`Key file ${file} is empty`);
}

export class DataDirLockedError extends Error {
  constructor(
    readonly dataDir: string,
    readonly pid: number,
  ) {
    super(
      `Another ferry serve (pid ${pid}) is already using the data directory ${dataDir}. Stop it first, or pass a different --data-dir.`,
    );
    this.name = 'DataDirLockedError';
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EPERM') return false;
  }
  // A pid can be reused after a crash (containers restart with small pids): only a Node process counts.
  try {
    return fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').includes('node');
  } catch {
    return true; // no /proc: trust the signal check
  }
}

/**
 * Takes the data directory for one `ferry serve`. A lock left by a process that no longer exists
 * (a crash, SIGKILL) is taken over. Returns the function that releases it.
 */
export function lockDataDir(dir: DataDir): () => void {
  const file = path.join(dir.root, 'serve.lock');
  for (let attempt = 0; attempt < 3; attempt++) {
    try {
      const fd = fs.openSync(file, 'wx', 0o600);
      fs.writeSync(fd, String(process.pid));
      fs.closeSync(fd);
      return () => {
        try {
          if (fs.readFileSync(file, 'utf8').trim() === String(process.pid)) fs.unlinkSync(file);
        } catch {
          // already gone
        }
      };
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
    }
    const pid = Number.parseInt(fs.readFileSync(file, 'utf8').trim(), 10);
    if (Number.isInteger(pid) && pid > 0 && pid !== process.pid && isAlive(pid))
      throw new DataDirLockedError(dir.root, pid);
    fs.rmSync(file, { force: true }); // stale: its owner is gone
  }
  throw new Error(`Could not take the lock ${file}`);
}

/** What `ferry serve` records while it listens, so offline commands can print the address people use. */
export interface ServerRecord {
  pid: number;
  url: string;
}

/**
 * Writes `server.json` (the listening URL and this pid) into the data directory; returns the function that
 * removes it again (only when it is still this process's).
 */
export function recordServer(dir: DataDir, url: string): () => void {
  const file = path.join(dir.root, 'server.json');
  const tmp = `${file}.${process.pid}.tmp`;
  fs.writeFileSync(tmp, `${JSON.stringify({ pid: process.pid, url } satisfies ServerRecord)}\n`, { mode: 0o600 });
  fs.renameSync(tmp, file);
  return () => {
    try {
      if ((JSON.parse(fs.readFileSync(file, 'utf8')) as ServerRecord).pid === process.pid) fs.unlinkSync(file);
    } catch {
      // already gone
    }
  };
}

/**
 * The server listening on this data directory, from its `server.json`; undefined when there is none, or
 * the file is left by a process that no longer runs (a crash, SIGKILL).
 */
export function readServerRecord(root: string): ServerRecord | undefined {
  let record: unknown;
  try {
    record = JSON.parse(fs.readFileSync(path.join(path.resolve(root), 'server.json'), 'utf8'));
  } catch {
    return undefined;
  }
  const { pid, url } = (record ?? {}) as Partial<ServerRecord>;
  if (typeof pid !== 'number' || !Number.isInteger(pid) || pid <= 0 || typeof url !== 'string') return undefined;
  if (!/^https?:\/\//.test(url) || !isAlive(pid)) return undefined;
  return { pid, url };
}
