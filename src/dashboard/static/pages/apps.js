// Apps: each app's state, active build, replicas and limits, run URL and a copyable curl example per mode.
import { api, session } from '../api.js';
import { appHref, listApps } from '../shared.js';
import { copyButton, errorText, h, shortId, stateBadge, timeEl } from '../ui.js';

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

/** The state shown: the API's, except that an active app with no replica running is "scaled to zero". */
function shownState(app, stats) {
  if (app.state === 'active' && stats && stats.replicas.starting + stats.replicas.ready === 0) {
    return stateBadge('zero', 'scaled to zero');
  }
  return stateBadge(app.state);
}

function appCard(app) {
  const slug = `app-${app.id}`;
  const runBase = `${location.origin}/v4/${session.projectId}/${app.id}`;
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
  const problem = h('p', { class: 'card-problem' });

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
    ),
  );

  return {
    card,
    update(next, stats, statsError) {
      state.replaceChildren(shownState(next, stats));
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
  const cards = new Map();

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
    apps.forEach((app, i) => {
      let entry = cards.get(app.id);
      if (!entry) {
        entry = appCard(app);
        cards.set(app.id, entry);
      }
      const [s, err] = stats[i];
      entry.update(app, s, err?.name === 'AbortError' ? null : err);
    });
    // Keep the cards in the API's order (by name), adding new ones; untouched when nothing changed, so
    // keyboard focus inside a card survives the refresh.
    const wanted = apps.map((app) => cards.get(app.id).card);
    if (wanted.length !== list.children.length || wanted.some((card, i) => list.children[i] !== card)) {
      list.replaceChildren(...wanted);
    }
  }

  await refresh();
  ctx.every(5000, refresh);
}
