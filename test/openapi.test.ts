/**
 * The OpenAPI document is generated from the route schemas, is valid OpenAPI 3.1 (checked by an independent
 * validator), covers every /v2 route and the run endpoint (/v4), and declares the statuses the shared
 * machinery can answer on every route. test/fuzz.test.ts checks every status it observes is declared.
 */
import assert from 'node:assert/strict';
import { after, before, it } from 'node:test';
import { compileErrors, validate } from '@readme/openapi-parser';
import { http, startServer, type TestServer } from './helpers/ferry.js';

let server: TestServer;
// biome-ignore lint/suspicious/noExplicitAny: the document is read as plain JSON
let doc: any;
before(async () => {
  server = await startServer();
  const res = await http(`${server.url}/v2/openapi.json`);
  assert.equal(res.status, 200);
  doc = res.json;
});
after(() => server.close());

type Operation = { responses: Record<string, unknown>; requestBody?: { content: Record<string, unknown> } };
const operations = (): Array<[string, string, Operation]> =>
  Object.entries(doc.paths as Record<string, Record<string, Operation>>).flatMap(([p, ops]) =>
    Object.entries(ops).map(([method, op]) => [method.toUpperCase(), p, op] as [string, string, Operation]),
  );

it('is a valid OpenAPI 3.1 document (@readme/openapi-parser)', async () => {
  assert.equal(doc.openapi, '3.1.0');
  assert.equal(doc.info.version, '1.0.0');
  const result = await validate(structuredClone(doc));
  assert.ok(result.valid, result.valid ? '' : compileErrors(result));
});

it('lists every /v2 route and the run endpoint', async () => {
  const documented = new Set(operations().map(([method, p]) => `${method} ${p}`));
  // Fastify's own route table (printRoutes is its public view of it), in OpenAPI's {param} spelling.
  const table = server.app.printRoutes({ commonPrefix: false });
  const routes: string[] = [];
  const stack: string[] = [];
  for (const line of table.split('\n')) {
    const match = /^([│ ]*)[├└]── (\S+)(?: \(([A-Z, ]+)\))?$/.exec(line);
    if (!match) continue;
    const depth = match[1]!.length / 4;
    stack.length = depth;
    const full = (stack[depth - 1] ?? '') + match[2]!;
    stack.push(full);
    for (const method of match[3]?.split(', ') ?? []) {
      if (method !== 'HEAD') routes.push(`${method} ${full.replace(/:([a-z_]+)/g, '{$1}')}`);
    }
  }
  const management = routes.filter((r) => r.split(' ')[1]!.startsWith('/v2/') && !r.endsWith('/v2/openapi.json'));
  assert.ok(management.length >= 12, `found only ${management.length} management routes in:\n${table}`);
  for (const route of management) assert.ok(documented.has(route), `${route} is not in the OpenAPI document`);
  assert.ok(documented.has('GET /v2/projects/{project_id}/apps/{app_id}/builds/{build_id}/zip-contents'));
  const zip = doc.paths['/v2/projects/{project_id}/apps/{app_id}/builds/{build_id}/zip-contents'].get;
  const body = zip.responses['200'].content['application/json'].schema;
  assert.deepEqual(Object.keys(body.properties).sort(), ['build_id', 'count', 'files', 'total_size']);

  // The run endpoint: a function call, and a custom app's any-method routes (its root and a path under it).
  for (const method of ['GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS']) {
    assert.ok(documented.has(`${method} /v4/{project_id}/{app_name}`), `${method} /v4/{project_id}/{app_name}`);
    assert.ok(
      documented.has(`${method} /v4/{project_id}/{app_name}/{function}`),
      `${method} /v4/{project_id}/{app_name}/{function}`,
    );
  }
  // Besides the API, the one route a client is meant to call: readiness (issue 43).
  for (const p of Object.keys(doc.paths)) assert.match(p, /^(\/v[24]\/|\/readyz$)/);
});

it('describes /readyz: no token, 200 ready, 503 naming the reason (storage among them)', async () => {
  const ready = doc.paths['/readyz'].get;
  assert.deepEqual(ready.security, []);
  assert.deepEqual(Object.keys(ready.responses).sort(), ['200', '503']);
  const reasons = JSON.stringify(ready.responses['503'].content['application/json'].schema);
  for (const reason of ['store', 'store-busy', 'storage']) assert.ok(reasons.includes(`"${reason}"`), reason);
  const live = await http(`${server.url}/readyz`);
  assert.equal(live.status, 200);
  assert.deepEqual(live.json, { status: 'ready' });
});

it('describes a function call: arguments, sync, async and stream answers, and every error status', async () => {
  const run = doc.paths['/v4/{project_id}/{app_name}/{function}'].post;
  assert.equal(run.operationId, 'runFunction');
  assert.ok(run.requestBody.content['application/json']);
  assert.ok(run.requestBody.content['text/plain']);
  assert.ok(run.responses['200'].content['application/json']);
  assert.ok(run.responses['200'].content['text/event-stream']);
  assert.deepEqual(run.responses['202'].content['application/json'].schema.required, ['run_id']);
  for (const status of ['400', '401', '403', '404', '413', '415', '429', '500', '502', '503', '504', '507']) {
    assert.ok(run.responses[status], `POST /v4/.../{function} does not declare ${status}`);
  }
  const names = (run.parameters as Array<{ name: string; in: string }>).map((p) => `${p.in}:${p.name}`);
  for (const name of [
    'path:project_id',
    'path:app_name',
    'path:function',
    'query:async',
    'query:webhookEndpoint',
    'header:idempotency-key',
    'header:x-webhook-secret',
  ]) {
    assert.ok(names.includes(name), `${name} is not a parameter of the run call`);
  }
});

it('declares 400, 401, 403 and 404 on every API route, 413 and 507 where a body is read, 415 where it must be JSON or ZIP', async () => {
  for (const [method, p, op] of operations().filter(([, path]) => path !== '/readyz')) {
    for (const status of ['400', '401', '403', '404']) {
      assert.ok(op.responses[status], `${method} ${p} does not declare ${status}`);
    }
    if (method !== 'GET' && method !== 'HEAD') {
      assert.ok(op.responses['413'], `${method} ${p} does not declare 413`);
      // A write a full disk refuses (issue 43).
      assert.ok(op.responses['507'], `${method} ${p} does not declare 507`);
      // Custom apps get any body forwarded as it is: only JSON routes refuse a type.
      if (p.startsWith('/v2/')) assert.ok(op.responses['415'], `${method} ${p} does not declare 415`);
    }
  }
  const deploy = doc.paths['/v2/projects/{project_id}/apps/{app_id}/builds'].post;
  assert.ok(deploy.responses['415'] && deploy.responses['413']);
  const cancel = doc.paths['/v2/projects/{project_id}/apps/{app_id}/builds/{build_id}/cancel'].post;
  assert.ok(cancel.responses['409']);
});
