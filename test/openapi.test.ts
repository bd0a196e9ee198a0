/** The OpenAPI document is generated from the route schemas and covers every /v2 route. */
import assert from 'node:assert/strict';
import { after, before, it } from 'node:test';
import { http, startServer, type TestServer } from './helpers/ferry.js';

let server: TestServer;
before(async () => {
  server = await startServer();
});
after(() => server.close());

it('GET /v2/openapi.json is OpenAPI 3.1, version 1.0.0, and lists every /v2 route', async () => {
  const res = await http(`${server.url}/v2/openapi.json`);
  assert.equal(res.status, 200);
  const doc = res.json;
  assert.equal(doc.openapi, '3.1.0');
  assert.equal(doc.info.version, '1.0.0');
  const documented = new Set<string>();
  for (const [p, ops] of Object.entries(doc.paths as Record<string, Record<string, unknown>>)) {
    for (const method of Object.keys(ops)) documented.add(`${method.toUpperCase()} ${p}`);
  }
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
  for (const path of Object.keys(doc.paths)) assert.ok(path.startsWith('/v2/'), `${path} is not a management route`);
});
