// Small DOM and formatting helpers. Pages build their DOM with h(): text always goes in as text nodes,
// never as HTML, so nothing a function returns or prints can inject markup; and control characters in it
// are shown, not obeyed (shown()).

/**
 * Characters text from outside (logs, results, names) may carry that change how the text around them
 * reads without being seen: C0 controls but tab and line feed (ESC starts terminal escapes; a carriage
 * return is kept before a line feed), DEL, the C1 controls (U+0080-U+009F, CSI among them), and the
 * Unicode controls that reorder or hide text: bidi embeddings, overrides and isolates (U+202A-U+202E,
 * U+2066-U+2069: "Trojan Source"), LRM, RLM, ALM, line and paragraph separators. The CLI shows the same
 * set (src/cli/terminal.ts).
 */
const HIDDEN_CONTROLS =
  // biome-ignore lint/suspicious/noControlCharactersInRegex: matching control characters is the point
  /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/u;
const HIDDEN_CONTROLS_ALL = new RegExp(HIDDEN_CONTROLS.source, 'gu');

/** `\u202E` for U+202E: how a hidden control is written where it stood. */
export function controlEscape(char) {
  return `\\u${char.codePointAt(0).toString(16).toUpperCase().padStart(4, '0')}`;
}

/**
 * `text` as DOM: itself when it holds no hidden control, else a fragment where each one (but a carriage
 * return before a line feed) is a marked `\u202E`-style escape (`<span class="ctl">`), so the text reads
 * in the order it was written and a reader sees what was there.
 */
export function shown(text) {
  if (!HIDDEN_CONTROLS.test(text)) return text;
  const fragment = document.createDocumentFragment();
  let at = 0;
  for (const match of text.matchAll(HIDDEN_CONTROLS_ALL)) {
    const char = match[0];
    if (char === '\r' && text[match.index + 1] === '\n') continue;
    if (match.index > at) fragment.append(text.slice(at, match.index));
    const name = `U+${controlEscape(char).slice(2)}`;
    fragment.append(h('span', { class: 'ctl', title: `hidden control character ${name}` }, controlEscape(char)));
    at = match.index + char.length;
  }
  if (at < text.length) fragment.append(text.slice(at));
  return fragment;
}

/**
 * h('a', { href: '#/apps', class: 'x', onclick: fn }, 'text', child, [more]) makes an element.
 * Attributes whose value is null, undefined or false are left out; true sets an empty attribute.
 * `value`, `checked` and `disabled`... are set as properties too where they matter.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs ?? {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') el.addEventListener(name.slice(2), value);
    else if (name === 'value' || name === 'checked') el[name] = value;
    else el.setAttribute(name, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : shown(String(child)));
  }
}

/**
 * Replaces the children of `container`, keeping keyboard focus on the element with the same
 * `data-key` when the old focused element had one (live-updating tables re-render every few seconds).
 */
export function replaceKeepingFocus(container, ...children) {
  const active = document.activeElement;
  const key = active && container.contains(active) ? active.getAttribute('data-key') : null;
  container.replaceChildren();
  append(container, children);
  if (key) container.querySelector(`[data-key="${CSS.escape(key)}"]`)?.focus();
}

/** Tells screen readers something happened (the polite live region of the page). */
export function announce(message) {
  const region = document.getElementById('status');
  if (!region) return;
  region.textContent = '';
  setTimeout(() => {
    region.textContent = message;
  }, 50);
}

const pad = (n) => String(n).padStart(2, '0');

/** Local date and time, `2026-11-22 10:04:31`. */
export function formatTime(iso) {
  if (!iso) return '—';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/**
 * A time in UTC to the minute, `2030-01-31 23:59 UTC`: for expiries, which the API keys form sets as UTC
 * days, and which a short-lived token (an hour) needs to the minute, not only to the day.
 */
export function formatUtcTime(iso) {
  if (!iso) return '—';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return `${d.toISOString().slice(0, 16).replace('T', ' ')} UTC`;
}

export function formatDate(iso) {
  return iso ? formatTime(iso).slice(0, 10) : '—';
}

/** "5 s ago", "3 min ago", "2 h ago", "4 d ago"; a future time is "in …". */
export function relativeTime(iso, now = Date.now()) {
  if (!iso) return '—';
  const diff = Math.round((now - Date.parse(iso)) / 1000);
  const abs = Math.abs(diff);
  let text;
  if (abs < 5) return 'just now';
  if (abs < 60) text = `${abs} s`;
  else if (abs < 3600) text = `${Math.floor(abs / 60)} min`;
  else if (abs < 86400) text = `${Math.floor(abs / 3600)} h`;
  else text = `${Math.floor(abs / 86400)} d`;
  return diff >= 0 ? `${text} ago` : `in ${text}`;
}

/** A <time> showing the relative time, the exact local time in its title. */
export function timeEl(iso) {
  if (!iso) return '—';
  return h('time', { datetime: iso, title: formatTime(iso) }, relativeTime(iso));
}

export function formatDuration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return '—';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 1)} s`;
  const s = Math.round(ms / 1000);
  return `${Math.floor(s / 60)} min ${s % 60} s`;
}

export function formatBytes(n) {
  if (n === null || n === undefined) return '—';
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

/** The run, build and app states, each with its colour class. */
export function stateBadge(state, label = state) {
  return h('span', { class: `badge state-${state}` }, label);
}

export function modeBadge(mode) {
  if (mode === 'async')
    return h('span', { class: 'badge mode-async', title: 'Asynchronous run (?async=true)' }, 'async');
  return h('span', { class: `badge mode-${mode}` }, mode);
}

/** Pretty JSON for a <pre>. */
export function json(value) {
  if (value === undefined) return '—';
  return JSON.stringify(value, null, 2);
}

async function writeClipboard(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // No async clipboard (plain http on another host, or no permission): the older way.
    const area = h('textarea', { class: 'offscreen', 'aria-hidden': 'true', tabindex: '-1' });
    area.value = text;
    document.body.append(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand('copy');
    } catch {
      ok = false;
    }
    area.remove();
    return ok;
  }
}

/** A "Copy" button; `label` names what it copies for screen readers ("Copy run URL"). */
export function copyButton(text, label) {
  const button = h('button', { type: 'button', class: 'copy', 'aria-label': `Copy ${label}` }, 'Copy');
  button.addEventListener('click', async () => {
    const value = typeof text === 'function' ? text() : text;
    const ok = await writeClipboard(value);
    button.textContent = ok ? 'Copied' : 'Copy failed';
    announce(ok ? `${label} copied` : `Could not copy the ${label}; select it and copy by hand`);
    setTimeout(() => {
      button.textContent = 'Copy';
    }, 1500);
  });
  return button;
}

/**
 * A button that asks once more before doing something that cannot be undone: the first press shows
 * "confirm" and "cancel" buttons in its place.
 */
export function confirmButton({ label, ariaLabel, question, confirmLabel, onConfirm }) {
  const wrap = h('span', { class: 'confirm' });
  const first = h('button', { type: 'button', class: 'danger', 'aria-label': ariaLabel ?? label }, label);
  const showFirst = () => {
    wrap.replaceChildren(first);
    first.focus();
  };
  first.addEventListener('click', () => {
    const yes = h('button', { type: 'button', class: 'danger solid' }, confirmLabel);
    const no = h('button', { type: 'button', onclick: showFirst }, 'Cancel');
    yes.addEventListener('click', async () => {
      yes.disabled = true;
      no.disabled = true;
      try {
        await onConfirm();
      } catch (err) {
        wrap.replaceChildren(first, errorText(err));
      }
    });
    wrap.replaceChildren(h('span', { class: 'question' }, question), ' ', yes, ' ', no);
    yes.focus();
  });
  wrap.append(first);
  return wrap;
}

/** Ferry's error codes (`FERRY_IMAGE_STEP_FAILED`) inside a text. */
const ERROR_CODES = /\bFERRY_[A-Z0-9_]+\b/g;

/**
 * `text` with each of Ferry's error codes in a `<code class="error-code">`, which never breaks inside:
 * the text around it may break anywhere it must (a long image reference), the code only before or after.
 */
export function coded(text) {
  const out = [];
  let at = 0;
  for (const match of text.matchAll(ERROR_CODES)) {
    if (match.index > at) out.push(text.slice(at, match.index));
    out.push(h('code', { class: 'error-code' }, match[0]));
    at = match.index + match[0].length;
  }
  if (at < text.length) out.push(text.slice(at));
  return out;
}

export function errorText(err) {
  const message = err?.code ? `${err.message} (${err.code})` : String(err?.message ?? err);
  return h('span', { class: 'error-text', role: 'alert' }, coded(message));
}

/** A full-width error box for a page that could not load. */
export function errorBox(err) {
  return h('div', { class: 'error-box', role: 'alert' }, h('strong', {}, 'Something went wrong. '), errorText(err));
}

/**
 * A table inside a scrollable region (narrow screens scroll it sideways; the region is focusable so the
 * keyboard can scroll it too). `head` is a list of column names.
 */
export function tableEl({ caption, head, body, className = '' }) {
  return h(
    'div',
    { class: 'table-wrap', role: 'region', 'aria-label': caption, tabindex: '0' },
    h(
      'table',
      { class: className },
      h('caption', { class: 'sr-only' }, caption),
      h(
        'thead',
        {},
        h(
          'tr',
          {},
          head.map((name) => h('th', { scope: 'col' }, name)),
        ),
      ),
      body,
    ),
  );
}

export function shortId(id) {
  return id ? id.slice(-12) : '—';
}

/** A definition list from [term, value] pairs; pairs with a null value are left out. */
/**
 * A list of facts, `[name, value]` each, in as many columns as fit; a fact that is null or undefined is
 * left out. `[name, value, 'wide']` takes a whole row: for text that needs room (an error, attempts),
 * which a narrow column would break into a word per line. Put wide facts last, so no column is left empty.
 */
export function facts(pairs) {
  return h(
    'dl',
    { class: 'facts' },
    pairs
      .filter(([, v]) => v !== null && v !== undefined)
      .map(([k, v, wide]) => h('div', { class: wide === 'wide' ? 'wide' : null }, h('dt', {}, k), h('dd', {}, v))),
  );
}
