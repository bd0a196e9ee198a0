// Apps: each app's state, active build, replicas and limits, run URL and a copyable curl example per mode.
import { api, runAddress, session } from '../api.js';
import { appHref, listApps } from '../shared.js';
import { copyButton, errorText, h, shortId, shown, stateBadge, timeEl } from '../ui.js';
import { clusterSection } from './cluster.js';

/** The curl example of each way to call a function; the token stays a shell variable, never the real one. */
export function curlExamples(runUrl) {
  const auth = `-H "Authorization: Bearer $FERRY_TOKEN"`;
  const json = `-H 'Content-Type: application/json'`;
  const hook = encodeURIComponent('https://example.com/hook');
  return [
    ['sync', 'Synchronous: waits for the result', `curl -X POST '${runUrl}' \\\n  ${auth} \\\n  ${json} \\\n  -d '{}'`],
    [
      'async',
      'Asynchronous: answers 202 with a run id at once',
      `curl -X POST '${runUrl}?async=true' \\\n  ${auth} \\\n  ${json} \\\n  -d '{}'`,
    ],
    [
      'stream',
      "Streaming: a generator's items as server-sent events",
      `curl -N -X POST '${runUrl}' \\\n  ${auth} \\\n  -H 'Accept: text/event-stream' \\\n  ${json} \\\n  -d '{}'`,
    ],
    [
      'webhook',
      'Webhook: the result is POSTed, signed, to your endpoint',
      `curl -X POST '${runUrl}?webhookEndpoint=${hook}' \\\n  ${auth} \\\n  -H "X-Webhook-Secret: $WEBHOOK_SECRET" \\\n  ${json} \\\n  -d '{}'`,
    ],
  ];
}

function replicaText(stats) {
  if (!stats) return '—';
  const r = stats.replicas;
  const running = r.starting + r.ready;
  const parts = [`${running} running`];
  if (r.starting > 0) parts.push(`${r.starting} starting`);
  const limits = r.min === null ? 'no active build' : `limits ${r.min}–${r.max}`;
  return `${parts.join(', ')} · ${limits}`;
}

function loadText(stats) {
  if (!stats) return '—';
  return `${stats.replicas.inflight} in flight, ${stats.replicas.queued} queued`;
}

/**
 * The state shown: the API's, except for an active app with no replica running: "cannot start" when its
 * last replica failed to start or crashed, "no public function" when its build exports none, else
 * "scaled to zero".
 */
function shownState(app, stats, health) {
  if (app.state === 'active' && stats && stats.replicas.starting + stats.replicas.ready === 0) {
    if (health.startProblem) return stateBadge('failed', 'cannot start');
    if (health.functions?.length === 0) return stateBadge('failed', 'no public function');
    return stateBadge('zero', 'scaled to zero');
  }
  return stateBadge(app.state);
}

// What the server writes to the app log when a replica starts or fails (replicas/pool.ts).
const REPLICA_READY = /^replica ready\b/;
const REPLICA_FAILED = /^replica (failed to start|exited unexpectedly)/;

/**
 * Why an app's replicas are not running, followed in its app log (GET .../apps/{app}/logs, read onward
 * from the last line seen): the last failure line, cleared by the next replica that became ready.
 */
function startWatch(appId) {
  let after = 0;
  let problem = null;
  return async (signal) => {
    // Bounded: the log keeps a few thousand lines per app, so a handful of pages reach its end.
    for (let page = 0; page < 20; page++) {
      const { lines } = await api(`/apps/${encodeURIComponent(appId)}/logs`, {
        query: { after, limit: 1000 },
        signal,
      });
      for (const line of lines) {
        after = line.seq;
        if (line.stream !== 'system') continue;
        if (REPLICA_READY.test(line.line)) problem = null;
        else if (REPLICA_FAILED.test(line.line)) problem = line.line;
      }
      if (lines.length < 1000) break;
    }
    return problem;
  };
}

function functionsText(build) {
  if (!build) return '—';
  if (build.functions === null || build.functions === undefined) return 'known once a replica loads the module';
  return build.functions.length > 0 ? build.functions.join(', ') : 'none';
}

/** `runOrigin`: where the run endpoint is (api.js runAddress). */
function appCard(app, runOrigin) {
  const slug = `app-${app.id}`;
  const runBase = `${runOrigin}/v4/${session.projectId}/${app.id}`;
  const fnInput = h('input', {
    id: `${slug}-fn`,
    class: 'fn-input',
    value: 'run',
    autocomplete: 'off',
    spellcheck: 'false',
    pattern: '[A-Za-z$][A-Za-z0-9_$]*',
  });
  const runUrl = () => `${runBase}/${encodeURIComponent(fnInput.value.trim() || 'run')}`;
  const urlCode = h('code', { class: 'run-url' }, runUrl());
  const exampleCodes = [];
  const examples = curlExamples(runUrl()).map(([mode, what, text], i) => {
    const code = h('code', {}, text);
    exampleCodes.push(code);
    return h(
      'div',
      { class: 'example' },
      h('div', { class: 'example-head' }, h('span', { class: 'example-mode' }, mode), h('span', {}, what)),
      h('pre', {}, code),
      copyButton(() => curlExamples(runUrl())[i][2], `${mode} curl example for ${app.id}`),
    );
  });
  fnInput.addEventListener('input', () => {
    urlCode.textContent = runUrl();
    curlExamples(runUrl()).forEach(([, , text], i) => {
      exampleCodes[i].textContent = text;
    });
  });

  const state = h('span', { class: 'app-state' }, stateBadge(app.state));
  const active = h('dd', {});
  const replicas = h('dd', {}, '—');
  const load = h('dd', {}, '—');
  const updated = h('dd', {});
  const functions = h('dd', { class: 'functions' }, '—');
  const problem = h('p', { class: 'card-problem' });
  let fnTouched = false;
  fnInput.addEventListener('input', () => {
    fnTouched = true;
  });

  const card = h(
    'article',
    { class: 'card app-card', 'aria-labelledby': `${slug}-name`, 'data-app': app.id },
    h('header', { class: 'card-head' }, h('h2', { id: `${slug}-name` }, app.id), state),
    h(
      'dl',
      { class: 'facts' },
      h('div', {}, h('dt', {}, 'Active build'), active),
      h('div', {}, h('dt', {}, 'Replicas'), replicas),
      h('div', {}, h('dt', {}, 'Load'), load),
      h('div', {}, h('dt', {}, 'Updated'), updated),
      h('div', {}, h('dt', {}, 'Functions'), functions),
    ),
    problem,
    h(
      'div',
      { class: 'run-url-row' },
      h('span', { class: 'label' }, 'Run URL'),
      urlCode,
      copyButton(runUrl, `run URL of ${app.id}`),
    ),
    h(
      'details',
      { class: 'examples' },
      h('summary', {}, 'curl examples (sync, async, stream, webhook)'),
      h('p', { class: 'inline-field' }, h('label', { for: `${slug}-fn` }, 'Function'), fnInput),
      h(
        'p',
        { class: 'hint' },
        'Set FERRY_TOKEN to a token with the run scope (API keys page). The token is never put in these examples.',
      ),
      examples,
    ),
    h(
      'nav',
      { class: 'card-links', 'aria-label': `${app.id} pages` },
      h('a', { href: appHref(app.id, 'builds') }, 'Builds'),
      h('a', { href: appHref(app.id, 'runs') }, 'Runs'),
      h('a', { href: appHref(app.id, 'charts') }, 'Charts'),
      h('a', { href: appHref(app.id, 'settings') }, 'Settings'),
    ),
  );

  return {
    card,
    watchStarts: startWatch(app.id),
    /** The active build (for its public functions), fetched again only when it changes. */
    build: null,
    update(next, stats, statsError, health) {
      state.replaceChildren(shownState(next, stats, health));
      functions.replaceChildren(shown(functionsText(health.build)));
      // Point the examples at a function that exists when the app has no `run`.
      const names = health.build?.functions;
      if (!fnTouched && names?.length > 0 && !names.includes('run') && fnInput.value === 'run') {
        fnInput.value = names[0];
        fnInput.dispatchEvent(new Event('input'));
        fnTouched = false;
      }
      active.replaceChildren(
        next.active_build_id
          ? h(
              'a',
              { href: appHref(next.id, 'builds', `/${next.active_build_id}`), title: next.active_build_id },
              shortId(next.active_build_id),
            )
          : 'none yet',
      );
      replicas.textContent = replicaText(stats);
      load.textContent = loadText(stats);
      updated.replaceChildren(timeEl(next.updated_at));
      problem.replaceChildren();
      if (next.state === 'failed') {
        problem.append(
          'The latest build failed; ',
          next.active_build_id ? 'the previous build keeps serving. ' : 'nothing is serving. ',
          h('a', { href: appHref(next.id, 'builds', `/${next.latest_build_id}`) }, 'See its log'),
        );
      }
      const running = stats ? stats.replicas.starting + stats.replicas.ready : 0;
      if (next.state === 'active' && health.startProblem && running === 0) {
        problem.append(
          h('strong', {}, 'Its replicas cannot start. '),
          'The last attempt: ',
          h('code', { class: 'start-problem' }, health.startProblem),
          ' (from the app log: ',
          h('code', {}, `ferry logs ${next.id}`),
          ')',
        );
      } else if (next.active_build_id && health.functions?.length === 0) {
        problem.append(
          h('strong', {}, 'No public function: '),
          'the active build exports none, so nothing can be called. Export a function (its name not starting with "_") from the entry.',
        );
      }
      if (health.error && health.error.name !== 'AbortError') problem.append(errorText(health.error));
      if (statsError) problem.append(errorText(statsError));
    },
  };
}

export async function renderApps(ctx) {
  ctx.setTitle('Apps');
  const list = h('div', { class: 'cards' });
  const empty = h(
    'div',
    { class: 'empty', hidden: true },
    h('p', {}, 'No apps yet. Deploy one from a folder holding ferry.toml:'),
    h('pre', {}, h('code', {}, `npx ferry deploy examples/hello`)),
  );
  ctx.main.append(
    h(
      'header',
      { class: 'page-head' },
      h('div', { class: 'title-row' }, h('h1', { tabindex: '-1' }, 'Apps')),
      h('p', { class: 'lead' }, 'Every app of the project, its replicas and how to call it. Updates every 5 seconds.'),
    ),
    empty,
    list,
  );
  // Below the apps: the Ferry processes serving them (GET /v2/cluster).
  const cluster = clusterSection(ctx.signal);
  ctx.main.append(cluster.section);
  const cards = new Map();
  const runOrigin = await runAddress();

  async function refresh() {
    const apps = await listApps({ signal: ctx.signal, fresh: true });
    empty.hidden = apps.length > 0;
    const stats = await Promise.all(
      apps.map((app) =>
        api(`/apps/${encodeURIComponent(app.id)}/stats`, { query: { minutes: 1 }, signal: ctx.signal }).then(
          (s) => [s, null],
          (err) => [null, err],
        ),
      ),
    );
    for (const app of apps) if (!cards.has(app.id)) cards.set(app.id, appCard(app, runOrigin));
    const health = await Promise.all(apps.map((app) => appHealth(cards.get(app.id), app)));
    apps.forEach((app, i) => {
      const [s, err] = stats[i];
      cards.get(app.id).update(app, s, err?.name === 'AbortError' ? null : err, health[i]);
    });
    // Keep the cards in the API's order (by name), adding new ones; untouched when nothing changed, so
    // keyboard focus inside a card survives the refresh.
    const wanted = apps.map((app) => cards.get(app.id).card);
    if (wanted.length !== list.children.length || wanted.some((card, i) => list.children[i] !== card)) {
      list.replaceChildren(...wanted);
    }
  }

  /** Why the app may not serve: its last replica start failure, and its active build's public functions. */
  async function appHealth(entry, app) {
    try {
      if (app.active_build_id && entry.build?.id !== app.active_build_id) {
        entry.build = await api(
          `/apps/${encodeURIComponent(app.id)}/builds/${encodeURIComponent(app.active_build_id)}`,
          { signal: ctx.signal },
        );
      }
      const startProblem = await entry.watchStarts(ctx.signal);
      return { startProblem, build: entry.build, functions: entry.build?.functions ?? null, error: null };
    } catch (error) {
      return { startProblem: null, build: entry.build, functions: entry.build?.functions ?? null, error };
    }
  }

  await Promise.all([refresh(), cluster.refresh()]);
  ctx.every(5000, () => Promise.all([refresh(), cluster.refresh()]));
}
