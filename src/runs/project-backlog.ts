/**
 * The per-project async backlog: how many async runs of a project are accepted and not finished (queued or
 * running), counted from the store so every process sharing it sees the same figure.
 *
 * Counting on every call would put a COUNT on the run endpoint's hot path, so a project's count is read at
 * most once per `ttlMs` and the runs this process accepts in between are added to it. Runs that end in
 * between are not subtracted until the next read: the limit errs on the side of refusing, by at most what
 * ended within one `ttlMs`.
 */
import type { Store } from '../store/index.js';
import { unfinishedRun } from '../store/unfinished.js';

export interface ProjectBacklog {
  /**
   * Counts one more accepted run of the project and answers true, or answers false (counting nothing)
   * when the project already has `limit` runs waiting or running.
   */
  admit(projectId: string): Promise<boolean>;
  /** `admit` without a Promise when the project's count is fresh; undefined when it must be read (admit). */
  admitNow(projectId: string): boolean | undefined;
  /** The project's count as this process knows it (tests, diagnostics). */
  count(projectId: string): Promise<number>;
}

interface Entry {
  count: number;
  readAt: number;
  reading?: Promise<void>;
}

/** Entries kept before stale ones are swept (one per project that called recently). */
const SWEEP_AT = 10_000;

export function createProjectBacklog(deps: {
  store: Store;
  limit: number;
  ttlMs?: number;
  clock?: () => number;
}): ProjectBacklog {
  const { store, limit } = deps;
  const ttlMs = deps.ttlMs ?? 1000;
  const clock = deps.clock ?? Date.now;
  const entries = new Map<string, Entry>();

  async function read(projectId: string): Promise<number> {
    const row = await store
      .selectFrom('runs')
      .select((eb) => eb.fn.countAll().as('n'))
      .where('project_id', '=', projectId)
      .where(unfinishedRun())
      .where('mode', '=', 'async')
      .executeTakeFirst();
    // PostgreSQL answers COUNT as a bigint (a string through most drivers).
    return Number(row?.n ?? 0);
  }

  /** Counts one more run in `entry` and answers true, or false when it is at the limit. */
  function take(entry: Entry): boolean {
    if (entry.count >= limit) return false;
    entry.count += 1;
    return true;
  }

  async function fresh(projectId: string): Promise<Entry> {
    let entry = entries.get(projectId);
    const now = clock();
    if (entry && now - entry.readAt < ttlMs) return entry;
    if (!entry) {
      if (entries.size >= SWEEP_AT) {
        for (const [id, e] of entries) if (now - e.readAt >= ttlMs && !e.reading) entries.delete(id);
      }
      entry = { count: 0, readAt: Number.NEGATIVE_INFINITY };
      entries.set(projectId, entry);
    }
    const e = entry;
    // Concurrent callers share one read (and wait for it before they count themselves).
    e.reading ??= (async () => {
      try {
        e.count = await read(projectId);
        e.readAt = clock();
      } finally {
        e.reading = undefined;
      }
    })();
    await e.reading;
    return e;
  }

  return {
    admitNow(projectId) {
      const entry = entries.get(projectId);
      return entry && clock() - entry.readAt < ttlMs ? take(entry) : undefined;
    },
    async admit(projectId) {
      return take(await fresh(projectId));
    },
    async count(projectId) {
      return (await fresh(projectId)).count;
    },
  };
}
