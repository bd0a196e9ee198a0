/**
 * The async backlog is per project (issue 12): a project that fills its
 * FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT answers 429 FERRY_PROJECT_BACKLOG_FULL, storing nothing, while
 * another project on the same server is still accepted. The count comes from the store.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

const LIMIT = 3;
const APP = {
  // One replica taking one run at a time: accepted runs wait in the backlog.
  'ferry.toml': '[app]\nname = "jobs"\n[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n',
  'main.ts':
    'export async function run({ ms }: { ms: number }) { await new Promise((r) => setTimeout(r, ms)); return 1; }\n',
};

describe('per-project async backlog', () => {
  let server: TestServer;
  let a: { projectId: string; token: string };
  let b: { projectId: string; token: string };
  const call = (auth: { projectId: string; token: string }, ms: number) =>
    http(`${server.url}/v4/${auth.projectId}/jobs/run?async=true`, { method: 'POST', token: auth.token, body: { ms } });
  const runsOf = async (projectId: string) =>
    (await server.services.store.selectFrom('runs').select('id').where('project_id', '=', projectId).execute()).length;

  before(async () => {
    server = await startServer({ env: { FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT: String(LIMIT) } });
    a = await server.bootstrap('project-a');
    b = await server.bootstrap('project-b');
    await deployFiles(server, a, 'jobs', APP);
    await deployFiles(server, b, 'jobs', APP);
  });
  after(() => server.close());

  it('refuses a full project with 429 FERRY_PROJECT_BACKLOG_FULL and still accepts another', async () => {
    const accepted: string[] = [];
    for (let i = 0; i < LIMIT; i++) {
      const res = await call(a, 1500);
      assert.equal(res.status, 202, res.text);
      accepted.push(res.json.run_id);
    }
    const before = await runsOf(a.projectId);
    const refused = await call(a, 1);
    assert.equal(refused.status, 429, refused.text);
    assert.equal(refused.json.error.code, 'FERRY_PROJECT_BACKLOG_FULL');
    assert.ok(refused.headers.get('retry-after'));
    assert.equal(await runsOf(a.projectId), before, 'the refused call stored nothing');

    const other = await call(b, 1);
    assert.equal(other.status, 202, `project B is not held up by project A: ${other.text}`);

    // Once A's runs have finished, the count read from the store lets A in again.
    await waitFor(
      async () => {
        const rows = await server.services.store
          .selectFrom('runs')
          .select('state')
          .where('id', 'in', accepted)
          .execute();
        return rows.every((r) => r.state === 'success') || undefined;
      },
      60_000,
      "project A's runs to finish",
    );
    const again = await waitFor(
      async () => {
        const res = await call(a, 1);
        return res.status === 202 ? res : undefined;
      },
      10_000,
      'project A to be accepted again',
    );
    assert.equal(again.status, 202);
  });

  it('counts the project backlog from the store, not from this process', async () => {
    // A run row written by someone else (another process sharing the store) counts as well.
    const fresh = await server.bootstrap('project-c');
    await deployFiles(server, fresh, 'jobs', APP);
    const appId = (
      await server.services.store
        .selectFrom('apps')
        .select('id')
        .where('project_id', '=', fresh.projectId)
        .executeTakeFirstOrThrow()
    ).id;
    const now = new Date().toISOString();
    await server.services.store
      .insertInto('runs')
      .values(
        Array.from({ length: LIMIT }, (_, i) => ({
          id: `00000000-0000-7000-8000-00000000000${i}`,
          project_id: fresh.projectId,
          app_id: appId,
          build_id: null,
          function_name: 'run',
          mode: 'async',
          state: i === 0 ? 'running' : 'queued',
          cold_start: 0,
          created_at: now,
        })),
      )
      .execute();
    const refused = await call(fresh, 1);
    assert.equal(refused.status, 429, refused.text);
    assert.equal(refused.json.error.code, 'FERRY_PROJECT_BACKLOG_FULL');
    // Those runs end elsewhere: within the count's one-second cache, the project is accepted again.
    await server.services.store
      .updateTable('runs')
      .set({ state: 'failure' })
      .where('project_id', '=', fresh.projectId)
      .execute();
    const again = await waitFor(
      async () => {
        const res = await call(fresh, 1);
        return res.status === 202 ? res : undefined;
      },
      10_000,
      'project C to be accepted again',
    );
    assert.equal(again.status, 202);
  });
});
