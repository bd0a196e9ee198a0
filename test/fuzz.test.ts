/**
 * A seeded, bounded fuzz over every operation of the OpenAPI document of a real server (a project, an app with
 * a ready build, a run, a second account and a secret), the run endpoint included. Each request mutates one
 * thing: a path parameter, a query value, a header or the body. It fails on any 5xx, any error body that is
 * not Ferry's (`{"error": {"code", "message"}}`, plus `run_id` on /v4, the code one of src/errors.ts with its
 * status), and any status the document does not declare for the operation.
 *
 * Reproduce a failure with the seed it prints: FERRY_FUZZ_SEED=<seed> node scripts/test.mjs fuzz
 */
import assert from 'node:assert/strict';
import { after, before, it } from 'node:test';
import { type Dispatcher, request } from 'undici';
import { ERRORS } from '../src/errors.js';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

const SEED = Number(process.env.FERRY_FUZZ_SEED ?? 0x5eed11);
/** Full rounds over every operation, at most; the time budget may end the run sooner. */
const ROUNDS = 60;
const MAX_REQUESTS = 3000;
const BUDGET_MS = 15_000;

/** mulberry32: small, seedable, good enough to pick mutations. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const random = prng(SEED);
const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)]!;

/** Values that have broken parsers somewhere: numbers past the edges, empties, unicode, escapes. */
const NASTY = [
  'Infinity',
  '-Infinity',
  'NaN',
  '-1',
  '0',
  '1e309',
  '-1e309',
  '1.5',
  '0x10',
  '9007199254740993',
  '99999999999999999999999',
  '',
  ' ',
  'true',
  'null',
  '[]',
  '{}',
  'ünïcödé',
  '日本語',
  '😀',
  '\u0000',
  '../..',
  '%',
  'a'.repeat(300),
  'x'.repeat(5000),
  '<script>',
  "' OR 1=1 --",
];
/** Spliced into the URL as they are: escapes that do not decode, and encoded separators. */
const RAW = ['%E0%A4%A', '%FF', '%C0%AF', '%', '%%', '%2F', '%2e%2e', '%00', '%u0041'];

type Param = { name: string; in: 'path' | 'query' | 'header' };
type Operation = {
  method: string;
  path: string;
  params: Param[];
  declared: Set<string>;
  body: boolean;
};

interface Sent {
  method: string;
  url: string;
  headers: Record<string, string>;
  body?: string | Uint8Array;
  what: string;
}

let server: TestServer;
let auth: { projectId: string; token: string };
let other: { projectId: string; token: string };
let operations: Operation[];
const baseline: Record<string, string> = {};

before(async () => {
  server = await startServer({ env: { FERRY_MAX_BODY_BYTES: String(256 * 1024) } });
  auth = await server.bootstrap();
  other = await server.bootstrap('elsewhere');
  const build = await deployFiles(server, auth, 'echo', {
    'ferry.toml': '[app]\nname = "echo"\n',
    'main.ts': 'export function run(args: unknown) { return args; }\nexport function other() { return 1; }\n',
  });
  const project = `${server.url}/v2/projects/${auth.projectId}`;
  const run = await http(`${server.url}/v4/${auth.projectId}/echo/run`, {
    method: 'POST',
    token: auth.token,
    body: { seed: SEED },
  });
  assert.equal(run.status, 200, run.text);
  const victim = await http(`${project}/service-accounts`, {
    method: 'POST',
    token: auth.token,
    body: { name: 'victim' },
  });
  assert.equal(victim.status, 201, victim.text);
  const secret = await http(`${project}/secrets/FUZZ`, { method: 'PUT', token: auth.token, body: { value: 'v' } });
  assert.equal(secret.status, 200, secret.text);
  const login = await http(`${project}/registries/fuzz.example`, {
    method: 'PUT',
    token: auth.token,
    body: { username: 'fuzz', password: 'fuzz-password' },
  });
  assert.equal(login.status, 200, login.text);
  Object.assign(baseline, {
    registry: 'fuzz.example',
    project_id: auth.projectId,
    app_id: 'echo',
    app_name: 'echo',
    build_id: build.id,
    run_id: run.json.run_id,
    service_account_id: victim.json.id,
    name: 'FUZZ',
    function: 'run',
  });

  const doc = (await http(`${server.url}/v2/openapi.json`)).json;
  operations = [];
  for (const [path, item] of Object.entries(doc.paths as Record<string, Record<string, unknown>>)) {
    for (const [method, raw] of Object.entries(item)) {
      const op = raw as { parameters?: Param[]; responses: Record<string, unknown>; requestBody?: unknown };
      operations.push({
        method: method.toUpperCase(),
        path,
        params: (op.parameters ?? []).map((p) => ({ name: p.name, in: p.in })),
        declared: new Set(Object.keys(op.responses)),
        body: op.requestBody !== undefined,
      });
    }
  }
});
after(() => server.close());

/** The request an operation's baseline makes: real ids, the token, a body that fits. */
function baseRequest(op: Operation): { path: Record<string, string>; query: [string, string][]; sent: Sent } {
  const path: Record<string, string> = {};
  for (const p of op.params) if (p.in === 'path') path[p.name] = encodeURIComponent(baseline[p.name] ?? 'x');
  const headers: Record<string, string> = { authorization: `Bearer ${auth.token}` };
  let body: string | undefined;
  if (op.body || op.method === 'POST' || op.method === 'PUT') {
    headers['content-type'] = 'application/json';
    body = op.path.endsWith('/service-accounts')
      ? JSON.stringify({ name: `fuzz-${Math.floor(random() * 1e6)}` })
      : op.path.includes('/secrets/')
        ? JSON.stringify({ value: 'fuzzed' })
        : op.path.includes('/registries/')
          ? JSON.stringify({ username: 'fuzzed', password: 'fuzzed' })
          : JSON.stringify({ n: 1 });
  }
  return { path, query: [], sent: { method: op.method, url: '', headers, body, what: 'baseline' } };
}

function deepNesting(depth: number): string {
  return `${'['.repeat(depth)}${']'.repeat(depth)}`;
}

const BODIES: Array<[string, () => string | Uint8Array]> = [
  ['array', () => '[1,2,3]'],
  ['number', () => '42'],
  ['string', () => '"text"'],
  ['null', () => 'null'],
  ['invalid JSON', () => '{"a": '],
  ['trailing garbage', () => '{"a":1} x'],
  ['deep nesting', () => `{"a":${deepNesting(3000)}}`],
  ['deep objects', () => `${'{"a":'.repeat(2000)}1${'}'.repeat(2000)}`],
  ['huge string', () => JSON.stringify({ value: 'x'.repeat(200_000), name: 'y'.repeat(200_000) })],
  ['too large', () => JSON.stringify({ blob: 'z'.repeat(300 * 1024) })],
  ['wrong member types', () => JSON.stringify({ name: 5, value: [], scopes: 'run', expires_at: {} })],
  ['nasty members', () => JSON.stringify({ name: pick(NASTY), value: pick(NASTY), expires_at: pick(NASTY) })],
  ['proto', () => '{"__proto__":{"polluted":1},"constructor":{"prototype":{"x":1}}}'],
  ['binary', () => new Uint8Array([0xff, 0xfe, 0x00, 0x01, 0x80])],
  ['empty', () => ''],
  ['bad utf-8', () => new Uint8Array([0x7b, 0x22, 0x61, 0x22, 0x3a, 0x22, 0xc3, 0x28, 0x22, 0x7d])],
];

const CONTENT_TYPES = [
  'application/x-www-form-urlencoded',
  'multipart/form-data; boundary=x',
  'text/plain',
  'application/json; charset=latin1',
  'application/vnd.x+json',
  'application/zip',
  'application/xml',
  'nonsense',
  'application/json; boundary',
  '',
];

/** One mutated request for `op`. */
function mutate(op: Operation): Sent {
  const { path, query, sent } = baseRequest(op);
  const kind = pick(['path', 'query', 'query', 'header', 'body', 'body', 'method-body']);
  const pathParams = op.params.filter((p) => p.in === 'path');
  const queryParams = op.params.filter((p) => p.in === 'query');
  if (kind === 'path' && pathParams.length > 0) {
    const p = pick(pathParams);
    const raw = random() < 0.3;
    path[p.name] = raw ? pick(RAW) : encodeURIComponent(pick(NASTY));
    sent.what = `path ${p.name}=${path[p.name]!.slice(0, 40)}`;
  } else if (kind === 'query' || (kind === 'path' && pathParams.length === 0)) {
    const name = queryParams.length > 0 && random() < 0.8 ? pick(queryParams).name : pick(['limit', 'x', 'follow']);
    const raw = random() < 0.2;
    const value = raw ? pick(RAW) : encodeURIComponent(pick(NASTY));
    query.push([name, value]);
    if (random() < 0.2) query.push([name, encodeURIComponent(pick(NASTY))]);
    sent.what = `query ${name}=${value.slice(0, 40)}`;
  } else if (kind === 'header') {
    const header = pick([
      'authorization',
      'authorization',
      'content-type',
      'accept',
      'idempotency-key',
      'x-webhook-secret',
      'accept-encoding',
    ]);
    const values: Record<string, string[]> = {
      authorization: [
        '',
        'Bearer',
        'Bearer ',
        'Basic dXNlcjpwYXNz',
        `Bearer ${other.token}`,
        `Bearer ${auth.token}x`,
        `Bearer ${auth.token.split('.').reverse().join('.')}`,
        'Bearer a.b.c',
        `Bearer ${'A'.repeat(5000)}`,
      ],
      'content-type': CONTENT_TYPES,
      accept: ['text/event-stream', 'application/xml', '*/*', ''],
      'idempotency-key': ['', ' ', 'k'.repeat(300), 'ok-key', 'tab\there'],
      'x-webhook-secret': ['', 's'.repeat(5000)],
      'accept-encoding': ['gzip', 'br;q=2', 'nonsense'],
    };
    const value = pick(values[header]!);
    if (header === 'authorization' && value === '') delete sent.headers.authorization;
    else sent.headers[header] = value;
    sent.what = `header ${header}: ${value.slice(0, 40)}`;
  } else {
    const [label, make] = pick(BODIES);
    sent.body = make();
    if (kind === 'method-body' || random() < 0.3) {
      const type = pick(CONTENT_TYPES);
      if (type === '') delete sent.headers['content-type'];
      else sent.headers['content-type'] = type;
    } else sent.headers['content-type'] ??= 'application/json';
    sent.what = `body ${label} as ${sent.headers['content-type'] ?? 'no type'}`;
  }
  if (random() < 0.1 && op.path.startsWith('/v4/')) query.push(['async', 'true']);
  const filled = op.path.replace(/\{([a-z_]+)\}/g, (_, name: string) => path[name] ?? 'x');
  const search = query.map(([k, v]) => `${k}=${v}`).join('&');
  sent.url = `${server.url}${filled}${search ? `?${search}` : ''}`;
  if (sent.method === 'GET' || sent.method === 'HEAD') delete sent.body;
  return sent;
}

it(`answers every mutated request of every documented operation with a declared, non-5xx status in Ferry's shape (seed ${SEED})`, async () => {
  console.log(`fuzz seed ${SEED} (FERRY_FUZZ_SEED=${SEED} to repeat)`);
  assert.ok(operations.length >= 25, `only ${operations.length} operations in the document`);
  assert.ok(operations.some((op) => op.path.startsWith('/v4/')));
  const start = Date.now();
  const failures: string[] = [];
  const seen = new Map<string, Set<number>>();
  let sentCount = 0;
  let skipped = 0;
  let rounds = 0;
  const slowest: Array<[number, string]> = [];
  outer: for (; rounds < ROUNDS; rounds++) {
    for (const op of operations) {
      if (sentCount >= MAX_REQUESTS || Date.now() - start > BUDGET_MS) break outer;
      const sent = mutate(op);
      let status: number;
      let text: string;
      const t0 = Date.now();
      try {
        // undici's own client: unlike fetch it sends any method (TRACE too) and header values as they are.
        const res = await request(sent.url, {
          method: sent.method as Dispatcher.HttpMethod,
          headers: sent.headers,
          body: sent.body,
          signal: AbortSignal.timeout(15_000),
        });
        status = res.statusCode;
        text = await res.body.text();
      } catch (err) {
        // The client refuses some values itself (invalid header bytes): nothing reached Ferry.
        if (err instanceof Error && 'code' in err && err.code === 'UND_ERR_INVALID_ARG') {
          skipped += 1;
          continue;
        }
        failures.push(`${sent.method} ${sent.url.slice(0, 200)} (${sent.what}): request failed: ${String(err)}`);
        continue;
      }
      const took = Date.now() - t0;
      slowest.push([took, `${sent.method} ${op.path} (${sent.what})`]);
      sentCount += 1;
      const key = `${op.method} ${op.path}`;
      if (!seen.has(key)) seen.set(key, new Set());
      seen.get(key)!.add(status);
      const where = `${sent.method} ${sent.url.slice(0, 200)} (${sent.what}) -> ${status} ${text.slice(0, 200)}`;
      if (status >= 500) failures.push(`5xx: ${where}`);
      if (!op.declared.has(String(status))) failures.push(`undeclared status: ${where}`);
      // A HEAD answer has no body to judge.
      if (status >= 400 && sent.method !== 'HEAD') {
        let body: { error?: { code?: unknown; message?: unknown }; run_id?: unknown } | undefined;
        try {
          body = JSON.parse(text);
        } catch {
          body = undefined;
        }
        const code = body?.error?.code;
        const known = typeof code === 'string' && code in ERRORS ? ERRORS[code as keyof typeof ERRORS] : undefined;
        const extra = body ? Object.keys(body).filter((k) => k !== 'error' && k !== 'run_id') : [];
        if (!known || typeof body?.error?.message !== 'string' || extra.length > 0) {
          failures.push(`not Ferry's error shape: ${where}`);
        } else if (known.status !== status) {
          failures.push(`${code} answered with ${status}, not its ${known.status}: ${where}`);
        }
      }
      if (failures.length >= 20) break outer;
    }
  }
  const elapsed = Date.now() - start;
  console.log(
    `fuzz: ${sentCount} requests (${skipped} refused by the client itself) over ${operations.length} operations, ` +
      `${rounds} full rounds, in ${elapsed} ms`,
  );
  slowest.sort((a, b) => b[0] - a[0]);
  console.log(`  median ${slowest[Math.floor(slowest.length / 2)]?.[0]} ms`);
  for (const [ms, what] of slowest.slice(0, 5)) console.log(`  slowest: ${ms} ms ${what}`);
  for (const [key, statuses] of seen) console.log(`  ${key}: ${[...statuses].sort().join(' ')}`);
  assert.deepEqual(failures, [], `seed ${SEED}`);
  // The time budget may cut the run short on a busy machine; every operation still had its turn.
  assert.ok(rounds >= 1, `not even one round over every operation in ${elapsed} ms`);
  assert.equal(seen.size, operations.length);
});
