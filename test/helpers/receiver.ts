/**
 * A scripted webhook receiver for tests: a real node:http server on loopback that answers each request
 * with the next step of its script and records what arrived (time, headers, the raw body bytes).
 *
 * Steps: a status code (answered with a short body), `{ status, headers }`, `'hang'` (never answers;
 * the socket is destroyed when the receiver closes) or `'close'` (drops the connection without a
 * response). When the script runs out, `fallback` answers (200 unless set).
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';

export type Step = number | { status: number; headers?: Record<string, string> } | 'hang' | 'close';

export interface Received {
  /** performance.now() when the request's body had fully arrived. */
  at: number;
  /** Date.now() at the same moment. */
  wallAt: number;
  method: string;
  path: string;
  headers: http.IncomingHttpHeaders;
  body: Buffer;
}

export interface Receiver {
  /** Base URL, `http://127.0.0.1:<port>` (or `http://[::1]:<port>`). */
  url: string;
  port: number;
  requests: Received[];
  /** Replaces the remaining script. */
  script(steps: Step[]): void;
  fallback: Step;
  /** Resolves when `n` requests in total have arrived. */
  waitForRequests(n: number, ms?: number): Promise<Received[]>;
  close(): Promise<void>;
}

export async function startReceiver(options: { host?: string; steps?: Step[] } = {}): Promise<Receiver> {
  const host = options.host ?? '127.0.0.1';
  let steps: Step[] = [...(options.steps ?? [])];
  const requests: Received[] = [];
  const waiters: Array<() => void> = [];
  const sockets = new Set<import('node:net').Socket>();

  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      requests.push({
        at: performance.now(),
        wallAt: Date.now(),
        method: req.method ?? '',
        path: req.url ?? '',
        headers: req.headers,
        body: Buffer.concat(chunks),
      });
      for (const w of waiters.splice(0)) w();
      const step = steps.length > 0 ? steps.shift()! : receiver.fallback;
      if (step === 'hang') return;
      if (step === 'close') {
        req.socket.destroy();
        return;
      }
      const { status, headers } = typeof step === 'number' ? { status: step, headers: {} } : step;
      res.writeHead(status, { 'content-type': 'text/plain', ...headers });
      res.end(`answered ${status}`);
    });
  });
  server.on('connection', (s) => {
    sockets.add(s);
    s.on('close', () => sockets.delete(s));
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, host, () => resolve());
  });
  const port = (server.address() as AddressInfo).port;

  const receiver: Receiver = {
    url: host.includes(':') ? `http://[${host}]:${port}` : `http://${host}:${port}`,
    port,
    requests,
    fallback: 200,
    script(next) {
      steps = [...next];
    },
    async waitForRequests(n, ms = 20_000) {
      const end = Date.now() + ms;
      while (requests.length < n) {
        const left = end - Date.now();
        if (left <= 0) throw new Error(`receiver got ${requests.length} requests, expected ${n}`);
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, left);
          waiters.push(() => {
            clearTimeout(timer);
            resolve();
          });
        });
      }
      return requests.slice(0, n);
    },
    async close() {
      for (const s of sockets) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
  return receiver;
}
