/**
 * Streaming-call helpers for tests: a POST asking for an event stream that records when each chunk
 * arrives (decoded, without transparent decompression), and a caller that goes away after the first item.
 */
import http from 'node:http';
import zlib from 'node:zlib';

export interface Arrival {
  at: number;
  text: string;
}

/**
 * POSTs with node:http (no transparent decompression) and records when each chunk arrives, decoded. Fails
 * when the connection stays silent for 30 s.
 */
export function streamRequest(
  url: string,
  token: string,
  body: unknown,
  headers: Record<string, string> = {},
): Promise<{ status: number; headers: http.IncomingHttpHeaders; arrivals: Arrival[] }> {
  return new Promise((resolve, reject) => {
    const started = Date.now();
    const req = http.request(
      url,
      {
        method: 'POST',
        headers: {
          authorization: `Bearer ${token}`,
          accept: 'text/event-stream',
          'content-type': 'application/json',
          ...headers,
        },
      },
      (res) => {
        const arrivals: Arrival[] = [];
        const gz = res.headers['content-encoding'] === 'gzip';
        const source = gz ? res.pipe(zlib.createGunzip()) : res;
        source.on('data', (chunk: Buffer) => arrivals.push({ at: Date.now() - started, text: chunk.toString('utf8') }));
        source.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, arrivals }));
        source.on('error', reject);
      },
    );
    // A hang guard only (a stream that sends nothing for this long has failed): busy machines stay well under it.
    req.setTimeout(30_000, () => req.destroy(new Error(`no data from ${url} for 30 s`)));
    req.on('error', reject);
    req.end(JSON.stringify(body));
  });
}

/** Starts a streaming call, reads its first chunk, then goes away; resolves with the run id. */
export function disconnectAfterFirstItem(url: string, token: string): Promise<string> {
  return new Promise<string>((resolve, reject) => {
    const req = http.request(url, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, accept: 'text/event-stream', 'content-type': 'application/json' },
    });
    req.on('response', (res) => {
      res.once('data', () => {
        req.destroy();
        resolve(String(res.headers['x-request-id']));
      });
    });
    req.on('error', (err) => (req.destroyed ? undefined : reject(err)));
    req.end('{}');
  });
}

/** One event of a streaming run as a test expects it: an item's text, or a named event. */
export type ExpectedEvent = string | { event: string; data: string };

/**
 * The exact wire text of a run's event stream (written out here rather than with src/http/sse.ts, so a
 * change to the format shows): `retry: 1000`, then each event in turn (sequence numbers from 1). An item
 * has the id `<run_id>:<seq>` and one `data:` line per line of its text. A named event (`error`, `end`) is,
 * by default, a comment `: <name> <data>` with no id, so the `data:` lines are the items and nothing else;
 * with `named` (the caller asked for `?events=true`) it is `event: <name>`, its id and its `data:` lines.
 */
export function streamWire(runId: string, events: ExpectedEvent[], options: { named?: boolean } = {}): string {
  let out = 'retry: 1000\n\n';
  events.forEach((e, i) => {
    const { event, data } = typeof e === 'string' ? { event: undefined, data: e } : e;
    if (event && !options.named) {
      for (const line of `${event} ${data}`.split('\n')) out += `: ${line}\n`;
      out += '\n';
      return;
    }
    if (event) out += `event: ${event}\n`;
    out += `id: ${runId}:${i + 1}\n`;
    for (const line of data.split('\n')) out += `data: ${line}\n`;
    out += '\n';
  });
  return out;
}

/** The `end` every stream finishes with. */
export function endEvent(runId: string, state = 'success'): ExpectedEvent {
  return { event: 'end', data: JSON.stringify({ run_id: runId, state }) };
}

/**
 * What a reader of `data:` lines gets from a stream's wire text (the common `iter_lines()` way): the text
 * after `data: ` on each such line, in order.
 */
export function dataLines(wire: string): string[] {
  return wire
    .split(/\r\n|\r|\n/)
    .filter((line) => line.startsWith('data:'))
    .map((line) => line.slice(line.startsWith('data: ') ? 6 : 5));
}
