// An app's settings: its scaling, changed without a build (PATCH .../apps/{app}), and deleting the app.
import { api } from '../api.js';
import { appHeader, listApps } from '../shared.js';
import { announce, confirmButton, errorBox, errorText, h, replaceKeepingFocus } from '../ui.js';

const FIELDS = [
  ['min_replicas', 'Minimum replicas', 0, 100],
  ['max_replicas', 'Maximum replicas', 1, 100],
  ['replica_concurrency', 'Runs per replica', 1, 1000],
  ['cooldown', 'Cooldown (seconds)', 0, 86400],
  ['response_grace_period', 'Response grace period (seconds)', 1, 86400],
];

export async function renderSettings(ctx) {
  const appId = ctx.params[0];
  ctx.setTitle(`Settings of ${appId}`);
  const origin = h('p', { class: 'hint', id: 'scaling-origin' });
  const status = h('p', { role: 'status', class: 'form-status' });
  const inputs = Object.fromEntries(
    FIELDS.map(([key, , min, max]) => [
      key,
      h('input', { id: `scale-${key}`, name: key, type: 'number', min: String(min), max: String(max), required: true }),
    ]),
  );
  const save = h('button', { type: 'submit', class: 'solid' }, 'Save scaling');
  const reset = h('button', { type: 'button' }, 'Use ferry.toml again');
  const form = h(
    'form',
    { class: 'scaling-form', 'aria-labelledby': 'scaling-title' },
    FIELDS.map(([key, label]) =>
      h('p', { class: 'inline-field' }, h('label', { for: `scale-${key}` }, label), inputs[key]),
    ),
    h('p', {}, save, ' ', reset),
    status,
  );
  const danger = h('div', {});
  ctx.main.append(
    appHeader(ctx, appId, 'settings', `Settings of ${appId}`),
    h(
      'section',
      { 'aria-labelledby': 'scaling-title' },
      h('h2', { id: 'scaling-title' }, 'Scaling'),
      h(
        'p',
        { class: 'lead' },
        'In force at once on every node, without a build, and kept over later deploys until you go back to ferry.toml.',
      ),
      origin,
      form,
    ),
    h('section', { 'aria-labelledby': 'delete-title' }, h('h2', { id: 'delete-title' }, 'Delete the app'), danger),
  );
  const base = `/apps/${encodeURIComponent(appId)}`;

  let overridden = false;
  // The values as loaded: only fields changed from these are sent, so saving one field does not pin the
  // others (still from ferry.toml) as overrides.
  let shown = {};
  function show(app) {
    overridden = Boolean(app.scaling_override);
    for (const [key] of FIELDS) inputs[key].value = app.scaling ? String(app.scaling[key]) : '';
    shown = Object.fromEntries(FIELDS.map(([key]) => [key, inputs[key].value]));
    origin.textContent = !app.scaling
      ? 'The app has no ready build yet: saved values apply to its first one.'
      : app.scaling_override
        ? `Set here: ${Object.keys(app.scaling_override).join(', ')} (the rest from the active build’s ferry.toml).`
        : 'From the active build’s ferry.toml.';
    reset.disabled = !overridden;
  }

  async function submit(body, done) {
    save.disabled = true;
    reset.disabled = true;
    status.replaceChildren();
    try {
      const app = await api(base, { method: 'PATCH', body, signal: ctx.signal });
      show(app);
      status.textContent = done;
      announce(done);
    } catch (err) {
      status.replaceChildren(errorText(err));
    } finally {
      save.disabled = false;
      reset.disabled = !overridden;
    }
  }

  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const scaling = {};
    for (const [key] of FIELDS) {
      if (inputs[key].value !== '' && inputs[key].value !== shown[key]) scaling[key] = Number(inputs[key].value);
    }
    if (Object.keys(scaling).length === 0) {
      status.textContent = 'Nothing changed';
      announce('Nothing changed');
      return;
    }
    void submit({ scaling }, 'Scaling saved');
  });
  reset.addEventListener('click', () => void submit({ scaling: null }, 'Scaling from ferry.toml again'));

  replaceKeepingFocus(
    danger,
    h(
      'p',
      {},
      'Calls to it are refused at once; its queued runs are cancelled; its builds and run history are deleted. ',
    ),
    confirmButton({
      label: 'Delete app',
      ariaLabel: `Delete app ${appId}`,
      question: `Delete ${appId} with its builds and run history?`,
      confirmLabel: `Delete ${appId}`,
      async onConfirm() {
        await api(base, { method: 'DELETE', signal: ctx.signal });
        announce(`${appId} deleted`);
        await listApps({ signal: ctx.signal, fresh: true }).catch(() => []);
        location.hash = '#/apps';
      },
    }),
  );

  try {
    show(await api(base, { signal: ctx.signal }));
  } catch (err) {
    ctx.main.append(errorBox(err));
  }
}
