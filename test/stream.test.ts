/**
 * Streaming mode (spec 4.4): headers, one `data:` event per item the moment it is yielded (also through
 * gzip, flushed per event), each with its `id:`, and no other `data:` line: the stream's end and an error
 * mid-stream are comments (`: end {...}`, `: error {...}`), named events only when the caller asks
 * (`?events=true` or `X-Ferry-Stream-Events: true`); multi-line strings, a disconnecting client that does not come back stopping the generator after the
 * resume grace period, and a generator called without an event stream answering a JSON array.
 * Resuming is in stream-resume.test.ts.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { http as call, deployFiles, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { dataLines, disconnectAfterFirstItem, endEvent, streamRequest, streamWire } from './helpers/stream.js';

describe('streaming runs', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const url = (fn: string) => `${server.url}/v4/${auth.projectId}/streamer/${fn}`;

  before(async () => {
    // A short resume grace, so a caller that goes away for good frees the one slot soon.
    server = await startServer({ streamResumeGraceSeconds: 1 });
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
    const runId = String(res.headers['x-request-id']);
    assert.match(runId, /^[0-9a-f-]{36}$/);
    const text = res.arrivals.map((a) => a.text).join('');
    // A reader of `data:` lines (Python's iter_lines() way) gets exactly the yielded items, nothing more.
    assert.deepEqual(dataLines(text), ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}']);
    assert.equal(text, streamWire(runId, ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}', endEvent(runId)]));
    assert.match(text, new RegExp(`\n: end \\{"run_id":"${runId}","state":"success"\\}\n\n$`));
    const eventTimes = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
    assert.ok(eventTimes.length >= 3, `events arrived in ${eventTimes.length} chunks: progressive delivery`);
    assert.ok(eventTimes.at(-1)! - eventTimes[0]! >= 600, `arrivals spread with the generator's sleeps: ${eventTimes}`);
  });

  it('still delivers each event as it is yielded when gzip-compressed', async () => {
    const res = await streamRequest(url('count'), auth.token, { n: 4, ms: 400 }, { 'accept-encoding': 'gzip' });
    assert.equal(res.headers['content-encoding'], 'gzip');
    const runId = String(res.headers['x-request-id']);
    const text = res.arrivals.map((a) => a.text).join('');
    assert.equal(text, streamWire(runId, ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}', endEvent(runId)]));
    const eventTimes = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
    assert.ok(eventTimes.length >= 3, 'flushed per event');
    assert.ok(eventTimes.at(-1)! - eventTimes[0]! >= 600, `${eventTimes}`);
  });

  it('sends strings as they are, splits multi-line strings into data lines, and other values as JSON', async () => {
    const res = await streamRequest(url('words'), auth.token, {});
    const runId = String(res.headers['x-request-id']);
    const text = res.arrivals.map((a) => a.text).join('');
    assert.match(text, /\ndata: two\ndata: lines\n\n/);
    assert.deepEqual(dataLines(text), ['plain text', 'two', 'lines', '42']);
    assert.equal(text, streamWire(runId, ['plain text', 'two\nlines', '42', endEvent(runId)]));
  });

  it('ends the stream with an error comment when the generator throws, and records failure', async () => {
    const res = await streamRequest(url('failing'), auth.token, {});
    const runId = String(res.headers['x-request-id']);
    const text = res.arrivals.map((a) => a.text).join('');
    const match = /^retry: 1000\n\nid: \S+\ndata: first\n\n: error (.*)\n\n: end \{.*\}\n\n$/.exec(text);
    assert.ok(match, text);
    assert.deepEqual(dataLines(text), ['first'], 'the error is no data: line');
    const payload = JSON.parse(match[1]!);
    assert.equal(payload.run_id, runId);
    assert.equal(payload.error.code, 'FERRY_FUNCTION_ERROR');
    assert.match(payload.error.message, /broke mid-stream/);
    assert.equal(text, streamWire(runId, ['first', { event: 'error', data: match[1]! }, endEvent(runId, 'failure')]));
    const run = await waitFor(async () => {
      const r = await call(`${server.url}/v2/projects/${auth.projectId}/apps/streamer/runs/${runId}`, {
        token: auth.token,
      });
      return r.json.state === 'failure' ? r.json : undefined;
    });
    assert.equal(run.mode, 'stream');
  });

  it('stops the generator when the client disconnects and does not resume within the grace, freeing the slot', async () => {
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

    // A reconnect after the grace finds the run over: the items it missed, why it ended, and the end.
    const late = await streamRequest(url('forever'), auth.token, {}, { 'last-event-id': `${runId}:1` });
    assert.equal(late.status, 200);
    const text = late.arrivals.map((a) => a.text).join('');
    const match = /\nid: \S+:(\d+)\ndata: \d+\n\n: error (.*)\n\n: end \{.*\}\n\n$/.exec(text);
    assert.ok(match, text);
    const lastItem = Number(match[1]);
    assert.equal(JSON.parse(match[2]!).error.code, 'FERRY_CLIENT_GONE');
    const items = Array.from({ length: lastItem - 1 }, (_, i) => String(i + 1));
    assert.equal(
      text,
      streamWire(runId, ['0', ...items, { event: 'error', data: match[2]! }, endEvent(runId, 'cancelled')]).replace(
        `id: ${runId}:1\ndata: 0\n\n`,
        '',
      ),
    );
    // After the last item there is nothing more a reader of items could get: 204 (EventSource stops).
    const over = await streamRequest(url('forever'), auth.token, {}, { 'last-event-id': `${runId}:${lastItem}` });
    assert.equal(over.status, 204);
    // With named events, the error and the end are events with ids: resuming after the last item sends them.
    const named = await streamRequest(
      `${url('forever')}?events=true`,
      auth.token,
      {},
      {
        'last-event-id': `${runId}:${lastItem}`,
      },
    );
    assert.equal(named.status, 200);
    const namedText = named.arrivals.map((a) => a.text).join('');
    assert.equal(
      namedText,
      `retry: 1000\n\nevent: error\nid: ${runId}:${lastItem + 1}\ndata: ${match[2]}\n\n` +
        `event: end\nid: ${runId}:${lastItem + 2}\ndata: {"run_id":"${runId}","state":"cancelled"}\n\n`,
    );
    const namedOver = await streamRequest(
      `${url('forever')}?events=true`,
      auth.token,
      {},
      {
        'last-event-id': `${runId}:${lastItem + 2}`,
      },
    );
    assert.equal(namedOver.status, 204);
  });

  it('sends the error and the end as named events when asked (?events=true or X-Ferry-Stream-Events)', async () => {
    const items = ['{"i":0}', '{"i":1}'];
    for (const [how, query, headers] of [
      ['query', '?events=true', {}],
      ['query 1', '?events=1', {}],
      ['header', '', { 'x-ferry-stream-events': 'true' }],
    ] as const) {
      const res = await streamRequest(`${url('count')}${query}`, auth.token, { n: 2, ms: 10 }, headers);
      assert.equal(res.status, 200, how);
      const runId = String(res.headers['x-request-id']);
      const text = res.arrivals.map((a) => a.text).join('');
      assert.equal(text, streamWire(runId, [...items, endEvent(runId)], { named: true }), how);
    }
    // Anything else is the default form.
    const plain = await streamRequest(`${url('count')}?events=yes`, auth.token, { n: 2, ms: 10 });
    const plainText = plain.arrivals.map((a) => a.text).join('');
    assert.equal(
      plainText,
      streamWire(String(plain.headers['x-request-id']), [...items, endEvent(String(plain.headers['x-request-id']))]),
    );

    const failed = await streamRequest(url('failing'), auth.token, {}, { 'x-ferry-stream-events': 'true' });
    const runId = String(failed.headers['x-request-id']);
    const text = failed.arrivals.map((a) => a.text).join('');
    const match = /^retry: 1000\n\nid: \S+\ndata: first\n\nevent: error\nid: \S+\ndata: (.*)\n\nevent: end\n/.exec(
      text,
    );
    assert.ok(match, text);
    assert.equal(JSON.parse(match[1]!).error.code, 'FERRY_FUNCTION_ERROR');
    assert.equal(
      text,
      streamWire(runId, ['first', { event: 'error', data: match[1]! }, endEvent(runId, 'failure')], { named: true }),
    );
  });

  it('answers a generator called without Accept: text/event-stream with its items as a JSON array', async () => {
    const res = await call(url('words'), { method: 'POST', token: auth.token, body: {} });
    assert.equal(res.status, 200);
    assert.deepEqual(res.json.result, ['plain text', 'two\nlines', 42]);
  });
});
