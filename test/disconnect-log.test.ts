/**
 * A caller that hangs up on a sync run is an everyday event: the server logs it at debug level with the
 * run id, never as an unhandled error with a stack. Read from the real server's pino log.
 */
import assert from 'node:assert/strict';
import { after, before, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

interface LogLine {
  level: number;
  msg: string;
  runId?: string;
  err?: unknown;
}

const lines: LogLine[] = [];
let server: TestServer;
let auth: { projectId: string; token: string };

before(async () => {
  server = await startServer({
    log: { level: 'debug', destination: { write: (line: string) => void lines.push(JSON.parse(line)) } },
  });
  auth = await server.bootstrap();
  await deployFiles(server, auth, 'slow', {
    'ferry.toml': '[app]\nname = "slow"\n',
    'main.ts': 'export async function run() { await new Promise((r) => setTimeout(r, 20_000)); return "late"; }',
  });
});
after(() => server.close());

it('logs a caller that disconnects from a sync run at debug level with the run id; no error for sync or stream', async () => {
  const runs = `${server.url}/v2/projects/${auth.projectId}/apps/slow/runs`;
  for (const accept of ['application/json', 'text/event-stream']) {
    const caller = new AbortController();
    const call = fetch(`${server.url}/v4/${auth.projectId}/slow/run`, {
      method: 'POST',
      headers: { authorization: `Bearer ${auth.token}`, 'content-type': 'application/json', accept },
      body: '{}',
      signal: caller.signal,
    })
      .then((res) => res.text())
      .catch(() => 'aborted');
    const running = await waitFor(
      async () => (await http(`${runs}?state=running`, { token: auth.token })).json.runs[0],
      60_000,
      'the run to start',
    );
    caller.abort();
    await call;
    const cancelled = await waitFor(
      async () => {
        const run = (await http(`${runs}/${running.run_id}`, { token: auth.token })).json;
        return run.state === 'cancelled' ? run : undefined;
      },
      60_000,
      'the run to be cancelled',
    );
    assert.equal(cancelled.reason, 'client_disconnected');
    // A stream that had started ends without an answer to give: nothing to log there.
    if (accept === 'text/event-stream') continue;
    const line = await waitFor(
      async () => lines.find((l) => l.runId === running.run_id && l.level === 20 && /disconnected/.test(l.msg)),
      30_000,
      'the debug line',
    );
    assert.equal(line.err, undefined, 'no stack for an everyday event');
  }
  const errors = lines.filter((l) => l.level >= 40);
  assert.deepEqual(errors, [], 'nothing at warn level or above');
});
