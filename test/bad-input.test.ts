/**
 * Inputs that used to answer 500 FERRY_INTERNAL or Fastify's own error shape: non-finite numbers in the
 * query, %-escapes that do not decode, and ZIP entry paths longer than the file system allows. Each is a
 * coded 4xx in Ferry's shape now.
 */
import assert from 'node:assert/strict';
import { once } from 'node:events';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

/** Ferry's error body: exactly `error` {code, message} (and `run_id` on the run endpoint). */
function assertFerryError(res: { status: number; json: unknown; text: string }, status: number, code: string) {
  assert.equal(res.status, status, res.text);
  const body = res.json as { error?: { code?: unknown; message?: unknown } };
  assert.equal(body?.error?.code, code, res.text);
  assert.equal(typeof body.error?.message, 'string');
}

/** Writes `bytes` on a fresh connection and reads until the server closes it. */
function rawExchange(url: string, bytes: string): Promise<string> {
  const { hostname, port } = new URL(url);
  return new Promise((resolve, reject) => {
    const socket = connect(Number(port), hostname, () => socket.end(bytes));
    let text = '';
    socket.setEncoding('utf8');
    socket.on('data', (d: string) => (text += d));
    socket.on('close', () => resolve(text));
    socket.on('error', reject);
    socket.setTimeout(30_000, () => socket.destroy(new Error('timed out')));
  });
}

describe('bad input answers a coded 4xx', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let app: string;

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'echo', {
      'ferry.toml': '[app]\nname = "echo"\n',
      'main.ts': 'export function run(args: unknown) { return args; }',
    });
    app = `${server.url}/v2/projects/${auth.projectId}/apps/echo`;
  });
  after(() => server.close());

  it('refuses non-finite numbers in the query with 400 FERRY_VALIDATION naming the parameter', async () => {
    const build = (await http(`${app}/builds`, { token: auth.token })).json.builds[0].id;
    const cases: Array<[string, string]> = [];
    for (const value of ['Infinity', '-Infinity', '1e309', '-1e309']) {
      cases.push(
        [`${app}/runs?limit=${value}`, 'limit'],
        [`${app}/builds?limit=${value}`, 'limit'],
        [`${app}/logs?limit=${value}`, 'limit'],
        [`${app}/logs?after=${value}`, 'after'],
        [`${app}/stats?minutes=${value}`, 'minutes'],
        [`${app}/builds/${build}/logs?after=${value}`, 'after'],
      );
    }
    for (const [url, name] of cases) {
      const res = await http(url, { token: auth.token });
      assertFerryError(res, 400, 'FERRY_VALIDATION');
      assert.match(res.json.error.message, new RegExp(`\\b${name}\\b`), url);
    }
  });

  it('answers a URL whose %-escapes do not decode with 400 FERRY_BAD_URL in Ferry’s shape', async () => {
    for (const path of [
      '/v2/projects/%E0%A4%A',
      `/v2/projects/${auth.projectId}/apps/%FF`,
      `/v4/${auth.projectId}/echo/%C0`,
      '/nowhere/%E0%A4%A',
    ]) {
      const res = await http(`${server.url}${path}`, { token: auth.token });
      assertFerryError(res, 400, 'FERRY_BAD_URL');
      assert.deepEqual(Object.keys(res.json), ['error']);
    }
  });

  it('refuses ZIP entries with a name or path longer than the file system allows (400 FERRY_ZIP_PATH_TOO_LONG)', async () => {
    const toml = '[app]\nname = "long"\n';
    const main = 'export function run() { return 1; }';
    const longName = `${'n'.repeat(300)}.ts`;
    const deepPath = `${Array.from({ length: 50 }, (_, i) => `folder-${i}-${'d'.repeat(90)}`).join('/')}/x.ts`;
    assert.ok(deepPath.length > 4096);
    for (const [name, why] of [
      [longName, 'name of 303 bytes'],
      [deepPath, 'path of'],
    ] as const) {
      const zip = await zipFiles({ 'ferry.toml': toml, 'main.ts': main, [name]: 'export {};' });
      const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/long/builds`, {
        method: 'POST',
        token: auth.token,
        body: zip,
        headers: { 'content-type': 'application/zip' },
      });
      assertFerryError(res, 400, 'FERRY_ZIP_PATH_TOO_LONG');
      assert.match(res.json.error.message, new RegExp(why));
    }
    // Names up to the limits still deploy.
    await deployFiles(server, auth, 'long', {
      'ferry.toml': toml,
      'main.ts': main,
      [`${'a'.repeat(255)}`]: 'x',
      [`${Array.from({ length: 9 }, () => 'b'.repeat(100)).join('/')}/c.txt`]: 'x',
    });
  });

  it('answers what Node’s HTTP parser refuses (not HTTP, headers too large) in Ferry’s shape', async () => {
    const cases: Array<[string, number, string]> = [
      ['NOT HTTP AT ALL\r\n\r\n', 400, 'FERRY_BAD_REQUEST'],
      [`GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${'b'.repeat(20_000)}\r\n\r\n`, 431, 'FERRY_HEADERS_TOO_LARGE'],
    ];
    for (const [bytes, status, code] of cases) {
      const answer = await rawExchange(server.url, bytes);
      const [head = '', body = ''] = answer.split('\r\n\r\n');
      assert.match(head, new RegExp(`^HTTP/1.1 ${status} `));
      assert.match(head, /content-type: application\/json/i);
      const json = JSON.parse(body);
      assert.deepEqual(Object.keys(json), ['error']);
      assert.equal(json.error.code, code);
      if (status === 431) assert.match(json.error.message, /16384 bytes/);
    }
  });

  it('reads and drops the rest of a refused body, answering the caller while it sends, and keeps the connection', async () => {
    // Refused before its body is read (401 here; 413 for an upload past a volume's room). The answer said
    // `connection: close` and the server closed at once: a caller still sending met a reset and saw EPIPE
    // instead of the answer (CI, a 16 MiB volume upload). Now the rest is read and dropped, and the
    // connection serves the caller's next request.
    const { hostname, port } = new URL(server.url);
    // Half open, as an HTTP client sending a body is: it goes on sending whatever it reads meanwhile.
    const socket = connect({ port: Number(port), host: hostname, allowHalfOpen: true });
    await once(socket, 'connect');
    const problems: string[] = [];
    socket.on('error', (err) => problems.push(String(err)));
    socket.setTimeout(60_000, () => socket.destroy(new Error(`timed out; so far:\n${text}`)));
    const closed = new Promise<void>((resolve) => socket.once('close', () => resolve()));
    let text = '';
    socket.setEncoding('utf8');
    socket.on('data', (d: string) => (text += d));
    const total = 32 * 1024 * 1024;
    socket.write(
      `PUT /v2/projects/${auth.projectId}/volumes/none/file?path=a.bin HTTP/1.1\r\nhost: ferry\r\n` +
        `authorization: Bearer not-a-token\r\ncontent-length: ${total}\r\n\r\n`,
    );
    socket.write(Buffer.alloc(64 * 1024));
    await waitFor(async () => text.includes('}'), 30_000, 'the answer');
    assert.match(text, /^HTTP\/1\.1 401 /);
    // The caller sends the rest of its body after it has the answer, then its next request.
    const chunk = Buffer.alloc(1024 * 1024);
    for (let sent = 64 * 1024; sent < total && problems.length === 0; sent += chunk.length) {
      if (!socket.write(chunk.subarray(0, Math.min(chunk.length, total - sent)))) {
        await new Promise<void>((resolve) => {
          socket.once('drain', resolve);
          socket.once('close', resolve);
        });
      }
    }
    socket.write('GET /healthz HTTP/1.1\r\nhost: ferry\r\nconnection: close\r\n\r\n');
    socket.once('end', () => socket.end());
    await closed;
    assert.deepEqual(problems, [], 'sending the rest of the body met no reset');
    assert.match(text, /\r\n\r\n\{.*\}HTTP\/1\.1 200 /s, 'the next request on the connection was answered');
  });
});
