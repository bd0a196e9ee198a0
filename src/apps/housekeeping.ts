/**
 * Removing what is no longer wanted (issue 14): an app with its builds, one build, and what retention
 * lets go of in the background.
 *
 * - **Delete an app**: its queued async runs end `cancelled` (webhooks sent), the records of its finished
 *   runs (logs and webhook deliveries included) and its builds' rows go in one transaction, then its
 *   archives and published build outputs are deleted, and every process is told (`app.deleted`): it stops
 *   the app's replicas once their runs are done, drops its queue consumer and removes its local copies.
 *   Runs in flight at that moment finish (within the response grace period) and their records stay until
 *   retention removes them.
 * - **Delete a build**: not the active one, nor one still being made; its row, log and files.
 * - **Retention** (`FERRY_KEEP_BUILDS`, `FERRY_RUN_RETENTION_DAYS`): a pass every interval on each process
 *   that keeps builds, bounded per pass; idempotent, so several processes may run it. Expired runs go in
 *   small batches of RETENTION_RUN_BATCH, one transaction each, each followed by a pause (retentionPause):
 *   as long as the batch took on PostgreSQL, three times as long on SQLite. On SQLite every run's record waits
 *   for the one writer, and every batch's pages go through the one log that the checkpoint thread copies and
 *   syncs; at half its time, a pass wrote the log so fast that the disk's syncs, which the log's restarts
 *   wait for, held 202s 140 to 210 ms on a 2-core machine (bench:scale measures the 202s meanwhile).
 * - **The projects' log budget** (`FERRY_PROJECT_LOG_BYTES`, in the same pass): a project whose runs'
 *   stored log lines (run_log_stats.bytes) pass the budget loses the logs of its oldest finished runs until
 *   it is under it again; each such run keeps one line saying what was removed, and its counts.
 * - **Local copies**: a build deleted while a replica here still runs it (an old build draining after a
 *   rollback, a deleted app's replicas finishing their runs) keeps its folder here until that replica has
 *   stopped (`released`); the published copy and the archive go at once. A process also removes the build
 *   folders in its data directory whose build is gone from the store, that no replica uses and that are
 *   more than two minutes old (after a delete made on another process, or after a crash).
 */

import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import type { ArtifactStore } from '../builds/artifact-store.js';
import type { BuildOutput } from '../builds/build-output.js';
import type { ChangeFeed } from '../cluster/change-feed.js';
import { ERRORS, FerryError } from '../errors.js';
import { FINAL_RUN_STATES } from '../runs/lifecycle.js';
import { droppedMarker } from '../runs/recorder.js';
import { cancelQueued } from '../runs/runs.js';
import { removeSchedules } from '../schedules/schedules.js';
import { lockApp } from '../store/active-build.js';
import { type Store, writesOneAtATime } from '../store/index.js';
import type { Build } from '../store/schema.js';
import { unfinishedRun } from '../store/unfinished.js';
import { findApp } from './apps.js';

const CHUNK = 500;
/** Builds and runs removed at most per retention pass (the next pass takes the rest). */
export const RETENTION_MAX_BUILDS = 100;
export const RETENTION_MAX_RUNS = 100_000;
/** Expired runs removed per transaction of a pass (with their logs and webhook records). */
export const RETENTION_RUN_BATCH = 200;
/**
 * The pause after a batch of expired runs, for a batch that took `batchMs`: retention takes at most half
 * of PostgreSQL's time and a quarter of SQLite's (see the module comment).
 */
export function retentionPause(store: Store, batchMs: number): number {
  return Math.max(1, batchMs * (writesOneAtATime(store) ? 3 : 1));
}
/** Runs whose logs the log budget removes at most per pass (the next pass takes the rest). */
export const LOG_BUDGET_MAX_RUNS = 20_000;
/** Local build folders younger than this are left alone by the sweep (an upload may be under way). */
const LOCAL_MIN_AGE_MS = 2 * 60_000;
const BUILD_ID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

export interface HousekeepingDeps {
  store: Store;
  artifacts: ArtifactStore;
  buildOutput: BuildOutput;
  changes: ChangeFeed;
  /** `<data-dir>/builds`. */
  buildsDir: string;
  /** Builds whose replicas run here now (their files stay). */
  buildsInUse(): Set<string>;
  /** Cancels a build being made (the pipeline). */
  cancelBuild(projectId: string, appId: string, buildId: string): Promise<unknown>;
  logger: Logger;
  /** No build uses the image `digest` any more: it leaves the image shelf and this node's cache. */
  imageGone?: (digest: string) => Promise<void>;
  /** Told what each delete through the API removed (metrics; retention's passes answer theirs). */
  onRemoved?: (what: { builds?: number; runs?: number; bytes?: number }) => void;
}

export interface Housekeeping {
  deleteApp(projectId: string, appId: string): Promise<{ builds: number; cancelledRuns: number; deletedRuns: number }>;
  deleteBuild(projectId: string, appId: string, buildId: string): Promise<void>;
  /**
   * One retention pass: what it removed (`logRuns`, `logBytes`: the logs the project log budget removed).
   * `maxRuns`: expired runs it removes at most (default RETENTION_MAX_RUNS); `signal`: stops it between
   * two batches (the process is closing); `onRuns`: told of each batch of runs removed, once committed.
   */
  retain(settings: {
    keepBuilds: number;
    runRetentionDays: number;
    projectLogBytes?: number;
    now?: number;
    maxRuns?: number;
    signal?: AbortSignal;
    onRuns?: (count: number) => void;
  }): Promise<{
    builds: number;
    runs: number;
    bytes: number;
    logRuns: number;
    logBytes: number;
  }>;
  /** The log budget's part of a pass: removes the oldest finished runs' logs of projects over `budget`. */
  trimLogs(budget: number): Promise<{ runs: number; bytes: number }>;
  /** Removes local build folders whose build is gone from the store; resolves with the bytes freed. */
  sweepLocal(): Promise<number>;
  /**
   * No replica here runs `buildId` any more (its draining pool stopped): if the build was deleted (here or
   * on another process), its folder, kept while it ran, goes now. Resolves with the bytes freed.
   */
  released(buildId: string): Promise<number>;
}

/** The smallest uuidv7 of time `ms`: ids below it were made before then (ids sort by time, byte order). */
export function idBefore(ms: number): string {
  const hex = Math.max(0, Math.floor(ms)).toString(16).padStart(12, '0');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-7000-8000-000000000000`;
}

/** Stats rows summed per statement by storedLogBytes. */
const LOG_STATS_SLICE = 5000;

/**
 * The bytes of run logs stored, over every project: run_log_stats summed a slice of LOG_STATS_SLICE rows
 * at a time in key order, with a turn of the event loop between slices, so no statement is long.
 */
export async function storedLogBytes(store: Store): Promise<number> {
  let total = 0;
  let after = '';
  for (;;) {
    const slice = await store
      .selectFrom((eb) =>
        eb
          .selectFrom('run_log_stats')
          .select(['run_id', 'bytes'])
          .where('run_id', '>', after)
          .orderBy('run_id')
          .limit(LOG_STATS_SLICE)
          .as('slice'),
      )
      .select((eb) => [
        eb.fn.countAll<number | string>().as('n'),
        eb.fn.sum<number | string | null>('slice.bytes').as('bytes'),
        eb.fn.max('slice.run_id').as('last'),
      ])
      .executeTakeFirst();
    total += Number(slice?.bytes ?? 0);
    if (!slice?.last || Number(slice.n) < LOG_STATS_SLICE) return total;
    after = slice.last;
    await new Promise((resolve) => setImmediate(resolve));
  }
}

export function createHousekeeping(deps: HousekeepingDeps): Housekeeping {
  const { store, logger } = deps;

  /** Deleted builds whose folder here stays until the replica running it stops (`released`). */
  const kept = new Set<string>();

  /**
   * The image of a deleted build goes with it once no other build (of any app: images are shared by digest)
   * uses it: from the image shelf and this node's cache (`imageGone`); other nodes drop their copies at
   * the `build.deleted` change (services.ts).
   */
  async function imageOf(digest: string): Promise<void> {
    try {
      const still = await store.selectFrom('builds').select('id').where('image_digest', '=', digest).executeTakeFirst();
      if (!still) await deps.imageGone?.(digest);
    } catch (err) {
      logger.warn({ err, digest }, 'removing a deleted build’s image failed');
    }
  }

  /**
   * Deletes a build's archive and build output (the published copy, and this process's unless a replica
   * here still runs the build: then once it stops).
   */
  async function removeFiles(build: Pick<Build, 'id' | 'archive_bytes' | 'image_digest'>): Promise<number> {
    let bytes = 0;
    if (build.image_digest) await imageOf(build.image_digest);
    try {
      const keepLocal = deps.buildsInUse().has(build.id);
      if (keepLocal) {
        if (kept.size >= 10_000) kept.clear();
        kept.add(build.id);
      }
      bytes += await deps.buildOutput.remove(build.id, { shared: true, keepLocal });
      await deps.artifacts.delete(build.id);
      bytes += Number(build.archive_bytes) || 0;
    } catch (err) {
      // The row is gone already: a file left behind is found again by no one but this log line.
      logger.warn({ err, buildId: build.id }, 'deleting a build’s files failed');
    }
    return bytes;
  }

  async function deleteRunHistory(db: Store, ids: string[]): Promise<void> {
    for (let i = 0; i < ids.length; i += CHUNK) {
      const chunk = ids.slice(i, i + CHUNK);
      await db.deleteFrom('run_log_lines').where('run_id', 'in', chunk).execute();
      await db.deleteFrom('run_log_stats').where('run_id', 'in', chunk).execute();
      await db.deleteFrom('webhook_attempts').where('run_id', 'in', chunk).execute();
      await db.deleteFrom('webhook_deliveries').where('run_id', 'in', chunk).execute();
      await db.deleteFrom('runs').where('id', 'in', chunk).execute();
    }
  }

  const housekeeping: Housekeeping = {
    async deleteApp(projectId, appId) {
      await findApp(store, projectId, appId);
      // Builds being made stop first: their pipeline would write to rows about to go.
      const making = await store
        .selectFrom('builds')
        .select('id')
        .where('project_id', '=', projectId)
        .where('app_id', '=', appId)
        .where('state', 'in', ['pending', 'building'])
        .execute();
      for (const b of making) await deps.cancelBuild(projectId, appId, b.id).catch(() => undefined);

      const now = Date.now();
      const result = await store.transaction().execute(async (trx) => {
        const builds = await trx
          .selectFrom('builds')
          .select(['id', 'archive_bytes', 'image_digest'])
          .where('project_id', '=', projectId)
          .where('app_id', '=', appId)
          .execute();
        const finished = (
          await trx
            .selectFrom('runs')
            .select('id')
            .where('project_id', '=', projectId)
            .where('app_id', '=', appId)
            .where('state', 'in', [...FINAL_RUN_STATES])
            .execute()
        ).map((r) => r.id);
        const queued = await trx
          .selectFrom('runs')
          .select(['id', 'webhook_endpoint'])
          .where('project_id', '=', projectId)
          .where('app_id', '=', appId)
          .where('state', '=', 'queued')
          .where('mode', '=', 'async')
          .where(unfinishedRun())
          .execute();
        for (let i = 0; i < queued.length; i += CHUNK) {
          await cancelQueued(
            trx,
            queued.slice(i, i + CHUNK),
            { message: `${ERRORS.FERRY_RUN_CANCELLED.message}: its app was deleted`, reason: 'app_deleted' },
            now,
          );
        }
        await deleteRunHistory(trx, finished);
        // The records left (runs in flight, those just cancelled) let go of their Idempotency-Keys: an app
        // deployed again under this name is a new app, and a key it is called with names its own runs.
        await trx
          .updateTable('runs')
          .set({ idempotency_key: null })
          .where('project_id', '=', projectId)
          .where('app_id', '=', appId)
          .where('idempotency_key', 'is not', null)
          .execute();
        const buildIds = builds.map((b) => b.id);
        for (let i = 0; i < buildIds.length; i += CHUNK) {
          await trx
            .deleteFrom('build_log_lines')
            .where('build_id', 'in', buildIds.slice(i, i + CHUNK))
            .execute();
        }
        await trx.deleteFrom('builds').where('project_id', '=', projectId).where('app_id', '=', appId).execute();
        // Its schedules start nothing more (an app deployed again under this name brings its own).
        await removeSchedules(trx, { projectId, appId });
        await trx.deleteFrom('apps').where('project_id', '=', projectId).where('id', '=', appId).execute();
        return { builds, cancelledRuns: queued.length, deletedRuns: finished.length };
      });
      // Every process (this one before the answer): refuse its calls, stop its replicas, drop its queue.
      await deps.changes.publish({ type: 'app.deleted', projectId, appId });
      let bytes = 0;
      for (const b of result.builds) bytes += await removeFiles(b);
      // Then each build by name: the other processes remove their copies of it once no replica there runs
      // it (a copy not in use goes at once; without the name, only a sweep would find it, minutes later).
      for (const b of result.builds) {
        await deps.changes.publish({ type: 'build.deleted', projectId, appId, buildId: b.id });
      }
      deps.onRemoved?.({ builds: result.builds.length, runs: result.deletedRuns, bytes });
      logger.info(
        { app: appId, builds: result.builds.length, cancelledRuns: result.cancelledRuns, runs: result.deletedRuns },
        'app deleted',
      );
      return { builds: result.builds.length, cancelledRuns: result.cancelledRuns, deletedRuns: result.deletedRuns };
    },

    async deleteBuild(projectId, appId, buildId) {
      const app = await findApp(store, projectId, appId);
      const build = await store
        .selectFrom('builds')
        .select(['id', 'state', 'archive_bytes', 'image_digest'])
        .where('project_id', '=', projectId)
        .where('app_id', '=', appId)
        .where('id', '=', buildId)
        .executeTakeFirst();
      if (!build) throw new FerryError('FERRY_BUILD_NOT_FOUND', `No build ${buildId} of app "${appId}"`);
      if (app.active_build_id === buildId) {
        throw new FerryError(
          'FERRY_BUILD_ACTIVE',
          `Build ${buildId} is the active build of "${appId}": activate another build first, or delete the app`,
        );
      }
      if (build.state === 'pending' || build.state === 'building') {
        throw new FerryError('FERRY_BUILD_IN_PROGRESS', `Build ${buildId} is ${build.state}: cancel it first`);
      }
      const deleted = await store.transaction().execute(async (trx) => {
        // Not the active one at the moment of the delete either (an activate may have raced it).
        const still = await lockApp(trx, projectId, appId);
        if (still?.active_build_id === buildId) return false;
        await trx.deleteFrom('build_log_lines').where('build_id', '=', buildId).execute();
        await trx.deleteFrom('builds').where('id', '=', buildId).execute();
        return true;
      });
      if (!deleted)
        throw new FerryError('FERRY_BUILD_ACTIVE', `Build ${buildId} became the active build of "${appId}"`);
      await deps.changes.publish({ type: 'build.deleted', projectId, appId, buildId });
      const bytes = await removeFiles(build);
      deps.onRemoved?.({ builds: 1, bytes });
    },

    async trimLogs(budget) {
      let runs = 0;
      let bytes = 0;
      if (budget <= 0) return { runs, bytes };
      // No project is over the budget while all of them together are not: their total first, summed a
      // slice of the stats at a time (a join of every logged run's stats with its run, in one statement,
      // held SQLite's writer and Node's event loop for seconds at a million runs: bench:scale).
      if ((await storedLogBytes(store)) <= budget) return { runs, bytes };
      // Stored log bytes per project, from the runs' stats (one row per run that printed, not per line).
      const totals = await store
        .selectFrom('run_log_stats as s')
        .innerJoin('runs as r', 'r.id', 's.run_id')
        .select(['r.project_id as project_id', (eb) => eb.fn.sum<number | string>('s.bytes').as('bytes')])
        .where('s.bytes', '>', 0)
        .groupBy('r.project_id')
        .execute();
      for (const total of totals) {
        let over = Number(total.bytes) - budget;
        for (let page = 0; over > 0 && runs < LOG_BUDGET_MAX_RUNS && page < 100; page++) {
          // Oldest first: run ids are uuidv7, in the order the runs were made.
          const oldest = await store
            .selectFrom('run_log_stats as s')
            .innerJoin('runs as r', 'r.id', 's.run_id')
            .select(['s.run_id as run_id'])
            .where('r.project_id', '=', total.project_id)
            .where('r.state', 'in', [...FINAL_RUN_STATES])
            .where('s.bytes', '>', 0)
            .orderBy('s.run_id', 'asc')
            .limit(Math.min(CHUNK, LOG_BUDGET_MAX_RUNS - runs))
            .execute();
          if (oldest.length === 0) break;
          for (const { run_id } of oldest) {
            if (over <= 0) break;
            const freed = await store.transaction().execute(async (trx) => {
              const stats = await trx
                .selectFrom('run_log_stats')
                .selectAll()
                .where('run_id', '=', run_id)
                .where('bytes', '>', 0)
                .executeTakeFirst();
              if (!stats) return 0;
              // Claims the row first: another process trimming at the same time finds bytes 0 and skips it.
              const claimed = await trx
                .updateTable('run_log_stats')
                .set({ bytes: 0 })
                .where('run_id', '=', run_id)
                .where('bytes', '=', stats.bytes)
                .executeTakeFirst();
              if (Number(claimed.numUpdatedRows) !== 1) return 0;
              const lines = await trx
                .selectFrom('run_log_lines')
                .select([(eb) => eb.fn.countAll<number | string>().as('n'), (eb) => eb.fn.max('seq').as('last')])
                .where('run_id', '=', run_id)
                .executeTakeFirst();
              const count = Number(lines?.n ?? 0);
              const last = Number(lines?.last ?? 0);
              await trx.deleteFrom('run_log_lines').where('run_id', '=', run_id).execute();
              const droppedLines = Number(stats.dropped_lines) + count;
              const droppedBytes = Number(stats.dropped_bytes) + Number(stats.bytes);
              await trx
                .updateTable('run_log_stats')
                .set({ dropped_lines: droppedLines, dropped_bytes: droppedBytes })
                .where('run_id', '=', run_id)
                .execute();
              // One line stays (not counted in the budget): why the log is gone, and what it held.
              await trx
                .insertInto('run_log_lines')
                .values({
                  run_id,
                  seq: last + 1,
                  at: new Date().toISOString(),
                  stream: 'system',
                  line: droppedMarker(
                    droppedLines,
                    droppedBytes,
                    `the project's run logs passed their budget of ${budget} bytes, and this run's were among the oldest`,
                  ),
                })
                .execute();
              return Number(stats.bytes);
            });
            if (freed === 0) continue;
            runs += 1;
            bytes += freed;
            over -= freed;
          }
        }
      }
      if (runs > 0) logger.info({ runs, bytes, budget }, 'the project log budget removed the oldest runs’ logs');
      return { runs, bytes };
    },

    async retain({
      keepBuilds,
      runRetentionDays,
      projectLogBytes = 0,
      now = Date.now(),
      maxRuns = RETENTION_MAX_RUNS,
      signal,
      onRuns,
    }) {
      let builds = 0;
      let bytes = 0;
      // Builds: per app, the newest keepBuilds ready builds and the active one stay; older builds go
      // (failed and cancelled ones older than the oldest kept ready build too).
      // Only apps with more builds than are kept can have one to delete: one count over the builds finds
      // them (a pass looked at every app with two queries each, 2,000 queries at 1,000 apps, which on
      // SQLite ran without a turn of the event loop between them: 0.2-0.4 s of stalled calls, bench:scale).
      const crowded =
        keepBuilds > 0
          ? await store
              .selectFrom('builds')
              .select(['project_id', 'app_id'])
              .groupBy(['project_id', 'app_id'])
              .having((eb) => eb.fn.countAll(), '>', keepBuilds)
              .execute()
          : [];
      const apps = [];
      for (const c of crowded) {
        const app = await store
          .selectFrom('apps')
          .select(['project_id', 'id', 'active_build_id'])
          .where('project_id', '=', c.project_id)
          .where('id', '=', c.app_id)
          .executeTakeFirst();
        if (app) apps.push(app);
      }
      for (const app of apps) {
        if (builds >= RETENTION_MAX_BUILDS) break;
        // A turn of the event loop per app: on SQLite an awaited query does not give one.
        await new Promise((resolve) => setImmediate(resolve));
        const ready = await store
          .selectFrom('builds')
          .select('id')
          .where('project_id', '=', app.project_id)
          .where('app_id', '=', app.id)
          .where('state', '=', 'ready')
          .orderBy('id', 'desc')
          .limit(keepBuilds)
          .execute();
        const byId = new Map<string, { id: string; archive_bytes: number; image_digest: string | null }>();
        if (ready.length >= keepBuilds) {
          const oldestKept = ready.at(-1)!.id;
          const older = await store
            .selectFrom('builds')
            .select(['id', 'archive_bytes', 'image_digest'])
            .where('project_id', '=', app.project_id)
            .where('app_id', '=', app.id)
            .where('id', '<', oldestKept)
            .where('state', 'in', ['ready', 'failed', 'cancelled'])
            .orderBy('id', 'asc')
            .limit(RETENTION_MAX_BUILDS - builds)
            .execute();
          for (const b of older) byId.set(b.id, b);
        }
        // Failed and cancelled builds: the newest keepBuilds stay, whatever the ready ones (an app whose
        // builds always fail would otherwise keep every archive uploaded to it).
        const unready = await store
          .selectFrom('builds')
          .select('id')
          .where('project_id', '=', app.project_id)
          .where('app_id', '=', app.id)
          .where('state', 'in', ['failed', 'cancelled'])
          .orderBy('id', 'desc')
          .limit(keepBuilds)
          .execute();
        if (unready.length >= keepBuilds) {
          const failedOlder = await store
            .selectFrom('builds')
            .select(['id', 'archive_bytes', 'image_digest'])
            .where('project_id', '=', app.project_id)
            .where('app_id', '=', app.id)
            .where('id', '<', unready.at(-1)!.id)
            .where('state', 'in', ['failed', 'cancelled'])
            .orderBy('id', 'asc')
            .limit(RETENTION_MAX_BUILDS - builds)
            .execute();
          for (const b of failedOlder) byId.set(b.id, b);
        }
        const old = [...byId.values()].sort((x, y) => (x.id < y.id ? -1 : 1)).slice(0, RETENTION_MAX_BUILDS - builds);
        for (const b of old) {
          if (b.id === app.active_build_id) continue;
          const gone = await store.transaction().execute(async (trx) => {
            const current = await lockApp(trx, app.project_id, app.id);
            if (current?.active_build_id === b.id) return false;
            await trx.deleteFrom('build_log_lines').where('build_id', '=', b.id).execute();
            const res = await trx.deleteFrom('builds').where('id', '=', b.id).executeTakeFirst();
            return Number(res.numDeletedRows) > 0;
          });
          if (!gone) continue;
          builds += 1;
          bytes += await removeFiles(b);
          await deps.changes.publish({
            type: 'build.deleted',
            projectId: app.project_id,
            appId: app.id,
            buildId: b.id,
          });
        }
      }
      // Runs: finished runs made before the retention window, their logs and webhook records with them,
      // oldest first, a batch per transaction, each followed by a pause (retentionPause).
      const cutoff = idBefore(now - runRetentionDays * 86_400_000);
      let runs = 0;
      let after = '';
      while (runRetentionDays > 0 && runs < maxRuns && !signal?.aborted) {
        const started = performance.now();
        const batch = (
          await store
            .selectFrom('runs')
            .select('id')
            .where('id', '<', cutoff)
            .where('id', '>', after)
            .where('state', 'in', [...FINAL_RUN_STATES])
            .orderBy('id', 'asc')
            .limit(Math.min(RETENTION_RUN_BATCH, maxRuns - runs))
            .execute()
        ).map((r) => r.id);
        if (batch.length === 0) break;
        await store.transaction().execute((trx) => deleteRunHistory(trx, batch));
        runs += batch.length;
        after = batch.at(-1)!;
        onRuns?.(batch.length);
        if (batch.length < RETENTION_RUN_BATCH) break;
        await new Promise((resolve) => setTimeout(resolve, retentionPause(store, performance.now() - started)));
      }
      bytes += await housekeeping.sweepLocal();
      if (builds > 0 || runs > 0 || bytes > 0) {
        logger.info({ builds, runs, bytes }, 'retention removed old builds and runs');
      }
      const logs = await housekeeping.trimLogs(projectLogBytes);
      return { builds, runs, bytes, logRuns: logs.runs, logBytes: logs.bytes };
    },

    async released(buildId) {
      if (deps.buildsInUse().has(buildId)) return 0;
      if (!kept.delete(buildId)) {
        // Deleted through another process (app.deleted, build.deleted came while it ran here)?
        const row = await store.selectFrom('builds').select('id').where('id', '=', buildId).executeTakeFirst();
        if (row) return 0;
      }
      // No row names it any more, so nothing starts a replica of it again.
      try {
        return await deps.buildOutput.remove(buildId);
      } catch (err) {
        logger.warn({ err, buildId }, 'removing a deleted build’s folder failed');
        return 0;
      }
    },

    async sweepLocal() {
      let names: string[];
      try {
        names = await fs.readdir(deps.buildsDir);
      } catch {
        return 0;
      }
      const ids = names.filter((n) => BUILD_ID.test(n));
      if (ids.length === 0) return 0;
      const inUse = deps.buildsInUse();
      const known = new Set<string>();
      for (let i = 0; i < ids.length; i += CHUNK) {
        const rows = await store
          .selectFrom('builds')
          .select('id')
          .where('id', 'in', ids.slice(i, i + CHUNK))
          .execute();
        for (const r of rows) known.add(r.id);
      }
      let bytes = 0;
      const now = Date.now();
      for (const id of ids) {
        if (known.has(id) || inUse.has(id)) continue;
        // A folder made in the last minutes may be an upload whose row is not committed yet.
        const stat = await fs.lstat(path.join(deps.buildsDir, id)).catch(() => undefined);
        if (!stat || now - stat.mtimeMs < LOCAL_MIN_AGE_MS) continue;
        bytes += await deps.buildOutput.remove(id).catch(() => 0);
      }
      return bytes;
    },
  };
  return housekeeping;
}
