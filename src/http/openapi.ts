/**
 * The OpenAPI document (`GET /v2/openapi.json`): @fastify/swagger writes it from the route schemas; this file
 * adds what no single route schema says, so a generated client knows every status it can get:
 *
 * - the statuses every route answers through shared machinery (validation and bad URLs `400`, tokens `401`
 *   and `403`, an unknown project `404`; on routes that read a body, `413` and `415`, and a full disk's
 *   `507`);
 * - `/readyz`, the one route outside /v2 and /v4 a client is meant to call;
 * - the run endpoint (`/v4`): a function call's arguments, its sync, async and streamed answers and every
 *   error, and a custom app's any-method routes. Its routes keep their own small validation schemas (the body
 *   is forwarded as the caller sent it), so its documentation schemas live here.
 */
import type { FastifyDynamicSwaggerOptions } from '@fastify/swagger';
import type { FastifySchema, RouteOptions } from 'fastify';
import { Type } from 'typebox';
import { errors } from './schemas.js';

/** The operations an OpenAPI 3.1 path item can hold; Fastify's `all` also takes WebDAV methods it cannot. */
const PATH_ITEM_METHODS = new Set(['get', 'put', 'post', 'delete', 'options', 'head', 'patch', 'trace']);
const PATH_ITEM_FIELDS = new Set(['summary', 'description', 'servers', 'parameters', '$ref']);

/** Statuses any route can answer, from hooks every route shares. */
export function sharedStatuses(methods: readonly string[]): number[] {
  const statuses = [400, 401, 403, 404];
  // Fastify reads a body for every method but GET and HEAD: a body can be too large or of the wrong type;
  // and those methods write, which a full disk refuses (507 FERRY_STORAGE_FULL, disk-space.ts).
  if (methods.some((m) => m !== 'GET' && m !== 'HEAD')) statuses.push(413, 415, 507);
  return statuses;
}

const RunPath = Type.Object({
  project_id: Type.String({ description: 'Project id, like p-7f3a9c21' }),
  app_name: Type.String({ description: 'The app name from ferry.toml' }),
});
const FunctionPath = Type.Object({
  ...RunPath.properties,
  function: Type.String({
    description: 'A public function of the app (exported, not starting with _); custom apps: the first path segment',
  }),
});

const RunQuery = Type.Object({
  async: Type.Optional(
    Type.String({ description: 'Exactly `true`: store the run and answer 202 at once (other values: sync)' }),
  ),
  webhookEndpoint: Type.Optional(
    Type.String({
      format: 'uri',
      maxLength: 2048,
      description:
        'Absolute http(s) URL without a user name or password, at most 2048 characters, to POST the outcome to; ' +
        'a host that is an IP address in a blocked range FERRY_WEBHOOK_ALLOW does not open is refused (400) (see docs/webhooks.md)',
    }),
  ),
});

const RunHeaders = Type.Object({
  'idempotency-key': Type.Optional(
    Type.String({
      description:
        'Async runs: a repeat (same function) within 24 hours answers the first run id and runs nothing; the ' +
        'key reused for another function of the app answers 422 FERRY_IDEMPOTENCY_KEY_REUSED',
    }),
  ),
  'x-webhook-secret': Type.Optional(Type.String({ description: 'Signs webhook deliveries of this run' })),
});

/** A cortex function's call also takes the stream options (the custom proxy forwards the query as it is). */
const STREAM_EVENTS =
  '`true` (or `1`): a stream also sends its `error` and `end` as named events (`event: error`, `event: end`), ' +
  'not as comments; see docs/api.md, "Streaming"';
const FunctionQuery = Type.Object({
  ...RunQuery.properties,
  events: Type.Optional(Type.String({ description: STREAM_EVENTS })),
});
const FunctionHeaders = Type.Object({
  ...RunHeaders.properties,
  'x-ferry-stream-events': Type.Optional(Type.String({ description: STREAM_EVENTS })),
});

const RunAccepted = Type.Object(
  { run_id: Type.String() },
  { description: 'Async run stored; poll GET .../runs/{run_id}' },
);

const RUN_ERRORS = [400, 401, 403, 404, 405, 413, 415, 422, 429, 500, 502, 503, 504, 507] as const;

const functionCall = {
  summary: 'Run a function',
  description:
    'Calls the public function `function` of a cortex app with the JSON object of the body as its arguments ' +
    '(`Content-Type: application/json`, `text/plain` or none; an empty body is `{}`). Synchronous by default ' +
    '(200), `?async=true` answers 202 at once, `Accept: text/event-stream` streams what a generator yields. ' +
    'Every response carries `X-Request-Id`, the run id; an error names it as `run_id` only when the call became ' +
    'a run (one refused before, with a 401, 404 or 415, is no run). For a custom app, the request is forwarded to its ' +
    'server instead and its response is answered as it is. See docs/api.md, "Run endpoint".',
  tags: ['run'],
  operationId: 'runFunction',
  consumes: ['application/json', 'text/plain'],
  params: FunctionPath,
  querystring: FunctionQuery,
  headers: FunctionHeaders,
  body: Type.Object({}, { additionalProperties: true, description: "The function's arguments" }),
  response: {
    200: {
      description: 'The result (sync), or the stream of server-sent events (Accept: text/event-stream)',
      content: {
        'application/json': {
          schema: Type.Object({
            run_id: Type.String(),
            result: Type.Unknown({ description: "The function's return value (undefined becomes null)" }),
            run_time_ms: Type.Integer(),
          }),
        },
        'text/event-stream': {
          schema: Type.String({
            description:
              'One `data:` event per yielded item and nothing else; the end (`: end {"run_id","state"}`) and a ' +
              'failure (`: error {"run_id","error"}`) are SSE comments, or named events with `?events=true`',
          }),
        },
      },
    },
    202: RunAccepted,
    ...errors(...RUN_ERRORS),
    default: { description: "Custom apps: the app server's response, as it answered (sandboxed: see the description)" },
  },
};

const customCall = (withFunction: boolean) => ({
  summary: withFunction ? 'Call a custom app (a path under it)' : 'Call a custom app (its root)',
  description:
    'Custom apps (`runtime = "custom"`) take every method and path under `/v4/{project_id}/{app_name}`, deeper ' +
    'paths included; the request is forwarded to the app server and its response answered as it is ' +
    '(`?async=true`: 202 and the response is stored), less `Service-Worker-Allowed`, and on the port that ' +
    'serves the dashboard with `Content-Security-Policy: sandbox allow-scripts allow-forms allow-popups` ' +
    'added (FERRY_RUN_PORT serves apps apart). A cortex app answers `405 FERRY_CORTEX_CALL` here. ' +
    'See docs/api.md, "Custom apps".',
  tags: ['run'],
  params: withFunction ? FunctionPath : RunPath,
  querystring: RunQuery,
  headers: RunHeaders,
  response: {
    202: RunAccepted,
    ...errors(400, 401, 403, 404, 405, 413, 422, 429, 502, 503, 504, 507),
    default: { description: "The app server's response, as it answered (sandboxed: see the description)" },
  },
});

const Readiness = Type.Object({
  status: Type.Union([Type.Literal('ready'), Type.Literal('unavailable')]),
  reason: Type.Optional(
    Type.Union([Type.Literal('store'), Type.Literal('store-busy'), Type.Literal('storage')], {
      description:
        '`store`: the store failed or cannot be reached; `store-busy`: it did not answer within a second; ' +
        '`storage`: the data folder has less free space than FERRY_MIN_FREE_MIB (new runs and uploads answer 507)',
    }),
  ),
});

/** `/readyz`: documented (issue 43), unlike `/healthz` and `/metrics`, which are for operators' tools. */
const readiness = {
  summary: 'Whether to send this server new work',
  description:
    'For load balancers and orchestrators; needs no token (like `/healthz`). 200 when the store answers and ' +
    'the data folder has at least FERRY_MIN_FREE_MIB free; 503 naming the reason otherwise. A `storage` 503 ' +
    'is no reason to restart the server: reads and accepted runs go on, and it answers 200 again within ' +
    'about 2 s of space coming back. See docs/operations.md, "Disk space".',
  tags: ['system'],
  operationId: 'readiness',
  security: [],
  response: {
    200: { description: 'Ready', ...Readiness },
    503: { description: 'Not ready: `reason` says why', ...Readiness },
  },
};

function methodsOf(route: RouteOptions): string[] {
  return typeof route.method === 'string' ? [route.method] : [...route.method];
}

/** What the document says about one route (`hide` for the ones it leaves out). */
function describeRoute(schema: FastifySchema | undefined, url: string, route: RouteOptions): FastifySchema {
  const hidden = { ...schema, hide: true };
  if (url.startsWith('/v2/')) {
    if (url === '/v2/openapi.json') return hidden;
    const response = { ...errors(...sharedStatuses(methodsOf(route))), ...(schema?.response as object) };
    return { ...schema, response };
  }
  // A deeper path has no OpenAPI spelling (a path parameter is one segment): the description says it.
  if (url === '/v4/:project_id/:app_name/:function') {
    return methodsOf(route).includes('POST') ? functionCall : customCall(true);
  }
  if (url === '/v4/:project_id/:app_name') return customCall(false);
  if (url === '/readyz') return readiness;
  return hidden;
}

export const swaggerOptions: FastifyDynamicSwaggerOptions = {
  openapi: {
    openapi: '3.1.0',
    info: {
      title: 'Ferry API',
      version: '1.0.0',
      description:
        'The management API (/v2: projects, service accounts, apps, builds, runs, secrets, registry logins) and the run ' +
        'endpoint (/v4) of a Ferry server. Errors are `{"error": {"code", "message"}}` (docs/errors.md).',
    },
    components: {
      securitySchemes: { bearer: { type: 'http', scheme: 'bearer', bearerFormat: 'JWT' } },
    },
    security: [{ bearer: [] }],
  },
  transform({ schema, url, route }) {
    return { schema: describeRoute(schema, url, route), url };
  },
  transformObject(document) {
    if (!('openapiObject' in document)) return document.swaggerObject;
    const { openapiObject } = document;
    const paths = (openapiObject.paths ?? {}) as Record<string, Record<string, unknown>>;
    for (const item of Object.values(paths)) {
      for (const key of Object.keys(item)) {
        if (!PATH_ITEM_METHODS.has(key) && !PATH_ITEM_FIELDS.has(key)) delete item[key];
      }
    }
    return openapiObject;
  },
};
