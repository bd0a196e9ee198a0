// Secrets: set (create or replace), list (names and times only: values never come back) and delete.
import { api } from '../api.js';
import { announce, confirmButton, errorBox, errorText, h, replaceKeepingFocus, tableEl, timeEl } from '../ui.js';

const NAME = /^[A-Za-z_][A-Za-z0-9_]{0,127}$/;

export async function renderSecrets(ctx) {
  ctx.setTitle('Secrets');
  const name = h('input', {
    id: 'secret-name',
    required: true,
    maxlength: '128',
    pattern: '[A-Za-z_][A-Za-z0-9_]{0,127}',
    autocomplete: 'off',
    spellcheck: 'false',
    class: 'mono',
    'aria-describedby': 'secret-name-hint',
  });
  const value = h('textarea', {
    id: 'secret-value',
    rows: '3',
    autocomplete: 'off',
    spellcheck: 'false',
    class: 'mono',
    'aria-describedby': 'secret-value-hint',
  });
  const problem = h('div', {});
  const submit = h('button', { type: 'submit', class: 'primary' }, 'Save secret');
  const form = h(
    'form',
    { class: 'card form', 'aria-labelledby': 'set-secret' },
    h('h2', { id: 'set-secret' }, 'Set a secret'),
    h(
      'p',
      { class: 'field' },
      h('label', { for: 'secret-name' }, 'Name'),
      name,
      h(
        'span',
        { id: 'secret-name-hint', class: 'hint' },
        'Letters, digits and _, not starting with a digit. Names starting with FERRY_ are reserved.',
      ),
    ),
    h(
      'p',
      { class: 'field' },
      h('label', { for: 'secret-value' }, 'Value'),
      value,
      h(
        'span',
        { id: 'secret-value-hint', class: 'hint' },
        'Stored encrypted; never shown again. An existing secret of that name is replaced.',
      ),
    ),
    h('div', { class: 'actions' }, submit),
    problem,
  );
  const body = h('tbody', {});
  const listProblem = h('div', {});
  ctx.main.append(
    h(
      'header',
      { class: 'page-head' },
      h('div', { class: 'title-row' }, h('h1', { tabindex: '-1' }, 'Secrets')),
      h(
        'p',
        { class: 'lead' },
        'Project secrets reach replicas as environment variables. A change reaches new replicas only: redeploy to apply it at once.',
      ),
    ),
    form,
    h('h2', {}, 'Secrets of the project'),
    listProblem,
    tableEl({ caption: 'Secrets (names only)', head: ['Name', 'Created', 'Updated', 'Actions'], body }),
  );

  async function refresh() {
    const { secrets } = await api('/secrets', { signal: ctx.signal });
    const rows = secrets.map((s) =>
      h(
        'tr',
        { 'data-secret': s.name },
        h('td', { class: 'mono' }, s.name),
        h('td', {}, timeEl(s.created_at)),
        h('td', {}, timeEl(s.updated_at)),
        h(
          'td',
          {},
          confirmButton({
            label: 'Delete',
            ariaLabel: `Delete ${s.name}`,
            question: `Delete ${s.name}?`,
            confirmLabel: 'Yes, delete',
            async onConfirm() {
              await api(`/secrets/${encodeURIComponent(s.name)}`, { method: 'DELETE' });
              announce(`Secret ${s.name} deleted`);
              await refresh();
              name.focus();
            },
          }),
        ),
      ),
    );
    if (rows.length === 0) rows.push(h('tr', {}, h('td', { colspan: '4', class: 'empty-row' }, 'No secrets.')));
    replaceKeepingFocus(body, rows);
  }

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    problem.replaceChildren();
    const key = name.value.trim();
    if (!NAME.test(key)) {
      problem.replaceChildren(errorText(new Error('The name must match [A-Za-z_][A-Za-z0-9_]*.')));
      name.focus();
      return;
    }
    submit.disabled = true;
    try {
      await api(`/secrets/${encodeURIComponent(key)}`, { method: 'PUT', body: { value: value.value } });
      value.value = '';
      name.value = '';
      announce(`Secret ${key} saved`);
      await refresh();
    } catch (err) {
      problem.replaceChildren(errorText(err));
    } finally {
      submit.disabled = false;
    }
  });

  try {
    await refresh();
  } catch (err) {
    listProblem.replaceChildren(errorBox(err));
  }
}
