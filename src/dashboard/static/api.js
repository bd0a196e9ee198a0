// The dashboard's only way to the server: the same /v2 API the CLI uses, with the signed-in token.
// The token lives in sessionStorage (this tab only, gone when it closes) and is sent in the
// Authorization header to this origin only; it never goes into a URL. No tenant's page runs with this
// origin to read it: apps answering on this port are sandboxed into an opaque origin (http/custom-proxy.ts
// APP_SANDBOX_CSP), or served on another port (FERRY_RUN_PORT).

const TOKEN_KEY = 'ferry.token';

/** The signed-in session: the token and what its (unverified) payload says. The server checks it on every call. */
export const session = { token: '', projectId: '', accountId: '', scopes: [], expiresAt: 0 };
/** The run endpoint's address of this session, once asked (runAddress). */
let runAddressOnce = null;

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
  }
}

/** Decodes a JWT's payload without verifying it (the server does that); throws when it is not a JWT. */
export function decodeToken(token) {
  const part = token.split('.')[1];
  if (!part || token.split('.').length !== 3) throw new Error('This is not a Ferry token (a JWT of three parts).');
  const base64 = part
    .replace(/-/g, '+')
    .replace(/_/g, '/')
    .padEnd(Math.ceil(part.length / 4) * 4, '=');
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const claims = JSON.parse(new TextDecoder().decode(bytes));
  if (typeof claims.prj !== 'string') throw new Error('This token names no project (no "prj" claim).');
  return claims;
}

function adopt(token) {
  const claims = decodeToken(token);
  session.token = token;
  session.projectId = claims.prj;
  session.accountId = typeof claims.sub === 'string' ? claims.sub : '';
  session.scopes = Array.isArray(claims.scp) ? claims.scp : [];
  session.expiresAt = typeof claims.exp === 'number' ? claims.exp * 1000 : 0;
}

/** Restores the session of this tab, if any. */
export function restoreSession() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return false;
  try {
    adopt(token);
    return true;
  } catch {
    sessionStorage.removeItem(TOKEN_KEY);
    return false;
  }
}

/** Checks the token against the server (it must open its project with the manage scope), then keeps it. */
export async function signIn(token) {
  const trimmed = token.trim().replace(/^Bearer\s+/i, '');
  const previous = { ...session };
  adopt(trimmed);
  runAddressOnce = null;
  try {
    const project = await api('');
    sessionStorage.setItem(TOKEN_KEY, trimmed);
    return project;
  } catch (err) {
    Object.assign(session, previous);
    throw err;
  }
}

export function signOut() {
  runAddressOnce = null;
  sessionStorage.removeItem(TOKEN_KEY);
  Object.assign(session, { token: '', projectId: '', accountId: '', scopes: [], expiresAt: 0 });
}

/**
 * The run endpoint's base address, for the run URLs the pages show: the project's `run_url` when the
 * server serves apps apart from this page's origin (FERRY_RUN_PORT, FERRY_RUN_URL), else this origin.
 * Asked once per sign-in.
 */
export function runAddress() {
  runAddressOnce ??= api('').then(
    (project) => project.run_url ?? location.origin,
    () => {
      runAddressOnce = null;
      return location.origin;
    },
  );
  return runAddressOnce;
}

/** `path` is relative to the project: `/apps` is `/v2/projects/<project>/apps`. */
export function projectPath(path) {
  return `/v2/projects/${encodeURIComponent(session.projectId)}${path}`;
}

async function failure(res) {
  let code = `HTTP_${res.status}`;
  let message = res.statusText || `The server answered ${res.status}`;
  try {
    const body = await res.json();
    if (body?.error) {
      code = body.error.code ?? code;
      message = body.error.message ?? message;
    }
  } catch {
    // not JSON: keep the status line
  }
  const err = new ApiError(res.status, code, message);
  if (res.status === 401) window.dispatchEvent(new CustomEvent('ferry:unauthenticated', { detail: err }));
  return err;
}

/**
 * Calls the management API of the signed-in project. Returns the parsed JSON (null for 204).
 * `query` members that are '' or undefined are left out. With `absolute`, `path` is the whole API path
 * (`/v2/cluster`, a route about the server rather than the project).
 */
export async function api(path, { method = 'GET', body, query, signal, absolute = false } = {}) {
  const url = new URL(absolute ? path : projectPath(path), location.origin);
  for (const [k, v] of Object.entries(query ?? {})) if (v !== undefined && v !== '') url.searchParams.set(k, v);
  const headers = { authorization: `Bearer ${session.token}`, accept: 'application/json' };
  if (body !== undefined) headers['content-type'] = 'application/json';
  const res = await fetch(url, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: 'no-store',
    credentials: 'omit',
  });
  if (!res.ok) throw await failure(res);
  if (res.status === 204) return null;
  return res.json();
}

/**
 * Reads a server-sent event stream of the management API. EventSource cannot send an Authorization
 * header, so this is fetch plus a ReadableStream, parsed by hand. Resolves when the stream ends.
 */
export async function streamEvents(path, { query, signal, onEvent }) {
  const url = new URL(projectPath(path), location.origin);
  for (const [k, v] of Object.entries(query ?? {})) if (v !== undefined && v !== '') url.searchParams.set(k, v);
  const res = await fetch(url, {
    headers: { authorization: `Bearer ${session.token}`, accept: 'text/event-stream' },
    signal,
    cache: 'no-store',
    credentials: 'omit',
  });
  if (!res.ok) throw await failure(res);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  const boundary = /\r?\n\r?\n/;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    for (let match = boundary.exec(buffer); match; match = boundary.exec(buffer)) {
      const block = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      const event = { event: 'message', data: '', id: undefined };
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
        if (field === 'data') data.push(text);
        else if (field === 'event') event.event = text;
        else if (field === 'id') event.id = text;
      }
      if (data.length === 0) continue;
      event.data = data.join('\n');
      onEvent(event);
    }
  }
}
