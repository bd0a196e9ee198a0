/**
 * Server-sent events: the wire format (one `data:` line per line of text, a blank line after each event)
 * and a writer over a raw Node response. Used by build logs now and by streaming runs.
 */
import type { ServerResponse } from 'node:http';

/** Formats one event. Text with newlines becomes several `data:` lines of the same event, as SSE requires. */
export function formatEvent(data: string, event?: string, id?: string | number): string {
  let out = '';
  if (event) out += `event: ${event}\n`;
  if (id !== undefined) out += `id: ${id}\n`;
  for (const line of data.split(/\r\n|\r|\n/)) out += `data: ${line}\n`;
  return `${out}\n`;
}

/** Starts an event stream on `res` with the headers the spec names. */
export function startEventStream(res: ServerResponse, headers: Record<string, string> = {}): void {
  res.writeHead(200, {
    'content-type': 'text/event-stream; charset=utf-8',
    'cache-control': 'no-cache',
    'x-accel-buffering': 'no',
    ...headers,
  });
  res.flushHeaders();
}

/** True when the request asks for an event stream. */
export function wantsEventStream(accept: string | undefined): boolean {
  return accept?.toLowerCase().includes('text/event-stream') ?? false;
}

/**
 * Formats a comment block (`: <text>` per line, then a blank line): EventSource and every reader of
 * `data:` lines skip it, so a stream's end and errors can be told without looking like one more item.
 */
export function formatComment(text: string): string {
  let out = '';
  for (const line of text.split(/\r\n|\r|\n/)) out += `: ${line}\n`;
  return `${out}\n`;
}
