/**
 * Resumable streams: every event of a streaming run has the id `<run_id>:<seq>` and the stream ends with
 * an end that no reader of events takes for an item (a comment; `event: end` with `?events=true`); a reconnect carrying `Last-Event-ID` (or `?lastEventId=`) resumes the same run (replay,
 * then live) instead of running the function again; 204 once nothing is left; coded errors for unknown,
 * foreign and malformed ids; an explicit error event when the size bound dropped events; and the npm
 * `eventsource` client, cut off mid-stream, sees every item once from one run.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { EventSource } from 'eventsource';
import { createParser } from 'eventsource-parser';
import { createStreamReplay } from '../src/runs/stream-replay.js';
import { http as call, deployFiles, startServer, type TestServer } from './helpers/ferry.js';

interface SseEvent {
  id: string | undefined;
  event: string | undefined;
  data: string;
}

/** A streaming call read with fetch and eventsource-parser, event by event. */
async function connect(url: string, token: string | undefined, body: unknown, headers: Record<string, string> = {}) {
  const abort = new AbortController();
  const res = await fetch(url, {
    method: 'POST',
    headers: {
      ...(token ? { authorization: `Bearer ${token}` } : {}),
      accept: 'text/event-stream',
      'content-type': 'application/json',
      ...headers,
    },
    body: JSON.stringify(body),
    signal: abort.signal,
  });
  const queue: SseEvent[] = [];
  let ended = false;
  let wake: () => void = () => {};
  const parser = createParser({
    onEvent: (e) => {
      queue.push({ id: e.id, event: e.event, data: e.data });
      wake();
    },
  });
  const pump = async () => {
    if (!res.body || !res.headers.get('content-type')?.startsWith('text/event-stream')) return;
    const decoder = new TextDecoder();
    for await (const chunk of res.body) parser.feed(decoder.decode(chunk as Uint8Array, { stream: true }));
  };
  pump()
    .catch(() => undefined)
    .finally(() => {
      ended = true;
      wake();
    });

  /** The next event, or undefined when the stream ended; fails after a generous bound. */
  async function next(): Promise<SseEvent | undefined> {
    const deadline = Date.now() + 60_000;
    while (queue.length === 0 && !ended) {
      assert.ok(Date.now() < deadline, 'no event within 60 s');
      await new Promise<void>((resolve) => {
        wake = resolve;
        setTimeout(resolve, 1000);
      });
    }
    return queue.shift();
  }
  /** Every event until the stream ends. */
  async function rest(): Promise<SseEvent[]> {
    const out: SseEvent[] = [];
    for (let i = 0; i < 1000; i++) {
      const e = await next();
      if (!e) return out;
      out.push(e);
    }
    throw new Error('more than 1000 events');
  }
  return { res, next, rest, close: () => abort.abort() };
}

const MAIN_TS = `
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const starts: Record<string, number> = {};
const released = new Set<string>();
const started = (tag: string) => { starts[tag] = (starts[tag] ?? 0) + 1; };

/** Yields a and b, waits (at most two minutes) until release({tag}) is called, then yields c and d. */
export async function* gated({ tag }: { tag: string }) {
  started(tag);
  yield 'a';
  yield 'b';
  for (let i = 0; i < 2400 && !released.has(tag); i++) await sleep(50);
  yield 'c';
  yield 'd';
}
export function release({ tag }: { tag: string }) { released.add(tag); return true; }
export function starts_of({ tag }: { tag: string }) { return starts[tag] ?? 0; }
export async function* count({ tag, n = 3, ms = 20 }: { tag: string; n?: number; ms?: number }) {
  started(tag);
  for (let i = 0; i < n; i++) { await sleep(ms); yield { i }; }
}
export function* big({ n = 10 }: { n?: number }) { for (let i = 0; i < n; i++) yield String(i).padStart(400, '.'); }
`;

describe('resumable streams', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const url = (fn: string, app = 'resumer') => `${server.url}/v4/${auth.projectId}/${app}/${fn}`;
  const run = async (fn: string, body: unknown) => {
    const res = await call(url(fn), { method: 'POST', token: auth.token, body });
    assert.equal(res.status, 200, res.text);
    return res.json.result;
  };
  /** How many stream runs of `fn` called with this tag the app's run list has (newest 500). */
  const recordedRuns = async (fn: string, tag: string) => {
    const base = `${server.url}/v2/projects/${auth.projectId}/apps/resumer/runs`;
    const list = await call(`${base}?mode=stream&limit=500`, { token: auth.token });
    assert.equal(list.status, 200, list.text);
    let found = 0;
    for (const r of list.json.runs as { run_id: string; function: string }[]) {
      if (r.function !== fn) continue;
      const one = await call(`${base}/${r.run_id}`, { token: auth.token });
      if (one.json.input?.tag === tag) found++;
    }
    return found;
  };
  const lastIdHeader = (id: string) => ({ 'last-event-id': id });

  before(async () => {
    // A generous grace, so a test's reconnect always comes in time; 2 KiB kept per run, to reach the bound.
    server = await startServer({ streamResumeGraceSeconds: 60, streamReplayBytes: 2048 });
    auth = await server.bootstrap();
    const toml = (name: string) =>
      `[app]\nname = "${name}"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 8\nresponse_grace_period = 180\n`;
    await deployFiles(server, auth, 'resumer', { 'ferry.toml': toml('resumer'), 'main.ts': MAIN_TS });
    await deployFiles(server, auth, 'other', { 'ferry.toml': toml('other'), 'main.ts': MAIN_TS });
  });
  after(() => server.close());

  it('gives every event the id <run_id>:<seq>; the events are the items, and event: end when asked', async () => {
    const stream = await connect(url('count'), auth.token, { tag: 'ids', n: 3 });
    assert.equal(stream.res.status, 200);
    const runId = String(stream.res.headers.get('x-request-id'));
    const items = [
      { id: `${runId}:1`, event: undefined, data: '{"i":0}' },
      { id: `${runId}:2`, event: undefined, data: '{"i":1}' },
      { id: `${runId}:3`, event: undefined, data: '{"i":2}' },
    ];
    assert.deepEqual(await stream.rest(), items);

    const named = await connect(`${url('count')}?events=true`, auth.token, { tag: 'ids', n: 3 });
    const namedId = String(named.res.headers.get('x-request-id'));
    assert.deepEqual(await named.rest(), [
      ...items.map((e) => ({ ...e, id: e.id.replace(runId, namedId) })),
      { id: `${namedId}:4`, event: 'end', data: JSON.stringify({ run_id: namedId, state: 'success' }) },
    ]);
  });

  it('resumes a running stream after Last-Event-ID: replays what followed, then goes on live, running once', async () => {
    const tag = 'live';
    const first = await connect(url('gated'), auth.token, { tag });
    const runId = String(first.res.headers.get('x-request-id'));
    assert.deepEqual(await first.next(), { id: `${runId}:1`, event: undefined, data: 'a' });
    assert.deepEqual(await first.next(), { id: `${runId}:2`, event: undefined, data: 'b' });
    first.close();

    // Resume after event 1: event 2 is replayed; c and d can only come live, after the release below.
    const second = await connect(url('gated'), auth.token, { tag }, lastIdHeader(`${runId}:1`));
    assert.equal(second.res.status, 200);
    assert.equal(second.res.headers.get('x-request-id'), runId);
    assert.deepEqual(await second.next(), { id: `${runId}:2`, event: undefined, data: 'b' });
    assert.equal(await run('release', { tag }), true);
    assert.deepEqual(await second.rest(), [
      { id: `${runId}:3`, event: undefined, data: 'c' },
      { id: `${runId}:4`, event: undefined, data: 'd' },
    ]);

    // After the last item (or the end's id, which named events carry) nothing is left: 204.
    for (const id of [`${runId}:4`, `${runId}:5`]) {
      const done = await connect(url('gated'), auth.token, { tag }, lastIdHeader(id));
      assert.equal(done.res.status, 204, id);
    }
    // With named events the end is one more event: resuming after the last item sends it.
    const end = await connect(`${url('gated')}?events=true`, auth.token, { tag }, lastIdHeader(`${runId}:4`));
    assert.deepEqual(await end.rest(), [
      { id: `${runId}:5`, event: 'end', data: JSON.stringify({ run_id: runId, state: 'success' }) },
    ]);
    assert.equal(await run('starts_of', { tag }), 1);
    assert.equal(await recordedRuns('gated', tag), 1);
    const record = await call(`${server.url}/v2/projects/${auth.projectId}/apps/resumer/runs/${runId}`, {
      token: auth.token,
    });
    assert.equal(record.json.state, 'success');
  });

  it('replays a finished run from a kept event (header or ?lastEventId=) and answers 204 after its end', async () => {
    const tag = 'finished';
    const stream = await connect(url('count'), auth.token, { tag, n: 3 });
    const runId = String(stream.res.headers.get('x-request-id'));
    const all = await stream.rest();
    assert.equal(all.length, 3);

    const replay = await connect(url('count'), auth.token, { tag, n: 3 }, lastIdHeader(`${runId}:1`));
    assert.equal(replay.res.status, 200);
    assert.deepEqual(await replay.rest(), all.slice(1));

    const byQuery = await connect(`${url('count')}?lastEventId=${encodeURIComponent(`${runId}:2`)}`, auth.token, {
      tag,
    });
    assert.deepEqual(await byQuery.rest(), all.slice(2));

    for (const id of [`${runId}:3`, `${runId}:4`]) {
      const end = await connect(url('count'), auth.token, { tag }, lastIdHeader(id));
      assert.equal(end.res.status, 204, id);
      assert.equal(end.res.headers.get('x-request-id'), runId);
      const endByQuery = await connect(`${url('count')}?lastEventId=${id}`, auth.token, { tag });
      assert.equal(endByQuery.res.status, 204, id);
    }
    assert.equal(await run('starts_of', { tag }), 1);
    assert.equal(await recordedRuns('count', tag), 1);
  });

  it('answers coded errors for unknown, foreign, malformed and unauthenticated resumes, running nothing', async () => {
    const tag = 'refused';
    const stream = await connect(url('count'), auth.token, { tag, n: 2 });
    const runId = String(stream.res.headers.get('x-request-id'));
    await stream.rest();

    const attempts: [string, string | undefined, string, number, string][] = [
      ['unknown run', auth.token, url('count'), 410, `01890000-0000-7000-8000-000000000000:1`],
      ["another app's path", auth.token, url('count', 'other'), 410, `${runId}:1`],
      ['another function', auth.token, url('gated'), 410, `${runId}:1`],
      ['not an event id', auth.token, url('count'), 400, 'hello'],
      ['an event not sent yet', auth.token, url('count'), 400, `${runId}:99`],
      ['no token', undefined, url('count'), 401, `${runId}:1`],
    ];
    const codes: Record<number, string> = {
      410: 'FERRY_STREAM_GONE',
      400: 'FERRY_LAST_EVENT_ID_INVALID',
      401: 'FERRY_UNAUTHENTICATED',
    };
    for (const [what, token, target, status, id] of attempts) {
      const res = await connect(target, token, { tag }, lastIdHeader(id));
      assert.equal(res.res.status, status, what);
      const body = (await res.res.json()) as { error: { code: string } };
      assert.equal(body.error.code, codes[status], what);
    }
    assert.equal(await run('starts_of', { tag }), 1);
    assert.equal(await recordedRuns('count', tag), 1);
  });

  it('says so with an error event when events after Last-Event-ID were dropped by the size bound', async () => {
    const stream = await connect(`${url('big')}?events=true`, auth.token, { n: 10 });
    const runId = String(stream.res.headers.get('x-request-id'));
    const all = await stream.rest();
    assert.equal(all.length, 11);

    // By default the notice is a comment: the wire's first lines after `retry:`, no data: line.
    const raw = await fetch(url('big'), {
      method: 'POST',
      headers: {
        authorization: `Bearer ${auth.token}`,
        accept: 'text/event-stream',
        'last-event-id': `${runId}:1`,
      },
    });
    assert.equal(raw.status, 200);
    const wire = await raw.text();
    assert.match(wire, /^retry: 1000\n\n: error \{"run_id":"[^"]+","error":\{"code":"FERRY_STREAM_EVENTS_DROPPED",/);
    assert.doesNotMatch(wire, /^event:/m);

    const resumed = await connect(`${url('big')}?events=true`, auth.token, { n: 10 }, lastIdHeader(`${runId}:1`));
    assert.equal(resumed.res.status, 200);
    const events = await resumed.rest();
    const [notice, ...replayed] = events;
    assert.equal(notice?.event, 'error');
    assert.equal(notice.id, undefined, 'the notice is not one of the run events');
    const payload = JSON.parse(notice.data);
    assert.equal(payload.run_id, runId);
    assert.equal(payload.error.code, 'FERRY_STREAM_EVENTS_DROPPED');
    // 2 KiB per run (overheads counted) keeps the last two 400-byte items and the end: 2 to 8 are gone.
    const firstKept = Number(replayed[0]?.id?.split(':')[1]);
    assert.ok(firstKept > 2, `first kept event ${firstKept}`);
    assert.equal(payload.error.resumes_at, `${runId}:${firstKept}`);
    assert.deepEqual(replayed, all.slice(firstKept - 1), 'the kept events, in order, to the end');
  });

  /**
   * The npm eventsource client on `count` (6 items), its first connection cut after the second event: what
   * it received, the statuses of its connections and the Last-Event-ID each carried.
   */
  async function eventSourceRun(tag: string, target: string) {
    const statuses: number[] = [];
    const lastIds: (string | null)[] = [];
    const es = new EventSource(target, {
      // The run endpoint takes POST with a token: eventsource lets the request be made by our fetch.
      fetch: async (input, init) => {
        lastIds.push(init.headers['Last-Event-ID'] ?? null);
        const res = await fetch(input, {
          ...init,
          method: 'POST',
          headers: { ...init.headers, authorization: `Bearer ${auth.token}`, 'content-type': 'application/json' },
          body: JSON.stringify({ tag, n: 6, ms: 300 }),
        });
        statuses.push(res.status);
        if (statuses.length > 1 || !res.body) return res;
        // The first connection breaks after its second event, as a flaky network would.
        const reader = res.body.getReader();
        const decoder = new TextDecoder();
        let seen = '';
        const cut = new ReadableStream<Uint8Array>({
          async pull(controller) {
            const { done, value } = await reader.read();
            if (done) return controller.close();
            controller.enqueue(value);
            seen += decoder.decode(value, { stream: true });
            if ((seen.match(/^id: /gm) ?? []).length >= 2 && seen.endsWith('\n\n')) {
              await reader.cancel();
              controller.close();
            }
          },
        });
        return new Response(cut, { status: res.status, headers: res.headers });
      },
    });
    const messages: string[] = [];
    const ends: string[] = [];
    es.onmessage = (e) => messages.push(e.data);
    es.addEventListener('end', (e) => ends.push(e.data));
    const deadline = Date.now() + 60_000;
    while (es.readyState !== es.CLOSED) {
      assert.ok(Date.now() < deadline, `still open after 60 s: ${JSON.stringify({ statuses, messages })}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    es.close();
    return { statuses, lastIds, messages, ends };
  }

  it('serves the npm eventsource client: cut off mid-stream, it resumes, gets every item once, and stops at 204', async () => {
    const tag = 'eventsource';
    const { statuses, lastIds, messages, ends } = await eventSourceRun(tag, url('count'));
    assert.deepEqual(
      messages,
      [0, 1, 2, 3, 4, 5].map((i) => JSON.stringify({ i })),
    );
    assert.equal(ends.length, 0, 'no named event unless asked for');
    assert.deepEqual(statuses, [200, 200, 204], 'first call, resume, stop');
    // The cut comes after the second event's chunk: usually event 2, later if chunks arrived together.
    assert.equal(lastIds.length, 3);
    assert.equal(lastIds[0], null);
    const runId = String(lastIds[1]).split(':')[0];
    assert.match(String(lastIds[1]), new RegExp(`^${runId}:[2-6]$`));
    // The end is a comment with no id: the last id is the last item's, and after it the answer is 204.
    assert.equal(lastIds[2], `${runId}:6`);
    assert.equal(await run('starts_of', { tag }), 1);
    assert.equal(await recordedRuns('count', tag), 1);
  });

  it('serves the npm eventsource client with named events (?events=true): the same items, then its end event', async () => {
    const tag = 'eventsource-named';
    const { statuses, lastIds, messages, ends } = await eventSourceRun(tag, `${url('count')}?events=true`);
    assert.deepEqual(
      messages,
      [0, 1, 2, 3, 4, 5].map((i) => JSON.stringify({ i })),
    );
    assert.equal(ends.length, 1);
    const runId = JSON.parse(ends[0]!).run_id;
    assert.equal(JSON.parse(ends[0]!).state, 'success');
    assert.deepEqual(statuses, [200, 200, 204], 'first call, resume, stop');
    assert.equal(lastIds.length, 3);
    assert.equal(lastIds[0], null);
    assert.match(String(lastIds[1]), new RegExp(`^${runId}:[2-6]$`));
    assert.equal(lastIds[2], `${runId}:7`);
    assert.equal(await run('starts_of', { tag }), 1);
    assert.equal(await recordedRuns('count', tag), 1);
  });
});

describe('the stream replay buffer', () => {
  const noop = () => {};
  /** The sequence numbers a reader attached from the start receives. */
  const keptSeqs = (stream: ReturnType<ReturnType<typeof createStreamReplay>['open']>) => {
    const seqs: number[] = [];
    stream.attach({ send: (e) => seqs.push(e.seq), end: noop }, 0);
    return seqs;
  };

  it('bounds each run and the total: finished runs are forgotten first, then the oldest events', () => {
    const replay = createStreamReplay({ keepMs: 60_000, maxBytesPerRun: 2000, maxTotalBytes: 2500, graceMs: 0 });
    const done = replay.open({ runId: 'r1', projectId: 'p', appId: 'a', fn: 'f', stop: noop });
    done.push('x'.repeat(300));
    done.end('success');
    assert.ok(replay.get('r1'));
    const running = replay.open({ runId: 'r2', projectId: 'p', appId: 'a', fn: 'f', stop: noop });
    for (let i = 0; i < 20; i++) {
      running.push(String(i).padStart(300, '.'));
      assert.ok(replay.totalBytes <= 2500, `${replay.totalBytes} bytes in all after event ${i + 1}`);
    }
    assert.equal(replay.get('r1'), undefined, 'the finished run was forgotten to make room');
    assert.ok(replay.totalBytes <= 2000, `${replay.totalBytes} bytes for the one run left`);
    assert.equal(running.lastSeq, 20);
    assert.ok(running.firstSeq > 1 && running.firstSeq <= 20, `first kept ${running.firstSeq}`);
    const seqs = keptSeqs(running);
    assert.deepEqual(
      seqs,
      Array.from({ length: 21 - running.firstSeq }, (_, i) => running.firstSeq + i),
    );

    // Tiny events are bounded too: each is counted with its overhead.
    const tiny = replay.open({ runId: 'r3', projectId: 'p', appId: 'a', fn: 'f', stop: noop });
    for (let i = 0; i < 2000; i++) tiny.push('.');
    assert.ok(replay.totalBytes <= 2500, `${replay.totalBytes} bytes`);
    assert.ok(keptSeqs(tiny).length < 100, 'a few dozen tiny events at most');
    replay.close();
  });

  it('stops a run whose last reader left only when nobody came back', () => {
    const replay = createStreamReplay({ keepMs: 60_000, maxBytesPerRun: 2000, maxTotalBytes: 2500, graceMs: 0 });
    let stopped = 0;
    const stream = replay.open({ runId: 'r', projectId: 'p', appId: 'a', fn: 'f', stop: () => stopped++ });
    const reader = { send: noop, end: noop };
    const other = { send: noop, end: noop };
    stream.attach(reader, 0);
    stream.attach(other, 0);
    stream.detach(reader);
    assert.equal(stopped, 0, 'another reader is still there');
    stream.detach(other);
    assert.equal(stopped, 1);
    replay.close();
  });
});
