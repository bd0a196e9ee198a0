/**
 * Follows a build's log over server-sent events and prints each line as it arrives. Shared by
 * `ferry deploy` and `ferry builds logs --follow`.
 */
import { createParser } from 'eventsource-parser';
import type { ApiClient } from './client.js';

/** One line of a build log, as the API sends it. */
export interface BuildLogLine {
  seq: number;
  line: string;
}

/** Prints the build's log lines until the build ends; resolves with its final state. */
export async function followBuildLog(
  client: ApiClient,
  appId: string,
  buildId: string,
  print: (line: string, entry: BuildLogLine) => void,
): Promise<string> {
  const path = `/v2/projects/${client.project}/apps/${appId}/builds/${buildId}/logs`;
  const body = await client.stream(path, { accept: 'text/event-stream' });
  let state = 'unknown';
  const parser = createParser({
    onEvent(event) {
      if (event.event === 'end') {
        state = (JSON.parse(event.data) as { state: string }).state;
        return;
      }
      const entry = JSON.parse(event.data) as BuildLogLine;
      print(entry.line, entry);
    },
  });
  const decoder = new TextDecoder();
  for await (const chunk of body) parser.feed(decoder.decode(chunk as Buffer, { stream: true }));
  return state;
}
