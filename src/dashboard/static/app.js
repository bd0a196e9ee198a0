// The Ferry dashboard: sign-in, the page shell and the hash router. Every page talks to the same /v2 API
// as the CLI, with the signed-in token; the server gives this page no privileges of its own.
import { api, restoreSession, session, signIn, signOut } from './api.js';
import { renderApps } from './pages/apps.js';
import { renderBuild, renderBuilds } from './pages/builds.js';
import { renderCharts } from './pages/charts.js';
import { renderKeys } from './pages/keys.js';
import { renderRun, renderRuns } from './pages/runs.js';
import { renderSchedules } from './pages/schedules.js';
import { renderSecrets } from './pages/secrets.js';
import { renderSettings } from './pages/settings.js';
import { renderVolumeFiles, renderVolumes } from './pages/volumes.js';
import { appHref, lastApp, listApps } from './shared.js';
import { errorBox, errorText, h, shown } from './ui.js';

const main = document.getElementById('main');
const shell = document.getElementById('shell');
const projectLabel = document.getElementById('project');

/** Top-level pages that belong to one app open that app: the last one used, else the first. */
const pickApp = (section) => async (ctx) => {
  const apps = await listApps({ signal: ctx.signal, fresh: true });
  const remembered = lastApp();
  const app = apps.find((a) => a.id === remembered) ?? apps[0];
  if (app) {
    location.replace(appHref(app.id, section));
    return;
  }
  ctx.setTitle(section[0].toUpperCase() + section.slice(1));
  ctx.main.append(
    h('h1', { tabindex: '-1' }, section[0].toUpperCase() + section.slice(1)),
    h('p', {}, 'No apps yet. Deploy one first: ', h('code', {}, 'npx ferry deploy examples/hello')),
  );
};

const ROUTES = [
  [/^\/apps$/, renderApps, 'apps'],
  [/^\/apps\/([^/]+)\/builds$/, renderBuilds, 'apps'],
  [/^\/apps\/([^/]+)\/builds\/([^/]+)$/, renderBuild, 'apps'],
  [/^\/apps\/([^/]+)\/runs$/, renderRuns, 'runs'],
  [/^\/apps\/([^/]+)\/runs\/([^/]+)$/, renderRun, 'runs'],
  [/^\/apps\/([^/]+)\/charts$/, renderCharts, 'charts'],
  [/^\/apps\/([^/]+)\/schedules$/, renderSchedules, 'apps'],
  [/^\/apps\/([^/]+)\/settings$/, renderSettings, 'apps'],
  [/^\/runs$/, pickApp('runs'), 'runs'],
  [/^\/charts$/, pickApp('charts'), 'charts'],
  [/^\/keys$/, renderKeys, 'keys'],
  [/^\/secrets$/, renderSecrets, 'secrets'],
  [/^\/volumes$/, renderVolumes, 'volumes'],
  [/^\/volumes\/([^/]+)$/, renderVolumeFiles, 'volumes'],
];

let current = null;
let firstRender = true;

function parseHash() {
  const raw = location.hash.replace(/^#/, '') || '/apps';
  const q = raw.indexOf('?');
  return { path: q < 0 ? raw : raw.slice(0, q), query: new URLSearchParams(q < 0 ? '' : raw.slice(q + 1)) };
}

function makeContext(path, params, query) {
  const controller = new AbortController();
  const { signal } = controller;
  const sleep = (ms) =>
    new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal.addEventListener('abort', () => {
        clearTimeout(timer);
        resolve();
      });
    });
  return {
    controller,
    main,
    params,
    query,
    signal,
    sleep,
    setTitle(title) {
      document.title = `${title} · Ferry`;
    },
    /** Updates the query of the current page in the URL without rendering the page again. */
    setQuery(values) {
      const next = new URLSearchParams();
      for (const [k, v] of Object.entries(values)) if (v) next.set(k, v);
      const text = next.toString();
      history.replaceState(null, '', `#${path}${text ? `?${text}` : ''}`);
    },
    /** Calls `fn` every `ms` after the previous call ended, while the page is shown and the tab visible. */
    every(ms, fn) {
      (async () => {
        while (!signal.aborted) {
          await sleep(ms);
          if (signal.aborted) return;
          if (document.hidden) continue;
          try {
            await fn();
          } catch (err) {
            if (err?.name !== 'AbortError') console.warn('refresh failed', err);
          }
        }
      })();
    },
  };
}

async function route() {
  if (!session.token) return;
  const { path, query } = parseHash();
  let match = null;
  let page = null;
  let section = '';
  for (const [re, render, nav] of ROUTES) {
    match = re.exec(path);
    if (match) {
      page = render;
      section = nav;
      break;
    }
  }
  current?.controller.abort();
  const params = match ? match.slice(1).map(decodeURIComponent) : [];
  const ctx = makeContext(path, params, query);
  current = ctx;
  for (const link of document.querySelectorAll('#nav a')) {
    if (link.dataset.section === section) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  main.replaceChildren();
  main.setAttribute('aria-busy', 'true');
  try {
    if (!page) {
      ctx.setTitle('Not found');
      main.append(h('h1', { tabindex: '-1' }, 'Not found'), h('p', {}, h('a', { href: '#/apps' }, 'Go to the apps')));
    } else {
      await page(ctx);
    }
  } catch (err) {
    if (err?.name !== 'AbortError' && current === ctx) main.append(errorBox(err));
  } finally {
    if (current === ctx) main.removeAttribute('aria-busy');
  }
  // Move focus to the new page's heading, so keyboard and screen-reader users start there.
  if (!firstRender && current === ctx) main.querySelector('h1')?.focus({ preventScroll: false });
  firstRender = false;
}

function showSignIn(problem) {
  current?.controller.abort();
  current = null;
  shell.hidden = true;
  document.title = 'Sign in · Ferry';
  const token = h('textarea', {
    id: 'token',
    name: 'token',
    rows: '4',
    required: true,
    autocomplete: 'off',
    spellcheck: 'false',
    class: 'mono',
    'aria-describedby': 'token-hint',
  });
  const message = h('div', { id: 'sign-in-problem' }, problem ? errorText(problem) : null);
  const submit = h('button', { type: 'submit', class: 'primary' }, 'Sign in');
  const form = h(
    'form',
    { class: 'card form sign-in', 'aria-labelledby': 'sign-in-title' },
    h('h1', { id: 'sign-in-title' }, 'Sign in to Ferry'),
    h(
      'p',
      { class: 'field' },
      h('label', { for: 'token' }, 'Service-account token'),
      token,
      h(
        'span',
        { id: 'token-hint', class: 'hint' },
        'A token with the manage scope: ',
        h('code', {}, 'npx ferry admin bootstrap'),
        ' prints one, with a sign-in link, or create one on the API keys page. It stays in this tab only (session storage) and is sent to this server only.',
      ),
    ),
    h('div', { class: 'actions' }, submit),
    message,
  );
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    submit.disabled = true;
    message.replaceChildren();
    try {
      await signIn(token.value);
      await start();
    } catch (err) {
      message.replaceChildren(errorText(err));
      token.focus();
    } finally {
      submit.disabled = false;
    }
  });
  main.replaceChildren(form);
  token.focus();
}

async function start() {
  shell.hidden = false;
  projectLabel.textContent = session.projectId;
  api('')
    .then((project) => {
      projectLabel.replaceChildren(shown(`${project.name} (${project.id})`));
    })
    .catch(() => {});
  if (!location.hash.startsWith('#/')) history.replaceState(null, '', '#/apps');
  await route();
}

// A sign-in link opened in a tab that already shows the dashboard changes only the fragment: no reload, so
// boot() does not run again. Take the token from here too.
window.addEventListener('hashchange', () => {
  if (!signInFromLink()) void route();
});
window.addEventListener('ferry:unauthenticated', (event) => {
  if (!sessionStorage.getItem('ferry.token')) return; // a failed sign-in says so itself
  signOut();
  showSignIn(new Error(`Signed out: the server refused the token (${event.detail.code}). Sign in again.`));
});
document.getElementById('sign-out').addEventListener('click', () => {
  signOut();
  history.replaceState(null, '', location.pathname);
  showSignIn();
});
document.getElementById('skip').addEventListener('click', (event) => {
  event.preventDefault();
  (main.querySelector('h1') ?? main).focus();
});

/**
 * A sign-in link is /#token=<token>. The fragment is never sent to the server (so the token is in no
 * request line, proxy or access log); it is read here, kept in session storage, and removed from the
 * address bar and history at once, before anything else runs. Returns false when the URL holds no link.
 */
function signInFromLink() {
  const link = /^#token=([^&]+)/.exec(location.hash);
  if (!link) return false;
  history.replaceState(null, '', `${location.pathname}${location.search}#/apps`);
  let token = '';
  try {
    token = decodeURIComponent(link[1]);
  } catch {
    token = link[1];
  }
  void (async () => {
    try {
      await signIn(token);
      await start();
    } catch (err) {
      showSignIn(err);
    }
  })();
  return true;
}

async function boot() {
  if (signInFromLink()) return;
  if (restoreSession()) {
    if (session.expiresAt && session.expiresAt < Date.now()) {
      signOut();
      showSignIn(new Error('The token of this session has expired. Sign in with a new one.'));
      return;
    }
    await start();
    return;
  }
  showSignIn();
}

void boot();
