// Pieces several pages share: the app picker and tabs of the per-app pages, and the list of apps.
import { api, session } from './api.js';
import { h } from './ui.js';

const LAST_APP = 'ferry.app';

let appsCache = { at: 0, project: '', apps: null };

/**
 * The project's apps, cached for a few seconds so moving between pages stays fast (per project: a sign-in
 * link can switch the tab to another one).
 */
export async function listApps({ signal, fresh = false } = {}) {
  const fromCache = appsCache.apps && appsCache.project === session.projectId && Date.now() - appsCache.at < 5000;
  if (!fresh && fromCache) return appsCache.apps;
  const project = session.projectId;
  const { apps } = await api('/apps', { signal });
  appsCache = { at: Date.now(), project, apps };
  return apps;
}

export function rememberApp(appId) {
  sessionStorage.setItem(LAST_APP, appId);
}

export function lastApp() {
  return sessionStorage.getItem(LAST_APP);
}

export function appHref(appId, section, rest = '') {
  return `#/apps/${encodeURIComponent(appId)}/${section}${rest}`;
}

const SECTIONS = [
  ['builds', 'Builds'],
  ['runs', 'Runs'],
  ['charts', 'Charts'],
  ['schedules', 'Schedules'],
  ['settings', 'Settings'],
];

/**
 * The heading block of a per-app page: breadcrumb, title, an app picker (moves to the same section of
 * another app) and tabs for the app's sections.
 */
export function appHeader(ctx, appId, section, title) {
  rememberApp(appId);
  const picker = h('select', { id: 'app-picker', 'aria-label': 'App' }, h('option', { value: appId }, appId));
  picker.addEventListener('change', () => {
    location.hash = appHref(picker.value, section);
  });
  listApps({ signal: ctx.signal })
    .then((apps) => {
      const names = apps.map((a) => a.id);
      if (!names.includes(appId)) names.unshift(appId);
      picker.replaceChildren(...names.map((n) => h('option', { value: n, selected: n === appId }, n)));
    })
    .catch(() => {});
  return h(
    'header',
    { class: 'page-head' },
    h(
      'nav',
      { class: 'crumbs', 'aria-label': 'Breadcrumb' },
      h('a', { href: '#/apps' }, 'Apps'),
      ' / ',
      h('span', {}, appId),
    ),
    h(
      'div',
      { class: 'title-row' },
      h('h1', { tabindex: '-1' }, title),
      h('label', { class: 'inline', for: 'app-picker' }, 'App ', picker),
    ),
    h(
      'nav',
      { class: 'tabs', 'aria-label': `${appId} sections` },
      SECTIONS.map(([key, label]) =>
        h('a', { href: appHref(appId, key), 'aria-current': key === section ? 'page' : null }, label),
      ),
    ),
  );
}
