/** `/v2/projects/{project_id}/service-accounts`: create (token shown once), list, revoke. */
import { Type } from 'typebox';
import type { AccountService } from '../../auth/account-service.js';
import { DEFAULT_EXPIRY_DAYS } from '../../auth/service-accounts.js';
import { FerryError } from '../../errors.js';
import { type AuthDeps, requireScope } from '../auth.js';
import type { RunAddress } from '../run-address.js';
import { errors, Nullable, ProjectParams, ServiceAccount } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const CreateBody = Type.Object(
  {
    name: Type.String({ minLength: 1, maxLength: 100 }),
    expires_at: Type.Optional(
      Type.String({ description: `Expiry date or date-time (ISO 8601); default ${DEFAULT_EXPIRY_DAYS} days from now` }),
    ),
    scopes: Type.Optional(
      Type.Array(Type.Union([Type.Literal('manage'), Type.Literal('run')]), {
        minItems: 1,
        description: 'Default: ["manage", "run"]. A run-only token is ["run"].',
      }),
    ),
  },
  { additionalProperties: false },
);

function parseExpiry(value: string | undefined): Date {
  if (value === undefined) return new Date(Date.now() + DEFAULT_EXPIRY_DAYS * 86_400_000);
  // A bare date means the end of that day, UTC: "expires 2027-01-31" should still work on the 31st.
  const text = /^\d{4}-\d{2}-\d{2}$/.test(value) ? `${value}T23:59:59.999Z` : value;
  const ms = Date.parse(text);
  if (!/^\d{4}-\d{2}-\d{2}/.test(value) || Number.isNaN(ms)) {
    throw new FerryError('FERRY_VALIDATION', `expires_at must be an ISO 8601 date or date-time, not "${value}"`);
  }
  return new Date(ms);
}

export interface AccountRouteDeps extends AuthDeps {
  accounts: AccountService;
}

/** `runAddress`: where the run endpoint is, told with the project (http/run-address.ts). */
export function registerServiceAccountRoutes(
  app: TypedServer,
  services: AccountRouteDeps,
  runAddress: Pick<RunAddress, 'forRequest'>,
): void {
  const manage = requireScope(services, 'manage');

  app.get(
    '/v2/projects/:project_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Get the project',
        params: ProjectParams,
        response: {
          200: Type.Object({
            id: Type.String(),
            name: Type.String(),
            created_at: Type.String(),
            run_url: Nullable(
              Type.String({
                description:
                  "The run endpoint's base address (`{run_url}`: apps are at `{run_url}/v4/{project_id}/{app_name}`) " +
                  'when the server serves it apart from this API: FERRY_RUN_URL, or with FERRY_RUN_PORT this ' +
                  "request's host name on that port. null: at this API's own address",
              }),
            ),
          }),
          ...errors(401, 403, 404),
        },
      },
    },
    async (request) => ({
      ...(await services.accounts.project(request.params.project_id)),
      run_url: runAddress.forRequest(request),
    }),
  );

  app.post(
    '/v2/projects/:project_id/service-accounts',
    {
      onRequest: manage,
      schema: {
        summary: 'Create a service account',
        description: 'The token is in this response only; it is never shown again.',
        params: ProjectParams,
        body: CreateBody,
        response: {
          201: Type.Intersect([ServiceAccount, Type.Object({ token: Type.String() })]),
          ...errors(400, 401, 403, 404),
        },
      },
    },
    async (request, reply) => {
      const { account, token } = await services.accounts.create({
        projectId: request.params.project_id,
        name: request.body.name,
        scopes: request.body.scopes ?? ['manage', 'run'],
        expiresAt: parseExpiry(request.body.expires_at),
      });
      return reply.code(201).send({ ...account, token });
    },
  );

  app.get(
    '/v2/projects/:project_id/service-accounts',
    {
      onRequest: manage,
      schema: {
        summary: 'List service accounts (never their tokens)',
        params: ProjectParams,
        response: { 200: Type.Object({ service_accounts: Type.Array(ServiceAccount) }), ...errors(401, 403, 404) },
      },
    },
    async (request) => ({ service_accounts: await services.accounts.list(request.params.project_id) }),
  );

  app.delete(
    '/v2/projects/:project_id/service-accounts/:service_account_id',
    {
      onRequest: manage,
      schema: {
        summary: 'Revoke a service account and its token',
        params: Type.Object({
          project_id: ProjectParams.properties.project_id,
          service_account_id: Type.String({ pattern: '^sa-[0-9a-f]{12}$' }),
        }),
        response: { 200: ServiceAccount, ...errors(401, 403, 404) },
      },
    },
    async (request) => services.accounts.revoke(request.params.project_id, request.params.service_account_id),
  );
}
