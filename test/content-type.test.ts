/**
 * One body rule for every route that reads JSON (docs/api.md, "Request bodies"): no Content-Type or
 * text/plain is JSON, application/json and application/*+json are JSON, anything else is a 415 naming
 * application/json; deploys name application/zip. A run never gets arguments other than the ones sent.
 */
import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

/** One request on a real socket with exactly these headers (no Content-Type unless given). */
function raw(
  url: string,
  method: string,
  headers: Record<string, string>,
  body?: string,
): Promise<{
  status: number;
  requestId: string | undefined;
  json: { [key: string]: unknown } & { error?: { code: string; message: string } };
}> {
  return new Promise((resolve, reject) => {
    const req = httpRequest(url, { method, headers: { ...headers, connection: 'close' } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => (text += d));
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          requestId: res.headers['x-request-id'] as string | undefined,
          json: text ? JSON.parse(text) : {},
        }),
      );
    });
    req.on('error', reject);
    req.setTimeout(30_000, () => req.destroy(new Error('timed out')));
    req.end(body);
  });
}

describe('request bodies', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const runUrl = (query = '') => `${server.url}/v4/${auth.projectId}/echo/run${query}`;
  const storedInput = async (runId: string) => {
    const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/echo/runs/${runId}`, {
      token: auth.token,
    });
    assert.equal(res.status, 200, res.text);
    return res.json.input;
  };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'echo', {
      'ferry.toml': '[app]\nname = "echo"\n',
      'main.ts': 'export function run(args: unknown) { return args; }',
    });
  });
  after(() => server.close());

  it('runs with the JSON sent by fetch without a Content-Type, and stores that input', async () => {
    const args = { name: 'Ferry', n: 3, nested: { ok: true } };
    // A Uint8Array body: fetch sends no Content-Type at all.
    const res = await fetch(runUrl(), {
      method: 'POST',
      headers: { authorization: `Bearer ${auth.token}` },
      body: new TextEncoder().encode(JSON.stringify(args)),
    });
    const body = (await res.json()) as { result: unknown; run_id: string };
    assert.equal(res.status, 200, JSON.stringify(body));
    assert.deepEqual(body.result, args);
    assert.deepEqual(await storedInput(body.run_id), args);
  });

  it('runs with the JSON sent by fetch with a string body (text/plain;charset=UTF-8)', async () => {
    const args = { greeting: 'héllo', list: [1, 2] };
    const res = await fetch(runUrl(), {
      method: 'POST',
      headers: { authorization: `Bearer ${auth.token}` },
      body: JSON.stringify(args),
    });
    const body = (await res.json()) as { result: unknown; run_id: string };
    assert.equal(res.status, 200, JSON.stringify(body));
    assert.deepEqual(body.result, args);
    assert.deepEqual(await storedInput(body.run_id), args);
  });

  it('reads text/plain, no Content-Type, application/json with a charset and +json alike (sync, async, stream)', async () => {
    const types: Array<string | undefined> = [
      undefined,
      'text/plain',
      'application/json; charset=utf-8',
      'application/vnd.api+json',
    ];
    for (const type of types) {
      const args = { type: type ?? 'none' };
      const headers: Record<string, string> = { authorization: `Bearer ${auth.token}` };
      if (type) headers['content-type'] = type;
      const sync = await raw(runUrl(), 'POST', headers, JSON.stringify(args));
      assert.equal(sync.status, 200, `${type}: ${JSON.stringify(sync.json)}`);
      assert.deepEqual(sync.json.result, args);
      assert.deepEqual(await storedInput(String(sync.json.run_id)), args);

      const queued = await raw(runUrl('?async=true'), 'POST', headers, JSON.stringify(args));
      assert.equal(queued.status, 202, `${type}: ${JSON.stringify(queued.json)}`);
      assert.deepEqual(await storedInput(String(queued.json.run_id)), args);

      const stream = await fetch(runUrl(), {
        method: 'POST',
        headers: { ...headers, accept: 'text/event-stream' },
        body: new TextEncoder().encode(JSON.stringify(args)),
      });
      assert.equal(stream.status, 200);
      assert.match(await stream.text(), new RegExp(`data: ${JSON.stringify(args).replace(/[{}+]/g, '\\$&')}`));
    }
  });

  it('answers 415 naming application/json for a form body (curl -d without -H), and runs nothing', async () => {
    const before = await http(`${server.url}/v2/projects/${auth.projectId}/apps/echo/runs?limit=500`, {
      token: auth.token,
    });
    for (const type of ['application/x-www-form-urlencoded', 'multipart/form-data; boundary=x', 'text/xml']) {
      for (const query of ['', '?async=true']) {
        const res = await raw(
          runUrl(query),
          'POST',
          { authorization: `Bearer ${auth.token}`, 'content-type': type },
          '{"a":1}',
        );
        assert.equal(res.status, 415, `${type}${query}: ${JSON.stringify(res.json)}`);
        assert.equal(res.json.error?.code, 'FERRY_UNSUPPORTED_MEDIA_TYPE');
        assert.match(res.json.error?.message ?? '', /application\/json/);
        assert.match(res.json.error?.message ?? '', new RegExp(type.split(';')[0]!.replace('/', '\\/')));
        // No run exists, so none is named (issue 43): the request keeps its X-Request-Id, which no run has.
        assert.equal(res.json.run_id, undefined, `${type}${query}: ${JSON.stringify(res.json)}`);
        assert.match(res.requestId ?? '', /^[0-9a-f-]{36}$/);
        const lookup = await http(`${server.url}/v2/projects/${auth.projectId}/apps/echo/runs/${res.requestId}`, {
          token: auth.token,
        });
        assert.equal(lookup.status, 404, lookup.text);
      }
    }
    const afterwards = await http(`${server.url}/v2/projects/${auth.projectId}/apps/echo/runs?limit=500`, {
      token: auth.token,
    });
    assert.equal(afterwards.json.runs.length, before.json.runs.length, 'a refused call must not be recorded');
  });

  it('refuses a text/plain or unlabelled body that is not a JSON object (400), and runs an empty body with {}', async () => {
    const headers = { authorization: `Bearer ${auth.token}` };
    let res = await raw(runUrl(), 'POST', { ...headers, 'content-type': 'text/plain' }, 'name=Ferry');
    assert.equal(res.status, 400);
    assert.equal(res.json.error?.code, 'FERRY_INVALID_JSON');
    res = await raw(runUrl(), 'POST', headers, '[1,2]');
    assert.equal(res.status, 400);
    assert.equal(res.json.error?.code, 'FERRY_BODY_NOT_OBJECT');
    res = await raw(runUrl(), 'POST', headers);
    assert.equal(res.status, 200);
    assert.deepEqual(res.json.result, {});
    res = await raw(runUrl(), 'POST', { ...headers, 'content-type': 'text/plain' }, '');
    assert.equal(res.status, 200);
    assert.deepEqual(res.json.result, {});
  });

  it('applies the same rule to the management API; deploys name application/zip', async () => {
    const secret = `${server.url}/v2/projects/${auth.projectId}/secrets/PLAIN`;
    const headers = { authorization: `Bearer ${auth.token}` };
    let res = await raw(secret, 'PUT', { ...headers, 'content-type': 'text/plain' }, '{"value":"from text"}');
    assert.equal(res.status, 200, JSON.stringify(res.json));
    res = await raw(secret, 'PUT', headers, '{"value":"unlabelled"}');
    assert.equal(res.status, 200, JSON.stringify(res.json));
    const stored = res.json.updated_at;
    res = await raw(
      secret,
      'PUT',
      { ...headers, 'content-type': 'application/x-www-form-urlencoded' },
      '{"value":"form"}',
    );
    assert.equal(res.status, 415);
    assert.match(res.json.error?.message ?? '', /application\/json/);
    // Values are never read back; the refused PUT must have left the secret as the last accepted one set it.
    assert.equal((await http(secret, { token: auth.token })).json.updated_at, stored);

    const deploy = `${server.url}/v2/projects/${auth.projectId}/apps/echo/builds`;
    for (const type of ['application/json', 'application/x-www-form-urlencoded', undefined]) {
      res = await raw(deploy, 'POST', type ? { ...headers, 'content-type': type } : headers, '{}');
      assert.equal(res.status, 415, `${type}: ${JSON.stringify(res.json)}`);
      assert.equal(res.json.error?.code, 'FERRY_UNSUPPORTED_MEDIA_TYPE');
      assert.match(res.json.error?.message ?? '', /application\/zip/);
    }
  });
});
