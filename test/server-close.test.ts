/**
 * Closing the HTTP server (a shutdown, every test's `after`) closes the connections that carry no request, including one that was opened and never sent a request. Node's own
 * idle-connection close leaves that one out, and it then held the close for the keep-alive timeout (72 s):
 * seen after a caller aborted a call (a second connection of its client's pool), and it made the
 * disconnect test take over a minute. The bound below is generous for a loaded machine and far below
 * those 72 s.
 */
import assert from 'node:assert/strict';
import net from 'node:net';
import { it } from 'node:test';
import { http, startServer } from './helpers/ferry.js';

it('closes a connection that never sent a request when the server closes', { timeout: 60_000 }, async () => {
  const server = await startServer();
  const url = new URL(server.url);
  const silent = net.connect({ host: url.hostname, port: Number(url.port) });
  await new Promise<void>((resolve, reject) => {
    silent.once('connect', resolve);
    silent.once('error', reject);
  });
  const closedByServer = new Promise<void>((resolve) => silent.once('close', () => resolve()));
  silent.on('error', () => {});
  // A request before: the server answers on its own connection, which is idle by the close.
  assert.equal((await http(`${server.url}/healthz`)).status, 200);
  const started = Date.now();
  await Promise.all([server.close(), closedByServer]);
  const took = Date.now() - started;
  assert.ok(took < 30_000, `the close took ${took} ms (the keep-alive timeout is 72 s)`);
});
