#!/usr/bin/env node
/**
 * The bare Node proxy of bench:run-sync (issue 15's yardstick): what a gateway in Node needs at the least
 * for one call, node:http in front and an undici Pool to the replica's Unix socket, nothing else (no auth,
 * no record, no validation). Listens on 127.0.0.1:PORT (0: any) and prints the port; forwards every request
 * to SOCKET as it is.
 *
 *   SOCKET=/path/to/replica.sock PORT=0 node bench/node-proxy.mjs
 */
import http from 'node:http';
import { Pool } from 'undici';

const pool = new Pool('http://localhost', { socketPath: process.env.SOCKET, connections: 64, pipelining: 1 });
const server = http.createServer(async (req, res) => {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  try {
    const up = await pool.request({
      method: req.method,
      path: req.url,
      headers: { 'content-type': 'application/json', 'x-ferry-run-id': 'proxy' },
      body: Buffer.concat(chunks),
    });
    const body = Buffer.from(await up.body.arrayBuffer());
    res.writeHead(up.statusCode, { 'content-type': 'application/x-ndjson', 'content-length': body.length });
    res.end(body);
  } catch (err) {
    res.writeHead(502).end(String(err));
  }
});
server.keepAliveTimeout = 65_000;
server.listen(Number(process.env.PORT ?? 0), '127.0.0.1', () => console.log(server.address().port));
