/**
 * This process as a node of the store: a row in `nodes` with a lease it renews.
 *
 * Work a process holds (an async run it claimed or runs, a webhook attempt it sends, a build it builds)
 * names the node as `owner`. One lease per node rather than one per row: renewing it is one UPDATE every
 * `ttl / 3` whatever the amount of work held, and all of a node's work is taken over together once its
 * lease has run out (cluster/recovery.ts). Writes that end a piece of work are fenced by `owner = <this
 * node>`, so a node that was paused past its lease and comes back cannot overwrite what another took over.
 *
 * A data directory is served by one process at a time (data-dir.ts takes a lock), so the node that served
 * it before this one is certainly dead: its lease is ended at once at start, and its work is recovered
 * without waiting for the lease to run out. That keeps a restart of the embedded default as quick to
 * recover as it always was.
 *
 * The row's `info` is what `GET /v2/cluster` shows of the node: written at start and at every renewal (the
 * same UPDATE), from the `info` callback the caller gives, so this module needs none of the parts it
 * describes.
 */
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import { randomHex } from '../ids.js';
import type { Store } from '../store/index.js';
import type { NodesTable } from '../store/schema.js';

/** `FERRY_LEASE_SECONDS` default: how long a node's work stays its own without a renewal. */
export const DEFAULT_LEASE_MS = 10_000;
/** The `lease_until` of a lease ended on purpose: its node stopped, or a later process of its data directory started. */
export const LEASE_ENDED = new Date(0).toISOString();

export interface NodeLease {
  /** This node's id: the `owner` of the work it holds. */
  readonly id: string;
  readonly ttlMs: number;
  /** Ends the previous incarnation's lease (same data directory), registers this node and starts renewing. */
  start(): Promise<void>;
  /** Stops renewing and ends the lease: what it still holds is taken over at the next sweep. */
  close(): Promise<void>;
  /**
   * May this node judge other nodes dead by their lease? Only once its own renewals have gone through
   * without a break for a whole lease: after a store outage every node's lease looks run out, and a node
   * that got the store back first must not take over the work of others that have not renewed yet.
   */
  canJudge(): boolean;
  /** Writes the node's `info` now rather than at the next renewal (after the server starts listening). */
  refresh(): Promise<void>;
}

/** What a node says of itself, besides what this module adds (hostname, pid, data_dir): a small JSON object. */
export type NodeInfoSource = () => Record<string, unknown>;

export function createNodeLease(deps: {
  store: Store;
  /** Where the id of the node serving this data directory is kept (`<data-dir>/node-id`). */
  dataDir: string;
  ttlMs?: number;
  logger: Logger;
  clock?: () => number;
  /** Called at every renewal for the rest of the node's `info` (version, role, address, load). */
  info?: NodeInfoSource;
}): NodeLease {
  const { store, logger } = deps;
  const ttlMs = deps.ttlMs ?? DEFAULT_LEASE_MS;
  const clock = deps.clock ?? Date.now;
  const id = `${os.hostname().slice(0, 40)}-${process.pid}-${randomHex(4)}`;
  const idFile = path.join(deps.dataDir, 'node-id');
  let timer: NodeJS.Timeout | undefined;
  let renewing: Promise<void> = Promise.resolve();
  let closed = false;
  let lost = false;
  /** Since when renewals have gone through without a break (undefined: the last one failed). */
  let steadySince: number | undefined;

  const until = () => new Date(clock() + ttlMs).toISOString();
  const startedAt = new Date(clock()).toISOString();

  /** The `info` column now. A callback that throws costs the extra fields, never the renewal. */
  function info(): string {
    let extra: Record<string, unknown> = {};
    try {
      extra = deps.info?.() ?? {};
    } catch (err) {
      logger.warn({ err, node: id }, 'describing this node failed; its info is left short');
    }
    return JSON.stringify({ ...extra, hostname: os.hostname(), pid: process.pid, data_dir: deps.dataDir });
  }

  async function register(): Promise<void> {
    const described = info();
    await store
      .insertInto('nodes')
      .values({ id, started_at: startedAt, lease_until: until(), info: described })
      .onConflict((oc) => oc.column('id').doUpdateSet({ lease_until: until(), info: described }))
      .execute();
  }

  async function renew(): Promise<void> {
    try {
      const result = await store
        .updateTable('nodes')
        .set({ lease_until: until(), info: info() })
        .where('id', '=', id)
        .executeTakeFirst();
      if (Number(result.numUpdatedRows) === 0) {
        // Another node found this one's lease run out (this process was paused, or could not reach the
        // store for longer than the lease) and took its work over; writes ending that work are refused by
        // the owner fence. Carry on as a node again for new work.
        if (!lost) logger.error({ node: id }, 'this process lost its lease: work it held was taken over by others');
        lost = true;
        await register();
      } else {
        lost = false;
      }
      steadySince ??= clock();
    } catch (err) {
      steadySince = undefined;
      logger.warn({ err, node: id }, 'renewing the node lease failed; retrying');
    }
  }

  return {
    id,
    ttlMs,
    async start() {
      let previous: string | undefined;
      try {
        previous = fs.readFileSync(idFile, 'utf8').trim() || undefined;
      } catch {
        previous = undefined;
      }
      if (previous && previous !== id) {
        await store.updateTable('nodes').set({ lease_until: LEASE_ENDED }).where('id', '=', previous).execute();
      }
      await register();
      steadySince = clock();
      fs.writeFileSync(`${idFile}.tmp`, `${id}\n`, { mode: 0o600 });
      fs.renameSync(`${idFile}.tmp`, idFile);
      const every = Math.max(100, Math.floor(ttlMs / 3));
      timer = setInterval(() => {
        if (!closed) renewing = renew();
      }, every);
      timer.unref();
    },
    async refresh() {
      if (closed || timer === undefined) return;
      // After the renewal in progress, so the two never write out of order.
      await renewing;
      renewing = renew();
      await renewing;
    },
    canJudge() {
      return steadySince !== undefined && clock() - steadySince >= ttlMs;
    },
    async close() {
      if (closed) return;
      closed = true;
      if (timer) clearInterval(timer);
      await renewing;
      // Ending the lease (rather than waiting for it to run out) lets the others take over at once.
      await store
        .updateTable('nodes')
        .set({ lease_until: LEASE_ENDED })
        .where('id', '=', id)
        .execute()
        .catch((err: unknown) => logger.warn({ err }, 'could not end the node lease; it runs out by itself'));
    },
  };
}

/** A node as the `nodes` table has it (`GET /v2/cluster`). */
export type NodeRow = NodesTable;

/** The nodes sharing the store, oldest first, at most `limit` (live and expired alike). */
export async function listNodes(store: Store, limit: number): Promise<NodeRow[]> {
  return store
    .selectFrom('nodes')
    .select(['id', 'started_at', 'lease_until', 'info'])
    .orderBy('started_at')
    .orderBy('id')
    .limit(limit)
    .execute();
}
