/**
 * Disk space: what a write refused for lack of it answers, and the data folder's free space, watched so
 * that intake stops before the disk is full.
 *
 * A full disk used to answer 500 FERRY_INTERNAL, and accepted runs could not end: every write failed
 * alike, their ends included. Two parts here:
 *
 * - `isStorageFull(err)`: whether an error, or one in its `cause` chain, is a write refused for lack of
 *   space: SQLite's `SQLITE_FULL`, PostgreSQL's SQLSTATE 53100 (disk_full), or a file write's `ENOSPC`
 *   or `EDQUOT` (an upload, an archive, a build folder). http/answer.ts answers every such error
 *   507 FERRY_STORAGE_FULL with Retry-After, on every route and connection, never 500.
 * - `createDiskSpace`: a look at the data folder's free space (`statfs`) about once a second, off the
 *   request path; what the request path reads is a flag. Under the threshold (FERRY_MIN_FREE_MIB) intake
 *   closes: new runs (runs/run-service.ts) and uploads (builds/build-service.ts) answer 507 before writing
 *   anything, so the runs already accepted keep the room to write their ends, and `/readyz` answers 503
 *   naming `storage`. The next look after space comes back opens it again (within `pollMs`, 1 s).
 *   Free space is what an unprivileged user may still take (`bavail`), the conservative reading.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import type { Logger } from 'pino';
import { FerryError } from './errors.js';

/** Seconds a caller refused for lack of space is asked to wait: freeing a disk is an operator's doing. */
export const STORAGE_RETRY_AFTER_S = '10';
const POLL_MS = 1000;
const EDQUOT = os.constants.errno.EDQUOT;

/** The driver and system codes of a write refused for lack of space (see the top of this file). */
const FULL_CODES = new Set(['SQLITE_FULL', '53100', 'ENOSPC', 'EDQUOT']);

/** Whether `err`, or an error in its `cause` chain (or an AggregateError's), is a write refused for lack of space. */
export function isStorageFull(err: unknown): boolean {
  let e = err;
  for (let depth = 0; depth < 8 && typeof e === 'object' && e !== null; depth++) {
    const { code, errno } = e as { code?: unknown; errno?: unknown };
    if ((typeof code === 'string' && FULL_CODES.has(code)) || (EDQUOT !== undefined && errno === -EDQUOT)) return true;
    if (e instanceof AggregateError && e.errors.some(isStorageFull)) return true;
    e = (e as { cause?: unknown }).cause;
  }
  return false;
}

/** 507 FERRY_STORAGE_FULL with Retry-After; `cause` is the write's own error (kept for the log). */
export function storageFull(cause?: unknown, message?: string): FerryError {
  return new FerryError('FERRY_STORAGE_FULL', message, {
    ...(cause === undefined ? {} : { cause }),
    headers: { 'retry-after': STORAGE_RETRY_AFTER_S },
  });
}

/** What `statfs` says, in the fields read here (Node's StatsFs, numbers or bigints). */
export interface SpaceStats {
  bsize: number | bigint;
  blocks: number | bigint;
  bavail: number | bigint;
}

/** The last look at the folder's filesystem. */
export interface SpaceReading {
  freeBytes: number;
  totalBytes: number;
  /** When it was read (the clock's ms). */
  at: number;
}

export interface DiskSpace {
  /** Free space is under the threshold (as of the last look): intake is closed. A flag, cheap to read. */
  readonly low: boolean;
  /** The threshold, bytes (0: intake never closes for space; writes that meet a full disk still answer 507). */
  readonly minFreeBytes: number;
  /** The last look, or null before the first (or with no threshold, when nothing is watched). */
  readonly last: SpaceReading | null;
  /** The 507 new runs and uploads answer while `low`. */
  intakeRefused(): FerryError;
  /** Looks now (the loop does every `pollMs`); resolves once the flag is up to date. */
  look(): Promise<void>;
  /** Starts the loop (none with a threshold of 0). */
  start(): void;
  close(): void;
}

/** Free and total bytes from a statfs answer (free: what an unprivileged user may still take). */
export function spaceOf(stats: SpaceStats): { freeBytes: number; totalBytes: number } {
  const bsize = Number(stats.bsize);
  return { freeBytes: Number(stats.bavail) * bsize, totalBytes: Number(stats.blocks) * bsize };
}

/**
 * Watches `dir`'s filesystem (see the top of this file).
 *
 * @example
 *   const space = createDiskSpace({ dir: dataDir.root, minFreeBytes: 64 * 1024 * 1024, logger });
 *   space.start();
 *   if (space.low) throw space.intakeRefused();
 */
export function createDiskSpace(deps: {
  dir: string;
  minFreeBytes: number;
  logger: Pick<Logger, 'warn' | 'info'>;
  /** Reads the filesystem's figures (default `fs.statfs`). */
  statfs?: (dir: string) => Promise<SpaceStats>;
  pollMs?: number;
  now?: () => number;
}): DiskSpace {
  const { dir, minFreeBytes, logger } = deps;
  const statfs = deps.statfs ?? ((folder: string) => fs.statfs(folder));
  const pollMs = deps.pollMs ?? POLL_MS;
  const now = deps.now ?? Date.now;
  let low = false;
  let last: SpaceReading | null = null;
  let failing = false;
  let timer: NodeJS.Timeout | undefined;
  let closed = false;
  let started = false;
  let looking: Promise<void> | undefined;
  const mib = (bytes: number) => `${Math.floor(bytes / 1024 / 1024)} MiB`;

  async function lookOnce(): Promise<void> {
    let reading: SpaceReading;
    try {
      reading = { ...spaceOf(await statfs(dir)), at: now() };
    } catch (err) {
      // The flag keeps its last value: a folder that cannot be read says nothing about its space.
      if (!failing) logger.warn({ err, dir }, 'cannot read the free space of the data folder');
      failing = true;
      return;
    }
    failing = false;
    last = reading;
    const under = minFreeBytes > 0 && reading.freeBytes < minFreeBytes;
    if (under && !low) {
      logger.warn(
        { dir, freeBytes: reading.freeBytes, minFreeBytes },
        `the data folder has ${mib(reading.freeBytes)} free, under FERRY_MIN_FREE_MIB (${mib(minFreeBytes)}): new runs and uploads are refused (507 FERRY_STORAGE_FULL) until space is freed`,
      );
    } else if (!under && low) {
      logger.info(
        { dir, freeBytes: reading.freeBytes, minFreeBytes },
        `the data folder has ${mib(reading.freeBytes)} free again: new runs and uploads are accepted`,
      );
    }
    low = under;
  }

  function look(): Promise<void> {
    // One look at a time: a slow filesystem is not asked again before it answered.
    looking ??= lookOnce().finally(() => {
      looking = undefined;
    });
    return looking;
  }

  function schedule(): void {
    if (closed) return;
    timer = setTimeout(() => {
      void look().finally(schedule);
    }, pollMs);
    timer.unref();
  }

  return {
    get low() {
      return low;
    },
    minFreeBytes,
    get last() {
      return last;
    },
    intakeRefused() {
      return storageFull(
        undefined,
        'The server is low on storage space (under its FERRY_MIN_FREE_MIB): new runs and uploads are refused until space is freed; retry later',
      );
    },
    look,
    start() {
      if (minFreeBytes === 0 || closed || started) return;
      started = true;
      void look().finally(schedule);
    },
    close() {
      closed = true;
      if (timer) clearTimeout(timer);
    },
  };
}
