/**
 * Issue 43, point 2, end to end on a real server with real replicas and the real clock: project A's two
 * apps have 50 `@every 1s` schedules each (overlap allowed, a function that sleeps 300 s, one replica), so
 * A's async backlog (FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT) is full and stays full; project B's `@every 2s`
 * schedule, deployed after, still starts a run for every tick, at least 90% of them within 2 s of their
 * tick, while A's refused ticks are skipped and counted, A's schedules move on, and the log gets a warning
 * a minute per project rather than one per refused tick. Deploys past the schedules limits are refused
 * with their codes.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { unfinishedRun } from '../src/store/unfinished.js';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

const BACKLOG = 20;
/** B's ticks measured: each `@every 2s`. */
const TICKS = 10;
const EVERY_MS = 2000;

/** An app of `n` `@every <every>` schedules calling `run`, with `scaling` and `main`. */
function app(name: string, n: number, every: string, scaling: string, main: string): Record<string, string> {
  let toml = `[app]\nname = "${name}"\n[scaling]\n${scaling}\n`;
  for (let i = 0; i < n; i++) toml += `[[schedules]]\nname = "s-${i}"\ncron = "@every ${every}"\noverlap = "allow"\n`;
  return { 'ferry.toml': toml, 'main.ts': main };
}
const SLEEPER = 'export async function run() { await new Promise((r) => setTimeout(r, 300_000)); return 1; }\n';
const QUICK = 'export function run() { return 1; }\n';

describe("one project's full backlog does not stop another project's schedules", { timeout: 300_000 }, () => {
  let server: TestServer;
  let a: { projectId: string; token: string };
  let b: { projectId: string; token: string };
  const lines: Array<{ level: number; msg: string; project?: string }> = [];

  /** The project's async runs queued or running (what its backlog counts). */
  const unfinishedRuns = (projectId: string) =>
    server.services.store
      .selectFrom('runs')
      .select(['id', 'app_id'])
      .where('project_id', '=', projectId)
      .where('mode', '=', 'async')
      .where(unfinishedRun())
      .execute();
  const unfinished = async (projectId: string) => (await unfinishedRuns(projectId)).length;

  before(async () => {
    server = await startServer({
      env: {
        FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT: String(BACKLOG),
        FERRY_MAX_SCHEDULES_PER_PROJECT: '101',
        // The sleeping runs are cancelled at the end (a server waits for its runs in flight when it closes).
        FERRY_CANCEL_GRACE_SECONDS: '0',
      },
      log: { level: 'warn', destination: { write: (line: string) => void lines.push(JSON.parse(line)) } },
    });
    a = await server.bootstrap('project-a');
    b = await server.bootstrap('project-b');
  });
  after(async () => {
    if (!server) return;
    // A's schedules stop and its runs are cancelled, so the close does not wait out their 300 s.
    await server.services.store
      .updateTable('schedules')
      .set({ paused: 1 })
      .where('project_id', '=', a.projectId)
      .execute();
    await waitFor(
      async () => {
        const left = await unfinishedRuns(a.projectId);
        await Promise.all(
          left.map((r) =>
            http(`${server.url}/v2/projects/${a.projectId}/apps/${r.app_id}/runs/${r.id}/cancel`, {
              method: 'POST',
              token: a.token,
            }),
          ),
        );
        return left.length === 0;
      },
      60_000,
      "A's runs to end",
    );
    await server.close();
  });

  it("starts B's ticks on time while A's backlog is full, skipping and counting A's refused ticks", async () => {
    for (const name of ['flood-1', 'flood-2'])
      await deployFiles(server, a, name, app(name, 50, '1s', 'max_replicas = 1', SLEEPER));
    await waitFor(async () => (await unfinished(a.projectId)) >= BACKLOG, 60_000, "A's backlog to fill");
    // From here every tick of A is refused: left due (before issue 43) its 100 rows were the oldest due
    // ones at every look, and B's schedule never came up.
    const bDeployed = Date.now();
    await deployFiles(server, b, 'clock', app('clock', 1, '2s', 'min_replicas = 1', QUICK));

    const started = await waitFor(
      async () => {
        const rows = await server.services.store
          .selectFrom('runs')
          .select(['scheduled_for', 'started_at'])
          .where('project_id', '=', b.projectId)
          .where('trigger', '=', 'schedule')
          .where('started_at', 'is not', null)
          .orderBy('scheduled_for')
          .execute();
        return rows.length >= TICKS + 1 ? rows : undefined;
      },
      90_000,
      `${TICKS + 1} of B's ticks to start`,
    );
    // The first tick may have met B's replica still starting: the ten after it are measured.
    const measured = started.slice(1, TICKS + 1).map((r) => ({
      tick: Date.parse(r.scheduled_for!),
      lateMs: Date.parse(r.started_at!) - Date.parse(r.scheduled_for!),
    }));
    for (let i = 1; i < measured.length; i++)
      assert.equal(measured[i]!.tick - measured[i - 1]!.tick, EVERY_MS, 'every tick of B has its run, none twice');
    const onTime = measured.filter((m) => m.lateMs <= 2000).length;
    assert.ok(
      onTime >= 0.9 * TICKS,
      `${onTime} of ${TICKS} of B's ticks started within 2 s: ${measured.map((m) => m.lateMs).join(', ')} ms`,
    );

    // All the while A's backlog was full, and A's refused ticks were skipped and counted: its schedules
    // moved on rather than staying due.
    assert.ok((await unfinished(a.projectId)) >= BACKLOG, "A's backlog is still full");
    const aSchedules = await server.services.store
      .selectFrom('schedules')
      .select(['name', 'next_tick_at', 'ticks_skipped'])
      .where('project_id', '=', a.projectId)
      .execute();
    assert.equal(aSchedules.length, 100);
    for (const s of aSchedules) {
      assert.ok(Number(s.ticks_skipped) > 0, `${s.name} counted its refused ticks`);
      assert.ok(Date.parse(s.next_tick_at) > bDeployed, `${s.name} moved on (next tick ${s.next_tick_at})`);
    }
    const metrics = await http(`${server.url}/metrics`);
    const backlogSkips = metrics.text.match(/^ferry_schedule_ticks_skipped_total\{[^}]*reason="backlog"[^}]*\} (\d+)/m);
    assert.ok(backlogSkips && Number(backlogSkips[1]) > 0, 'ferry_schedule_ticks_skipped_total{reason="backlog"}');
    // Thousands of refused ticks, a warning a minute for the project (the test takes a few minutes at most).
    const warnings = lines.filter((l) => l.level === 40 && /async backlog is full/.test(l.msg));
    assert.ok(warnings.length >= 1, 'the skips are logged');
    assert.ok(
      warnings.length <= 5,
      `${warnings.length} warnings: ${warnings
        .slice(0, 5)
        .map((w) => w.msg)
        .join(' | ')}`,
    );
    assert.ok(
      warnings.every((w) => w.project === a.projectId),
      'only A is refused',
    );
  });

  it('refuses a deploy past the schedules limits with their codes', async () => {
    const upload = async (auth: { projectId: string; token: string }, name: string, files: Record<string, string>) =>
      http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds`, {
        method: 'POST',
        token: auth.token,
        body: await zipFiles(files),
        headers: { 'content-type': 'application/zip' },
      });
    // A has 100 schedules of the 101 the server allows a project.
    const project = await upload(a, 'more', app('more', 2, '1h', 'max_replicas = 1', QUICK));
    assert.equal(project.status, 409, project.text);
    assert.equal(project.json.error.code, 'FERRY_PROJECT_SCHEDULES_FULL');
    assert.match(project.json.error.message, /other apps have 100 schedules and this one would have 2/);
    // 51 in one app: the default FERRY_MAX_SCHEDULES_PER_APP is 50.
    const perApp = await upload(b, 'wide', app('wide', 51, '1h', 'max_replicas = 1', QUICK));
    assert.equal(perApp.status, 400, perApp.text);
    assert.equal(perApp.json.error.code, 'FERRY_CONFIG_INVALID');
    assert.match(
      perApp.json.error.message,
      /schedules: 51 schedules; .*at most 50 per app \(FERRY_MAX_SCHEDULES_PER_APP\)/,
    );
    // Neither left an app or a build behind.
    const left = await server.services.store
      .selectFrom('apps')
      .select('id')
      .where('id', 'in', ['more', 'wide'])
      .execute();
    assert.deepEqual(left, []);
  });
});
