/**
 * Issue 43, point 8: a tenant's app never answers with the dashboard's origin. On the port that serves the
 * dashboard every response of a custom app's server is sandboxed (`Content-Security-Policy: sandbox ...`
 * without `allow-same-origin`) whatever its status, and `Service-Worker-Allowed` never reaches a caller.
 * Real servers, real sandboxed replicas. The browser side of the same attack is
 * test/dashboard-origin.test.ts.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { http as call, deployFiles, REPO_ROOT, startServer, type TestServer } from './helpers/ferry.js';

const THIEF = path.join(REPO_ROOT, 'test', 'fixtures', 'security', 'origin-thief');
/** Scripts, forms and popups, in an opaque origin: never `allow-same-origin`. */
const SANDBOX = 'sandbox allow-scripts allow-forms allow-popups';

async function folderFiles(dir: string): Promise<Record<string, string>> {
  const files: Record<string, string> = {};
  for (const entry of await fs.readdir(dir)) files[entry] = await fs.readFile(path.join(dir, entry), 'utf8');
  return files;
}

describe("a custom app on the dashboard's port", () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const url = (rest: string) => `${server.url}/v4/${auth.projectId}/evil${rest}`;

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'evil', await folderFiles(THIEF));
  });
  after(() => server?.close());

  it('answers every status sandboxed, without Service-Worker-Allowed', async () => {
    for (const [rest, method, status] of [
      ['/', 'GET', 200],
      ['/', 'HEAD', 200],
      ['/sw.js', 'GET', 200],
      ['/steal?t=x', 'GET', 204],
      ['/missing', 'GET', 404],
      ['/boom', 'GET', 500],
      ['/missing', 'POST', 404],
    ] as const) {
      const res = await call(url(rest), { method });
      const what = `${method} ${rest}`;
      assert.equal(res.status, status, what);
      assert.equal(res.headers.get('content-security-policy'), SANDBOX, what);
      assert.equal(res.headers.get('service-worker-allowed'), null, what);
      assert.ok(res.headers.get('x-request-id'), what);
    }
    // The body is the app's, untouched.
    const page = await call(url('/'));
    assert.match(page.text, /sessionStorage\.getItem\('ferry\.token'\)/);
    assert.equal(page.headers.get('content-type'), 'text/html; charset=utf-8');
  });

  it("keeps the app's own policy beside the sandbox (a browser enforces both)", async () => {
    const res = await call(url('/own-policy'));
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('content-security-policy'), `img-src 'self', ${SANDBOX}`);
    assert.equal(res.headers.get('service-worker-allowed'), null);
  });
});
