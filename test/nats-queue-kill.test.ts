/**
 * The async queue on NATS JetStream when a consuming process dies (issue 13, item 1): two `ferry serve`
 * processes on one PostgreSQL and the shared NATS, each its own data directory (no shared folder); one is
 * SIGKILLed (its whole process group) while it runs async runs. Its messages are redelivered after the ack
 * wait and its lease runs out; the run record decides: the runs it held run on the other process, the ones
 * it was running run again (`retry_interrupted`), and every run ends terminal.
 */
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { deployFiles, http, tempDir, waitFor } from './helpers/ferry.js';
import {
  bootstrapShared,
  createTestDatabase,
  type FleetProcess,
  fleetAppFiles,
  parseEvidence,
  startFleetProcess,
  sweepStrays,
  type TestDatabase,
} from './helpers/fleet.js';
import { deleteClusterStreams, NATS_URL } from './helpers/nats.js';

const RUNS = 40;

describe('a consuming process SIGKILLed with the JetStream queue', () => {
  let root: string;
  let db: TestDatabase;
  let client: pg.Client;
  const cluster = `t_${process.pid}_${randomBytes(4).toString('hex')}`;
  const procs: FleetProcess[] = [];
  let auth: { projectId: string; token: string };

  before(
    async () => {
      root = await tempDir('ferry-nats-kill-');
      db = await createTestDatabase('ferry_nats_kill');
      const keysDir = path.join(root, 'keys');
      auth = await bootstrapShared(path.join(root, 'a'), db.url, keysDir);
      for (const label of ['a', 'b']) {
        procs.push(
          await startFleetProcess(label, path.join(root, label), {
            databaseUrl: db.url,
            keysDir,
            artifactsDir: path.join(root, `artifacts-${label}`),
            env: {
              FERRY_SANDBOX: 'off',
              FERRY_LEASE_SECONDS: '3',
              FERRY_NATS_URL: NATS_URL,
              FERRY_CLUSTER_NAME: cluster,
            },
          }),
        );
      }
      client = new pg.Client({ connectionString: db.url });
      await client.connect();
    },
    { timeout: 120_000 },
  );

  after(async () => {
    await Promise.allSettled(procs.map((p) => p.stop(10_000)));
    if (root) await sweepStrays(root);
    await client?.end().catch(() => undefined);
    await db?.drop();
    await deleteClusterStreams(cluster);
    if (root) await fs.rm(root, { recursive: true, force: true });
  });

  it('runs every accepted run to a terminal state after a consumer dies mid-run', { timeout: 240_000 }, async () => {
    const [a, b] = procs as [FleetProcess, FleetProcess];
    const evidence = path.join(root, 'evidence.jsonl');
    await deployFiles(a, auth, 'fleet', fleetAppFiles('fleet', evidence));
    const ids: string[] = [];
    for (let n = 0; n < RUNS; n++) {
      const target = n % 2 ? a : b;
      const res = await http(`${target.url}/v4/${auth.projectId}/fleet/work?async=true`, {
        method: 'POST',
        token: auth.token,
        body: { n, ms: 1500 },
      });
      assert.equal(res.status, 202, res.text);
      ids.push(res.json.run_id as string);
    }
    // Kill the process that is running a run (whichever it is), while it runs it.
    const nodes = await client.query<{ id: string; info: string }>('select id, info from nodes');
    const urlOf = new Map(nodes.rows.map((r) => [r.id, (JSON.parse(r.info) as { url?: string }).url]));
    const running = await waitFor(
      async () => {
        const r = await client.query<{ id: string; owner: string }>(
          // The newest start: the run has most of its 1.5 s left, so its process is still running it at the kill.
          "select id, owner from runs where state = 'running' and owner is not null order by started_at desc limit 1",
        );
        return r.rows[0];
      },
      60_000,
      'a running run',
    );
    const victim = procs.find((p) => p.url === urlOf.get(running.owner));
    assert.ok(victim, `the owner ${running.owner} is one of the processes`);
    const heldBefore = await client.query<{ id: string }>('select id from runs where owner = $1', [running.owner]);
    await victim.kill();
    // What the victim was running when it died, as the record says (no lease has run out yet): a run whose
    // function had ended but whose end was not written yet counts, and runs again, as it must.
    const interrupted = await client.query<{ id: string }>(
      "select id from runs where owner = $1 and state = 'running'",
      [running.owner],
    );
    assert.ok(interrupted.rows.length >= 1, 'the victim was running a run when it died');
    const rows = await waitFor(
      async () => {
        const r = await client.query<{ id: string; state: string; attempts: number; owner: string | null }>(
          'select id, state, attempts, owner from runs where id = any($1)',
          [ids],
        );
        return r.rows.every((row) => ['success', 'failure', 'timeout', 'cancelled'].includes(row.state))
          ? r.rows
          : undefined;
      },
      180_000,
      `${RUNS} runs terminal after the kill`,
    );
    assert.equal(rows.length, RUNS);
    assert.deepEqual(
      rows.filter((r) => r.state !== 'success'),
      [],
      'every run succeeds (retry_interrupted)',
    );
    // The runs the victim was running ran again on the survivor. (The run seen running before the kill may
    // have ended and been written in the moment before it: only the record after the kill tells.)
    for (const { id } of interrupted.rows) {
      const killedRun = rows.find((r) => r.id === id);
      assert.ok(
        killedRun && killedRun.attempts >= 2,
        `the interrupted run started again: ${JSON.stringify(killedRun)}`,
      );
    }
    assert.ok(heldBefore.rows.length >= 1);
    // Every run's function ran to its end at least once.
    const { lines } = parseEvidence(`${await fs.readFile(evidence, 'utf8')}\n`);
    const ended = new Set(lines.filter((l) => l.ev === 'end').map((l) => l.n));
    for (let n = 0; n < RUNS; n++) assert.ok(ended.has(n), `run ${n} ended`);
  });
});
