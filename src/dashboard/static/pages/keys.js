// API keys: service accounts of the project. Create one with a name, an expiry date and scopes; its token
// is shown once (in this page's memory only) with a copy button; list, and revoke.
import { api, session, signOut } from '../api.js';
import {
  announce,
  confirmButton,
  copyButton,
  errorBox,
  errorText,
  formatDate,
  formatUtcTime,
  h,
  replaceKeepingFocus,
  tableEl,
  timeEl,
} from '../ui.js';

const DAY = 86_400_000;
const isoDay = (ms) => new Date(ms).toISOString().slice(0, 10);

export async function renderKeys(ctx) {
  ctx.setTitle('API keys');
  const name = h('input', { id: 'sa-name', name: 'name', required: true, maxlength: '100', autocomplete: 'off' });
  const expires = h('input', {
    id: 'sa-expires',
    name: 'expires',
    type: 'date',
    required: true,
    value: isoDay(Date.now() + 30 * DAY),
    min: isoDay(Date.now()),
    max: isoDay(Date.now() + 3650 * DAY),
    'aria-describedby': 'sa-expires-hint',
  });
  const scope = (value, label) =>
    h(
      'p',
      { class: 'check' },
      h('input', { type: 'checkbox', id: `sa-scope-${value}`, name: 'scopes', value, checked: true }),
      h('label', { for: `sa-scope-${value}` }, h('strong', {}, value), ` ${label}`),
    );
  const formProblem = h('div', {});
  const created = h('div', { id: 'new-token' });
  const submit = h('button', { type: 'submit', class: 'primary' }, 'Create service account');
  const form = h(
    'form',
    { class: 'card form', 'aria-labelledby': 'create-sa' },
    h('h2', { id: 'create-sa' }, 'Create a service account'),
    h('p', { class: 'field' }, h('label', { for: 'sa-name' }, 'Name'), name),
    h(
      'p',
      { class: 'field' },
      h('label', { for: 'sa-expires' }, 'Expires on'),
      expires,
      h('span', { id: 'sa-expires-hint', class: 'hint' }, 'At the end of that day (UTC); at most 10 years.'),
    ),
    h(
      'fieldset',
      {},
      h('legend', {}, 'Scopes'),
      scope('manage', 'the management API and this dashboard'),
      scope('run', 'call functions on the run endpoint'),
    ),
    h('div', { class: 'actions' }, submit),
    formProblem,
  );
  const body = h('tbody', {});
  const listProblem = h('div', {});
  ctx.main.append(
    h(
      'header',
      { class: 'page-head' },
      h('div', { class: 'title-row' }, h('h1', { tabindex: '-1' }, 'API keys')),
      h(
        'p',
        { class: 'lead' },
        'Service accounts and their tokens. Use one per environment, set an expiry date, and store tokens as secrets.',
      ),
    ),
    created,
    form,
    h('h2', {}, 'Service accounts'),
    listProblem,
    tableEl({
      caption: 'Service accounts',
      head: ['Name', 'Scopes', 'Created', 'Expires', 'Last used', 'Status', 'Actions'],
      body,
      className: 'keys',
    }),
  );

  async function refresh() {
    const { service_accounts: accounts } = await api('/service-accounts', { signal: ctx.signal });
    accounts.sort((a, b) => (a.created_at < b.created_at ? 1 : -1));
    const rows = accounts.map((a) => {
      const you = a.id === session.accountId;
      const status = a.revoked_at
        ? h('span', { class: 'badge state-cancelled' }, 'revoked')
        : a.expired
          ? h('span', { class: 'badge state-failure' }, 'expired')
          : h('span', { class: 'badge state-success' }, 'active');
      return h(
        'tr',
        {
          'data-account-id': a.id,
          'data-name': a.name,
          class: a.expired || a.revoked_at ? 'inactive' : null,
        },
        h(
          'td',
          {},
          h('span', { class: 'sa-name' }, a.name),
          you ? h('span', { class: 'badge you', title: 'The token of this session' }, 'you') : null,
          h('div', { class: 'mono hint' }, a.id),
        ),
        h('td', {}, a.scopes.join(', ')),
        h('td', {}, h('time', { datetime: a.created_at }, formatDate(a.created_at))),
        h(
          'td',
          {},
          h('time', { datetime: a.expires_at, title: a.expires_at }, formatUtcTime(a.expires_at)),
          a.expired ? h('span', { class: 'hint' }, ' (expired)') : null,
        ),
        h('td', {}, a.last_used_at ? timeEl(a.last_used_at) : 'never'),
        h('td', {}, status),
        h(
          'td',
          {},
          a.revoked_at
            ? '—'
            : confirmButton({
                label: 'Revoke',
                ariaLabel: `Revoke ${a.name}`,
                question: you ? 'Revoke the token of this session? You will be signed out.' : `Revoke ${a.name}?`,
                confirmLabel: 'Yes, revoke',
                async onConfirm() {
                  await api(`/service-accounts/${encodeURIComponent(a.id)}`, { method: 'DELETE' });
                  announce(`${a.name} revoked; its token no longer works`);
                  if (you) {
                    signOut();
                    location.reload();
                    return;
                  }
                  await refresh();
                  body.querySelector(`tr[data-account-id="${CSS.escape(a.id)}"] td`)?.setAttribute('tabindex', '-1');
                  body.querySelector(`tr[data-account-id="${CSS.escape(a.id)}"] td`)?.focus();
                },
              }),
        ),
      );
    });
    if (rows.length === 0) rows.push(h('tr', {}, h('td', { colspan: '7', class: 'empty-row' }, 'None.')));
    replaceKeepingFocus(body, rows);
  }

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    formProblem.replaceChildren();
    const scopes = [...form.querySelectorAll('input[name="scopes"]:checked')].map((el) => el.value);
    if (scopes.length === 0) {
      formProblem.replaceChildren(errorText(new Error('Choose at least one scope.')));
      return;
    }
    submit.disabled = true;
    try {
      const account = await api('/service-accounts', {
        method: 'POST',
        body: { name: name.value.trim(), expires_at: expires.value, scopes },
      });
      showToken(account);
      name.value = '';
      await refresh();
    } catch (err) {
      formProblem.replaceChildren(errorText(err));
    } finally {
      submit.disabled = false;
    }
  });

  // The token exists only in this panel: not in storage, not in the URL, gone on reload or "Done".
  function showToken(account) {
    const field = h('input', {
      id: 'token-value',
      readonly: true,
      value: account.token,
      class: 'mono token',
      spellcheck: 'false',
      autocomplete: 'off',
    });
    const done = h('button', { type: 'button' }, 'Done, I have stored it');
    done.addEventListener('click', () => {
      created.replaceChildren();
      name.focus();
    });
    const panel = h(
      'section',
      { class: 'card token-panel', 'aria-labelledby': 'token-title' },
      h('h2', { id: 'token-title', tabindex: '-1' }, `Token for ${account.name}`),
      h(
        'p',
        { class: 'warning', role: 'alert' },
        h('strong', {}, 'Copy this token now. '),
        'It will not be shown again: Ferry keeps only its hash. Store it as a secret; never commit it.',
      ),
      h('p', { class: 'field' }, h('label', { for: 'token-value' }, 'Token'), field),
      h(
        'div',
        { class: 'actions' },
        copyButton(() => field.value, `token for ${account.name}`),
        done,
      ),
      h(
        'p',
        { class: 'hint' },
        `Scopes ${account.scopes.join(', ')}; expires ${formatUtcTime(account.expires_at)}. Project ${session.projectId}.`,
      ),
    );
    created.replaceChildren(panel);
    panel.querySelector('h2').focus();
    field.addEventListener('focus', () => field.select());
  }

  try {
    await refresh();
  } catch (err) {
    listProblem.replaceChildren(errorBox(err));
  }
  ctx.every(30_000, refresh);
}
