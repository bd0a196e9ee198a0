// The cluster section of the Apps page: every Ferry process (node) sharing the store, from GET /v2/cluster,
// with its role, version, address and load. The apps listed per node are the signed-in project's only.
import { api } from '../api.js';
import { errorText, h, relativeTime, replaceKeepingFocus, tableEl, timeEl } from '../ui.js';

const HEAD = ['Node', 'Role', 'Version', 'Address', 'Runs in flight', 'Async backlog', 'Replicas', 'Apps', 'Started'];

/** A lease ended on purpose is the epoch (the node stopped); else it ran out at that time. */
function ended(leaseUntil) {
  return Date.parse(leaseUntil) === 0 ? 'stopped' : `lease ran out ${relativeTime(leaseUntil)}`;
}

function num(value) {
  return h('td', { class: 'num' }, value === null || value === undefined ? '—' : String(value));
}

function nodeRow(node, answering) {
  const load = node.load;
  const replicas = load ? `${load.replicas_ready} ready, ${load.replicas_starting} starting` : '—';
  const apps =
    node.apps.length > 0
      ? node.apps.map((a) => `${a.app_id} (${a.replicas_ready + a.replicas_starting})`).join(', ')
      : '—';
  const cells = [
    h(
      'td',
      { class: 'node', title: node.hostname && node.pid ? `${node.hostname}, pid ${node.pid}` : null },
      h('code', {}, node.id),
      answering ? h('span', { class: 'hint' }, ' (this page)') : null,
    ),
    h('td', {}, node.role ?? '—'),
    h('td', {}, node.version ?? '—'),
    h('td', { class: 'address' }, node.url ? h('code', {}, node.url) : '—'),
    num(load?.runs_in_flight),
    num(load?.async_backlog),
    h('td', {}, replicas),
    h('td', { class: 'apps' }, apps),
    h('td', {}, timeEl(node.started_at)),
  ];
  // Each value under its column's name where the table becomes one card per node (narrow screens).
  cells.forEach((cell, i) => {
    cell.setAttribute('data-label', HEAD[i]);
  });
  return h('tr', { 'data-node': node.id }, cells);
}

/** The section and its refresh; the page calls `refresh` on its own timer. */
export function clusterSection(signal) {
  const summary = h('p', { class: 'hint' });
  const body = h('tbody', {});
  const expired = h('p', { class: 'hint', hidden: true });
  const problem = h('p', { class: 'card-problem' });
  const section = h(
    'section',
    { class: 'cluster', 'aria-labelledby': 'cluster-heading' },
    h('h2', { id: 'cluster-heading' }, 'Cluster'),
    summary,
    tableEl({ caption: 'Ferry processes sharing the store', head: HEAD, body, className: 'cluster-nodes' }),
    expired,
    problem,
  );

  async function refresh() {
    try {
      const view = await api('/v2/cluster', { absolute: true, signal });
      summary.textContent =
        view.nodes.length === 1
          ? 'One Ferry process serves this store.'
          : `${view.nodes.length} Ferry processes share this store.`;
      replaceKeepingFocus(body, ...view.nodes.map((node) => nodeRow(node, node.id === view.node)));
      expired.hidden = view.expired.length === 0;
      expired.textContent = `Stopped or lease ran out, not removed yet: ${view.expired
        .map((node) => `${node.id} (${ended(node.lease_until)})`)
        .join(', ')}`;
      problem.replaceChildren();
    } catch (err) {
      if (err?.name !== 'AbortError') problem.replaceChildren(errorText(err));
    }
  }

  return { section, refresh };
}
