/**
 * A proxy on loopback that breaks a stream mid-way, for the clients' resume tests: it cuts the first
 * stream connection once two items have passed, lets resumes (Last-Event-ID) through whole, and counts them.
 */
import net from 'node:net';

/**
 * A TCP proxy to Ferry that cuts the first stream connection once two items have passed (its requests
 * with Last-Event-ID go through whole), and counts the resumes it saw.
 */
export async function cuttingProxy(
  target: URL,
): Promise<{ url: string; resumes: () => number; close(): Promise<void> }> {
  let cut = false;
  let resumes = 0;
  const sockets = new Set<net.Socket>();
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(target.port), target.hostname);
    sockets.add(client).add(upstream);
    let request = '';
    let isStream = false;
    let items = 0;
    client.on('data', (chunk: Buffer) => {
      request += chunk.toString('latin1');
      if (/accept: text\/event-stream/i.test(request)) isStream = true;
      if (/last-event-id:/i.test(request) && !request.includes('\u0000counted')) {
        resumes++;
        request += '\u0000counted';
      }
      // Streams come uncompressed through here, so the proxy sees where items end (fetch asks for gzip).
      upstream.write(
        Buffer.from(
          chunk.toString('latin1').replace(/\r\naccept-encoding:[^\r]*/i, '\r\naccept-encoding: identity'),
          'latin1',
        ),
      );
    });
    upstream.on('data', (chunk: Buffer) => {
      client.write(chunk);
      if (isStream && !cut && !/last-event-id:/i.test(request)) {
        items += (chunk.toString('latin1').match(/^data:/gm) ?? []).length;
        if (items >= 2) {
          cut = true;
          client.destroy();
          upstream.destroy();
        }
      }
    });
    for (const s of [client, upstream]) {
      s.on('error', () => {});
      s.on('close', () => {
        client.destroy();
        upstream.destroy();
      });
    }
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as net.AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    resumes: () => resumes,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}
