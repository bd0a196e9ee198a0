/**
 * Fastify's schema compilers, shared by every server this process builds: a route schema is compiled once
 * per process, not once per server.
 *
 * Fastify makes new compilers for each instance, so each `buildServer` compiled every route's validators
 * (Ajv) and response serializers (fast-json-stringify) again: about 145 ms of CPU per server on the CI
 * machine. A `ferry serve` process builds one server and sees no difference; a process that builds many (the
 * test suite starts hundreds of servers in its processes) pays the compilation once. The compiled
 * functions are pure: they depend on the schema, the external schemas and the options alone, which make the
 * cache key (the route's method and URL do not enter into what is compiled). The cache holds one entry per
 * distinct schema, a fixed set.
 */
import AjvCompiler from '@fastify/ajv-compiler';
import { SerializerSelector } from '@fastify/fast-json-stringify-compiler';
import type { FastifyServerOptions } from 'fastify';

type CompilersFactory = NonNullable<NonNullable<FastifyServerOptions['schemaController']>['compilersFactory']>;
type BuildValidator = NonNullable<CompilersFactory['buildValidator']>;
type BuildSerializer = NonNullable<CompilersFactory['buildSerializer']>;

function memoize<F extends (route: { schema: unknown; httpPart?: string }) => unknown>(
  prefix: string,
  compile: F,
  cache: Map<string, unknown>,
): F {
  return ((route) => {
    const key = `${prefix}\u0000${route.httpPart ?? ''}\u0000${JSON.stringify(route.schema)}`;
    let compiled = cache.get(key);
    if (compiled === undefined) {
      compiled = compile(route);
      cache.set(key, compiled);
    }
    return compiled;
  }) as F;
}

const buildAjvValidator = AjvCompiler() as unknown as BuildValidator;
const buildFjsSerializer = SerializerSelector() as unknown as BuildSerializer;
const validators = new Map<string, unknown>();
const serializers = new Map<string, unknown>();

/** The `schemaController.compilersFactory` every Ferry server is built with. */
export const sharedCompilers: CompilersFactory = {
  buildValidator: ((externalSchemas: unknown, options: unknown) =>
    memoize(
      JSON.stringify([externalSchemas, options]),
      (buildAjvValidator as (e: unknown, o: unknown) => (route: { schema: unknown }) => unknown)(
        externalSchemas,
        options,
      ),
      validators,
    )) as unknown as BuildValidator,
  buildSerializer: ((externalSchemas: unknown, options: unknown) =>
    memoize(
      JSON.stringify([externalSchemas, options]),
      (buildFjsSerializer as (e: unknown, o: unknown) => (route: { schema: unknown }) => unknown)(
        externalSchemas,
        options,
      ),
      serializers,
    )) as unknown as BuildSerializer,
};
