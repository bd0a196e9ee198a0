/**
 * The tunnel of a WebSocket session: a caller's connection spliced onto a raw connection to a custom app's
 * server (through the replica's supervisor), bytes both ways with back-pressure, for as long as both sides
 * keep it. One implementation, used at both ends of a session:
 *
 * - the process that accepted the caller's upgrade (http/custom-proxy.ts) writes the caller's request to
 *   the replica, then tunnels; it adds the caller's stall limit and the app's idle timeout (`onFlowing`);
 * - a worker (http/worker-api.ts) tunnels a gateway's session (cluster/protocol.ts): the gateway's
 *   connection already carries the caller's request after the tunnel's own head.
 *
 * On a gateway the custom proxy's "replica" is the worker's tunnel (runs/remote-invoker.ts), so a clustered
 * session is this same splice twice. It resolves with the status line the app's server answered (101, or
 * a refusal it sent as it is), for the run's record; it rejects FERRY_REPLICA_DIED when the server closed
 * without answering.
 */
import type { Socket } from 'node:net';
import { FerryError } from '../errors.js';

export interface TunnelOptions {
  /** Written to the app's server first: the caller's request line and headers, when this end has them. */
  request?: string;
  /** What the caller sent after its request head (the upgrade's `head`). */
  head: Buffer;
  /** The app's server sent its first bytes: the caller has an answer, whatever happens next. */
  onAnswered?: () => void;
  /** The bytes flow both ways: add limits to the pair; `close` ends it. */
  onFlowing?: (upstream: Socket, close: () => void) => void;
}

/** Splices `socket` onto a new connection to `replica` until either closes or `signal` aborts. */
export function tunnel(
  socket: Socket,
  replica: { connect(): Socket },
  signal: AbortSignal,
  options: TunnelOptions,
): Promise<number> {
  return new Promise<number>((resolve, reject) => {
    const upstream = replica.connect();
    let status = 0;
    const close = () => {
      upstream.destroy();
      socket.destroy();
      if (status === 0) reject(new FerryError('FERRY_REPLICA_DIED', 'The app closed the connection'));
      else resolve(status);
    };
    signal.addEventListener('abort', close, { once: true });
    upstream.once('error', close);
    upstream.once('close', close);
    socket.once('close', close);
    upstream.once('connect', () => {
      if (options.request !== undefined) upstream.write(options.request);
      if (options.head.length > 0) upstream.write(options.head);
      upstream.once('data', (first: Buffer) => {
        // The status line of the server's answer (101, or a refusal it sends as-is), for the run record.
        const match = /^HTTP\/1\.[01] (\d{3})/.exec(first.subarray(0, 16).toString('latin1'));
        status = match ? Number(match[1]) : 502;
        options.onAnswered?.();
      });
      // pipe() stops reading one side while the other's socket is full (back-pressure both ways).
      upstream.pipe(socket);
      socket.pipe(upstream);
      upstream.setNoDelay(true);
      socket.setNoDelay(true);
      options.onFlowing?.(upstream, close);
    });
  });
}
