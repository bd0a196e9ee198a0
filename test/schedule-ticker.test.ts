// The schedule ticker on a real store (SQLite here, PostgreSQL in test/postgres/), with the real run
// recorder and a fake clock: one run per tick when two nodes race on it or a node dies between the
// run's insert and the schedule's advance, one catch-up run after downtime, overlap skip, pause and
// resume, a tick per local day across daylight saving time changes, and schedules replaced by builds.
// Issue 43: a tick the backlog refuses is skipped and counted and the schedule moves on, one project's
// due schedules never keep another's from a look, and the ticker's warnings come once a minute per project.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, beforeEach, describe, it } from 'node:test';
import pino from 'pino';
import type { ScheduleConfig } from '../src/apps/app-config.js';
import { FerryError } from '../src/errors.js';
import { createMetrics } from '../src/metrics.js';
import { createRunRecorder, newRunRow, type RunRecorder } from '../src/runs/recorder.js';
import { listSchedules, replaceSchedules, setPaused } from '../src/schedules/schedules.js';
import { createScheduleRunStarter } from '../src/schedules/start-run.js';
import { createScheduleTicker, type ScheduleRunStarter } from '../src/schedules/ticker.js';
import type { Store } from '../src/store/index.js';
import { openTestStore, type TestStore } from './helpers/store.js';

const log = pino({ level: 'silent' });
const APP = { projectId: 'p-sched', appId: 'reports' };

function schedule(over: Partial<ScheduleConfig> = {}): ScheduleConfig {
  return {
    name: 'nightly',
    cron: '0 3 * * *',
    timezone: 'UTC',
    function: 'run',
    args: { full: true },
    webhook: null,
    overlap: 'allow',
    ...over,
  };
}

describe('schedule ticker', () => {
  let dir: string;
  let test: TestStore;
  let store: Store;
  const recorders: RunRecorder[] = [];

  before(async () => {
    dir = mkdtempSync(path.join(tmpdir(), 'ferry-ticker-'));
    test = await openTestStore(dir);
    store = test.store;
  });
  after(async () => {
    for (const r of recorders) await r.close();
    await test.close();
    rmSync(dir, { recursive: true, force: true });
  });
  beforeEach(async () => {
    await store.deleteFrom('schedules').execute();
    await store.deleteFrom('runs').execute();
  });

  /**
   * A node: its own recorder and ticker over the shared store. `options.full`: the projects whose async
   * backlog is full (the run service refuses them as it refuses a call); `options.lines`: where its log goes.
   */
  function node(
    name: string,
    wrap?: (s: ScheduleRunStarter) => ScheduleRunStarter,
    options: { full?: Set<string>; lines?: Array<Record<string, unknown>> } = {},
  ) {
    const recorder = createRunRecorder({ store, logger: log, owner: name });
    recorders.push(recorder);
    const metrics = createMetrics();
    // The run service's two steps as the ticker needs them: admitted unless the test fills the project's
    // backlog, committed by this node's recorder.
    const starter = createScheduleRunStarter({
      runs: {
        admitAsync: async (projectId) => {
          if (options.full?.has(projectId)) throw new FerryError('FERRY_PROJECT_BACKLOG_FULL');
        },
        commitAsync: (fields) => recorder.insertNow(newRunRow({ ...fields, mode: 'async', owner: null })),
      },
      runtimeOf: async () => 'cortex',
    });
    const lines = options.lines;
    const logger = lines
      ? pino({ level: 'debug' }, { write: (line: string) => lines.push(JSON.parse(line) as Record<string, unknown>) })
      : log;
    const ticker = createScheduleTicker({ db: store, starter: wrap ? wrap(starter) : starter, log: logger, metrics });
    return { ticker, metrics };
  }

  async function runs() {
    return store
      .selectFrom('runs')
      .select(['id', 'trigger', 'schedule_name', 'scheduled_for', 'input', 'function_name', 'mode', 'state'])
      .orderBy('scheduled_for')
      .execute();
  }

  async function skipped(metrics: ReturnType<typeof createMetrics>, reason: string): Promise<number> {
    const m = await metrics.scheduleTicksSkipped.get();
    return m.values.find((v) => v.labels.reason === reason)?.value ?? 0;
  }

  it('starts one async run per due tick, with the schedule and the tick on the record', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule()], Date.parse('2026-05-01T12:00:00Z'));
    const a = node('a');
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-02T02:59:59Z')), 0);
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-02T03:00:00.200Z')), 1);
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-02T03:00:01Z')), 0);
    const [run, ...rest] = await runs();
    assert.equal(rest.length, 0);
    assert.deepEqual(
      { ...run, id: undefined },
      {
        id: undefined,
        trigger: 'schedule',
        schedule_name: 'nightly',
        scheduled_for: '2026-05-02T03:00:00.000Z',
        input: '{"full":true}',
        function_name: 'run',
        mode: 'async',
        state: 'queued',
      },
    );
    const [view] = await listSchedules(store, APP);
    assert.equal(view?.next_tick_at, '2026-05-03T03:00:00.000Z');
    assert.equal(view?.last_run?.id, run?.id);
  });

  it('two nodes racing on every tick of 20 give 20 runs, one each', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    const a = node('a');
    const b = node('b');
    for (let i = 1; i <= 20; i++) {
      const now = Date.parse('2026-05-01T00:00:00Z') + i * 60_000 + 10;
      const started = await Promise.all([a.ticker.tickOnce(now), b.ticker.tickOnce(now)]);
      assert.equal(started[0] + started[1], 1, `tick ${i}: one node started it`);
    }
    const all = await runs();
    assert.equal(all.length, 20);
    assert.equal(new Set(all.map((r) => r.scheduled_for)).size, 20);
  });

  it('a node that dies between the run and the advance leaves the tick to the next look: still one run', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    let inserted = 0;
    const dying = node('dying', (s) => ({
      async startScheduled(row, tick, key) {
        const id = await s.startScheduled(row, tick, key);
        inserted += 1;
        // The process is killed here: the run is committed, the schedule is not advanced.
        throw new Error(`killed after inserting ${id}`);
      },
    }));
    const now = Date.parse('2026-05-01T00:01:00.010Z');
    assert.equal(await dying.ticker.tickOnce(now), 0);
    assert.equal(inserted, 1);
    assert.equal((await runs()).length, 1);
    const [stillDue] = await listSchedules(store, APP);
    assert.equal(stillDue?.next_tick_at, '2026-05-01T00:01:00.000Z');
    // Another node (or this one restarted) looks: the same run, and the schedule moves on.
    const other = node('other');
    assert.equal(await other.ticker.tickOnce(now + 500), 1);
    const all = await runs();
    assert.equal(all.length, 1);
    const [moved] = await listSchedules(store, APP);
    assert.equal(moved?.next_tick_at, '2026-05-01T00:02:00.000Z');
    assert.equal(moved?.last_run?.id, all[0]?.id);
  });

  it('after downtime one catch-up run starts and the missed ticks are counted', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    const a = node('a');
    // Down from 00:01 to 01:00:30: 60 ticks were due, one runs.
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T01:00:30Z')), 1);
    const all = await runs();
    assert.deepEqual(
      all.map((r) => r.scheduled_for),
      ['2026-05-01T01:00:00.000Z'],
    );
    assert.equal(await skipped(a.metrics, 'downtime'), 59);
    const [view] = await listSchedules(store, APP);
    assert.equal(view?.ticks_skipped, 59);
    assert.equal(view?.next_tick_at, '2026-05-01T01:01:00.000Z');
  });

  it('overlap = "skip" starts no tick while the last run is unfinished', async () => {
    await replaceSchedules(
      store,
      APP,
      'b1',
      [schedule({ cron: '@every 1m', overlap: 'skip' })],
      Date.parse('2026-05-01T00:00:30Z'),
    );
    const a = node('a');
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:00Z')), 1);
    // The run is still queued at the next two ticks.
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:02:00Z')), 0);
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:03:00Z')), 0);
    assert.equal(await skipped(a.metrics, 'overlap'), 2);
    await store.updateTable('runs').set({ state: 'success' }).execute();
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:04:00Z')), 1);
    assert.deepEqual(
      (await runs()).map((r) => r.scheduled_for),
      ['2026-05-01T00:01:00.000Z', '2026-05-01T00:04:00.000Z'],
    );
  });

  it('a paused schedule starts nothing; resumed, it goes on from its next tick without the missed ones', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    const a = node('a');
    await setPaused(store, APP, 'nightly', true, Date.parse('2026-05-01T00:00:40Z'));
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:05:00Z')), 0);
    assert.equal((await listSchedules(store, APP))[0]?.next_tick_at, null);
    await setPaused(store, APP, 'nightly', false, Date.parse('2026-05-01T00:10:30Z'));
    assert.equal((await listSchedules(store, APP))[0]?.next_tick_at, '2026-05-01T00:11:00.000Z');
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:11:00Z')), 1);
    assert.equal(await skipped(a.metrics, 'downtime'), 0);
    assert.equal((await runs()).length, 1);
  });

  it('a daily tick in Europe/Berlin runs at 03:00 local time on each day across the spring change', async () => {
    await replaceSchedules(
      store,
      APP,
      'b1',
      [schedule({ cron: '0 3 * * *', timezone: 'Europe/Berlin' })],
      Date.parse('2026-03-27T12:00:00Z'),
    );
    const a = node('a');
    // The fake clock looks every 10 minutes for three days.
    for (let t = Date.parse('2026-03-27T12:00:00Z'); t < Date.parse('2026-03-30T12:00:00Z'); t += 600_000) {
      await a.ticker.tickOnce(t);
    }
    assert.deepEqual(
      (await runs()).map((r) => r.scheduled_for),
      ['2026-03-28T02:00:00.000Z', '2026-03-29T01:00:00.000Z', '2026-03-30T01:00:00.000Z'],
    );
  });

  it('a new build replaces the schedules; an unchanged one keeps its state, a changed one restarts', async () => {
    const t0 = Date.parse('2026-05-01T00:00:30Z');
    await replaceSchedules(
      store,
      APP,
      'b1',
      [
        schedule({ name: 'keep', cron: '@every 1m' }),
        schedule({ name: 'change', cron: '@every 1m' }),
        schedule({ name: 'drop' }),
      ],
      t0,
    );
    await setPaused(store, APP, 'keep', true, t0);
    await replaceSchedules(
      store,
      APP,
      'b2',
      [
        schedule({ name: 'keep', cron: '@every 1m', args: { v: 2 } }),
        schedule({ name: 'change', cron: '@every 5m' }),
        schedule({ name: 'new', cron: '@hourly' }),
      ],
      t0 + 1000,
    );
    const views = await listSchedules(store, APP);
    assert.deepEqual(
      views.map((v) => [v.name, v.build_id, v.paused, v.next_tick_at, v.args]),
      [
        ['change', 'b2', false, '2026-05-01T00:05:00.000Z', { full: true }],
        ['keep', 'b2', true, null, { v: 2 }],
        ['new', 'b2', false, '2026-05-01T01:00:00.000Z', { full: true }],
      ],
    );
  });
  /** `n` schedules of `cron` named `<prefix>-<i>`. */
  function many(n: number, prefix: string, cron: string): ScheduleConfig[] {
    return Array.from({ length: n }, (_, i) => schedule({ name: `${prefix}-${i}`, cron }));
  }

  it('a tick the backlog refuses is skipped and counted, and the schedule moves on to its next tick', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    const full = new Set([APP.projectId]);
    const a = node('a', undefined, { full });
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:00.010Z')), 0);
    const [refused] = await listSchedules(store, APP);
    assert.equal(refused?.next_tick_at, '2026-05-01T00:02:00.000Z', 'the refused tick is not left due');
    assert.equal(refused?.ticks_skipped, 1);
    assert.equal(refused?.last_run, null);
    assert.equal(await skipped(a.metrics, 'backlog'), 1);
    assert.equal((await runs()).length, 0);
    // The backlog has room again: the next tick runs, at its own time.
    full.clear();
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:02:00.010Z')), 1);
    assert.deepEqual(
      (await runs()).map((r) => r.scheduled_for),
      ['2026-05-01T00:02:00.000Z'],
    );
    assert.equal(await skipped(a.metrics, 'backlog'), 1);
  });

  it('a tick whose run a dying node inserted is that run, not a skip, when the backlog then refuses it', async () => {
    await replaceSchedules(store, APP, 'b1', [schedule({ cron: '@every 1m' })], Date.parse('2026-05-01T00:00:30Z'));
    const dying = node('dying', (s) => ({
      async startScheduled(row, tick, key) {
        await s.startScheduled(row, tick, key);
        throw new Error('killed after inserting the run');
      },
    }));
    const now = Date.parse('2026-05-01T00:01:00.010Z');
    assert.equal(await dying.ticker.tickOnce(now), 0);
    // The run it inserted fills the project's backlog: the next look is refused, and finds the tick's run.
    const other = node('other', undefined, { full: new Set([APP.projectId]) });
    assert.equal(await other.ticker.tickOnce(now + 500), 1);
    const all = await runs();
    assert.equal(all.length, 1);
    const [moved] = await listSchedules(store, APP);
    assert.equal(moved?.next_tick_at, '2026-05-01T00:02:00.000Z');
    assert.equal(moved?.last_run?.id, all[0]?.id);
    assert.equal(moved?.ticks_skipped, 0);
    assert.equal(await skipped(other.metrics, 'backlog'), 0);
  });

  it("one project's due schedules, however many and however stuck, never keep another project's from a look", async () => {
    const t0 = Date.parse('2026-05-01T00:00:30Z');
    const A = { projectId: 'p-a', appId: 'flood' };
    const B = { projectId: 'p-b', appId: 'clock' };
    // 150 schedules of project A, more than a look takes, whose every start fails (its ticks stay due,
    // older than any of B's), and one schedule of project B, ticking every minute.
    await replaceSchedules(store, A, 'b1', many(150, 'a', '@every 1m'), t0);
    await replaceSchedules(store, B, 'b1', [schedule({ name: 'b', cron: '@every 1m' })], t0 + 60_000);
    const failures: string[] = [];
    const a = node('a', (s) => ({
      async startScheduled(row, tick, key) {
        if (row.project_id === A.projectId) {
          failures.push(row.name);
          throw new Error('the run queue failed');
        }
        return s.startScheduled(row, tick, key);
      },
    }));
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:00.010Z')), 0);
    for (let minute = 2; minute <= 4; minute++) {
      const now = Date.parse(`2026-05-01T00:0${minute}:00.010Z`);
      assert.equal(await a.ticker.tickOnce(now), 1, `B's tick of minute ${minute} started`);
    }
    assert.deepEqual(
      (await runs()).map((r) => [r.schedule_name, r.scheduled_for]),
      [
        ['b', '2026-05-01T00:02:00.000Z'],
        ['b', '2026-05-01T00:03:00.000Z'],
        ['b', '2026-05-01T00:04:00.000Z'],
      ],
    );
    // A's schedules were still tried, a look's worth each time.
    assert.equal(failures.length, 100 + 3 * 99);
    const stuck = (await listSchedules(store, A)).filter((v) => v.next_tick_at === '2026-05-01T00:01:00.000Z');
    assert.equal(stuck.length, 150, "A's failed ticks stay due, to be tried again");
  });

  it('a flood of refused ticks moves every schedule on and logs one line a minute per project, saying how many it stands for', async () => {
    const t0 = Date.parse('2026-05-01T00:00:30Z');
    const A = { projectId: 'p-a', appId: 'flood' };
    const B = { projectId: 'p-b', appId: 'flood' };
    await replaceSchedules(store, A, 'b1', many(30, 'a', '@every 20s'), t0);
    await replaceSchedules(store, B, 'b1', many(5, 'b', '@every 20s'), t0);
    const lines: Array<Record<string, unknown>> = [];
    const a = node('a', undefined, { full: new Set([A.projectId, B.projectId]), lines });
    /** The warnings logged since line `from`, by project (both projects' rows come in one look, in either order). */
    const warned = (from = 0) =>
      lines
        .slice(from)
        .filter((l) => l.level === 40)
        .map((l) => [l.project, l.suppressed, String(l.msg).replace(/ \(.*/, '')])
        .sort((x, y) => String(x[0]).localeCompare(String(y[0])));
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:00:40.010Z')), 0);
    assert.deepEqual(warned(), [
      ['p-a', 0, 'schedule tick skipped: the async backlog is full'],
      ['p-b', 0, 'schedule tick skipped: the async backlog is full'],
    ]);
    // Within the minute: no more lines, however many ticks are refused.
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:00.010Z')), 0);
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:20.010Z')), 0);
    assert.equal(warned().length, 2);
    // A minute after the first line, the next refused tick of each project has its line, counting the rest.
    const mark = lines.length;
    assert.equal(await a.ticker.tickOnce(Date.parse('2026-05-01T00:01:40.010Z')), 0);
    assert.deepEqual(warned(mark), [
      ['p-a', 29 + 30 + 30, 'schedule tick skipped: the async backlog is full'],
      ['p-b', 4 + 5 + 5, 'schedule tick skipped: the async backlog is full'],
    ]);
    assert.equal(await skipped(a.metrics, 'backlog'), 4 * 35);
    for (const app of [A, B]) {
      for (const view of await listSchedules(store, app)) {
        assert.equal(view.next_tick_at, '2026-05-01T00:02:00.000Z', `${view.name} moved on`);
        assert.equal(view.ticks_skipped, 4);
      }
    }
    assert.equal((await runs()).length, 0);
  });
});
