/**
 * The loader of bench:scale: fills a Ferry store (SQLite file or PostgreSQL, opened with Ferry's own
 * `openStore` from dist/) with many apps and many finished runs, written with Ferry's own run-row code
 * (`newRunRow` of src/runs/recorder.ts, `insertRunsIgnoring` of src/store/run-inserts.ts) and the store's
 * Kysely for log lines, log stats, apps and builds. Kept small on purpose: when the run write path changes,
 * only `writeBatch` should need to follow.
 *
 * The apps: the apps deployed through the API beforehand (real builds) stay; each of the others, up to
 * `apps` in all, gets an apps row and a builds row copied from the active build of `appId` (new id, its
 * own name). Their build folders do not exist: a build's files are needed only when a replica starts,
 * and these apps are never called (min_replicas 0).
 *
 * The runs, in creation order (run ids are UUIDv7 of their creation time, as Ferry makes them):
 * `expiredShare` of them created between 90 and 31 days ago (past a 30-day retention), the rest spread
 * over the last 29 days up to a minute ago. `mainShare` of them belong to `appId` (the app the bench reads
 * through the API), the others are spread over all the other apps at random.
 */
import crypto from 'node:crypto';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { sql } from 'kysely';
import { REPO_ROOT } from './lib.mjs';

const DAY = 86_400_000;
const dist = (p) => import(pathToFileURL(path.join(REPO_ROOT, 'dist', 'src', p)).href);

/** Runs written per transaction. */
const BATCH = 2000;
/** Log lines per INSERT (5 values each: under SQLite's limit of bound values). */
const LINES_CHUNK = 1000;

/**
 * A UUIDv7 of the time `ms` (as src/ids.ts lays it out: 48-bit milliseconds, version 7, then random bits).
 * Not Ferry's `uuidv7`, which stays monotonic within a process: after one load it would stamp every id
 * of a second load (the next store) with the first load's last time, and retention, which goes by the
 * ids' time, would find no expired run.
 */
function uuidv7At(ms) {
  const bytes = crypto.randomBytes(16);
  bytes.writeUIntBE(ms, 0, 6);
  bytes[6] = 0x70 | (bytes[6] & 0x0f);
  bytes[8] = 0x80 | (bytes[8] & 0x3f);
  const hex = bytes.toString('hex');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** A small deterministic random source (the same data for the same seed on both stores). */
function rng(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const WORDS = ['alpha', 'order', 'invoice', 'resize', 'thumbnail', 'sync', 'customer', 'report', 'export', 'retry'];

/** What a run of one of these apps takes, returns and prints: a few hundred bytes of JSON, like a real call. */
function content(rand, i) {
  const pick = () => WORDS[Math.floor(rand() * WORDS.length)];
  const items = Array.from({ length: 1 + Math.floor(rand() * 6) }, (_, k) => ({
    sku: `sku-${(i * 7 + k) % 100000}`,
    qty: 1 + Math.floor(rand() * 9),
    price_cents: Math.floor(rand() * 100000),
  }));
  const input = JSON.stringify({
    user_id: Math.floor(rand() * 1e6),
    action: pick(),
    items,
    note: `${pick()} ${pick()} ${pick()} #${i}`,
    requested_at: new Date(1_700_000_000_000 + i * 1000).toISOString(),
  });
  const result = JSON.stringify({
    ok: true,
    id: crypto.randomUUID(),
    total_cents: items.reduce((s, it) => s + it.qty * it.price_cents, 0),
    lines: items.length,
    tags: [pick(), pick()],
  });
  return { input, result };
}

/**
 * Loads more apps, up to `apps` (copies of `appId`'s active build), and `runs` finished runs into the store of
 * `dataDir` / `databaseUrl`. Resolves with what the bench needs to read them back: sample run ids of the
 * deployed app, a deep-page cursor, the number of expired runs, and timings.
 */
export async function loadScale({ dataDir, databaseUrl, projectId, appId, apps, runs, expiredShare, mainShare, now }) {
  const { openStore, dialectOf } = await dist('store/index.js');
  const { newRunRow } = await dist('runs/recorder.js');
  const { insertRunsIgnoring } = await dist('store/run-inserts.js');
  const { isoTime } = await dist('ids.js');
  const store = await openStore({ dataDir, databaseUrl });
  const rand = rng(31);
  const t0 = performance.now();
  try {
    // The apps: the deployed one dates from before its oldest run (runs older than their app are not
    // listed: an app deleted and deployed again is a new app), the others are copies of its build.
    const oldest = now - 90 * DAY - 60_000;
    const main = await store
      .selectFrom('apps')
      .selectAll()
      .where('project_id', '=', projectId)
      .where('id', '=', appId)
      .executeTakeFirstOrThrow();
    const build = await store
      .selectFrom('builds')
      .selectAll()
      .where('id', '=', main.active_build_id)
      .executeTakeFirstOrThrow();
    await store
      .updateTable('apps')
      .set({ created_at: isoTime(oldest) })
      .where('project_id', '=', projectId)
      .execute();
    const deployed = await store
      .selectFrom('apps')
      .select(['id', 'active_build_id'])
      .where('project_id', '=', projectId)
      .orderBy('id')
      .execute();
    const appIds = [appId, ...deployed.map((a) => a.id).filter((id) => id !== appId)];
    const builds = Object.fromEntries(deployed.map((a) => [a.id, a.active_build_id]));
    const width = String(apps).length;
    for (let from = appIds.length; from < apps; from += 500) {
      await store.transaction().execute(async (trx) => {
        const appRows = [];
        const buildRows = [];
        for (let n = from; n < Math.min(apps, from + 500); n++) {
          const name = `app-${String(n).padStart(width, '0')}`;
          const id = uuidv7At(oldest - 60_000 + n);
          const rename = (text) => text.replaceAll(`"${appId}"`, `"${name}"`);
          buildRows.push({
            ...build,
            id,
            app_id: name,
            config_toml: rename(build.config_toml),
            config_json: rename(build.config_json),
            created_at: isoTime(oldest),
            started_at: isoTime(oldest),
            finished_at: isoTime(oldest),
          });
          appRows.push({
            id: name,
            project_id: projectId,
            name,
            active_build_id: id,
            scaling_json: null,
            created_at: isoTime(oldest),
            updated_at: isoTime(oldest),
          });
          appIds.push(name);
          builds[name] = id;
        }
        for (let i = 0; i < buildRows.length; i += 50)
          await trx
            .insertInto('builds')
            .values(buildRows.slice(i, i + 50))
            .execute();
        for (let i = 0; i < appRows.length; i += 100)
          await trx
            .insertInto('apps')
            .values(appRows.slice(i, i + 100))
            .execute();
      });
    }
    const tApps = performance.now();

    // The runs, oldest first.
    const expired = Math.round(runs * expiredShare);
    const expiredFrom = now - 90 * DAY;
    const expiredSpan = 59 * DAY;
    const recentFrom = now - 29 * DAY;
    const recentSpan = 29 * DAY - 60_000;
    const mainRuns = [];
    const sampleEvery = Math.max(1, Math.floor((runs * mainShare) / 1000));
    let mainCount = 0;
    let lines = 0;
    for (let start = 0; start < runs; start += BATCH) {
      const rows = [];
      const logRows = [];
      const stats = [];
      for (let i = start; i < Math.min(runs, start + BATCH); i++) {
        const created =
          i < expired
            ? expiredFrom + Math.floor((i / expired) * expiredSpan)
            : recentFrom + Math.floor(((i - expired) / Math.max(1, runs - expired)) * recentSpan);
        const app = rand() < mainShare ? appId : (appIds[1 + Math.floor(rand() * (appIds.length - 1))] ?? appId);
        const id = uuidv7At(created);
        const m = rand();
        const mode = m < 0.7 ? 'sync' : m < 0.98 ? 'async' : 'stream';
        const s = rand();
        const state = s < 0.93 ? 'success' : s < 0.98 ? 'failure' : s < 0.99 ? 'timeout' : 'cancelled';
        const { input, result } = content(rand, i);
        const started = created + (mode === 'async' ? 2 + Math.floor(rand() * 50) : 0);
        const ms = state === 'timeout' ? 900_000 : 3 + Math.floor(rand() * rand() * 2000);
        const row = newRunRow({
          id,
          build: { projectId, appId: app, buildId: builds[app] },
          fn: rand() < 0.8 ? 'run' : 'report',
          mode,
          input,
          idempotencyKey: mode === 'async' && rand() < 0.1 ? `key-${i}` : undefined,
          createdAt: created,
        });
        const error =
          state === 'failure'
            ? {
                code: 'FERRY_FUNCTION_ERROR',
                message: `TypeError: Cannot read properties of undefined (reading '${WORDS[i % 10]}')`,
              }
            : state === 'timeout'
              ? { code: 'FERRY_RUN_TIMEOUT', message: 'The run took longer than the app’s response_grace_period' }
              : state === 'cancelled'
                ? { code: 'FERRY_RUN_CANCELLED', message: 'The run was cancelled' }
                : undefined;
        rows.push({
          ...row,
          state,
          status_code: state === 'success' ? 200 : state === 'failure' ? 500 : state === 'timeout' ? 504 : 409,
          result: state === 'success' ? result : null,
          error_code: error?.code ?? null,
          error_message: error?.message ?? null,
          cold_start: rand() < 0.01 ? 1 : 0,
          attempts: state === 'cancelled' && mode === 'async' ? 0 : 1,
          started_at: state === 'cancelled' && mode === 'async' ? null : isoTime(started),
          finished_at: isoTime(started + ms),
          run_time_ms: state === 'cancelled' ? null : ms,
        });
        if (app === appId) {
          if (mainCount % sampleEvery === 0) mainRuns.push(id);
          mainCount++;
        }
        // A third of the runs print: 1 to 6 lines each, with their byte count in run_log_stats.
        if (rand() < 0.33) {
          const n = 1 + Math.floor(rand() * 6);
          let bytes = 0;
          for (let seq = 1; seq <= n; seq++) {
            const line = `[${WORDS[(i + seq) % 10]}] handled ${seq}/${n} user=${Math.floor(rand() * 1e6)} in ${Math.floor(rand() * 500)} ms`;
            bytes += Buffer.byteLength(line);
            logRows.push({
              run_id: id,
              seq,
              at: isoTime(started + seq),
              stream: seq === n && state === 'failure' ? 'stderr' : 'stdout',
              line,
            });
          }
          stats.push({ run_id: id, bytes, dropped_lines: 0, dropped_bytes: 0 });
        }
      }
      await writeBatch(store, insertRunsIgnoring, rows, logRows, stats);
      lines += logRows.length;
      if (start % (BATCH * 50) === 0 || start + BATCH >= runs) {
        const done = Math.min(runs, start + BATCH);
        const rate = done / ((performance.now() - tApps) / 1000);
        process.stdout.write(`\r  loaded ${done} of ${runs} runs (${Math.round(rate)} runs/s)   `);
      }
    }
    process.stdout.write('\n');
    // PostgreSQL plans from its statistics: what autovacuum would gather soon after the tables grew so.
    // (SQLite has none unless ANALYZE is run, which Ferry does not do: its plans are measured without.)
    if (dialectOf(store) === 'postgres') await sql`analyze`.execute(store);
    return {
      appIds,
      expired,
      mainCount,
      mainRuns,
      // A cursor near the oldest end of the deployed app's runs: a page from it is a deep page.
      deepCursor: mainRuns[Math.min(mainRuns.length - 1, 5)],
      logLines: lines,
      appsSeconds: (tApps - t0) / 1000,
      runsSeconds: (performance.now() - tApps) / 1000,
    };
  } finally {
    await store.destroy();
  }
}

/** One transaction: the runs (Ferry's multi-row insert), then their log lines and log stats. */
async function writeBatch(store, insertRunsIgnoring, rows, logRows, stats) {
  await store.transaction().execute(async (trx) => {
    await insertRunsIgnoring(trx, rows);
    for (let i = 0; i < logRows.length; i += LINES_CHUNK)
      await trx
        .insertInto('run_log_lines')
        .values(logRows.slice(i, i + LINES_CHUNK))
        .execute();
    for (let i = 0; i < stats.length; i += LINES_CHUNK)
      await trx
        .insertInto('run_log_stats')
        .values(stats.slice(i, i + LINES_CHUNK))
        .execute();
  });
}
