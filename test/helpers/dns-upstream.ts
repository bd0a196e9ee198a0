/**
 * A UDP socket and a TCP server listening on one port of 127.0.0.1, as a DNS upstream needs (the
 * forwarder is given one port for both). The UDP socket takes a free port and the TCP server then asks
 * for the same number; that number may already be taken for TCP (another process's connection), so on
 * EADDRINUSE both are closed and the pair is tried again on a new port, a bounded number of times. Before
 * this, a taken TCP port left `listen` without its callback and the test's `before` hook waited forever
 * (the suite of 2026-11-27 lost 600 s to it in test/security/dns-isolation).
 */
import dgram from 'node:dgram';
import net from 'node:net';

const ATTEMPTS = 20;

/**
 * A DNS upstream stub on one port: `onQuery` gets each UDP message (with the socket and the sender, to
 * answer), `onConnection` each TCP connection, which the stub tracks so that `close()` ends them all.
 */
export async function startUdpAndTcp(
  onQuery: (udp: dgram.Socket, message: Buffer, client: dgram.RemoteInfo) => void,
  onConnection: (socket: net.Socket) => void,
): Promise<{ port: number; close(): Promise<void> }> {
  const sockets = new Set<net.Socket>();
  let last: unknown;
  for (let attempt = 0; attempt < ATTEMPTS; attempt++) {
    const udp = dgram.createSocket('udp4');
    udp.on('message', (message, client) => onQuery(udp, message, client));
    await new Promise<void>((resolve, reject) => {
      udp.once('error', reject);
      udp.bind(0, '127.0.0.1', () => {
        udp.off('error', reject);
        resolve();
      });
    });
    const port = udp.address().port;
    const tcp = net.createServer((socket) => {
      sockets.add(socket);
      socket.on('error', () => {});
      socket.on('close', () => sockets.delete(socket));
      onConnection(socket);
    });
    try {
      await new Promise<void>((resolve, reject) => {
        tcp.once('error', reject);
        tcp.listen(port, '127.0.0.1', () => {
          tcp.off('error', reject);
          resolve();
        });
      });
    } catch (err) {
      last = err;
      udp.close();
      if ((err as NodeJS.ErrnoException).code !== 'EADDRINUSE') throw err;
      continue;
    }
    return {
      port,
      close: async () => {
        udp.close();
        for (const socket of sockets) socket.destroy();
        await new Promise((resolve) => tcp.close(resolve));
      },
    };
  }
  throw new Error(`no port of 127.0.0.1 was free for both UDP and TCP in ${ATTEMPTS} tries: ${String(last)}`);
}
