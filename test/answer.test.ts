/**
 * http/answer.ts, the one error answer: every kind of error (a FerryError with and without headers or
 * details, Fastify's validation and parser errors, a store outage, bare or wrapped in FERRY_INTERNAL,
 * anything else thrown) becomes the status, headers and envelope docs/errors.md describes; and each writer
 * (raw response, upgrade socket, SSE event data, worker protocol line) puts that same answer on its
 * connection. In process, on loopback sockets only for the writers that need one.
 */
import assert from 'node:assert/strict';
import http from 'node:http';
import net from 'node:net';
import { after, before, describe, it } from 'node:test';
import { ERRORS, FerryError } from '../src/errors.js';
import {
  answer,
  errorEventData,
  refuseOnSocket,
  toFerryError,
  workerErrorLine,
  writeAnswer,
} from '../src/http/answer.js';
import { StoreUnavailableError } from '../src/store/index.js';

const RUN = '01a20bd5-2d74-72e0-9ad8-52788bca559a';
const JSON_TYPE = 'application/json; charset=utf-8';

describe('answer: any error to {status, headers, body}', () => {
  const cases: Array<[string, unknown, number, string, Record<string, string>?]> = [
    ['a FerryError', new FerryError('FERRY_APP_NOT_FOUND', 'No app "x"'), 404, 'FERRY_APP_NOT_FOUND'],
    [
      'a FerryError with Retry-After',
      new FerryError('FERRY_QUEUE_FULL', undefined, { headers: { 'retry-after': '5' } }),
      503,
      'FERRY_QUEUE_FULL',
      { 'retry-after': '5' },
    ],
    [
      'a validation error (Fastify)',
      Object.assign(new Error('body/x must be string'), { validation: [{}], statusCode: 400 }),
      400,
      'FERRY_VALIDATION',
    ],
    [
      'a Fastify parser error',
      Object.assign(new Error('bad json'), { code: 'FST_ERR_CTP_INVALID_JSON_BODY', statusCode: 400 }),
      400,
      'FERRY_INVALID_JSON',
    ],
    ['a bad URL', Object.assign(new Error('bad url'), { code: 'FST_ERR_BAD_URL' }), 400, 'FERRY_BAD_URL'],
    [
      'a JSON SyntaxError of the body parser',
      Object.assign(new SyntaxError('Unexpected token'), { statusCode: 400 }),
      400,
      'FERRY_INVALID_JSON',
    ],
    ['another 4xx of Fastify', Object.assign(new Error('too big'), { statusCode: 413 }), 413, 'FERRY_BODY_TOO_LARGE'],
    [
      'a store outage',
      new StoreUnavailableError(new Error('ECONNREFUSED')),
      503,
      'FERRY_STORE_UNAVAILABLE',
      { 'retry-after': '5' },
    ],
    [
      'a store outage a run wrapped in FERRY_INTERNAL',
      new FerryError('FERRY_INTERNAL', undefined, { cause: new StoreUnavailableError(new Error('57P01')) }),
      503,
      'FERRY_STORE_UNAVAILABLE',
      { 'retry-after': '5' },
    ],
    ['an unknown Error', new Error('secret /etc/ferry/keys'), 500, 'FERRY_INTERNAL'],
    ['a thrown string', 'oops', 500, 'FERRY_INTERNAL'],
    ['null', null, 500, 'FERRY_INTERNAL'],
  ];
  for (const [name, err, status, code, extra] of cases) {
    it(`${name}: ${status} ${code}`, () => {
      const answered = answer(err);
      assert.equal(answered.status, status);
      assert.equal(answered.error.code, code);
      assert.deepEqual(answered.headers, { ...extra, 'content-type': JSON_TYPE });
      const body = JSON.parse(answered.body) as { error: Record<string, string> };
      assert.deepEqual(Object.keys(body), ['error']);
      assert.equal(body.error.code, code);
      assert.equal(typeof body.error.message, 'string');
      assert.doesNotMatch(answered.body, /secret|stack|ECONNREFUSED|57P01/);
      if (code === 'FERRY_INTERNAL') assert.equal(body.error.message, ERRORS.FERRY_INTERNAL.message);
    });
  }

  it('a run: run_id in the body (last) and X-Request-Id', () => {
    const answered = answer(new FerryError('FERRY_NO_READY_BUILD'), { runId: RUN });
    assert.equal(
      answered.body,
      `{"error":{"code":"FERRY_NO_READY_BUILD","message":"${ERRORS.FERRY_NO_READY_BUILD.message}"},"run_id":"${RUN}"}`,
    );
    assert.equal(answered.headers['x-request-id'], RUN);
  });

  it('a call refused before it became a run: X-Request-Id only, no run_id (issue 43)', () => {
    const answered = answer(new FerryError('FERRY_UNSUPPORTED_MEDIA_TYPE'), { requestId: RUN });
    assert.deepEqual(Object.keys(JSON.parse(answered.body)), ['error']);
    assert.equal(answered.headers['x-request-id'], RUN);
  });

  it("an error's details are members of its error object", () => {
    const answered = answer(new FerryError('FERRY_FUNCTION_ERROR', 'TypeError: x', { details: { type: 'TypeError' } }));
    assert.deepEqual(JSON.parse(answered.body), {
      error: { code: 'FERRY_FUNCTION_ERROR', message: 'TypeError: x', type: 'TypeError' },
    });
  });

  it('toFerryError keeps a FerryError as it is', () => {
    const ferry = new FerryError('FERRY_RUN_TIMEOUT');
    assert.equal(toFerryError(ferry), ferry);
  });
});

describe('the writers', () => {
  it('SSE error event data: run_id first, then the error', () => {
    assert.equal(
      errorEventData(new FerryError('FERRY_STREAM_GONE', 'gone'), RUN),
      `{"run_id":"${RUN}","error":{"code":"FERRY_STREAM_GONE","message":"gone"}}`,
    );
    assert.equal(JSON.parse(errorEventData(new Error('x'), RUN)).error.code, 'FERRY_INTERNAL');
  });

  it('the worker protocol line: the error object, its status and headers', () => {
    assert.deepEqual(workerErrorLine(new StoreUnavailableError(new Error('down'))), {
      e: 'error',
      error: { code: 'FERRY_STORE_UNAVAILABLE', message: ERRORS.FERRY_STORE_UNAVAILABLE.message },
      status: 503,
      headers: { 'retry-after': '5' },
    });
    assert.equal(workerErrorLine(new Error('x')).error.code, 'FERRY_INTERNAL');
  });

  describe('on loopback sockets', () => {
    let server: http.Server;
    let port = 0;
    before(async () => {
      server = http.createServer((req, res) => {
        if (req.url === '/resumed') res.setHeader('x-request-id', 'the-resumed-run');
        writeAnswer(
          res,
          answer(new FerryError('FERRY_QUEUE_FULL', undefined, { headers: { 'retry-after': '3' } }), { runId: RUN }),
        );
      });
      server.on('upgrade', (_req, socket: net.Socket) => {
        refuseOnSocket(socket, answer(new StoreUnavailableError(new Error('down')), { runId: RUN }));
      });
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      port = (server.address() as net.AddressInfo).port;
    });
    after(() => new Promise<void>((resolve) => server.close(() => resolve())));

    it('a raw response: status, headers, length and body', async () => {
      const res = await fetch(`http://127.0.0.1:${port}/x`);
      assert.equal(res.status, 503);
      assert.equal(res.headers.get('retry-after'), '3');
      assert.equal(res.headers.get('x-request-id'), RUN);
      assert.equal(res.headers.get('content-type'), JSON_TYPE);
      const text = await res.text();
      assert.equal(res.headers.get('content-length'), String(Buffer.byteLength(text)));
      assert.deepEqual(JSON.parse(text).run_id, RUN);
    });

    it('a raw response that names its run already keeps that X-Request-Id', async () => {
      const res = await fetch(`http://127.0.0.1:${port}/resumed`);
      assert.equal(res.headers.get('x-request-id'), 'the-resumed-run');
      await res.text();
    });

    it('an upgrade refused: an HTTP/1.1 answer on the socket, then it closes', async () => {
      const text = await new Promise<string>((resolve, reject) => {
        const socket = net.connect(port, '127.0.0.1');
        let got = '';
        socket.setEncoding('utf8');
        socket.on('data', (chunk: string) => {
          got += chunk;
        });
        socket.on('error', reject);
        socket.on('close', () => resolve(got));
        socket.setTimeout(30_000, () => socket.destroy(new Error('no answer in 30 s')));
        socket.write('GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n');
      });
      const [head = '', body = ''] = text.split('\r\n\r\n');
      assert.match(head, /^HTTP\/1\.1 503 Service Unavailable\r\n/);
      assert.match(head, /\r\nretry-after: 5\r\n/);
      assert.match(head, new RegExp(`\\r\\nx-request-id: ${RUN}\\r\\n`));
      assert.match(head, /\r\nconnection: close$/);
      assert.match(head, new RegExp(`\\r\\ncontent-length: ${Buffer.byteLength(body)}\\r\\n`));
      assert.deepEqual(JSON.parse(body), {
        error: { code: 'FERRY_STORE_UNAVAILABLE', message: ERRORS.FERRY_STORE_UNAVAILABLE.message },
        run_id: RUN,
      });
    });
  });
});
