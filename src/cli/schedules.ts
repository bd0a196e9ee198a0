/**
 * `ferry schedules list [APP] | pause APP NAME | resume APP NAME | trigger APP NAME`: the `[[schedules]]`
 * of apps' active builds, through `/v2/projects/{p}/apps/{a}/schedules`. Without APP, `list` shows the
 * schedules of every app of the project.
 */
import type { ScheduleView } from '../schedules/schedules.js';
import { type ApiClient, createClient, printJson, printTable } from './client.js';

interface Json {
  json?: boolean;
}

function schedulesPath(client: ApiClient, app: string, name?: string): string {
  const base = `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/schedules`;
  return name === undefined ? base : `${base}/${encodeURIComponent(name)}`;
}

export async function schedulesListCommand(app: string | undefined, options: Json = {}): Promise<void> {
  const client = createClient();
  let apps: string[];
  if (app !== undefined) apps = [app];
  else {
    const { apps: all } = await client.call<{ apps: Array<{ id: string }> }>(
      'GET',
      `/v2/projects/${client.project}/apps`,
    );
    apps = all.map((a) => a.id);
  }
  const rows: Array<ScheduleView & { app: string }> = [];
  for (const id of apps) {
    const { schedules } = await client.call<{ schedules: ScheduleView[] }>('GET', schedulesPath(client, id));
    for (const s of schedules) rows.push({ app: id, ...s });
  }
  if (options.json) return printJson(rows);
  printTable(
    rows.map((s) => ({
      app: s.app,
      name: s.name,
      cron: s.timezone === 'UTC' ? s.cron : `${s.cron} (${s.timezone})`,
      function: s.function,
      next_tick: s.paused ? 'paused' : (s.next_tick_at ?? 'never'),
      last_run: s.last_run ? `${s.last_run.id} ${s.last_run.state}` : null,
      skipped: s.ticks_skipped,
    })),
    ['app', 'name', 'cron', 'function', 'next_tick', 'last_run', 'skipped'],
  );
}

async function setPausedCommand(app: string, name: string, paused: boolean, options: Json): Promise<void> {
  const client = createClient();
  const view = await client.call<ScheduleView>(
    'POST',
    `${schedulesPath(client, app, name)}/${paused ? 'pause' : 'resume'}`,
  );
  if (options.json) return printJson(view);
  process.stdout.write(
    paused
      ? `Paused schedule ${name} of ${app}: no tick starts a run until it is resumed.\n`
      : `Resumed schedule ${name} of ${app}: next tick ${view.next_tick_at ?? 'never'}.\n`,
  );
}

export function schedulesPauseCommand(app: string, name: string, options: Json = {}): Promise<void> {
  return setPausedCommand(app, name, true, options);
}

export function schedulesResumeCommand(app: string, name: string, options: Json = {}): Promise<void> {
  return setPausedCommand(app, name, false, options);
}

export async function schedulesTriggerCommand(app: string, name: string, options: Json = {}): Promise<void> {
  const client = createClient();
  const started = await client.call<{ run_id: string }>('POST', `${schedulesPath(client, app, name)}/trigger`);
  if (options.json) return printJson(started);
  process.stdout.write(
    `Started run ${started.run_id} of schedule ${name}. Follow it with: ferry runs get ${app} ${started.run_id} --wait\n`,
  );
}
