/**
 * A TCP proxy to PostgreSQL that loses the answer of one statement, for real: the statement reaches the
 * server and commits, and the client's connection is reset before the answer comes back (what a client
 * sees when the network or the server goes away at that moment). Then the proxy refuses connections for a
 * while (the store is down), and listens again on the same port.
 *
 * The statement is found by its text in the client's bytes (the Parse or Query message carries it). From
 * then on the proxy forwards what the client sends (the rest of the extended query: Bind, Execute, Sync)
 * but nothing of what the server answers, and resets the client once the server says ReadyForQuery (the
 * statement's transaction is over: committed). The server's connection is closed after that.
 */
import net from 'node:net';

/** ReadyForQuery: 'Z', length 5, a status byte (PostgreSQL's frontend/backend protocol). */
const READY_FOR_QUERY = Buffer.from([0x5a, 0x00, 0x00, 0x00, 0x05]);

export interface LossyStoreProxy {
  port: number;
  /**
   * Loses the answer of the next statement whose text contains `needle`, then refuses every connection for
   * `downMs` and listens again. Resolves once the proxy listens again.
   */
  loseAnswerOf(needle: string, downMs: number): Promise<void>;
  /** Answers lost so far. */
  lost(): number;
  close(): Promise<void>;
}

export async function startLossyStoreProxy(target: { host: string; port: number }): Promise<LossyStoreProxy> {
  const sockets = new Set<net.Socket>();
  let armed: { needle: Buffer; hit: () => void } | undefined;
  let lost = 0;
  const track = (s: net.Socket) => {
    sockets.add(s);
    s.on('close', () => sockets.delete(s));
    s.on('error', () => s.destroy());
  };
  const server = net.createServer((client) => {
    const upstream = net.connect(target);
    track(client);
    track(upstream);
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
    /** The last bytes the client sent, so a text split across two chunks is still found. */
    let tail = Buffer.alloc(0);
    let losing = false;
    client.on('data', (chunk: Buffer) => {
      if (armed && !losing) {
        const seen = Buffer.concat([tail, chunk]);
        if (seen.includes(armed.needle)) {
          losing = true;
          const { hit } = armed;
          armed = undefined;
          // This pair ends on its own (below), not with the outage's reset: the statement must commit.
          sockets.delete(client);
          sockets.delete(upstream);
          setTimeout(() => {
            client.destroy();
            upstream.destroy();
          }, 10_000).unref();
          hit();
        } else {
          tail = seen.subarray(Math.max(0, seen.length - armed.needle.length));
        }
      }
      upstream.write(chunk);
    });
    let answer = Buffer.alloc(0);
    upstream.on('data', (chunk: Buffer) => {
      if (!losing) {
        client.write(chunk);
        return;
      }
      answer = Buffer.concat([answer, chunk]);
      if (answer.includes(READY_FOR_QUERY)) {
        lost += 1;
        client.resetAndDestroy();
        upstream.end();
      }
    });
  });
  const listen = (port: number) =>
    new Promise<number>((resolve, reject) => {
      server.once('error', reject);
      server.listen(port, '127.0.0.1', () => {
        server.off('error', reject);
        resolve((server.address() as net.AddressInfo).port);
      });
    });
  const port = await listen(0);
  return {
    port,
    async loseAnswerOf(needle, downMs) {
      await new Promise<void>((hit) => {
        armed = { needle: Buffer.from(needle), hit };
      });
      // The answer is being lost: the store goes away with it, every other connection too.
      const closed = new Promise<void>((resolve) => server.close(() => resolve()));
      setTimeout(() => {
        for (const s of sockets) s.resetAndDestroy();
      }, 200);
      await closed;
      await new Promise((resolve) => setTimeout(resolve, downMs));
      await listen(port);
    },
    lost: () => lost,
    async close() {
      for (const s of sockets) s.destroy();
      if (server.listening) await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
