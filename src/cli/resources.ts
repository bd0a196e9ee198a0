/**
 * The CLI's resource commands: `ferry login`, `ferry apps list`, `ferry builds list|logs|files`,
 * `ferry tokens create|list|revoke`. Each prints a table (or JSON with --json).
 */

import { followBuildLog } from './build-log-follow.js';
import { CliError, createClient, printJson, printTable, runBaseUrl } from './client.js';
import { projectOfToken, resolveCliSettings, writeConfigFile } from './config-file.js';
import { printLine, safeJson } from './terminal.js';

interface Json {
  json?: boolean;
}

export async function loginCommand(options: Json & { url?: string; token?: string; project?: string }): Promise<void> {
  const current = resolveCliSettings();
  const token = options.token ?? process.env.FERRY_TOKEN;
  if (!token) throw new CliError('Pass --token <token> (from `ferry admin bootstrap` or the API keys page).', 2);
  const url = (options.url ?? current.url ?? 'http://127.0.0.1:8000').replace(/\/+$/, '');
  const project = options.project ?? projectOfToken(token);
  if (!project) throw new CliError('The token names no project; pass --project <project_id>.', 2);
  // Check the token against the server before storing it.
  process.env.FERRY_URL = url;
  process.env.FERRY_TOKEN = token;
  process.env.FERRY_PROJECT = project;
  const client = createClient();
  const info = await client.call<{ id: string; name: string }>('GET', `/v2/projects/${project}`);
  const file = writeConfigFile({ url, token, project });
  if (options.json) return printJson({ url, project_id: info.id, project_name: info.name, config_file: file });
  process.stdout.write(`Logged in to ${url} as project ${info.name} (${info.id}); saved to ${file}\n`);
}

export async function appsListCommand(options: Json): Promise<void> {
  const client = createClient();
  const { apps } = await client.call<{ apps: Array<Record<string, string | null>> }>(
    'GET',
    `/v2/projects/${client.project}/apps`,
  );
  if (options.json) return printJson(apps);
  // The run URL only where there is a `run` function: the active build knows the public functions.
  const functions = await Promise.all(
    apps.map(async (a) => {
      if (!a.active_build_id) return null;
      const build = await client
        .call<{ functions: string[] | null }>(
          'GET',
          `/v2/projects/${client.project}/apps/${a.id}/builds/${a.active_build_id}`,
        )
        .catch(() => ({ functions: null }));
      return build.functions;
    }),
  );
  const runBase = await runBaseUrl(client);
  printTable(
    apps.map((a, i) => {
      const fns = functions[i] ?? null;
      const hasRun = fns === null ? Boolean(a.active_build_id) : fns.includes('run');
      return {
        ...a,
        functions: fns === null ? null : fns.length > 0 ? fns.join(',') : '(none)',
        run_url: hasRun ? `${runBase}/v4/${client.project}/${a.name}/run` : null,
      };
    }),
    ['id', 'state', 'active_build_id', 'updated_at', 'functions', 'run_url'],
  );
}

export async function buildsListCommand(app: string, options: Json & { limit?: string }): Promise<void> {
  const client = createClient();
  const limit = options.limit ? `?limit=${encodeURIComponent(options.limit)}` : '';
  const { builds } = await client.call<{
    builds: Array<Record<string, string | number | boolean | null | { digest: string }>>;
  }>('GET', `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/builds${limit}`);
  if (options.json) return printJson(builds);
  printTable(
    builds.map((b) => ({
      ...b,
      duration: b.duration_ms === null ? null : `${(Number(b.duration_ms) / 1000).toFixed(1)}s`,
      active: b.active === true ? 'yes' : null,
      // The manifest digest, short as `docker images` shows it (the full one is in --json).
      image: typeof b.image === 'object' && b.image !== null ? b.image.digest.slice(0, 'sha256:'.length + 12) : null,
    })),
    ['id', 'state', 'active', 'created_at', 'duration', 'file_count', 'image', 'error'],
  );
}

/** `ferry apps delete <app>`: asks on a terminal unless --yes; refuses without --yes when it cannot ask. */
export async function appsDeleteCommand(app: string, options: Json & { yes?: boolean }): Promise<void> {
  const client = createClient();
  if (!options.yes) {
    if (!process.stdin.isTTY) {
      throw new CliError(`Deleting ${app} removes its builds and run history; pass --yes to confirm`, 2);
    }
    const { createInterface } = await import('node:readline/promises');
    const rl = createInterface({ input: process.stdin, output: process.stderr });
    const answer = await rl.question(
      `Delete app ${app} in project ${client.project}, with its builds and run history? Type the app name to confirm: `,
    );
    rl.close();
    if (answer.trim() !== app) throw new CliError('Not deleted', 1);
  }
  const result = await client.call<{ builds_deleted: number; runs_cancelled: number; runs_deleted: number }>(
    'DELETE',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}`,
  );
  if (options.json) return printJson(result);
  process.stdout.write(
    `Deleted ${app}: ${result.builds_deleted} build(s), ${result.runs_deleted} run record(s); ${result.runs_cancelled} queued run(s) cancelled\n`,
  );
}

export async function buildsDeleteCommand(buildId: string, options: Json & { app?: string }): Promise<void> {
  const client = createClient();
  const app = await appOfBuild(client, buildId, options.app);
  const result = await client.call<{ build_id: string; deleted: boolean }>(
    'DELETE',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/builds/${encodeURIComponent(buildId)}`,
  );
  if (options.json) return printJson(result);
  process.stdout.write(`Deleted build ${buildId} of ${app}\n`);
}

export async function buildsActivateCommand(buildId: string, options: Json & { app?: string }): Promise<void> {
  const client = createClient();
  const app = await appOfBuild(client, buildId, options.app);
  const build = await client.call<{ id: string; state: string }>(
    'POST',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/builds/${encodeURIComponent(buildId)}/activate`,
  );
  if (options.json) return printJson(build);
  process.stdout.write(`Build ${build.id} is now the active build of ${app}\n`);
}

/** `ferry rollback <app>`: activates the newest ready build older than the active one. */
export async function rollbackCommand(app: string, options: Json): Promise<void> {
  const client = createClient();
  const base = `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}`;
  const found = await client.call<{ active_build_id: string | null }>('GET', base);
  if (!found.active_build_id) throw new CliError(`App ${app} has no active build to roll back from`);
  // Builds come newest first, 200 a page: the one to go back to is the first ready build after the active.
  let before: string | null = null;
  let seenActive = false;
  for (let page = 0; page < 50; page++) {
    const query: string = `?limit=200${before ? `&before=${encodeURIComponent(before)}` : ''}`;
    const { builds, next_before } = await client.call<{
      builds: Array<{ id: string; state: string }>;
      next_before: string | null;
    }>('GET', `${base}/builds${query}`);
    for (const b of builds) {
      if (b.id === found.active_build_id) seenActive = true;
      else if (seenActive && b.state === 'ready') {
        const build = await client.call<{ id: string }>('POST', `${base}/builds/${b.id}/activate`);
        if (options.json) return printJson({ app, from: found.active_build_id, to: build.id });
        process.stdout.write(`Rolled ${app} back from build ${found.active_build_id} to ${build.id}\n`);
        return;
      }
    }
    if (!next_before) break;
    before = next_before;
  }
  throw new CliError(`App ${app} has no ready build older than its active build ${found.active_build_id}`);
}

export async function appsScaleCommand(
  app: string,
  options: Json & {
    min?: string;
    max?: string;
    concurrency?: string;
    cooldown?: string;
    grace?: string;
    reset?: boolean;
  },
): Promise<void> {
  const client = createClient();
  const scaling: Record<string, number> = {};
  const keys: Array<[keyof typeof options, string]> = [
    ['min', 'min_replicas'],
    ['max', 'max_replicas'],
    ['concurrency', 'replica_concurrency'],
    ['cooldown', 'cooldown'],
    ['grace', 'response_grace_period'],
  ];
  for (const [option, key] of keys) {
    const value = options[option];
    if (value === undefined) continue;
    if (typeof value !== 'string' || !/^\d{1,9}$/.test(value)) {
      throw new CliError(`--${String(option)} takes a whole number (got ${String(value)})`, 2);
    }
    scaling[key] = Number(value);
  }
  if (options.reset && Object.keys(scaling).length > 0) {
    throw new CliError('--reset clears the override: pass it alone', 2);
  }
  if (!options.reset && Object.keys(scaling).length === 0) {
    throw new CliError('Say what to change: --min, --max, --concurrency, --cooldown, --grace, or --reset', 2);
  }
  const updated = await client.call<{ scaling: Record<string, number> | null; scaling_override: object | null }>(
    'PATCH',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}`,
    { body: { scaling: options.reset ? null : scaling } },
  );
  if (options.json) return printJson(updated);
  const s = updated.scaling;
  process.stdout.write(
    s
      ? `${app}: min_replicas ${s.min_replicas}, max_replicas ${s.max_replicas}, replica_concurrency ${s.replica_concurrency}, cooldown ${s.cooldown}s${updated.scaling_override ? ' (set through the API; `ferry apps scale --reset` goes back to ferry.toml)' : ' (from ferry.toml)'}\n`
      : `${app}: scaling saved; it applies once the app has a ready build\n`,
  );
}

/** Finds the app of a build id by asking each app; lets `ferry builds files <build_id>` work without --app. */
async function appOfBuild(client: ReturnType<typeof createClient>, buildId: string, app?: string): Promise<string> {
  if (app) return app;
  const { apps } = await client.call<{ apps: Array<{ id: string }> }>('GET', `/v2/projects/${client.project}/apps`);
  for (const a of apps) {
    try {
      await client.call('GET', `/v2/projects/${client.project}/apps/${a.id}/builds/${buildId}`);
      return a.id;
    } catch {
      // not this app's
    }
  }
  throw new CliError(`No build ${buildId} in project ${client.project}`);
}

export async function buildsLogsCommand(
  buildId: string,
  options: Json & { app?: string; follow?: boolean },
): Promise<void> {
  const client = createClient();
  const app = await appOfBuild(client, buildId, options.app);
  if (options.follow) {
    const state = await followBuildLog(client, app, buildId, (line, entry) =>
      options.json ? process.stdout.write(`${safeJson(JSON.stringify(entry))}\n`) : printLine(line),
    );
    // With --json, stdout carries the lines only.
    (options.json ? process.stderr : process.stdout).write(`(build ${state})\n`);
    return;
  }
  const { lines, state } = await client.call<{ lines: Array<{ line: string }>; state: string }>(
    'GET',
    `/v2/projects/${client.project}/apps/${app}/builds/${buildId}/logs`,
  );
  if (options.json) return printJson(lines);
  for (const l of lines) printLine(l.line);
  process.stdout.write(`(build ${state})\n`);
}

export async function buildsFilesCommand(buildId: string, options: Json & { app?: string }): Promise<void> {
  const client = createClient();
  const app = await appOfBuild(client, buildId, options.app);
  const listing = await client.call<{
    count: number;
    total_size: number;
    files: Array<{ path: string; size: number }>;
  }>('GET', `/v2/projects/${client.project}/apps/${app}/builds/${buildId}/zip-contents`);
  if (options.json) return printJson(listing);
  printTable(listing.files, ['path', 'size']);
  process.stdout.write(`${listing.count} files, ${listing.total_size} bytes\n`);
}

export async function buildsCancelCommand(buildId: string, options: Json & { app?: string }): Promise<void> {
  const client = createClient();
  const app = await appOfBuild(client, buildId, options.app);
  const build = await client.call<{ state: string }>(
    'POST',
    `/v2/projects/${client.project}/apps/${app}/builds/${buildId}/cancel`,
  );
  if (options.json) return printJson(build);
  process.stdout.write(`Build ${buildId}: ${build.state}\n`);
}

export async function tokensCreateCommand(
  name: string,
  options: Json & { expires?: string; scope?: string[] },
): Promise<void> {
  const client = createClient();
  const created = await client.call<Record<string, unknown> & { token: string }>(
    'POST',
    `/v2/projects/${client.project}/service-accounts`,
    {
      body: {
        name,
        ...(options.expires ? { expires_at: options.expires } : {}),
        ...(options.scope ? { scopes: options.scope } : {}),
      },
    },
  );
  if (options.json) return printJson(created);
  process.stdout.write(
    `Created service account ${String(created.name)} (${String(created.id)}), scopes ${(created.scopes as string[]).join(', ')}, expires ${String(created.expires_at)}\n\nToken (shown once):\n${created.token}\n`,
  );
}

export async function tokensListCommand(options: Json): Promise<void> {
  const client = createClient();
  const { service_accounts } = await client.call<{ service_accounts: Array<Record<string, unknown>> }>(
    'GET',
    `/v2/projects/${client.project}/service-accounts`,
  );
  if (options.json) return printJson(service_accounts);
  printTable(
    service_accounts.map((s) => ({
      id: String(s.id),
      name: String(s.name),
      scopes: (s.scopes as string[]).join(','),
      expires_at: String(s.expires_at),
      status: s.revoked_at ? 'revoked' : s.expired ? 'expired' : 'active',
      created_at: String(s.created_at),
      last_used_at: (s.last_used_at as string | null) ?? null,
    })),
    // The name and creation time tell accounts apart, e.g. the owners of two `ferry admin bootstrap` runs.
    ['id', 'name', 'scopes', 'status', 'created_at', 'expires_at', 'last_used_at'],
  );
}

export async function tokensRevokeCommand(id: string, options: Json = {}): Promise<void> {
  const client = createClient();
  const sa = await client.call<{ id: string; revoked_at: string }>(
    'DELETE',
    `/v2/projects/${client.project}/service-accounts/${id}`,
  );
  if (options.json) return printJson(sa);
  process.stdout.write(`Revoked ${sa.id} at ${sa.revoked_at}\n`);
}
