/** `POST /v2/projects/{project_id}/apps/{app_id}/runs/{run_id}/webhook/redeliver`: send a run's webhook again. */
import { Type } from 'typebox';
import type { RunService } from '../../runs/run-service.js';
import { type AuthDeps, requireScope } from '../auth.js';
import { AppId, errors, ProjectId } from '../schemas.js';
import type { TypedServer } from '../typed-server.js';

const RunParams = Type.Object({
  project_id: ProjectId,
  app_id: AppId,
  run_id: Type.String({ pattern: '^[0-9a-f-]{36}$' }),
});

export interface WebhookRouteDeps extends AuthDeps {
  runs: Pick<RunService, 'redeliverWebhook'>;
}

export function registerWebhookRoutes(app: TypedServer, services: WebhookRouteDeps): void {
  const manage = requireScope(services, 'manage');

  app.post(
    '/v2/projects/:project_id/apps/:app_id/runs/:run_id/webhook/redeliver',
    {
      onRequest: manage,
      schema: {
        summary: "Send a run's webhook again, with a fresh budget of 3 attempts",
        description:
          'Works in any delivery state (delivered, failed, pending) for 7 days after the delivery ended. ' +
          'Attempts are added to the run, numbered on from the earlier ones.',
        params: RunParams,
        response: {
          202: Type.Object({ run_id: Type.String(), state: Type.Literal('pending') }),
          ...errors(400, 401, 403, 404, 409, 410),
        },
      },
    },
    async (request, reply) => {
      const { project_id, app_id, run_id } = request.params;
      await services.runs.redeliverWebhook(project_id, app_id, run_id);
      return reply.code(202).send({ run_id, state: 'pending' as const });
    },
  );
}
