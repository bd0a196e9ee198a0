/**
 * A plain node:http server for Ferry's custom runtime: no dependencies, so nothing needs installing.
 *
 *   GET  /health, /ready  200 "ok" (Ferry's health and readiness checks, see ferry.toml)
 *   GET  /                {"hello": "world", "pid": ...}
 *   ANY  /echo            the request as JSON: method, path, query, headers, body
 *   GET  /events          a server-sent-event stream: data: 1 ... data: 5, 200 ms apart
 *
 * Ferry gives the server the path after /v4/<project_id>/custom-node, and sets PORT.
 */
import http from 'node:http';

const port = Number(process.env.PORT ?? 8080);

function sendJson(res, status, value) {
  const body = JSON.stringify(value);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
  res.end(body);
}

async function readText(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return Buffer.concat(chunks).toString('utf8');
}

function events(req, res) {
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
  let n = 0;
  const send = () => {
    n += 1;
    res.write(`data: ${n}\n\n`);
    if (n === 5) {
      clearInterval(timer);
      res.end();
    }
  };
  const timer = setInterval(send, 200);
  send();
  // The caller went away: stop writing.
  req.on('close', () => clearInterval(timer));
}

const server = http.createServer(async (req, res) => {
  const url = new URL(req.url ?? '/', 'http://localhost');
  const route = `${req.method} ${url.pathname}`;
  try {
    if (route === 'GET /health' || route === 'GET /ready') {
      res.writeHead(200, { 'content-type': 'text/plain' });
      res.end('ok');
    } else if (route === 'GET /') {
      sendJson(res, 200, { hello: 'world', pid: process.pid });
    } else if (url.pathname === '/echo') {
      const body = await readText(req);
      sendJson(res, 200, {
        method: req.method,
        path: url.pathname,
        query: Object.fromEntries(url.searchParams),
        headers: req.headers,
        body,
      });
    } else if (route === 'GET /events') {
      events(req, res);
    } else {
      sendJson(res, 404, { error: 'not found', method: req.method, path: url.pathname });
    }
  } catch (err) {
    console.error(err);
    if (!res.headersSent) sendJson(res, 500, { error: 'internal error' });
    else res.destroy();
  }
});

server.listen(port, () => console.log(`listening on port ${port}`));

// Ferry stops a replica with SIGTERM: finish the requests in flight, then exit 0.
process.on('SIGTERM', () => {
  console.log('SIGTERM: closing');
  server.close(() => process.exit(0));
  server.closeIdleConnections();
  // Streams still open after 10 s are cut, so the process does not outlive Ferry's grace period.
  setTimeout(() => server.closeAllConnections(), 10_000).unref();
});
