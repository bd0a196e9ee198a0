// The server's limits on schedules (issue 43: FERRY_MAX_SCHEDULES_PER_APP, FERRY_MAX_SCHEDULES_PER_PROJECT)
// on a real store (SQLite here, PostgreSQL in test/postgres/): an app past its limit and a project past its
// own are refused with their codes, a change that adds nothing to its app is not, and two apps of one
// project activated at once under the lock never both pass on a count that holds neither.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, beforeEach, describe, it } from 'node:test';
import type { ScheduleConfig } from '../src/apps/app-config.js';
import type { FerryError } from '../src/errors.js';
import { checkScheduleLimits, ScheduleLimitError } from '../src/schedules/limits.js';
import { replaceSchedules } from '../src/schedules/schedules.js';
import type { Store } from '../src/store/index.js';
import { openTestStore, type TestStore } from './helpers/store.js';

const PROJECT = 'p-limits';
const LIMITS = { perApp: 4, perProject: 6 };

function schedules(n: number): ScheduleConfig[] {
  return Array.from({ length: n }, (_, i) => ({
    name: `s-${i}`,
    cron: '@hourly',
    timezone: 'UTC',
    function: 'run',
    args: {},
    webhook: null,
    overlap: 'skip' as const,
  }));
}

describe('limits on schedules', () => {
  let dir: string;
  let test: TestStore;
  let store: Store;

  before(async () => {
    dir = mkdtempSync(path.join(tmpdir(), 'ferry-schedule-limits-'));
    test = await openTestStore(dir);
    store = test.store;
  });
  after(async () => {
    await test.close();
    rmSync(dir, { recursive: true, force: true });
  });
  beforeEach(async () => {
    await store.deleteFrom('schedules').execute();
  });

  const app = (appId: string) => ({ projectId: PROJECT, appId });
  /** The refusal of giving `appId` `count` schedules now (undefined: allowed). */
  async function refusal(appId: string, count: number, limits = LIMITS): Promise<FerryError | undefined> {
    try {
      await checkScheduleLimits(store, app(appId), count, limits, { lock: false });
      return undefined;
    } catch (err) {
      assert.ok(err instanceof ScheduleLimitError, String(err));
      return err;
    }
  }

  it("refuses more than the app's limit with FERRY_CONFIG_INVALID naming schedules and the setting", async () => {
    assert.equal(await refusal('a', 4), undefined);
    const refused = await refusal('a', 5);
    assert.equal(refused?.code, 'FERRY_CONFIG_INVALID');
    assert.equal(refused?.status, 400);
    assert.match(
      refused?.message ?? '',
      /^ferry\.toml: schedules: 5 schedules; .*at most 4 per app \(FERRY_MAX_SCHEDULES_PER_APP\)/,
    );
  });

  it("refuses passing the project's limit with FERRY_PROJECT_SCHEDULES_FULL, counting the other apps only", async () => {
    await replaceSchedules(store, app('a'), 'b1', schedules(4));
    await replaceSchedules(store, app('b'), 'b1', schedules(1));
    // Another project's schedules do not count.
    await replaceSchedules(store, { projectId: 'p-other', appId: 'c' }, 'b1', schedules(4));
    assert.equal(await refusal('c', 1), undefined, '4 + 1 + 1 of 6');
    const refused = await refusal('c', 2);
    assert.equal(refused?.code, 'FERRY_PROJECT_SCHEDULES_FULL');
    assert.equal(refused?.status, 409);
    assert.match(
      refused?.message ?? '',
      /other apps have 5 schedules and this one would have 2: .*at most 6 per project/,
    );
    // An app's own schedules are replaced, not added to: b may go from 1 to 2.
    assert.equal(await refusal('b', 2), undefined);
    assert.equal((await refusal('b', 3))?.code, 'FERRY_PROJECT_SCHEDULES_FULL');
    // No schedules never passes a limit.
    assert.equal(await refusal('c', 0, { perApp: 0, perProject: 0 }), undefined);
  });

  it('lets a project over a lowered limit deploy what does not add schedules to the app', async () => {
    await replaceSchedules(store, app('a'), 'b1', schedules(4));
    await replaceSchedules(store, app('b'), 'b1', schedules(4));
    const lowered = { perApp: 4, perProject: 2 };
    assert.equal(await refusal('a', 4, lowered), undefined, 'the same count');
    assert.equal(await refusal('a', 1, lowered), undefined, 'fewer');
    assert.equal((await refusal('c', 1, lowered))?.code, 'FERRY_PROJECT_SCHEDULES_FULL', 'a new app adds');
  });

  it('two apps given schedules at once under the lock never both pass the project limit', async () => {
    await replaceSchedules(store, app('a'), 'b1', schedules(2));
    const events: string[] = [];
    /** What activating a build of `appId` with 3 schedules does: check under the lock, then write them. */
    const activate = (appId: string) =>
      store.transaction().execute(async (trx) => {
        await checkScheduleLimits(trx, app(appId), 3, LIMITS, { lock: true });
        events.push(`checked ${appId}`);
        // Long enough for the other transaction to reach its check if nothing held it.
        await new Promise((r) => setTimeout(r, 300));
        await replaceSchedules(trx, app(appId), 'b1', schedules(3));
      });
    const outcomes = await Promise.allSettled([activate('b'), activate('c')]);
    const passed = outcomes.filter((o) => o.status === 'fulfilled');
    const refused = outcomes.flatMap((o) => (o.status === 'rejected' ? [o.reason as FerryError] : []));
    assert.equal(passed.length, 1, `one passes: ${JSON.stringify(events)}`);
    assert.equal(refused[0]?.code, 'FERRY_PROJECT_SCHEDULES_FULL');
    const count = await store
      .selectFrom('schedules')
      .select((eb) => eb.fn.countAll().as('n'))
      .where('project_id', '=', PROJECT)
      .executeTakeFirstOrThrow();
    assert.equal(Number(count.n), 5);
  });
});
