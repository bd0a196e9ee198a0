/**
 * Streaming mode (spec 4.4): headers, one `data:` event per item the moment it is yielded (also through
 * gzip, flushed per event), multi-line strings, errors mid-stream, a disconnecting client stopping the
 * generator, and a generator called without an event stream answering a JSON array.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { http as call, deployFiles, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { disconnectAfterFirstItem, streamRequest } from './helpers/stream.js';

describe('streaming runs', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const url = (fn: string) => `${server.url}/v4/${auth.projectId}/streamer/${fn}`;

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'streamer', {
      'ferry.toml': '[app]\nname = "streamer"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n',
      'main.ts': `
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
export async function* count({ n = 4, ms = 250 }: { n?: number; ms?: number }) {
  for (let i = 0; i < n; i++) { await sleep(ms); yield { i }; }
}
export function* words() { yield 'plain text'; yield 'two\\nlines'; yield 42; }
export async function* failing() { yield 'first'; await sleep(50); throw new TypeError('broke mid-stream'); }
export async function* forever() { let i = 0; try { for (;;) { await sleep(50); yield i++; } } finally { console.log('generator closed'); } }
`,
    });
  });
  after(() => server.close());

  it('sends each item as it is yielded, with the headers the spec names', async () => {
    // Items 400 ms apart (1.2 s from first to last): buffered, they would arrive together. Checking for half
    // that spread leaves room for a test process kept off the CPU on a busy machine.
    const res = await streamRequest(url('count'), auth.token, { n: 4, ms: 400 });
    assert.equal(res.status, 200);
    assert.equal(res.headers['content-type'], 'text/event-stream; charset=utf-8');
    assert.equal(res.headers['cache-control'], 'no-cache');
    assert.equal(res.headers['transfer-encoding'], 'chunked');
    assert.match(String(res.headers['x-request-id']), /^[0-9a-f-]{36}$/);
    const text = res.arrivals.map((a) => a.text).join('');
    assert.equal(text, 'data: {"i":0}\n\ndata: {"i":1}\n\ndata: {"i":2}\n\ndata: {"i":3}\n\n');
    const eventTimes = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
    assert.ok(eventTimes.length >= 3, `events arrived in ${eventTimes.length} chunks: progressive delivery`);
    assert.ok(eventTimes.at(-1)! - eventTimes[0]! >= 600, `arrivals spread with the generator's sleeps: ${eventTimes}`);
  });

  it('still delivers each event as it is yielded when gzip-compressed', async () => {
    const res = await streamRequest(url('count'), auth.token, { n: 4, ms: 400 }, { 'accept-encoding': 'gzip' });
    assert.equal(res.headers['content-encoding'], 'gzip');
    const text = res.arrivals.map((a) => a.text).join('');
    assert.equal(text, 'data: {"i":0}\n\ndata: {"i":1}\n\ndata: {"i":2}\n\ndata: {"i":3}\n\n');
    const eventTimes = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
    assert.ok(eventTimes.length >= 3, 'flushed per event');
    assert.ok(eventTimes.at(-1)! - eventTimes[0]! >= 600, `${eventTimes}`);
  });

  it('sends strings as they are, splits multi-line strings into data lines, and other values as JSON', async () => {
    const res = await streamRequest(url('words'), auth.token, {});
    assert.equal(
      res.arrivals.map((a) => a.text).join(''),
      'data: plain text\n\ndata: two\ndata: lines\n\ndata: 42\n\n',
    );
  });

  it('ends the stream with an error event when the generator throws, and records failure', async () => {
    const res = await streamRequest(url('failing'), auth.token, {});
    const text = res.arrivals.map((a) => a.text).join('');
    assert.match(text, /^data: first\n\n/);
    const match = /event: error\ndata: (.*)\n\n$/.exec(text);
    assert.ok(match, text);
    const payload = JSON.parse(match[1]!);
    assert.equal(payload.error.code, 'FERRY_FUNCTION_ERROR');
    assert.match(payload.error.message, /broke mid-stream/);
    const runId = String(res.headers['x-request-id']);
    const run = await waitFor(async () => {
      const r = await call(`${server.url}/v2/projects/${auth.projectId}/apps/streamer/runs/${runId}`, {
        token: auth.token,
      });
      return r.json.state === 'failure' ? r.json : undefined;
    });
    assert.equal(run.mode, 'stream');
  });

  it('stops the generator when the client disconnects and frees the replica slot', async () => {
    const runId = await disconnectAfterFirstItem(url('forever'), auth.token);
    // One replica, one slot: a new call gets through only if the endless generator let go of it. Not let go,
    // it would hold the slot for the app's grace period (900 s); idle, it lets go at once. The bound is
    // generous, and streamRequest gives up on a silent connection before the test could hang.
    const started = Date.now();
    const next = await streamRequest(url('words'), auth.token, {});
    assert.equal(next.status, 200);
    assert.ok(Date.now() - started < 20_000, `the slot was free ${Date.now() - started} ms later`);
    const run = await waitFor(async () => {
      const r = await call(`${server.url}/v2/projects/${auth.projectId}/apps/streamer/runs/${runId}`, {
        token: auth.token,
      });
      return r.json.state !== 'running' && r.json.state !== 'queued' ? r.json : undefined;
    });
    assert.equal(run.state, 'cancelled');
    assert.equal(run.reason, 'client_disconnected');
  });

  it('answers a generator called without Accept: text/event-stream with its items as a JSON array', async () => {
    const res = await call(url('words'), { method: 'POST', token: auth.token, body: {} });
    assert.equal(res.status, 200);
    assert.deepEqual(res.json.result, ['plain text', 'two\nlines', 42]);
  });
});
