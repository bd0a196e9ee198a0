/**
 * Every accepted run ends (issue 30 point 5), fast and at one server: a claim or a start committed while
 * the store's connection broke leaves a run the store says this node holds but the node never heard of.
 * Neither recovery (dead nodes only) nor the claimers (free runs only) would look at it again; the async
 * worker's held-runs sweep must: the queued one is let go and runs, the running one ends `interrupted`.
 * Runs on SQLite here and on PostgreSQL through test/postgres/held-runs.test.ts.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { uuidv7 } from '../src/ids.js';
import { newRunRow } from '../src/runs/recorder.js';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

describe('runs a live node holds in the store but not in hand', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'held', {
      'ferry.toml': '[app]\nname = "held"\n',
      'main.ts': 'export async function run({ n }: { n: number }) { return { n }; }\n',
    });
  });
  after(async () => {
    await server?.close();
  });

  it('are let go (queued) or ended as interrupted (running)', { timeout: 120_000 }, async () => {
    const { store, node } = server.services;
    const res = await http(`${server.url}/v4/${auth.projectId}/held/run?async=true`, {
      method: 'POST',
      token: auth.token,
      body: { n: 0 },
    });
    assert.equal(res.status, 202, res.text);
    const first = await waitFor(
      async () => {
        const r = await store.selectFrom('runs').selectAll().where('id', '=', res.json.run_id).executeTakeFirst();
        return r?.state === 'success' ? r : undefined;
      },
      30_000,
      'a first async run',
    );
    const build = { projectId: auth.projectId, appId: 'held', buildId: first.build_id ?? '' };
    // A claim whose answer was lost: queued, held by this live node, in no queue of it.
    const lostClaim = newRunRow({ id: uuidv7(), build, fn: 'run', mode: 'async', input: '{"n":1}', owner: node.id });
    // A start whose answer was lost: running (one start), held by this node, performed nowhere.
    const lostStart = {
      ...newRunRow({ id: uuidv7(), build, fn: 'run', mode: 'async', input: '{"n":2}', owner: node.id }),
      state: 'running' as const,
      attempts: 1,
      started_at: new Date().toISOString(),
    };
    await store.insertInto('runs').values([lostClaim, lostStart]).execute();
    const rows = await waitFor(
      async () => {
        const r = await store
          .selectFrom('runs')
          .select(['id', 'state', 'reason', 'result'])
          .where('id', 'in', [lostClaim.id, lostStart.id])
          .execute();
        return r.every((x) => x.state !== 'queued' && x.state !== 'running') ? r : undefined;
      },
      // Two sweeps 10 s apart, then the claim: generous for a loaded machine.
      60_000,
      'both runs to end',
    );
    const byId = new Map(rows.map((r) => [r.id, r]));
    assert.equal(byId.get(lostClaim.id)?.state, 'success', 'the lost claim is let go, claimed again and run');
    assert.equal(byId.get(lostClaim.id)?.result, '{"n":1}');
    assert.equal(byId.get(lostStart.id)?.state, 'failure');
    assert.equal(byId.get(lostStart.id)?.reason, 'interrupted');
  });
});
