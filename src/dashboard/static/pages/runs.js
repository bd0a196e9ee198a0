// Runs of an app (newest first, live, filtered, paged) and one run: timeline, input, result or error,
// logs and webhook attempts with a redeliver button.
import { api } from '../api.js';
import { appHeader, appHref } from '../shared.js';
import {
  announce,
  coded,
  confirmButton,
  errorBox,
  errorText,
  facts,
  formatDuration,
  formatTime,
  h,
  json,
  modeBadge,
  replaceKeepingFocus,
  shortId,
  stateBadge,
  tableEl,
  timeEl,
} from '../ui.js';

export const RUN_STATES = ['queued', 'running', 'success', 'failure', 'timeout', 'cancelled'];
export const RUN_MODES = ['sync', 'async', 'stream'];
const FINAL = ['success', 'failure', 'timeout', 'cancelled'];
const POLL_MS = 2000;

function runDuration(run) {
  if (run.run_time_ms !== null) return run.run_time_ms;
  if (run.started_at && run.finished_at) return Date.parse(run.finished_at) - Date.parse(run.started_at);
  if (run.started_at && !run.finished_at) return Date.now() - Date.parse(run.started_at);
  return null;
}

function select(id, label, values, current) {
  return h(
    'p',
    { class: 'inline-field' },
    h('label', { for: id }, label),
    h(
      'select',
      { id },
      h('option', { value: '' }, 'Any'),
      values.map((v) => h('option', { value: v, selected: v === current }, v)),
    ),
  );
}

/** What started a run, in the runs table: a call, a schedule (its name), or `runs retry` of another run. */
function startedBy(run) {
  if (run.trigger === 'schedule') return run.schedule ? `schedule ${run.schedule.name}` : 'schedule';
  if (run.trigger === 'retry') return run.retry_of ? `retry of ${shortId(run.retry_of)}` : 'retry';
  return 'call';
}

export async function renderRuns(ctx) {
  const appId = ctx.params[0];
  ctx.setTitle(`Runs of ${appId}`);
  const filters = { state: ctx.query.get('state') ?? '', mode: ctx.query.get('mode') ?? '' };
  let before = ctx.query.get('before') ?? '';
  const pages = [];
  let seen = null;
  let live = true;

  const stateField = select('filter-state', 'State', RUN_STATES, filters.state);
  const modeField = select('filter-mode', 'Mode', RUN_MODES, filters.mode);
  const liveBox = h('input', { type: 'checkbox', id: 'live', checked: true });
  const updated = h('span', { class: 'hint', 'aria-live': 'off' });
  const body = h('tbody', {});
  const pager = h('div', { class: 'pager' });
  const problem = h('div', {});

  ctx.main.append(
    appHeader(ctx, appId, 'runs', `Runs of ${appId}`),
    h(
      'form',
      { class: 'toolbar', 'aria-label': 'Filter runs', onsubmit: (e) => e.preventDefault() },
      stateField,
      modeField,
      h('p', { class: 'inline-field' }, liveBox, h('label', { for: 'live' }, 'Live (every 2 s)')),
      updated,
    ),
    problem,
    tableEl({
      caption: `Runs of ${appId}, newest first`,
      head: ['Run', 'Function', 'Mode', 'Started by', 'State', 'Attempts', 'Status', 'Duration', 'Cold start', 'Time'],
      body,
      className: 'runs',
    }),
    pager,
  );

  function row(run, fresh) {
    return h(
      'tr',
      {
        'data-run-id': run.run_id,
        'data-state': run.state,
        'data-mode': run.mode,
        class: [fresh ? 'fresh' : '', run.mode === 'async' ? 'is-async' : ''].join(' ').trim() || null,
      },
      h(
        'td',
        { 'data-label': 'Run' },
        h(
          'a',
          {
            href: appHref(appId, 'runs', `/${run.run_id}`),
            class: 'mono',
            title: run.run_id,
            'aria-label': `Run ${run.run_id}`,
            'data-key': run.run_id,
          },
          shortId(run.run_id),
        ),
      ),
      h('td', { class: 'mono', 'data-label': 'Function' }, run.function),
      h('td', { 'data-label': 'Mode' }, modeBadge(run.mode)),
      h('td', { 'data-label': 'Started by', class: 'started-by' }, startedBy(run)),
      h('td', { 'data-label': 'State' }, stateBadge(run.state)),
      // Starts so far: more than 1 for a run its app's [retries] (or retry_interrupted) tried again.
      h('td', { class: 'num', 'data-label': 'Attempts' }, String(run.attempts ?? 0)),
      h('td', { class: 'num', 'data-label': 'Status' }, run.status_code === null ? '—' : String(run.status_code)),
      h('td', { class: 'num', 'data-label': 'Duration' }, formatDuration(runDuration(run))),
      h('td', { 'data-label': 'Cold start' }, run.cold_start ? h('span', { class: 'badge cold' }, 'cold') : '—'),
      h('td', { 'data-label': 'Time' }, timeEl(run.created_at)),
    );
  }

  async function refresh() {
    const res = await api(`/apps/${encodeURIComponent(appId)}/runs`, {
      query: { limit: 50, before, state: filters.state, mode: filters.mode },
      signal: ctx.signal,
    });
    problem.replaceChildren();
    const rows = res.runs.map((run) => row(run, seen !== null && !seen.has(run.run_id)));
    seen = new Set(res.runs.map((r) => r.run_id));
    if (rows.length === 0) {
      rows.push(h('tr', {}, h('td', { colspan: '10', class: 'empty-row' }, 'No runs match.')));
    }
    replaceKeepingFocus(body, rows);
    updated.textContent = `Updated ${formatTime(new Date().toISOString()).slice(11)}`;

    const newest = h('button', { type: 'button', disabled: !before }, 'Newest');
    newest.addEventListener('click', () => go('', true));
    const newer = h('button', { type: 'button', disabled: !before }, 'Newer');
    newer.addEventListener('click', () => go(pages.pop() ?? '', false));
    const older = h('button', { type: 'button', disabled: !res.next_before }, 'Older');
    older.addEventListener('click', () => {
      pages.push(before);
      go(res.next_before, false);
    });
    replaceKeepingFocus(pager, newest, ' ', newer, ' ', older);
  }

  function go(nextBefore, reset) {
    if (reset) pages.length = 0;
    before = nextBefore;
    seen = null;
    ctx.setQuery({ ...filters, before });
    refresh().catch(showError);
  }

  function showError(err) {
    if (err.name !== 'AbortError') problem.replaceChildren(errorBox(err));
  }

  for (const [field, key] of [
    [stateField, 'state'],
    [modeField, 'mode'],
  ]) {
    field.querySelector('select').addEventListener('change', (e) => {
      filters[key] = e.target.value;
      go('', true);
    });
  }
  liveBox.addEventListener('change', () => {
    live = liveBox.checked;
    announce(live ? 'Live updates on' : 'Live updates paused');
  });

  await refresh();
  ctx.every(POLL_MS, async () => {
    if (live) await refresh().catch(showError);
  });
}

function timeline(run) {
  const created = Date.parse(run.created_at);
  const started = run.started_at ? Date.parse(run.started_at) : null;
  const finished = run.finished_at ? Date.parse(run.finished_at) : null;
  const end = finished ?? Date.now();
  const total = Math.max(1, end - created);
  const wait = (started ?? end) - created;
  // Widths through the CSSOM (el.style), which the page's CSP allows; style attributes it would refuse.
  const waitSeg = h('span', { class: 'seg wait', title: `waited ${formatDuration(wait)}` });
  waitSeg.style.flexGrow = String(Math.max(wait, total / 200));
  const runSeg = started
    ? h('span', { class: `seg run state-${run.state}`, title: `ran ${formatDuration(end - started)}` })
    : null;
  if (runSeg) runSeg.style.flexGrow = String(Math.max(end - started, total / 200));
  const bar = h('div', { class: 'timeline-bar', 'aria-hidden': 'true' }, waitSeg, runSeg);
  const step = (label, iso, note) =>
    h(
      'li',
      { class: iso ? 'done' : 'pending' },
      h('span', { class: 'step' }, label),
      iso ? h('time', { datetime: iso }, formatTime(iso)) : h('span', {}, 'not yet'),
      note ? h('span', { class: 'hint' }, ` ${note}`) : null,
    );
  return h(
    'div',
    { class: 'timeline' },
    bar,
    h(
      'ol',
      {},
      step('Created', run.created_at, null),
      step(
        'Started',
        run.started_at,
        started ? `waited ${formatDuration(started - created)}${run.cold_start ? ' (cold start)' : ''}` : null,
      ),
      step('Finished', run.finished_at, finished && started ? `ran ${formatDuration(runDuration(run))}` : null),
    ),
  );
}

function webhookSection(ctx, appId, run, reload) {
  const hook = run.webhook;
  const content = [];
  if (!hook) {
    content.push(
      h(
        'p',
        { class: 'hint' },
        run.state && FINAL.includes(run.state) ? 'This run was called without a webhookEndpoint.' : 'No delivery yet.',
      ),
    );
  } else {
    content.push(
      facts([
        ['Endpoint', h('span', { class: 'mono break' }, hook.url)],
        ['Delivery', stateBadge(`hook-${hook.state}`, hook.state)],
        ['Next attempt', hook.next_attempt_at ? timeEl(hook.next_attempt_at) : null],
      ]),
    );
    const body = h(
      'tbody',
      {},
      hook.attempts.length === 0
        ? h('tr', {}, h('td', { colspan: '5', class: 'empty-row' }, 'No attempts yet.'))
        : hook.attempts.map((a) =>
            h(
              'tr',
              {},
              h('td', { class: 'num' }, String(a.attempt)),
              h('td', {}, h('time', { datetime: a.at }, formatTime(a.at))),
              h(
                'td',
                {},
                a.status_code === null
                  ? '—'
                  : h(
                      'span',
                      { class: `badge ${a.status_code < 300 ? 'state-success' : 'state-failure'}` },
                      String(a.status_code),
                    ),
              ),
              h('td', { class: 'num' }, formatDuration(a.duration_ms)),
              h('td', { class: 'break' }, coded(a.error ?? '')),
            ),
          ),
    );
    content.push(
      tableEl({ caption: 'Webhook attempts', head: ['Attempt', 'At', 'Status', 'Duration', 'Error'], body }),
    );
    const note = h('span', {});
    const redeliver = h('button', { type: 'button', 'data-key': 'redeliver' }, 'Redeliver');
    redeliver.addEventListener('click', async () => {
      redeliver.disabled = true;
      note.replaceChildren();
      try {
        await api(`/apps/${encodeURIComponent(appId)}/runs/${encodeURIComponent(run.run_id)}/webhook/redeliver`, {
          method: 'POST',
          signal: ctx.signal,
        });
        announce('Webhook redelivery queued');
        note.replaceChildren(h('span', { class: 'hint' }, ' Queued for redelivery.'));
        await reload();
      } catch (err) {
        note.replaceChildren(errorText(err));
      } finally {
        redeliver.disabled = false;
      }
    });
    content.push(h('div', { class: 'actions' }, redeliver, note));
  }
  return content;
}

export async function renderRun(ctx) {
  const [appId, runId] = ctx.params;
  ctx.setTitle(`Run ${shortId(runId)} of ${appId}`);
  const summary = h('div', {});
  const io = h('div', { class: 'split' });
  const logs = h('div', {});
  const hook = h('div', {});
  ctx.main.append(
    appHeader(ctx, appId, 'runs', `Run ${shortId(runId)}`),
    summary,
    io,
    h('section', { 'aria-labelledby': 'run-logs' }, h('h2', { id: 'run-logs' }, 'Logs'), logs),
    h('section', { 'aria-labelledby': 'run-webhook' }, h('h2', { id: 'run-webhook' }, 'Webhook'), hook),
  );
  const base = `/apps/${encodeURIComponent(appId)}/runs/${encodeURIComponent(runId)}`;
  let last = '';
  let current = null;

  async function load({ wait = false } = {}) {
    // An unfinished run is asked for with ?wait: the answer comes when it ends (or after 20 s).
    const run = await api(base, {
      query: wait && current && !FINAL.includes(current.state) ? { wait: 20 } : undefined,
      signal: ctx.signal,
    });
    const log = await api(`${base}/logs`, { signal: ctx.signal });
    current = run;
    const key = JSON.stringify([run, log]);
    if (key === last) return false;
    last = key;
    replaceKeepingFocus(
      summary,
      h(
        'div',
        { class: 'badges' },
        stateBadge(run.state),
        ' ',
        modeBadge(run.mode),
        run.cold_start ? [' ', h('span', { class: 'badge cold' }, 'cold start')] : null,
      ),
      FINAL.includes(run.state)
        ? null
        : h(
            'p',
            { class: 'run-actions' },
            confirmButton({
              label: 'Cancel run',
              question: 'Cancel this run? Its function is told to stop.',
              confirmLabel: 'Cancel the run',
              async onConfirm() {
                await api(`${base}/cancel`, { method: 'POST', signal: ctx.signal });
                announce('Run cancelled');
                await load();
              },
            }),
          ),
      facts([
        ['Run id', h('span', { class: 'mono' }, run.run_id)],
        ['Function', h('span', { class: 'mono' }, run.function)],
        ['Status code', run.status_code === null ? '—' : String(run.status_code)],
        ['Run time', formatDuration(runDuration(run))],
        [
          'Build',
          run.build_id
            ? h('a', { href: appHref(appId, 'builds', `/${run.build_id}`), class: 'mono' }, shortId(run.build_id))
            : '—',
        ],
        [
          'Started by',
          run.trigger === 'schedule' && run.schedule
            ? `schedule ${run.schedule.name}, tick ${run.schedule.tick}`
            : run.trigger === 'retry' && run.retry_of
              ? h('a', { href: appHref(appId, 'runs', `/${run.retry_of}`) }, `retry of ${shortId(run.retry_of)}`)
              : null,
        ],
        ['Next attempt', run.next_attempt_at],
        // Last, each on a row of its own: codes need more room than a column gives.
        ['Reason', run.reason ? coded(run.reason) : null, 'wide'],
        [
          'Attempts',
          run.attempt_history?.length
            ? coded(
                `${run.attempt_history.map((a) => `${a.attempt}: ${a.state}${a.error_code ? ` (${a.error_code})` : ''}`).join(', ')}${run.dead ? ' — dead: no attempt left' : ''}`,
              )
            : null,
          'wide',
        ],
      ]),
      h('section', { 'aria-labelledby': 'run-timeline' }, h('h2', { id: 'run-timeline' }, 'Timeline'), timeline(run)),
    );
    const outcome = run.error
      ? h(
          'section',
          { 'aria-labelledby': 'run-error' },
          h('h2', { id: 'run-error' }, 'Error'),
          h('p', { class: 'error-text' }, coded(run.error.code)),
          h('pre', { class: 'code error', tabindex: '0', 'aria-label': 'Error message' }, run.error.message),
        )
      : h(
          'section',
          { 'aria-labelledby': 'run-result' },
          h('h2', { id: 'run-result' }, 'Result'),
          FINAL.includes(run.state)
            ? h(
                'pre',
                { class: 'code', tabindex: '0', 'aria-label': 'Result' },
                run.result === undefined ? '(not kept)' : json(run.result),
              )
            : h('p', { class: 'hint' }, 'The run has not finished yet.'),
        );
    replaceKeepingFocus(
      io,
      h(
        'section',
        { 'aria-labelledby': 'run-input' },
        h('h2', { id: 'run-input' }, 'Input'),
        h(
          'pre',
          { class: 'code', tabindex: '0', 'aria-label': 'Input' },
          run.input === undefined ? '(not kept)' : json(run.input),
        ),
      ),
      outcome,
    );
    replaceKeepingFocus(
      logs,
      log.lines.length === 0
        ? h('p', { class: 'hint' }, 'The function printed nothing.')
        : h(
            'pre',
            { class: 'log', tabindex: '0', 'aria-label': 'Run logs' },
            log.lines.map((l) =>
              h(
                'span',
                { class: `line ${l.stream}` },
                h('span', { class: 'line-meta' }, `${formatTime(l.at).slice(11)} ${l.stream.padEnd(6)} `),
                `${l.line}\n`,
              ),
            ),
          ),
    );
    replaceKeepingFocus(hook, webhookSection(ctx, appId, run, load));
    return true;
  }

  try {
    await load();
  } catch (err) {
    ctx.main.append(errorBox(err));
    return;
  }
  // Follow the run while it or its webhook delivery is still moving (a redelivery sets it moving again).
  const moving = (r) => !FINAL.includes(r.state) || ['pending', 'sending'].includes(r.webhook?.state);
  let quiet = 0;
  ctx.every(POLL_MS, async () => {
    if (current && !moving(current) && quiet >= 2) return;
    quiet = (await load({ wait: true })) ? 0 : quiet + 1;
  });
}
