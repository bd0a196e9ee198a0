/**
 * The run endpoint's hot case (a plain sync call: no query string, a JSON body, no event stream) is served
 * by src/http/run-fast-path.ts, everything else by the Fastify route. Both must answer alike: the same
 * request sent once as is and once with a query parameter the route ignores (which sends it through
 * Fastify) gets the same status, error code, body members and X-Request-Id = run_id, and the run records
 * are the same.
 */
import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

interface Answer {
  status: number;
  requestId: string | undefined;
  contentType: string | undefined;
  json: Record<string, unknown> & { error?: { code: string; message: string }; run_id?: string };
}

/** One request on a real socket; `chunks` are written one by one (chunked encoding) when given. */
function send(url: string, headers: Record<string, string>, body: string | string[] | undefined): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(url, { method: 'POST', headers: { ...headers, connection: 'close' } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => (text += d));
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          requestId: res.headers['x-request-id'] as string | undefined,
          contentType: res.headers['content-type'],
          json: text ? JSON.parse(text) : {},
        }),
      );
    });
    req.on('error', reject);
    req.setTimeout(30_000, () => req.destroy(new Error('timed out')));
    if (Array.isArray(body)) {
      for (const chunk of body) req.write(chunk);
      req.end();
    } else req.end(body);
  });
}

describe('the run endpoint fast path answers as the Fastify route does', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const LIMIT = 4096;

  before(async () => {
    server = await startServer({ maxBodyBytes: LIMIT });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'same', {
      'ferry.toml': '[app]\nname = "same"\n',
      'main.ts': [
        'export function run(args: { x?: unknown }) { return { got: args.x ?? null, text: "é\\n\\u2028\\"" }; }',
        'export function nothing() { return undefined; }',
        'export function fails() { throw new TypeError("no good"); }',
        'export function _hidden() { return 1; }',
      ].join('\n'),
    });
  });
  after(() => server.close());

  const auth_ = () => ({ authorization: `Bearer ${auth.token}` });
  const cases: Array<{
    name: string;
    path: string;
    headers: () => Record<string, string>;
    body?: string | string[];
    /** `async=true` for an async call (the fast path takes exactly that query string). */
    query?: string;
  }> = [
    {
      name: 'a call',
      path: 'same/run',
      headers: () => ({ ...auth_(), 'content-type': 'application/json' }),
      body: '{"x":[1,"два"]}',
    },
    { name: 'no body', path: 'same/run', headers: auth_ },
    { name: 'undefined returned', path: 'same/nothing', headers: auth_, body: '{}' },
    {
      name: 'text/plain',
      path: 'same/run',
      headers: () => ({ ...auth_(), 'content-type': 'text/plain' }),
      body: '{"x":1}',
    },
    { name: 'not JSON', path: 'same/run', headers: auth_, body: '{"x":' },
    { name: 'an array', path: 'same/run', headers: auth_, body: '[1]' },
    { name: 'a private function', path: 'same/_hidden', headers: auth_, body: '{}' },
    { name: 'an unknown function', path: 'same/missing', headers: auth_, body: '{}' },
    { name: 'a throwing function', path: 'same/fails', headers: auth_, body: '{}' },
    { name: 'no token', path: 'same/run', headers: () => ({}), body: '{}' },
    { name: 'a bad token', path: 'same/run', headers: () => ({ authorization: 'Bearer nope' }), body: '{}' },
    { name: 'an unknown app', path: 'nosuch/run', headers: auth_, body: '{}' },
    { name: 'a body over the limit', path: 'same/run', headers: auth_, body: `{"x":"${'a'.repeat(LIMIT)}"}` },
    {
      name: 'a chunked body over the limit',
      path: 'same/run',
      headers: auth_,
      body: ['{"x":"', 'b'.repeat(LIMIT), '"}'],
    },
    {
      name: 'a form body',
      path: 'same/run',
      headers: () => ({ ...auth_(), 'content-type': 'application/x-www-form-urlencoded' }),
      body: 'x=1',
    },
    { name: 'an async call', path: 'same/run', headers: auth_, body: '{"x":"later"}', query: 'async=true' },
    { name: 'an async call without a body', path: 'same/run', headers: auth_, query: 'async=true' },
    { name: 'an async call not JSON', path: 'same/run', headers: auth_, body: 'nope', query: 'async=true' },
    {
      name: 'an async call with a bad Idempotency-Key',
      path: 'same/run',
      headers: () => ({ ...auth_(), 'idempotency-key': 'has space' }),
      body: '{}',
      query: 'async=true',
    },
    {
      name: 'an async call of an unknown function',
      path: 'same/missing',
      headers: auth_,
      body: '{}',
      query: 'async=true',
    },
  ];

  for (const c of cases) {
    it(`${c.name}: the same answer either way`, async () => {
      const url = `${server.url}/v4/${auth.projectId}/${c.path}`;
      const fast = await send(c.query ? `${url}?${c.query}` : url, c.headers(), c.body);
      const routed = await send(c.query ? `${url}?${c.query}&via=fastify` : `${url}?via=fastify`, c.headers(), c.body);
      assert.equal(fast.status, routed.status, JSON.stringify({ fast: fast.json, routed: routed.json }));
      assert.equal(fast.json.error?.code, routed.json.error?.code);
      assert.deepEqual(Object.keys(fast.json).sort(), Object.keys(routed.json).sort());
      assert.equal(fast.contentType, 'application/json; charset=utf-8');
      assert.equal(fast.contentType, routed.contentType);
      // Every answer names its run; a run's answer is that run's.
      assert.ok(fast.requestId);
      if (fast.json.run_id !== undefined) assert.equal(fast.json.run_id, fast.requestId);
      if (fast.status === 202) {
        // Both runs are stored with their input and run to the end.
        for (const answer of [fast, routed]) {
          const record = await http(
            `${server.url}/v2/projects/${auth.projectId}/apps/same/runs/${answer.json.run_id}?wait=30`,
            { token: auth.token },
          );
          assert.equal(record.status, 200, record.text);
          assert.equal(record.json.state, 'success', record.text);
          assert.equal(record.json.mode, 'async');
          assert.deepEqual(record.json.input, c.body === undefined ? {} : JSON.parse(c.body as string));
        }
      }
      if (fast.status === 200) {
        assert.deepEqual(fast.json.result, routed.json.result);
        assert.equal(typeof fast.json.run_time_ms, 'number');
        // The run is recorded alike: its stored result is the one answered.
        for (const answer of [fast, routed]) {
          const record = await http(
            `${server.url}/v2/projects/${auth.projectId}/apps/same/runs/${answer.json.run_id}`,
            {
              token: auth.token,
            },
          );
          assert.equal(record.status, 200, record.text);
          assert.equal(record.json.state, 'success');
          assert.deepEqual(record.json.result, answer.json.result);
        }
      }
    });
  }

  it('answers a repeated Idempotency-Key with the first run, whichever path each call takes', async () => {
    const url = `${server.url}/v4/${auth.projectId}/same/run?async=true`;
    const headers = { ...auth_(), 'idempotency-key': `key-${Date.now()}` };
    const first = await send(url, headers, '{"x":1}');
    const again = await send(url, headers, '{"x":2}');
    const routed = await send(`${url}&via=fastify`, headers, '{"x":3}');
    assert.equal(first.status, 202, JSON.stringify(first.json));
    for (const answer of [again, routed]) {
      assert.equal(answer.status, 202, JSON.stringify(answer.json));
      assert.equal(answer.json.run_id, first.json.run_id);
      assert.equal(answer.requestId, first.json.run_id);
    }
  });

  it('counts its calls in /metrics under the route, as Fastify does', async () => {
    const metrics = await http(`${server.url}/metrics`, { token: auth.token });
    assert.equal(metrics.status, 200, metrics.text);
    const line = (status: number) =>
      new RegExp(
        `^ferry_http_requests_total\\{method="POST",route="/v4/:project_id/:app_name/:function",status="${status}"[^}]*\\} (\\d+)`,
        'm',
      );
    // Two 200s per successful case above (fast and routed): four cases end 200.
    assert.ok(Number(line(200).exec(metrics.text)?.[1]) >= 8, metrics.text);
    assert.ok(Number(line(413).exec(metrics.text)?.[1]) >= 4, metrics.text);
  });
});
