// An app's schedules: the [[schedules]] of its active build, each with its next tick and last run,
// paused, resumed or triggered here (POST .../schedules/{name}/pause|resume|trigger).
import { api } from '../api.js';
import { appHeader, appHref } from '../shared.js';
import { announce, errorBox, errorText, h, replaceKeepingFocus, shortId, stateBadge, tableEl, timeEl } from '../ui.js';

export async function renderSchedules(ctx) {
  const appId = ctx.params[0];
  ctx.setTitle(`Schedules of ${appId}`);
  const base = `/apps/${encodeURIComponent(appId)}/schedules`;
  const status = h('p', { role: 'status', class: 'form-status' });
  const region = h('div', {});
  ctx.main.append(
    appHeader(ctx, appId, 'schedules', `Schedules of ${appId}`),
    h(
      'p',
      { class: 'lead' },
      'Runs started on a timetable, from [[schedules]] in the active build’s ferry.toml. Updates every 10 seconds.',
    ),
    status,
    region,
  );

  async function act(name, action, done) {
    status.replaceChildren();
    try {
      const out = await api(`${base}/${encodeURIComponent(name)}/${action}`, { method: 'POST', signal: ctx.signal });
      const message = action === 'trigger' ? `${done}: run ${out.run_id}` : done;
      status.textContent = message;
      announce(message);
      await refresh();
    } catch (err) {
      status.replaceChildren(errorText(err));
    }
  }

  function row(s) {
    const toggle = h('button', { type: 'button' }, s.paused ? 'Resume' : 'Pause');
    toggle.setAttribute('aria-label', `${s.paused ? 'Resume' : 'Pause'} schedule ${s.name}`);
    toggle.addEventListener(
      'click',
      () => void act(s.name, s.paused ? 'resume' : 'pause', `${s.name} ${s.paused ? 'resumed' : 'paused'}`),
    );
    const trigger = h('button', { type: 'button', 'aria-label': `Run schedule ${s.name} now` }, 'Run now');
    trigger.addEventListener('click', () => void act(s.name, 'trigger', `${s.name} started`));
    return h(
      'tr',
      {},
      h('td', {}, h('strong', {}, s.name)),
      h('td', {}, h('code', {}, s.cron), s.timezone === 'UTC' ? '' : ` (${s.timezone})`),
      h('td', {}, h('code', {}, s.function)),
      h('td', {}, s.paused ? stateBadge('zero', 'paused') : s.next_tick_at ? timeEl(s.next_tick_at) : 'never'),
      h(
        'td',
        {},
        s.last_run
          ? [
              h('a', { href: appHref(appId, 'runs', `/${s.last_run.id}`) }, shortId(s.last_run.id)),
              ' ',
              stateBadge(s.last_run.state),
            ]
          : '—',
      ),
      h('td', {}, String(s.ticks_skipped)),
      h('td', {}, toggle, ' ', trigger),
    );
  }

  async function refresh() {
    let schedules;
    try {
      ({ schedules } = await api(base, { signal: ctx.signal }));
    } catch (err) {
      replaceKeepingFocus(region, errorBox(err));
      return;
    }
    if (schedules.length === 0) {
      replaceKeepingFocus(
        region,
        h('p', {}, 'The active build has no schedules. Add one to ferry.toml and deploy:'),
        h('pre', {}, h('code', {}, '[[schedules]]\nname = "nightly"\ncron = "0 3 * * *"\nfunction = "run"')),
      );
      return;
    }
    replaceKeepingFocus(
      region,
      tableEl({
        caption: `Schedules of ${appId}`,
        head: ['Name', 'When', 'Function', 'Next tick', 'Last run', 'Skipped ticks', 'Actions'],
        body: h('tbody', {}, schedules.map(row)),
      }),
    );
  }

  await refresh();
  ctx.every(10_000, refresh);
}
