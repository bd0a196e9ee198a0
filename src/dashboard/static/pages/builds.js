// Builds of an app (state, duration) and one build: its live log, its archive as a file tree, its ferry.toml.
import { api, streamEvents } from '../api.js';
import { appHeader, appHref } from '../shared.js';
import {
  announce,
  coded,
  confirmButton,
  errorBox,
  errorText,
  facts,
  formatBytes,
  formatDuration,
  h,
  replaceKeepingFocus,
  shortId,
  shown,
  stateBadge,
  tableEl,
  timeEl,
} from '../ui.js';

const FINAL = ['ready', 'failed', 'cancelled'];

function buildDuration(build) {
  if (build.duration_ms !== null && build.duration_ms !== undefined) return build.duration_ms;
  if (build.started_at && !build.finished_at) return Date.now() - Date.parse(build.started_at);
  return null;
}

export async function renderBuilds(ctx) {
  const appId = ctx.params[0];
  ctx.setTitle(`Builds of ${appId}`);
  const body = h('tbody', {});
  const pager = h('div', { class: 'pager' });
  ctx.main.append(
    appHeader(ctx, appId, 'builds', `Builds of ${appId}`),
    tableEl({
      caption: `Builds of ${appId}, newest first`,
      head: ['Build', 'State', 'Runtime', 'Files', 'Archive', 'Created', 'Duration', 'Error', 'Actions'],
      body,
    }),
    pager,
  );
  const pages = [];
  let before = ctx.query.get('before') ?? '';
  let activeId = null;

  /**
   * Activate (roll back to) a ready build that is not the active one; delete one that is neither active nor
   * being made. Each in a slot of its own (style.css `.row-actions`), so every row's Delete lines up, with
   * or without an Activate before it.
   */
  function buildActions(b) {
    if (b.id === activeId) return '';
    const base = `/apps/${encodeURIComponent(appId)}/builds/${encodeURIComponent(b.id)}`;
    const out = [];
    if (b.state === 'ready') {
      const activate = h('button', { type: 'button', 'aria-label': `Activate build ${shortId(b.id)}` }, 'Activate');
      activate.addEventListener('click', async () => {
        activate.disabled = true;
        try {
          await api(`${base}/activate`, { method: 'POST', signal: ctx.signal });
          announce(`Build ${shortId(b.id)} is now active`);
          await refresh();
        } catch (err) {
          activate.disabled = false;
          activate.after(errorText(err));
        }
      });
      out.push(h('span', { class: 'slot-activate' }, activate));
    }
    if (FINAL.includes(b.state)) {
      out.push(
        h(
          'span',
          { class: 'slot-delete' },
          confirmButton({
            label: 'Delete',
            ariaLabel: `Delete build ${shortId(b.id)}`,
            question: 'Delete this build and its files?',
            confirmLabel: 'Delete the build',
            async onConfirm() {
              await api(base, { method: 'DELETE', signal: ctx.signal });
              announce(`Build ${shortId(b.id)} deleted`);
              await refresh();
            },
          }),
        ),
      );
    }
    return out.length === 0 ? '' : h('div', { class: 'row-actions' }, out);
  }

  async function refresh() {
    const [app, list] = await Promise.all([
      api(`/apps/${encodeURIComponent(appId)}`, { signal: ctx.signal }),
      api(`/apps/${encodeURIComponent(appId)}/builds`, { query: { limit: 25, before }, signal: ctx.signal }),
    ]);
    activeId = app.active_build_id;
    const rows = list.builds.map((b) =>
      h(
        'tr',
        { 'data-build-id': b.id },
        h(
          'td',
          {},
          h(
            'a',
            { href: appHref(appId, 'builds', `/${b.id}`), class: 'mono', title: b.id, 'data-key': b.id },
            shortId(b.id),
          ),
          b.id === activeId ? h('span', { class: 'badge active-build' }, 'active') : null,
        ),
        h('td', {}, stateBadge(b.state)),
        h('td', {}, b.runtime ?? '—'),
        h('td', { class: 'num' }, String(b.file_count)),
        h('td', { class: 'num' }, formatBytes(b.archive_bytes)),
        h('td', {}, timeEl(b.created_at)),
        h('td', { class: 'num' }, formatDuration(buildDuration(b))),
        h(
          'td',
          { class: 'build-error' },
          b.error ? h('span', { class: 'error-text', title: b.error }, coded(b.error)) : '',
        ),
        h('td', { class: 'build-actions' }, buildActions(b)),
      ),
    );
    if (rows.length === 0) rows.push(h('tr', {}, h('td', { colspan: '9', class: 'empty-row' }, 'No builds.')));
    replaceKeepingFocus(body, rows);
    const older = h('button', { type: 'button', disabled: !list.next_before }, 'Older');
    older.addEventListener('click', () => {
      pages.push(before);
      before = list.next_before;
      ctx.setQuery({ before });
      void refresh();
    });
    const newer = h('button', { type: 'button', disabled: !before }, 'Newer');
    newer.addEventListener('click', () => {
      before = pages.pop() ?? '';
      ctx.setQuery({ before });
      void refresh();
    });
    replaceKeepingFocus(pager, newer, ' ', older);
  }
  await refresh();
  ctx.every(3000, refresh);
}

/** Files of the archive as nested folders: <details> per folder, so the keyboard opens and closes them. */
export function fileTree(files) {
  const root = { dirs: new Map(), files: [] };
  for (const file of files) {
    const parts = file.path.split('/');
    let node = root;
    for (const dir of parts.slice(0, -1)) {
      if (!node.dirs.has(dir)) node.dirs.set(dir, { dirs: new Map(), files: [] });
      node = node.dirs.get(dir);
    }
    node.files.push({ name: parts.at(-1), file });
  }
  const renderNode = (node, depth) =>
    h(
      'ul',
      { class: depth === 0 ? 'tree' : null, role: depth === 0 ? 'list' : null },
      [...node.dirs.entries()]
        .sort(([a], [b]) => a.localeCompare(b))
        .map(([name, child]) =>
          h(
            'li',
            { class: 'dir' },
            h('details', { open: depth < 2 }, h('summary', {}, `${name}/`), renderNode(child, depth + 1)),
          ),
        ),
      node.files
        .sort((a, b) => a.name.localeCompare(b.name))
        .map(({ name, file }) =>
          h(
            'li',
            { class: 'file', 'data-path': file.path },
            h('span', { class: 'file-name' }, name),
            h('span', { class: 'file-size', title: `${file.size} bytes, crc32 ${file.crc32}` }, formatBytes(file.size)),
          ),
        ),
    );
  return renderNode(root, 0);
}

export async function renderBuild(ctx) {
  const [appId, buildId] = ctx.params;
  ctx.setTitle(`Build ${shortId(buildId)} of ${appId}`);
  const meta = h('div', {});
  const actions = h('div', { class: 'actions' });
  const logState = h('p', { class: 'hint', role: 'status' }, 'Loading the log…');
  const log = h('pre', { class: 'log', tabindex: '0', 'aria-label': 'Build log' });
  const tree = h('div', {}, h('p', { class: 'hint' }, 'Loading the file list…'));
  const toml = h('pre', { class: 'code', tabindex: '0', 'aria-label': 'ferry.toml' });
  ctx.main.append(
    appHeader(ctx, appId, 'builds', `Build ${shortId(buildId)}`),
    h(
      'section',
      { 'aria-labelledby': 'build-summary' },
      h('h2', { id: 'build-summary', class: 'sr-only' }, 'Summary'),
      meta,
      actions,
    ),
    h(
      'div',
      { class: 'split' },
      h('section', { 'aria-labelledby': 'build-log' }, h('h2', { id: 'build-log' }, 'Log'), logState, log),
      h(
        'div',
        {},
        h('section', { 'aria-labelledby': 'build-files' }, h('h2', { id: 'build-files' }, 'Files'), tree),
        h('section', { 'aria-labelledby': 'build-toml' }, h('h2', { id: 'build-toml' }, 'ferry.toml'), toml),
      ),
    ),
  );

  let build;
  async function loadBuild() {
    build = await api(`/apps/${encodeURIComponent(appId)}/builds/${encodeURIComponent(buildId)}`, {
      signal: ctx.signal,
    });
    meta.replaceChildren(
      facts([
        ['State', stateBadge(build.state)],
        ['Build id', h('span', { class: 'mono' }, build.id)],
        ['Runtime', build.runtime ?? '—'],
        ['Created', timeEl(build.created_at)],
        ['Duration', formatDuration(buildDuration(build))],
        ['Archive', `${build.file_count} files, ${formatBytes(build.archive_bytes)}`],
        ['Error', build.error ? h('span', { class: 'error-text' }, coded(build.error)) : null, 'wide'],
      ]),
    );
    toml.replaceChildren(shown(build.config_toml ?? ''));
    actions.replaceChildren();
    if (!FINAL.includes(build.state)) {
      const cancel = h('button', { type: 'button', class: 'danger' }, 'Cancel build');
      cancel.addEventListener('click', async () => {
        cancel.disabled = true;
        try {
          await api(`/apps/${encodeURIComponent(appId)}/builds/${encodeURIComponent(buildId)}/cancel`, {
            method: 'POST',
          });
          announce('Build cancelled');
          await loadBuild();
        } catch (err) {
          cancel.disabled = false;
          actions.append(errorText(err));
        }
      });
      actions.append(cancel);
    }
  }

  try {
    await loadBuild();
  } catch (err) {
    ctx.main.replaceChildren(appHeader(ctx, appId, 'builds', `Build ${shortId(buildId)}`), errorBox(err));
    return;
  }

  api(`/apps/${encodeURIComponent(appId)}/builds/${encodeURIComponent(buildId)}/zip-contents`, { signal: ctx.signal })
    .then((contents) => {
      tree.replaceChildren(
        h('p', { class: 'hint' }, `${contents.count} files, ${formatBytes(contents.total_size)} uncompressed`),
        fileTree(contents.files),
      );
    })
    .catch((err) => {
      if (err.name !== 'AbortError') tree.replaceChildren(errorText(err));
    });

  // The log, live while the build runs: server-sent events read with fetch (EventSource cannot send the token).
  let seq = 0;
  const follow = async () => {
    for (let attempt = 0; !ctx.signal.aborted; attempt++) {
      logState.textContent = FINAL.includes(build.state) ? 'Complete log.' : 'Following the log live…';
      try {
        let ended = false;
        await streamEvents(`/apps/${encodeURIComponent(appId)}/builds/${encodeURIComponent(buildId)}/logs`, {
          query: { after: seq },
          signal: ctx.signal,
          onEvent(event) {
            if (event.event === 'end') {
              ended = true;
              return;
            }
            const line = JSON.parse(event.data);
            seq = line.seq;
            const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
            log.append(shown(`${line.line}\n`));
            if (atBottom) log.scrollTop = log.scrollHeight;
          },
        });
        if (ended) {
          const wasFinal = FINAL.includes(build.state);
          await loadBuild();
          logState.textContent = `Complete log. The build is ${build.state}.`;
          if (!wasFinal) announce(`Build ${build.state}`);
          if (!log.textContent) log.textContent = '(no log lines)';
          return;
        }
      } catch (err) {
        if (ctx.signal.aborted) return;
        logState.replaceChildren('The log stream broke; retrying. ', errorText(err));
      }
      await ctx.sleep(Math.min(5000, 500 * 2 ** attempt));
    }
  };
  void follow();
}
