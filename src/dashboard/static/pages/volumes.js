// Volumes: the project's persistent folders (list, size and use, the apps mounting each), creating one,
// and the files of one volume (browse folders, delete a file or folder). Copying files is the CLI's
// (`ferry volumes cp`), which streams any size.
import { api } from '../api.js';
import {
  announce,
  confirmButton,
  errorBox,
  errorText,
  formatBytes,
  h,
  replaceKeepingFocus,
  tableEl,
  timeEl,
} from '../ui.js';

const NAME = /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/;

export async function renderVolumes(ctx) {
  ctx.setTitle('Volumes');
  const name = h('input', { id: 'volume-name', required: true, maxlength: '63', autocomplete: 'off', class: 'mono' });
  const size = h('input', { id: 'volume-size', required: true, type: 'number', min: '16', value: '1024' });
  const problem = h('div', {});
  const submit = h('button', { type: 'submit', class: 'primary' }, 'Create volume');
  const form = h(
    'form',
    { class: 'card form', 'aria-labelledby': 'create-volume' },
    h('h2', { id: 'create-volume' }, 'Create a volume'),
    h('p', { class: 'field' }, h('label', { for: 'volume-name' }, 'Name'), name),
    h('p', { class: 'field' }, h('label', { for: 'volume-size' }, 'Size (MiB)'), size),
    h('div', { class: 'actions' }, submit),
    problem,
  );
  const body = h('tbody', {});
  const listProblem = h('div', {});
  ctx.main.append(
    h(
      'header',
      { class: 'page-head' },
      h('div', { class: 'title-row' }, h('h1', { tabindex: '-1' }, 'Volumes')),
      h(
        'p',
        { class: 'lead' },
        'Persistent folders for model weights and data, mounted in apps with [[volumes]] in ferry.toml. Copy files with ',
        h('code', {}, 'ferry volumes cp'),
        '.',
      ),
    ),
    form,
    h('h2', {}, 'Volumes of the project'),
    listProblem,
    tableEl({ caption: 'Volumes', head: ['Name', 'Size', 'Used', 'Mounted by', 'Created', 'Actions'], body }),
  );

  async function refresh() {
    const { volumes } = await api('/volumes', { signal: ctx.signal });
    const details = await Promise.all(
      volumes.map((v) => api(`/volumes/${encodeURIComponent(v.name)}`, { signal: ctx.signal }).catch(() => v)),
    );
    const rows = details.map((v) =>
      h(
        'tr',
        { 'data-volume': v.name },
        h('td', { class: 'mono' }, h('a', { href: `#/volumes/${encodeURIComponent(v.name)}` }, v.name)),
        h('td', {}, formatBytes(v.size_mib * 1024 * 1024)),
        h('td', {}, v.used_bytes === undefined ? '-' : formatBytes(v.used_bytes)),
        h('td', {}, (v.mounted_by ?? []).join(', ') || '-'),
        h('td', {}, timeEl(v.created_at)),
        h(
          'td',
          {},
          confirmButton({
            label: 'Delete',
            ariaLabel: `Delete ${v.name}`,
            question: `Delete ${v.name} and all its files?`,
            confirmLabel: 'Yes, delete',
            async onConfirm() {
              await api(`/volumes/${encodeURIComponent(v.name)}`, { method: 'DELETE' });
              announce(`Volume ${v.name} deleted`);
              await refresh();
            },
          }),
        ),
      ),
    );
    if (rows.length === 0) rows.push(h('tr', {}, h('td', { colspan: '6', class: 'empty-row' }, 'No volumes.')));
    replaceKeepingFocus(body, rows);
  }

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    problem.replaceChildren();
    const key = name.value.trim();
    if (!NAME.test(key)) {
      problem.replaceChildren(errorText(new Error('Use a-z, 0-9 and -, starting and ending with a letter or digit.')));
      name.focus();
      return;
    }
    submit.disabled = true;
    try {
      await api('/volumes', { method: 'POST', body: { name: key, size_mib: Number(size.value) } });
      name.value = '';
      announce(`Volume ${key} created`);
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

export async function renderVolumeFiles(ctx) {
  const volume = decodeURIComponent(ctx.params[0]);
  const dir = ctx.query.get('path') ?? '/';
  ctx.setTitle(`${volume}:${dir}`);
  const body = h('tbody', {});
  const problem = h('div', {});
  const parent = dir.replace(/\/[^/]*\/?$/, '') || '/';
  ctx.main.append(
    h(
      'header',
      { class: 'page-head' },
      h('div', { class: 'title-row' }, h('h1', { tabindex: '-1' }, h('span', { class: 'mono' }, `${volume}:${dir}`))),
      h(
        'p',
        { class: 'lead' },
        h('a', { href: '#/volumes' }, 'All volumes'),
        dir === '/' ? '' : ' · ',
        dir === '/'
          ? ''
          : h('a', { href: `#/volumes/${encodeURIComponent(volume)}?path=${encodeURIComponent(parent)}` }, 'Up'),
      ),
    ),
    problem,
    tableEl({ caption: `Files in ${dir}`, head: ['Name', 'Type', 'Size', 'Modified', 'Actions'], body }),
  );
  const join = (name) => `${dir.replace(/\/$/, '')}/${name}`;

  async function refresh() {
    const listing = await api(`/volumes/${encodeURIComponent(volume)}/files`, {
      query: { path: dir },
      signal: ctx.signal,
    });
    const rows = listing.entries.map((e) =>
      h(
        'tr',
        { 'data-entry': e.name },
        h(
          'td',
          { class: 'mono' },
          e.type === 'folder'
            ? h(
                'a',
                { href: `#/volumes/${encodeURIComponent(volume)}?path=${encodeURIComponent(join(e.name))}` },
                `${e.name}/`,
              )
            : e.name,
        ),
        h('td', {}, e.type),
        h('td', {}, e.type === 'file' ? formatBytes(e.size) : '-'),
        h('td', {}, timeEl(e.modified_at)),
        h(
          'td',
          {},
          confirmButton({
            label: 'Delete',
            ariaLabel: `Delete ${e.name}`,
            question: e.type === 'folder' ? `Delete ${e.name} and all in it?` : `Delete ${e.name}?`,
            confirmLabel: 'Yes, delete',
            async onConfirm() {
              await api(`/volumes/${encodeURIComponent(volume)}/file`, {
                method: 'DELETE',
                query: { path: join(e.name), recursive: e.type === 'folder' ? 'true' : '' },
              });
              announce(`${e.name} deleted`);
              await refresh();
            },
          }),
        ),
      ),
    );
    if (rows.length === 0) rows.push(h('tr', {}, h('td', { colspan: '5', class: 'empty-row' }, 'Empty folder.')));
    if (listing.truncated) rows.push(h('tr', {}, h('td', { colspan: '5' }, 'More entries are not shown.')));
    replaceKeepingFocus(body, rows);
  }

  try {
    await refresh();
  } catch (err) {
    problem.replaceChildren(errorBox(err));
  }
}
