/**
 * Which request bodies Ferry reads, and how: one rule for the management API and the run endpoint.
 *
 * - `application/json`, `application/*+json` (any parameters, such as `charset`): parsed as JSON.
 * - No `Content-Type`, or `text/plain`: parsed as JSON too. That is what `fetch(url, { body: JSON.stringify(x) })`
 *   and many HTTP libraries send; reading such a body as anything else would run a function with arguments
 *   other than the ones sent.
 * - Anything else (a form body from `curl -d`, multipart, XML): `415 FERRY_UNSUPPORTED_MEDIA_TYPE` naming the
 *   accepted type, before the body is read.
 *
 * Deploys take `application/zip` instead (see routes/builds.ts); they name that type in their 415.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { bodyTooLarge, FerryError } from '../errors.js';

declare module 'fastify' {
  interface FastifyContextConfig {
    /** The body type the route takes, as named in a 415 (default `application/json`). */
    accepts?: string;
  }
}

/** `application/<anything>+json`, parameters allowed. */
export const JSON_SUFFIX_TYPE = /^application\/[a-z0-9!#$&^_.-]+\+json(?:\s*;.*)?$/i;

/** The 415 of a body whose Content-Type the route does not read. */
export function unsupportedMediaType(contentType: string | undefined, accepted = 'application/json'): FerryError {
  const shown = contentType === undefined ? 'none' : JSON.stringify(contentType.slice(0, 100));
  return new FerryError(
    'FERRY_UNSUPPORTED_MEDIA_TYPE',
    `Content-Type ${shown} is not accepted here; send the body with Content-Type: ${accepted}`,
  );
}

/** The type named in a 415 for this request's route. */
export function acceptedType(request: FastifyRequest): string {
  return request.routeOptions.config?.accepts ?? 'application/json';
}

/**
 * Replaces `scope`'s body parsers with the JSON rule above. `parse` turns the bytes of a body into the
 * request's `body` (it throws a FerryError for one it refuses); `bodyLimit` bounds what is read.
 */
export function useJsonBodies(
  scope: Pick<FastifyInstance, 'removeAllContentTypeParsers' | 'addContentTypeParser'>,
  parse: (raw: Buffer) => unknown,
  bodyLimit: number,
): void {
  scope.removeAllContentTypeParsers();
  const options = { parseAs: 'buffer' as const, bodyLimit };
  const parser = (
    _request: FastifyRequest,
    body: Buffer | string,
    done: (err: Error | null, body?: unknown) => void,
  ) => {
    try {
      done(null, parse(body as Buffer));
    } catch (err) {
      done(err as Error);
    }
  };
  scope.addContentTypeParser(['application/json', 'text/plain'], options, parser);
  scope.addContentTypeParser(JSON_SUFFIX_TYPE, options, parser);
  // The catch-all also receives bodies sent without any Content-Type: those are JSON; others are refused unread.
  scope.addContentTypeParser('*', (request, payload, done) => {
    const contentType = request.headers['content-type'];
    if (contentType !== undefined) {
      done(unsupportedMediaType(contentType, acceptedType(request)));
      return;
    }
    if (Number(request.headers['content-length']) > bodyLimit) {
      done(bodyTooLarge(bodyLimit));
      return;
    }
    readLimitedBody(payload, bodyLimit).then(
      (body) => parser(request, body, done),
      (err: Error) => done(err),
    );
  });
}

/**
 * A request body's bytes, at most `limit` of them: past it, rejects with FERRY_BODY_TOO_LARGE and reads the
 * rest only to drop it (the caller still gets its answer on a kept-alive connection).
 */
export function readLimitedBody(stream: NodeJS.ReadableStream, limit: number): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    stream.on('data', (chunk: Buffer) => {
      size += chunk.length;
      if (size > limit) {
        stream.removeAllListeners('data');
        stream.resume();
        reject(bodyTooLarge(limit));
        return;
      }
      chunks.push(chunk);
    });
    stream.on('error', reject);
    stream.on('end', () => {
      if (size <= limit) resolve(chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, size));
    });
  });
}

// Where a body's limit is stated (the archive route and builds/upload.ts alike).
export { bodyTooLarge, formatBytes } from '../errors.js';

/** Parses a management API body: JSON (prototype poisoning refused), an empty body being no body. */
export function parseJsonBody(raw: Buffer): unknown {
  if (raw.length === 0) return undefined;
  let value: unknown;
  try {
    value = JSON.parse(raw.toString('utf8'), (key, v) => {
      if (key === '__proto__') throw new SyntaxError('__proto__ is not allowed');
      return v;
    });
  } catch {
    throw new FerryError('FERRY_INVALID_JSON');
  }
  return value;
}
