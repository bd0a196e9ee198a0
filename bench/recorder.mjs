#!/usr/bin/env node
/**
 * What a run's durable record costs on the embedded store (issue 15): the run recorder (runs/recorder.ts)
 * over a real SQLite file in a temp dir, driven in this process the way the run path drives it (start,
 * an event-loop turn, `running`, a turn, `success`), 32 runs in flight. Each run also does BENCH_WORK_US of
 * busy work, so that the recorder's flush every 5 ms writes batches of the size it writes under load (about
 * 50 to 70 rows; at full speed they would be hundreds, and cheaper per row). Measured side by side in one
 * run, alternating: the same loop with the recorder and without it; the difference is the record's CPU.
 * Prints figures; asserts nothing.
 *
 *   npm run build && npm run bench:recorder
 *   BENCH_RUNS=100000 BENCH_WORK_US=70 BENCH_ROUNDS=3 npm run bench:recorder
 */
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import {
  envInt,
  fmt,
  loadAverage,
  machineReport,
  REPO_ROOT,
  requireDist,
  runMain,
  summarize,
  table,
  tempDir,
} from './lib.mjs';

const RUNS = envInt('BENCH_RUNS', 100_000);
const WORK_US = envInt('BENCH_WORK_US', 70, 0);
const ROUNDS = envInt('BENCH_ROUNDS', 3);
const LANES = 32;

const dist = (file) => import(pathToFileURL(path.join(REPO_ROOT, 'dist', 'src', file)).href);

runMain(async () => {
  requireDist();
  const { openSqliteStore } = await dist('store/sqlite.js');
  const { createRunRecorder, newRunRow } = await dist('runs/recorder.js');
  const { uuidv7, isoTime } = await dist('ids.js');
  const { default: pino } = await import('pino');

  console.log('Ferry bench: the run recorder on SQLite, with and without a record per run\n');
  console.log(machineReport());
  const dataDir = await tempDir('ferry-bench-recorder-');
  const store = await openSqliteStore({ dataDir });
  const recorder = createRunRecorder({ store, logger: pino({ level: 'silent' }), owner: 'bench-node' });
  const build = {
    projectId: 'p-1a2b3c4d',
    appId: '0192a8f0-0000-7000-8000-000000000000',
    buildId: '0192a8f0-0000-7000-8000-000000000001',
  };
  // Each flush of the recorder's is one transaction: counted to tell the batch size.
  let flushes = 0;
  const transaction = store.transaction.bind(store);
  store.transaction = () => {
    flushes += 1;
    return transaction();
  };

  const turn = () => new Promise((resolve) => setImmediate(resolve));
  const work = () => {
    const until = process.hrtime.bigint() + BigInt(WORK_US * 1000);
    while (process.hrtime.bigint() < until);
  };
  async function lane(runs, record) {
    for (let i = 0; i < runs; i++) {
      const id = uuidv7();
      const created = Date.now();
      if (record) recorder.start(newRunRow({ id, build, fn: 'run', mode: 'sync', input: '{}', createdAt: created }));
      work();
      await turn();
      const started = Date.now();
      if (record)
        recorder.update(id, { state: 'running', build_id: build.buildId, started_at: isoTime(started), cold_start: 0 });
      await turn();
      const now = Date.now();
      if (record) {
        recorder.finish(id, {
          result: '{"ok":true}',
          run_time_ms: now - started,
          state: 'success',
          status_code: 200,
          finished_at: isoTime(now),
        });
      }
    }
  }
  async function measure(runs, record) {
    await recorder.flush(true);
    const before = process.cpuUsage();
    const began = Date.now();
    flushes = 0;
    const perLane = Math.ceil(runs / LANES);
    await Promise.all(Array.from({ length: LANES }, () => lane(perLane, record)));
    await recorder.flush(true);
    const used = process.cpuUsage(before);
    const n = perLane * LANES;
    return {
      us: (used.user + used.system) / n,
      sys: used.system / n,
      perSecond: n / ((Date.now() - began) / 1000),
      flushes,
      n,
    };
  }

  console.log(
    `${LANES} runs in flight, ${WORK_US} µs of work per run, ${RUNS} runs per round, ${ROUNDS} rounds each way\n`,
  );
  await measure(Math.min(RUNS, 20_000), true); // warm-up: JIT, statement cache, the file's first pages
  await measure(Math.min(RUNS, 20_000), false);
  const rows = [
    ['round', 'without µs/run', 'with µs/run', 'record µs/run', 'of it kernel', 'runs/s with', 'rows/flush'],
  ];
  const diffs = [];
  for (let r = 1; r <= ROUNDS; r++) {
    const without = await measure(RUNS, false);
    const withRecord = await measure(RUNS, true);
    const diff = withRecord.us - without.us;
    diffs.push(diff);
    rows.push([
      String(r),
      fmt(without.us),
      fmt(withRecord.us),
      fmt(diff),
      fmt(withRecord.sys - without.sys),
      String(Math.round(withRecord.perSecond)),
      fmt(withRecord.n / Math.max(1, withRecord.flushes), 0),
    ]);
  }
  console.log(table(rows));
  const stored = await store
    .selectFrom('runs')
    .select((eb) => eb.fn.countAll().as('n'))
    .executeTakeFirstOrThrow();
  console.log(`\nrecord per run (median of ${ROUNDS}): ${fmt(summarize(diffs).median)} µs of CPU`);
  console.log(`rows in the runs table at the end: ${stored.n}`);
  console.log(`load average at end: ${loadAverage()}`);
  await recorder.close();
  await store.destroy();
});
