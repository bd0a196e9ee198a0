/**
 * Error messages a user reads: allowed values listed once, 413s that state the limit, and a deploy without
 * an entry file that names both runtimes' entries.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

describe('error messages', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let project: string;

  before(async () => {
    server = await startServer({
      env: { FERRY_MAX_BODY_BYTES: String(64 * 1024), FERRY_MAX_UPLOAD_BYTES: String(1024 * 1024) },
    });
    auth = await server.bootstrap();
    project = `${server.url}/v2/projects/${auth.projectId}`;
    await deployFiles(server, auth, 'echo', {
      'ferry.toml': '[app]\nname = "echo"\n',
      'main.ts': 'export function run(args: unknown) { return args; }',
    });
  });
  after(() => server.close());

  it('lists the allowed values of a union once', async () => {
    let res = await http(`${project}/apps/echo/runs?state=bogus`, { token: auth.token });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    assert.equal(
      res.json.error.message,
      'Invalid request: query parameter state must be one of queued, running, success, failure, timeout, cancelled',
    );
    res = await http(`${project}/apps/echo/runs?mode=later`, { token: auth.token });
    assert.equal(res.json.error.message, 'Invalid request: query parameter mode must be one of sync, async, stream');
    res = await http(`${project}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'ci', scopes: ['deploy'] },
    });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.message, 'Invalid request: body member scopes.0 must be one of manage, run');
    assert.doesNotMatch(res.json.error.message, /constant|anyOf/);
  });

  it('states the limit in a 413 (body and upload)', async () => {
    let res = await http(`${server.url}/v4/${auth.projectId}/echo/run`, {
      method: 'POST',
      token: auth.token,
      body: { blob: 'x'.repeat(70 * 1024) },
    });
    assert.equal(res.status, 413);
    assert.equal(res.json.error.code, 'FERRY_BODY_TOO_LARGE');
    assert.equal(res.json.error.message, 'The request body is larger than the limit of 65536 bytes (64 KiB)');
    // Without a Content-Type (read as JSON) and on the management API: the same limit, the same words.
    res = await http(`${project}/secrets/BIG`, {
      method: 'PUT',
      token: auth.token,
      body: Buffer.from(JSON.stringify({ value: 'x'.repeat(70 * 1024) })),
    });
    assert.equal(res.status, 413);
    assert.equal(res.json.error.message, 'The request body is larger than the limit of 65536 bytes (64 KiB)');

    const big = await zipFiles({ 'ferry.toml': '[app]\nname = "big"\n', 'blob.bin': randomBytes(1536 * 1024) });
    res = await http(`${project}/apps/big/builds`, {
      method: 'POST',
      token: auth.token,
      body: big,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 413);
    assert.equal(res.json.error.message, 'The archive is larger than the limit of 1048576 bytes (1 MiB)');
  });

  it('names main.py as well as the Node entries when a deploy has no entry file', async () => {
    const build = await deployFiles(
      server,
      auth,
      'no-entry',
      { 'ferry.toml': '[app]\nname = "no-entry"\n', 'index.ts': 'export const run = () => 1;\n' },
      { expect: 'failed' },
    );
    const res = await http(`${project}/apps/no-entry/builds/${build.id}`, { token: auth.token });
    assert.match(res.json.error, /main\.ts, main\.js or main\.mjs/);
    assert.match(res.json.error, /main\.py/);
  });
});
