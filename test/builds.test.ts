/**
 * Deploys through the management routes: upload, build states, the build log (JSON and live SSE), cancel,
 * the zip-contents listing, refusals of bad archives and bad requests, and a failed build leaving the
 * previous one active. The routes are called in-process (Fastify's inject); the live log goes over a socket.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { helloApp, zipFiles } from './helpers/app-zip.js';
import { startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { makeZip } from './helpers/raw-zip.js';

describe('builds', () => {
  let server: TestServer;
  let projectId: string;
  let token: string;
  const appsPath = () => `/v2/projects/${projectId}/apps`;

  const upload = (app: string, zip: Buffer, headers: Record<string, string> = {}) =>
    server.inject(`${appsPath()}/${app}/builds`, {
      method: 'POST',
      token,
      body: zip,
      headers: { 'content-type': 'application/zip', ...headers },
    });

  const settle = (app: string, id: string) =>
    waitFor(
      async () => {
        const res = await server.inject(`${appsPath()}/${app}/builds/${id}`, { token });
        return ['ready', 'failed', 'cancelled'].includes(res.json.state) ? res.json : undefined;
      },
      60_000,
      `build ${id}`,
    );

  before(async () => {
    server = await startServer({ env: { FERRY_MAX_UPLOAD_BYTES: String(2 * 1024 * 1024) } });
    ({ projectId, token } = await server.bootstrap());
  });
  after(() => server.close());

  it('builds an uploaded app, makes it active, and lists its archive in order', async () => {
    const files = {
      'ferry.toml': '[app]\nname = "greeter"\n',
      'main.ts': "import { word } from './lib/word.js';\nexport function run() { return word; }\n",
      'lib/word.ts': "export const word = 'hi';\n",
    };
    const zip = await zipFiles(files);
    const res = await upload('greeter', zip);
    assert.equal(res.status, 201, res.text);
    assert.equal(res.json.state, 'pending');
    assert.equal(res.json.file_count, 3);
    const build = await settle('greeter', res.json.id);
    assert.equal(build.state, 'ready', JSON.stringify(build));
    assert.match(build.config_toml, /name = "greeter"/);

    const app = await server.inject(`${appsPath()}/greeter`, { token });
    assert.equal(app.json.active_build_id, res.json.id);
    assert.equal(app.json.state, 'active');

    const listing = await server.inject(`${appsPath()}/greeter/builds/${res.json.id}/zip-contents`, { token });
    assert.equal(listing.status, 200);
    assert.equal(listing.json.count, 3);
    const expected = Object.entries(files).map(([name, text]) => [name, Buffer.byteLength(text)]);
    assert.deepEqual(
      listing.json.files.map((f: { path: string; size: number }) => [f.path, f.size]),
      expected,
    );
    assert.equal(
      listing.json.total_size,
      expected.reduce((n, [, size]) => n + Number(size), 0),
    );

    const logs = await server.inject(`${appsPath()}/greeter/builds/${res.json.id}/logs`, { token });
    assert.equal(logs.json.state, 'ready');
    assert.ok(
      logs.json.lines.some((l: { line: string }) => /Build ready/.test(l.line)),
      logs.text,
    );
  });

  it('keeps the previous build active when a new build fails', async () => {
    const good = await upload('flaky', await helloApp('flaky'));
    assert.equal((await settle('flaky', good.json.id)).state, 'ready');
    const bad = await upload('flaky', await helloApp('flaky', 'export function run( {\n'));
    const failed = await settle('flaky', bad.json.id);
    assert.equal(failed.state, 'failed');
    assert.match(failed.error, /Bundling failed/);
    const app = await server.inject(`${appsPath()}/flaky`, { token });
    assert.equal(app.json.active_build_id, good.json.id);
    const log = await server.inject(`${appsPath()}/flaky/builds/${bad.json.id}/logs`, { token });
    assert.ok(
      log.json.lines.some((l: { line: string }) => /main\.ts:\d+/.test(l.line)),
      'the log names the file and line',
    );
  });

  it('streams the build log as server-sent events until the build ends', async () => {
    const res = await upload('streamer', await helloApp('streamer'));
    const stream = await fetch(`${server.url}${appsPath()}/streamer/builds/${res.json.id}/logs`, {
      headers: { authorization: `Bearer ${token}`, accept: 'text/event-stream' },
    });
    assert.equal(stream.status, 200);
    assert.match(stream.headers.get('content-type') ?? '', /^text\/event-stream/);
    const text = await stream.text();
    assert.match(text, /^data: \{"seq":1,/m);
    assert.match(text, /event: end\ndata: \{"state":"ready"\}/);
  });

  it('cancels a pending build and refuses to cancel a finished one', async () => {
    // Two uploads to one app build one at a time: the second waits while the first builds.
    const first = await upload('queue', await helloApp('queue'));
    const second = await upload('queue', await helloApp('queue'));
    const cancel = await server.inject(`${appsPath()}/queue/builds/${second.json.id}/cancel`, {
      method: 'POST',
      token,
    });
    assert.equal(cancel.status, 200, cancel.text);
    assert.equal(cancel.json.state, 'cancelled');
    assert.equal((await settle('queue', first.json.id)).state, 'ready');
    const again = await server.inject(`${appsPath()}/queue/builds/${first.json.id}/cancel`, { method: 'POST', token });
    assert.equal(again.status, 409);
    assert.equal(again.json.error.code, 'FERRY_BUILD_NOT_CANCELLABLE');
  });

  it('refuses bad archives with their own codes and writes nothing outside the build folder', async () => {
    const cases: Array<[string, Buffer, string]> = [
      [
        'traversal',
        makeZip([
          { name: 'ferry.toml', data: '[app]\nname="x"\n' },
          { name: '../../escape.txt', data: 'x' },
        ]),
        'FERRY_ZIP_PATH_TRAVERSAL',
      ],
      ['absolute', makeZip([{ name: '/tmp/abs.txt', data: 'x' }]), 'FERRY_ZIP_ABSOLUTE_PATH'],
      ['symlink', makeZip([{ name: 'link', data: '/etc/passwd', mode: 0o120777 }]), 'FERRY_ZIP_SYMLINK'],
      ['device', makeZip([{ name: 'dev', data: '', mode: 0o020644 }]), 'FERRY_ZIP_SPECIAL_FILE'],
      ['corrupt', Buffer.from('this is not a zip file at all'), 'FERRY_ZIP_CORRUPT'],
    ];
    const before = new Set(await fs.readdir(path.join(server.dataDir, 'builds')));
    for (const [name, zip, code] of cases) {
      const res = await upload('x', zip);
      assert.equal(res.status, 400, `${name}: ${res.text}`);
      assert.equal(res.json.error.code, code, name);
    }
    assert.deepEqual(
      new Set(await fs.readdir(path.join(server.dataDir, 'builds'))),
      before,
      'no build folder is left behind',
    );
    assert.deepEqual(await fs.readdir(path.join(server.dataDir, 'tmp')), [], 'no upload is left behind');
    await assert.rejects(fs.access(path.join(server.dataDir, 'escape.txt')));
    const apps = await server.inject(appsPath(), { token });
    assert.ok(!apps.json.apps.some((a: { id: string }) => a.id === 'x'), 'a refused upload creates no app');
  });

  it('refuses an archive without ferry.toml, with an invalid one, or for another app name', async () => {
    let res = await upload('noconf', await zipFiles({ 'main.ts': 'export const run = () => 1;' }));
    assert.equal(res.json.error.code, 'FERRY_CONFIG_MISSING');
    res = await upload(
      'badconf',
      await zipFiles({ 'ferry.toml': '[app]\nname = "badconf"\n[scaling]\nmax_replicas = "two"\n' }),
    );
    assert.equal(res.status, 400);
    assert.equal(res.json.error.code, 'FERRY_CONFIG_INVALID');
    assert.match(res.json.error.message, /scaling\.max_replicas/);
    res = await upload('mismatch', await helloApp('other-name'));
    assert.equal(res.json.error.code, 'FERRY_APP_NAME_MISMATCH');
  });

  it('refuses an upload over the size limit (413) and the wrong content type (415)', async () => {
    const big = await zipFiles({ 'ferry.toml': '[app]\nname = "big"\n', 'blob.bin': randomBytes(3 * 1024 * 1024) });
    let res = await upload('big', big);
    assert.equal(res.status, 413, res.text);
    assert.equal(res.json.error.code, 'FERRY_BODY_TOO_LARGE');
    res = await server.inject(`${appsPath()}/big/builds`, {
      method: 'POST',
      token,
      body: Buffer.from('{}'),
      headers: { 'content-type': 'text/plain' },
    });
    assert.equal(res.status, 415);
    assert.equal(res.json.error.code, 'FERRY_UNSUPPORTED_MEDIA_TYPE');
  });

  it('answers clear 4xx for bad JSON, bad parameters and unknown routes', async () => {
    let res = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: Buffer.from('{"name": '),
      headers: { 'content-type': 'application/json' },
    });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.code, 'FERRY_INVALID_JSON');
    res = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: '' },
    });
    assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    res = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'x', expires_at: 'soon' },
    });
    assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    res = await server.inject(`${appsPath()}/Bad_Name`, { token });
    assert.equal(res.status, 400);
    res = await server.inject(`${appsPath()}/hello/builds/not-a-build/zip-contents`, { token });
    assert.equal(res.status, 400);
    res = await server.inject(`/v2/nothing-here`, { token });
    assert.equal(res.status, 404);
    assert.equal(res.json.error.code, 'FERRY_ROUTE_NOT_FOUND');
  });

  it('serves /healthz and Prometheus /metrics', async () => {
    const health = await server.inject(`/healthz`);
    assert.deepEqual(health.json, { status: 'ok' });
    const metrics = await server.inject(`/metrics`);
    assert.match(metrics.headers.get('content-type') ?? '', /^text\/plain/);
    assert.match(metrics.text, /^ferry_builds_total\{state="ready",node="[^"]+",role="all"\} \d+/m);
    assert.match(metrics.text, /^ferry_http_requests_total\{/m);
  });
});
