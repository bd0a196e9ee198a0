/**
 * Fastify's error handlers and the log of an error answer: what a route throws, and what Node's HTTP
 * parser refuses, answered through http/answer.ts (the one error answer); internal errors and a store out
 * of reach are logged here.
 */
import { type IncomingMessage, maxHeaderSize } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyBaseLogger, FastifyReply, FastifyRequest } from 'fastify';
import { FerryError } from '../errors.js';
import { answer, refuseOnSocket, replyWithAnswer } from './answer.js';

/** Logs what an error answer says about the server: internal errors, the store out of reach, a caller gone. */
export function logError(log: FastifyBaseLogger, ferry: FerryError, err: unknown, runId: string | undefined): void {
  if (ferry.code === 'FERRY_INTERNAL') log.error({ err, runId }, 'unhandled error');
  if (ferry.code === 'FERRY_STORE_UNAVAILABLE') log.warn({ err, runId }, 'the store cannot be reached');
  // The caller hung up on a run: an everyday event, and nobody is left to answer.
  if (ferry.code === 'FERRY_CLIENT_GONE') log.debug({ runId }, 'the caller disconnected before the run ended');
}

/** Fastify's error handler: every route's error, answered by http/answer.ts. */
export function errorHandler(err: unknown, request: FastifyRequest, reply: FastifyReply): void {
  // The run endpoint's call: its id always, as X-Request-Id; as `run_id` only once it became a run.
  const runId = request.runId || undefined;
  const answered = answer(err, { requestId: runId, runId: request.runRecorded ? runId : undefined, request });
  logError(request.log, answered.error, err, runId);
  // Refused before its body was read (an upload past a volume's size, a body too large): see drainRefused.
  if (!request.raw.complete && !drainRefused(request.raw)) reply.header('connection', 'close');
  replyWithAnswer(reply, answered);
}

/** How long, at most, the rest of a refused body is read after the answer (as nginx's lingering_time). */
export const DRAIN_MS = 30_000;

/**
 * A request answered before its body was read (refused): the rest of the body is read and dropped, and the
 * connection stays open for the caller's next request, as Fastify and Node do by default. A caller still
 * sending so reads the answer; closing the connection instead (as Ferry did) reset it under a caller still
 * sending, which then saw EPIPE rather than the answer (CI: a 16 MiB volume upload refused 413). A caller
 * that neither sends the rest nor hangs up is cut after DRAIN_MS, so it cannot hold the server's close
 * longer than that. False when the body cannot be read to its end: the route already tore it down (a write
 * that failed midway destroys its source); that connection is to be closed once the answer is sent.
 */
export function drainRefused(req: IncomingMessage): boolean {
  if (req.destroyed) return false;
  req.resume();
  const socket = req.socket as (Socket & { server?: { listening?: boolean } }) | null;
  // `destroy?.()`: a request made with `inject` (light-my-request) has a stand-in socket without one, and its
  // 'end' and 'close' may never come: the timer fired 30 s later as an uncaught TypeError (test/postgres/
  // secrets, on a slow machine).
  const timer = setTimeout(() => socket?.destroy?.(), DRAIN_MS);
  timer.unref();
  req.once('end', () => {
    clearTimeout(timer);
    // Read to its end after the server began to close: the close has already let its idle connections
    // go, and this one would otherwise hold it until the keep-alive timeout (72 s).
    if (socket?.server?.listening === false) socket.destroy();
  });
  req.once('close', () => clearTimeout(timer));
  return true;
}

/**
 * Requests Node's HTTP parser refuses before Fastify sees them (not HTTP, headers over the limit, too slow):
 * answered on the socket, in Ferry's shape like every other error, then the connection is closed.
 */
export function clientErrorHandler(err: Error & { code?: string }, socket: Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const refusal =
    err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? new FerryError('FERRY_REQUEST_TIMEOUT')
      : err.code === 'HPE_HEADER_OVERFLOW'
        ? new FerryError(
            'FERRY_HEADERS_TOO_LARGE',
            `The request headers are larger than the limit of ${maxHeaderSize} bytes (all headers together)`,
          )
        : new FerryError('FERRY_BAD_REQUEST');
  refuseOnSocket(socket, answer(refusal));
}
