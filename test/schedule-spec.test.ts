// `[[schedules]]` and `[retries]` in ferry.toml: the timing of ticks (croner for cron and time zones,
// Ferry's own epoch-aligned `@every`), across daylight saving time changes on a fixed clock, the
// catch-up after downtime, the retry delays, and the coded build errors naming the key.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { AppConfigError, parseAppConfig } from '../src/apps/app-config.js';
import { nextAttempt, retryDelayMs } from '../src/runs/retries.js';
import { dueTicks, LATE_GRACE_MS, MAX_COUNTED_TICKS, parseDuration, parseTiming } from '../src/schedules/spec.js';

const at = (iso: string) => new Date(iso);
const iso = (d: Date | null) => d?.toISOString() ?? null;

/** The first `n` ticks after `from`. */
function ticks(cron: string, zone: string, from: string, n: number): string[] {
  const timing = parseTiming(cron, zone);
  const out: string[] = [];
  let t = at(from);
  for (let i = 0; i < n; i++) {
    const next = timing.next(t);
    assert.ok(next);
    out.push(next.toISOString());
    t = next;
  }
  return out;
}

describe('schedule timing', () => {
  it('a daily tick in Europe/Berlin keeps its local time across the spring and autumn changes', () => {
    // 03:00 local: CET (+01:00) before 29 March 2026, CEST (+02:00) after, CET again after 25 October.
    assert.deepEqual(ticks('0 3 * * *', 'Europe/Berlin', '2026-03-27T12:00:00Z', 3), [
      '2026-03-28T02:00:00.000Z',
      '2026-03-29T01:00:00.000Z',
      '2026-03-30T01:00:00.000Z',
    ]);
    assert.deepEqual(ticks('0 3 * * *', 'Europe/Berlin', '2026-10-24T12:00:00Z', 2), [
      '2026-10-25T02:00:00.000Z',
      '2026-10-26T02:00:00.000Z',
    ]);
  });

  it('a tick inside the spring gap runs at the first time after it, and a repeated autumn time runs once', () => {
    // 02:30 does not exist in Berlin on 29 March 2026 (02:00 → 03:00): it runs at 03:00 CEST.
    assert.deepEqual(ticks('30 2 * * *', 'Europe/Berlin', '2026-03-28T12:00:00Z', 2), [
      '2026-03-29T01:00:00.000Z',
      '2026-03-30T00:30:00.000Z',
    ]);
    // 02:30 happens twice on 25 October 2026 (CEST, then CET): one tick, at the first.
    assert.deepEqual(ticks('30 2 * * *', 'Europe/Berlin', '2026-10-24T12:00:00Z', 2), [
      '2026-10-25T00:30:00.000Z',
      '2026-10-26T01:30:00.000Z',
    ]);
  });

  it('an hourly schedule has 23 ticks on the spring day and 25 on the autumn day in Berlin', () => {
    const count = (fromIso: string, toIso: string) =>
      ticks('0 * * * *', 'Europe/Berlin', fromIso, 30).filter((t) => t < toIso).length;
    assert.equal(count('2026-03-28T22:59:00Z', '2026-03-29T22:00:00.000Z'), 23);
    assert.equal(count('2026-10-24T21:59:00Z', '2026-10-25T23:00:00.000Z'), 25);
  });

  it('nicknames and UTC by default', () => {
    assert.deepEqual(ticks('@daily', 'UTC', '2026-01-01T05:00:00Z', 1), ['2026-01-02T00:00:00.000Z']);
    assert.deepEqual(ticks('@hourly', 'UTC', '2026-01-01T05:10:00Z', 1), ['2026-01-01T06:00:00.000Z']);
    assert.equal(parseTiming('@daily').timezone, 'UTC');
  });

  it('@every ticks on multiples of its interval since the epoch, whoever computes them', () => {
    assert.deepEqual(ticks('@every 10m', 'UTC', '2026-01-01T00:04:59Z', 3), [
      '2026-01-01T00:10:00.000Z',
      '2026-01-01T00:20:00.000Z',
      '2026-01-01T00:30:00.000Z',
    ]);
    assert.equal(iso(parseTiming('@every 2s').next(at('2026-01-01T00:00:00.000Z'))), '2026-01-01T00:00:02.000Z');
    assert.equal(parseDuration('1h30m'), 5_400_000);
    assert.equal(parseDuration('10'), undefined);
  });

  it('after downtime one catch-up tick runs and the others are counted as skipped', () => {
    const timing = parseTiming('@every 1m');
    const none = dueTicks(timing, at('2026-01-01T00:10:00Z'), at('2026-01-01T00:09:59Z'));
    assert.deepEqual([none.tick, none.skipped, iso(none.next)], [null, 0, '2026-01-01T00:10:00.000Z']);
    const one = dueTicks(timing, at('2026-01-01T00:10:00Z'), at('2026-01-01T00:10:30Z'));
    assert.deepEqual(
      [iso(one.tick), one.skipped, iso(one.next)],
      ['2026-01-01T00:10:00.000Z', 0, '2026-01-01T00:11:00.000Z'],
    );
    const late = dueTicks(timing, at('2026-01-01T00:10:00Z'), at('2026-01-01T01:10:30Z'));
    assert.deepEqual(
      [iso(late.tick), late.skipped, late.skippedAtLeast, iso(late.next)],
      ['2026-01-01T01:10:00.000Z', 60, false, '2026-01-01T01:11:00.000Z'],
    );
    // A look that came a few seconds late (every node busy): each tick within LATE_GRACE_MS gets its own
    // run, the earliest first; its next is due as well, and the ticker runs it next.
    const slow = dueTicks(parseTiming('@every 2s'), at('2026-01-01T00:00:00Z'), at('2026-01-01T00:00:04.500Z'));
    assert.deepEqual(
      [iso(slow.tick), slow.skipped, iso(slow.next)],
      ['2026-01-01T00:00:00.000Z', 0, '2026-01-01T00:00:02.000Z'],
    );
    // Ticks older than LATE_GRACE_MS are downtime: skipped, up to the first one within it.
    const mixed = dueTicks(parseTiming('@every 10s'), at('2026-01-01T00:00:00Z'), at('2026-01-01T00:01:00Z'));
    assert.equal(LATE_GRACE_MS, 30_000);
    assert.deepEqual(
      [iso(mixed.tick), mixed.skipped, iso(mixed.next)],
      ['2026-01-01T00:00:30.000Z', 3, '2026-01-01T00:00:40.000Z'],
    );
    // Years of one-second ticks: counting stops, the latest due tick is still found exactly.
    const years = dueTicks(parseTiming('@every 1s'), at('2020-01-01T00:00:00Z'), at('2026-01-01T00:00:00.500Z'));
    assert.deepEqual(
      [iso(years.tick), years.skipped, years.skippedAtLeast, iso(years.next)],
      ['2026-01-01T00:00:00.000Z', MAX_COUNTED_TICKS, true, '2026-01-01T00:00:01.000Z'],
    );
  });
});

describe('retry policy', () => {
  const policy = {
    max_attempts: 4,
    initial_delay: 1,
    backoff: 2,
    max_delay: 3,
    on: ['failure' as const, 'timeout' as const],
  };

  it('delays grow by the backoff and stop at max_delay', () => {
    assert.deepEqual(
      [1, 2, 3, 4].map((a) => retryDelayMs(policy, a)),
      [1000, 2000, 3000, 3000],
    );
  });

  it('only the listed endings are retried, and the last attempt of a retried run ends it dead', () => {
    assert.deepEqual(nextAttempt(policy, 1, 'failure'), { retry: true, delayMs: 1000 });
    assert.deepEqual(nextAttempt(policy, 3, 'timeout'), { retry: true, delayMs: 3000 });
    assert.deepEqual(nextAttempt(policy, 4, 'failure'), { retry: false, dead: true });
    assert.deepEqual(nextAttempt(policy, 1, 'interrupted'), { retry: false, dead: false });
    assert.deepEqual(nextAttempt(policy, 1, 'success'), { retry: false, dead: false });
    assert.deepEqual(nextAttempt({ ...policy, max_attempts: 1 }, 1, 'failure'), { retry: false, dead: false });
  });
});

describe('ferry.toml [[schedules]] and [retries]', () => {
  const base = '[app]\nname = "reports"\n';

  it('fills in the defaults', () => {
    const config = parseAppConfig(`${base}[[schedules]]\nname = "nightly"\ncron = "0 3 * * *"\n`);
    assert.deepEqual(config.schedules, [
      {
        name: 'nightly',
        cron: '0 3 * * *',
        timezone: 'UTC',
        function: 'run',
        args: {},
        webhook: null,
        overlap: 'skip',
      },
    ]);
    assert.equal(config.retries.max_attempts, 1);
    assert.deepEqual(parseAppConfig(base).schedules, []);
  });

  it('takes every key', () => {
    const config = parseAppConfig(
      `${base}[[schedules]]\nname = "nightly-report"\ncron = "@every 10m"\ntimezone = "Europe/Berlin"\nfunction = "report"\nargs = { full = true, days = [1, 2] }\nwebhook = "https://example.com/hook"\noverlap = "allow"\n\n[retries]\nmax_attempts = 3\ninitial_delay = 1\nbackoff = 2.0\nmax_delay = 300\non = ["failure", "timeout"]\n`,
    );
    assert.deepEqual(config.schedules[0], {
      name: 'nightly-report',
      cron: '@every 10m',
      timezone: 'Europe/Berlin',
      function: 'report',
      args: { full: true, days: [1, 2] },
      webhook: 'https://example.com/hook',
      overlap: 'allow',
    });
    assert.deepEqual(config.retries, {
      max_attempts: 3,
      initial_delay: 1,
      backoff: 2,
      max_delay: 300,
      on: ['failure', 'timeout'],
    });
  });

  const refused: [string, string, RegExp][] = [
    ['[[schedules]]\nname = "a"\ncron = "61 * * * *"\n', 'schedules.0.cron', /not a valid cron expression.*minute/],
    ['[[schedules]]\nname = "a"\ncron = "* * * *"\n', 'schedules.0.cron', /5 fields/],
    ['[[schedules]]\nname = "a"\ncron = "@fortnightly"\n', 'schedules.0.cron', /not a known nickname/],
    ['[[schedules]]\nname = "a"\ncron = "@every 0s"\n', 'schedules.0.cron', /between 1s/],
    ['[[schedules]]\nname = "a"\ncron = "@every soon"\n', 'schedules.0.cron', /duration/],
    ['[[schedules]]\nname = "a"\ncron = "@daily"\ntimezone = "Mars/Olympus"\n', 'schedules.0.timezone', /IANA/],
    [
      '[[schedules]]\nname = "a"\ncron = "@daily"\n[[schedules]]\nname = "a"\ncron = "@hourly"\n',
      'schedules.1.name',
      /unique/,
    ],
    ['[[schedules]]\nname = "a"\ncron = "@daily"\nargs = { at = 1979-05-27T07:32:00Z }\n', 'schedules.0.args', /JSON/],
    ['[[schedules]]\nname = "a"\ncron = "@daily"\noverlap = "queue"\n', 'schedules.0.overlap', /./],
    ['[[schedules]]\ncron = "@daily"\n', 'schedules.0.name', /required/],
    ['[retries]\nmax_attempts = 21\n', 'retries.max_attempts', /20/],
    ['[retries]\nmax_attempts = 0\n', 'retries.max_attempts', /1/],
    ['[retries]\ninitial_delay = 10\nmax_delay = 5\n', 'retries.max_delay', /less than/],
    ['[retries]\non = ["failure", "success"]\n', 'retries.on.1', /./],
  ];
  for (const [toml, key, message] of refused) {
    it(`refuses ${key}: ${toml.split('\n').find((l) => l.includes('=') && !l.startsWith('name'))}`, () => {
      assert.throws(
        () => parseAppConfig(base + toml),
        (err: unknown) => {
          assert.ok(err instanceof AppConfigError);
          assert.equal(err.key, key);
          assert.match(err.message, message);
          assert.match(err.message, new RegExp(`^ferry\\.toml: ${key.replaceAll('.', '\\.')}: `));
          return true;
        },
      );
    });
  }
});
