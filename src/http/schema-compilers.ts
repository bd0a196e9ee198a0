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

/** What Fastify calls with a route's schema part; returns the compiled validator or serializer. */
type RouteCompiler = (route: { schema: unknown; httpPart?: string }) => unknown;
/** What Fastify calls once per server (and plugin context) to get a RouteCompiler. */
type CompilerFactory = (externalSchemas: unknown, options: unknown) => RouteCompiler;

/**
 * Wraps one of Fastify's compiler factories so that what it compiles is kept for the process: the key is
 * the external schemas and options (what the factory was built with), the request part and the schema.
 */
function keepCompiled(factory: CompilerFactory): CompilerFactory {
  const compiled = new Map<string, unknown>();
  return (externalSchemas, options) => {
    const compile = factory(externalSchemas, options);
    const prefix = JSON.stringify([externalSchemas, options]);
    return (route) => {
      const key = `${prefix}\u0000${route.httpPart ?? ''}\u0000${JSON.stringify(route.schema)}`;
      let done = compiled.get(key);
      if (done === undefined) {
        done = compile(route);
        compiled.set(key, done);
      }
      return done;
    };
  };
}

/** The `schemaController.compilersFactory` every Ferry server is built with. */
export const sharedCompilers: CompilersFactory = {
  buildValidator: keepCompiled(AjvCompiler() as unknown as CompilerFactory) as unknown as BuildValidator,
  buildSerializer: keepCompiled(SerializerSelector() as unknown as CompilerFactory) as unknown as BuildSerializer,
};
