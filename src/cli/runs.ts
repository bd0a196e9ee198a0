/**
 * `ferry runs list|get|logs|cancel|retry` shows and acts on runs (`ferry run`, the call itself: run-call.ts).
 */
import { isFinalState } from '../runs/lifecycle.js';
import { CliError, createClient, printJson, printTable } from './client.js';
import { printLine, safeJson, safeText } from './terminal.js';

interface Json {
  json?: boolean;
}

export async function runsListCommand(
  app: string,
  options: { json?: boolean; limit?: string; state?: string; mode?: string; dead?: boolean },
): Promise<void> {
  const client = createClient();
  const query = new URLSearchParams();
  if (options.limit) query.set('limit', options.limit);
  if (options.dead) query.set('dead', 'true');
  if (options.state) query.set('state', options.state);
  if (options.mode) query.set('mode', options.mode);
  const qs = query.size > 0 ? `?${query}` : '';
  const { runs } = await client.call<{ runs: Array<Record<string, unknown>> }>(
    'GET',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs${qs}`,
  );
  if (options.json) return printJson(runs);
  printTable(
    runs.map((r) => ({
      run_id: String(r.run_id),
      function: String(r.function),
      mode: String(r.mode),
      state: r.dead ? `${String(r.state)} (dead)` : String(r.state),
      trigger: startedBy(r),
      // Starts so far: more than 1 for a run its app's [retries] (or retry_interrupted) tried again.
      attempts: Number(r.attempts ?? 0),
      status: r.status_code === null ? null : Number(r.status_code),
      ms: r.run_time_ms === null ? null : Number(r.run_time_ms),
      cold: r.cold_start ? 'yes' : '',
      created_at: String(r.created_at),
    })),
    ['run_id', 'function', 'mode', 'trigger', 'state', 'attempts', 'status', 'ms', 'cold', 'created_at'],
  );
}

/** What started a run, as the list shows it: `call`, `schedule <name>`, or `retry of <the run's short id>`. */
function startedBy(r: Record<string, unknown>): string {
  if (r.trigger === 'schedule') return `schedule ${(r.schedule as { name: string } | null)?.name ?? ''}`.trim();
  if (r.trigger === 'retry') return typeof r.retry_of === 'string' ? `retry of ${r.retry_of.slice(-12)}` : 'retry';
  return 'call';
}

/**
 * `ferry runs get <app> <run_id> [--wait [seconds]]`: the run; with --wait, once it has ended or the time is
 * up (the server holds each request up to 60 s, so a longer wait is several requests).
 */
export async function runsGetCommand(
  app: string,
  runId: string,
  options: Json & { wait?: string | boolean } = {},
): Promise<void> {
  const client = createClient();
  const path = `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs/${encodeURIComponent(runId)}`;
  let waitSeconds = 0;
  if (options.wait !== undefined && options.wait !== false) {
    waitSeconds = options.wait === true ? 60 : Number(options.wait);
    if (!/^\d{1,4}$/.test(String(options.wait === true ? 60 : options.wait)) || waitSeconds > 3600) {
      throw new CliError(`--wait takes whole seconds, 0 to 3600 (got ${String(options.wait)})`, 2);
    }
  }
  const end = Date.now() + waitSeconds * 1000;
  let run = await client.call<{ state: string }>('GET', path);
  for (let i = 0; i < 100 && !isFinalState(run.state); i++) {
    const left = Math.ceil((end - Date.now()) / 1000);
    if (left <= 0) break;
    run = await client.call<{ state: string }>('GET', `${path}?wait=${Math.min(60, left)}`);
  }
  printJson(run);
}

/** `ferry runs cancel <app> <run_id>`: cancels the run; prints it once it has ended (or the cancel is under way). */
export async function runsCancelCommand(app: string, runId: string, options: Json = {}): Promise<void> {
  const client = createClient();
  const run = await client.call<{ state: string; error: { message: string } | null }>(
    'POST',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs/${encodeURIComponent(runId)}/cancel`,
  );
  if (options.json) return printJson(run);
  process.stdout.write(
    run.state === 'cancelled'
      ? `Run ${runId} cancelled${run.error ? `: ${safeText(run.error.message)}` : ''}\n`
      : `Run ${runId}: ${run.state}${isFinalState(run.state) ? ' (it ended before the cancel reached it)' : ' (the cancel is under way)'}\n`,
  );
}

export async function runsRetryCommand(app: string, runId: string, options: Json = {}): Promise<void> {
  const client = createClient();
  const started = await client.call<{ run_id: string }>(
    'POST',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs/${encodeURIComponent(runId)}/retry`,
  );
  if (options.json) return printJson(started);
  process.stdout.write(
    `Started run ${started.run_id}, a retry of ${runId}. Follow it with: ferry runs get ${app} ${started.run_id} --wait\n`,
  );
}

export async function runsLogsCommand(app: string, runId: string, options: Json = {}): Promise<void> {
  const client = createClient();
  const { lines } = await client.call<{ lines: Array<{ at: string; stream: string; line: string }> }>(
    'GET',
    `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/runs/${runId}/logs`,
  );
  if (options.json) return printJson(lines);
  // What the function printed, its controls made visible: it must not drive the user's terminal.
  for (const l of lines) printLine(`${l.at} ${l.stream.padEnd(6)} ${l.line}`);
}

/**
 * `ferry logs <app> [--follow]`: the app log (what replicas print outside runs, and their starts, crashes
 * and restarts). `--follow` polls for new lines until interrupted.
 */
export async function appLogsCommand(app: string, options: Json & { follow?: boolean }): Promise<void> {
  const client = createClient();
  type Line = { seq: number; at: string; replica: string; stream: string; line: string };
  let after = 0;
  const all: Line[] = [];
  for (;;) {
    const { lines } = await client.call<{ lines: Line[] }>(
      'GET',
      `/v2/projects/${client.project}/apps/${encodeURIComponent(app)}/logs?after=${after}&limit=5000`,
    );
    for (const l of lines) {
      // --json: one array without --follow (the convention for lists), one object per line while following.
      if (options.json && !options.follow) all.push(l);
      else if (options.json) process.stdout.write(`${safeJson(JSON.stringify(l))}\n`);
      else printLine(`${l.at} ${l.replica} ${l.stream.padEnd(6)} ${l.line}`);
      after = l.seq;
    }
    // A full page means more are waiting: ask again at once.
    if (lines.length === 5000) continue;
    if (!options.follow) {
      if (options.json) printJson(all);
      return;
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}
