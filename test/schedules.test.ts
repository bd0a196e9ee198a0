/**
 * Scheduled runs end to end on a real server with real replicas and the real clock: a `@every 2s`
 * schedule starts one async run per tick (trigger "schedule", the tick on the record), pause stops the
 * ticks and resume starts them again without the missed ones, trigger runs one now, a new deploy replaces
 * the schedules, deleting the app removes them, and bad schedules are refused naming the key.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';

interface RunView {
  run_id: string;
  trigger: string;
  schedule: { name: string; tick: string } | null;
  state: string;
  input?: unknown;
}

const MAIN =
  'export function run(args: { n: number }) { return { got: args.n }; }\nexport function other() { return 1; }\n';

describe('scheduled runs', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const api = (path: string, method = 'GET') =>
    http(`${server.url}/v2/projects/${auth.projectId}${path}`, { method, token: auth.token });
  const scheduledRuns = async (app: string): Promise<RunView[]> => {
    const res = await api(`/apps/${app}/runs?limit=500`);
    return (res.json.runs as RunView[]).filter((r) => r.trigger === 'schedule');
  };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
  });
  after(() => server?.close());

  it('a real @every 2s schedule starts one run per tick, each with its tick', async () => {
    await deployFiles(server, auth, 'clock', {
      'ferry.toml': '[app]\nname = "clock"\n[[schedules]]\nname = "tick"\ncron = "@every 2s"\nargs = { n = 7 }\n',
      'main.ts': MAIN,
    });
    const runs = await waitFor(
      async () => {
        const found = await scheduledRuns('clock');
        return found.length >= 3 ? found : undefined;
      },
      60_000,
      'three ticks',
    );
    const ticks = runs.map((r) => Date.parse(r.schedule!.tick)).sort((a, b) => a - b);
    assert.equal(new Set(ticks).size, ticks.length, 'no tick ran twice');
    for (const t of ticks) assert.equal(t % 2000, 0, 'ticks fall on multiples of 2 s');
    for (const r of runs) assert.equal(r.schedule!.name, 'tick');
    const one = await api(`/apps/clock/runs/${runs[0]!.run_id}?wait=30`);
    assert.equal(one.json.state, 'success', one.text);
    assert.deepEqual(one.json.result, { got: 7 });
    const listed = await api('/apps/clock/schedules');
    assert.equal(listed.status, 200, listed.text);
    const [schedule] = listed.json.schedules;
    assert.equal(schedule.name, 'tick');
    assert.equal(schedule.paused, false);
    assert.ok(Date.parse(schedule.next_tick_at) > Date.parse(schedule.last_tick_at));
  });

  it('pause stops the ticks; resume starts from the next tick, without the missed ones; trigger runs one now', async () => {
    const paused = await api('/apps/clock/schedules/tick/pause', 'POST');
    assert.equal(paused.status, 200, paused.text);
    assert.equal(paused.json.paused, true);
    assert.equal(paused.json.next_tick_at, null);
    const pausedAt = Date.now();
    // Wait past two ticks' time (generous): no run is started for a tick after the pause.
    await new Promise((r) => setTimeout(r, 4500));
    const during = (await scheduledRuns('clock')).filter((r) => Date.parse(r.schedule!.tick) > pausedAt + 1000);
    assert.deepEqual(during, [], 'no tick ran while paused');

    const resumed = await api('/apps/clock/schedules/tick/resume', 'POST');
    assert.equal(resumed.json.paused, false);
    const resumedAt = Date.parse(resumed.json.next_tick_at);
    const after = await waitFor(
      async () => {
        const found = (await scheduledRuns('clock')).filter((r) => Date.parse(r.schedule!.tick) >= resumedAt);
        return found.length > 0 ? found : undefined;
      },
      30_000,
      'a tick after resume',
    );
    assert.ok(after.length >= 1);
    // The ticks missed while paused were not run afterwards either.
    const missed = (await scheduledRuns('clock')).filter((r) => {
      const t = Date.parse(r.schedule!.tick);
      return t > pausedAt + 1000 && t < resumedAt;
    });
    assert.deepEqual(missed, []);

    const triggered = await api('/apps/clock/schedules/tick/trigger', 'POST');
    assert.equal(triggered.status, 202, triggered.text);
    const run = await api(`/apps/clock/runs/${triggered.json.run_id}?wait=30`);
    assert.equal(run.json.trigger, 'schedule');
    assert.equal(run.json.schedule.name, 'tick');
    assert.equal(run.json.state, 'success');

    const unknown = await api('/apps/clock/schedules/nope/trigger', 'POST');
    assert.equal(unknown.status, 404);
    assert.equal(unknown.json.error.code, 'FERRY_SCHEDULE_NOT_FOUND');
  });

  it('a new build replaces the schedules; deleting the app removes them', async () => {
    await deployFiles(server, auth, 'clock', {
      'ferry.toml':
        '[app]\nname = "clock"\n[[schedules]]\nname = "daily"\ncron = "0 3 * * *"\ntimezone = "Europe/Berlin"\n',
      'main.ts': MAIN,
    });
    const listed = await api('/apps/clock/schedules');
    assert.deepEqual(
      listed.json.schedules.map((s: { name: string; timezone: string }) => [s.name, s.timezone]),
      [['daily', 'Europe/Berlin']],
    );
    const deleted = await http(`${server.url}/v2/projects/${auth.projectId}/apps/clock`, {
      method: 'DELETE',
      token: auth.token,
    });
    assert.ok(deleted.status < 300, deleted.text);
    const rows = await server.services.store
      .selectFrom('schedules')
      .selectAll()
      .where('app_id', '=', 'clock')
      .execute();
    assert.deepEqual(rows, []);
  });

  it('examples/nightly-report deploys with its schedules and retries, and its heartbeat runs when triggered', async () => {
    const dir = path.join(REPO_ROOT, 'examples', 'nightly-report');
    await deployFiles(server, auth, 'nightly-report', {
      'ferry.toml': readFileSync(path.join(dir, 'ferry.toml'), 'utf8'),
      'main.ts': readFileSync(path.join(dir, 'main.ts'), 'utf8'),
    });
    const listed = await api('/apps/nightly-report/schedules');
    assert.deepEqual(
      listed.json.schedules.map((s: { name: string }) => s.name),
      ['heartbeat', 'nightly'],
    );
    const triggered = await api('/apps/nightly-report/schedules/heartbeat/trigger', 'POST');
    assert.equal(triggered.status, 202, triggered.text);
    const run = await api(`/apps/nightly-report/runs/${triggered.json.run_id}?wait=30`);
    assert.equal(run.json.state, 'success', run.text);
    assert.deepEqual(run.json.result, { ok: true });
  });

  it('refuses a bad cron or time zone at upload, and a function the app does not export at build, naming the key', async () => {
    const zip = await zipFiles({
      'ferry.toml': '[app]\nname = "bad"\n[[schedules]]\nname = "x"\ncron = "61 * * * *"\n',
      'main.ts': MAIN,
    });
    const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/bad/builds`, {
      method: 'POST',
      token: auth.token,
      body: zip,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 400, res.text);
    assert.equal(res.json.error.code, 'FERRY_CONFIG_INVALID');
    assert.match(res.json.error.message, /schedules\.0\.cron/);

    const build = await deployFiles(
      server,
      auth,
      'bad',
      {
        'ferry.toml': '[app]\nname = "bad"\n[[schedules]]\nname = "x"\ncron = "@hourly"\nfunction = "missing"\n',
        'main.ts': MAIN,
      },
      { expect: 'failed' },
    );
    assert.match(
      (build as { error?: string }).error ?? '',
      /schedules\.0\.function: "missing" is not a public function/,
    );
  });
});
