/**
 * The fleet test (issue 12): three real `ferry serve` processes, each with its own data dir, sharing one
 * fresh PostgreSQL database, one keys dir and one artifacts dir.
 *
 * - A deploy through one process is callable through the others at once; a new build made through it is
 *   in force on them within 1 second.
 * - A token revoked through one process is refused by the others within 1 second.
 * - 1,000 async runs with webhooks spread over the three; one process is SIGKILLed mid-run (with its
 *   replicas, as when its machine dies) and restarted a few seconds later on the same data dir. Every run
 *   reaches a terminal state, every webhook is delivered at least once, no run executes twice at the same
 *   time, runs never on the killed process execute exactly once, and runs it was executing are run again
 *   (the app sets `retry_interrupted`) and succeed. A few runs outlast a lease, so renewal is exercised.
 *
 * The processes run with FERRY_SANDBOX=off: the function must leave evidence outside itself (a shared
 * file, and the serving process's data dir in its socket path), which a sandbox forbids, and this test is
 * about how work is claimed, not about the sandbox (test/security covers that).
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, tempDir } from './helpers/ferry.js';
import {
  type Accepted,
  bootstrapShared,
  collectExecutions,
  createTestDatabase,
  type EvidenceLine,
  EvidenceTail,
  type Execution,
  type FleetProcess,
  type FleetSettings,
  fleetAppFiles,
  type Incarnation,
  overlapping,
  parseEvidence,
  type Slot,
  sleep,
  startFleetProcess,
  submitAsync,
  sweepStrays,
  type TestDatabase,
  within,
} from './helpers/fleet.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const RUNS = 1000;
/** The kill comes once this many calls were accepted (about a third). */
const KILL_AFTER = 333;
/** Calls from this one on wait until the killed process is back, so it takes calls again too. */
const GATE_AT = 800;
/** Calls in flight at once, and at most one new call per PACE_MS (so the run lasts past the restart). */
const IN_FLIGHT = 24;
const PACE_MS = 10;
/**
 * FERRY_LEASE_SECONDS. The killed process's runs are taken over at its restart (which ends its lease at
 * once) or at the lease's end, whichever comes first (on a loaded machine a restart can take longer than
 * the lease), so the lease need not be short. It must outlast any stall of a live
 * process: on a loaded 2-core CI machine a live process once went 3.3 s without renewing (its 4 s run took
 * 7.3 s), its lease of 3 s lapsed, and another process ran its runs again while it still ran them. A
 * process stalled for longer than its lease is judged dead by design (docs/scaling-out.md, leases).
 */
const LEASE_SECONDS = 10;
const RESTART_AFTER_MS = 3000;
/**
 * Most runs sleep 30-80 ms, so a kill lands mid-run; one in LONG_EVERY sleeps longer than a lease, so a
 * process that failed to renew its leases would see its runs taken over (and run twice at once), and
 * the restarted process starts while the others are surely executing.
 */
const LONG_EVERY = 40;
const LONG_MS = (LEASE_SECONDS + 1) * 1000;
const sleepOf = (n: number) => (n % LONG_EVERY === LONG_EVERY / 2 ? LONG_MS : 30 + ((n * 37) % 51));
const TERMINAL = new Set(['success', 'failure', 'timeout', 'cancelled']);

interface RunRow {
  run_id: string;
  state: string;
  reason: string | null;
  finished_at: string | null;
  error: { code: string; message: string } | null;
  attempts?: number;
}

// The analysis the fleet test relies on, on evidence written by hand: it must see what it is meant to see.
describe('fleet evidence analysis', () => {
  const line = (ev: 'start' | 'end', n: number, exec: string, t: number, dir: string): EvidenceLine => ({
    ev,
    n,
    exec,
    t,
    sock: `${dir}/run/r1/replica.sock`,
    pid: 1,
  });
  const incarnations: Incarnation[] = [
    { label: 'A#1', dataDir: '/f/a', from: 0, until: 100 },
    { label: 'B', dataDir: '/f/b', from: 0, until: Number.POSITIVE_INFINITY },
    { label: 'A#2', dataDir: '/f/a', from: 200, until: Number.POSITIVE_INFINITY },
  ];

  it('ends an execution cut by the kill at the kill, and tells incarnations of one data dir apart by time', () => {
    const { executions, problems } = collectExecutions(
      [line('start', 1, 'x', 50, '/f/a'), line('start', 1, 'y', 250, '/f/a'), line('end', 1, 'y', 300, '/f/a')],
      incarnations,
    );
    assert.deepEqual(problems, []);
    assert.deepEqual(
      executions.map((e) => [e.on, e.start, e.end, e.interrupted]),
      [
        ['A#1', 50, 100, true],
        ['A#2', 250, 300, false],
      ],
    );
    assert.deepEqual(overlapping(executions), []);
  });

  it('finds two executions of one run at the same time, an open one, and a line no process could have written', () => {
    const { executions, problems } = collectExecutions(
      [
        line('start', 2, 'p', 10, '/f/a'),
        line('start', 2, 'q', 40, '/f/b'),
        line('end', 2, 'p', 60, '/f/a'),
        line('end', 2, 'q', 90, '/f/b'),
        line('start', 3, 'r', 120, '/f/b'),
        line('start', 3, 's', 130, '/f/b'),
        line('start', 4, 'z', 150, '/f/a'),
      ],
      incarnations,
    );
    assert.equal(problems.length, 1, 'the start at 150 on /f/a falls between A#1 and A#2');
    assert.deepEqual(
      overlapping(executions).map(([x, y]) => [x.exec, y.exec]),
      [
        ['p', 'q'],
        ['r', 's'],
      ],
    );
  });
});

describe('a fleet of three ferry serve processes on one PostgreSQL', () => {
  let root: string;
  let db: TestDatabase | undefined;
  let receiver: Receiver | undefined;
  let settings: FleetSettings;
  const dataDirs: string[] = [];
  /** The live process of each slot (A, B, C); A is replaced when it is restarted. */
  const procs: FleetProcess[] = [];
  /** Every process started, for the teardown. */
  const started: FleetProcess[] = [];
  const slots: Slot[] = [];
  let auth: { projectId: string; token: string };

  const start = async (i: number, label = 'ABC'[i]!) => {
    const proc = await startFleetProcess(label, dataDirs[i]!, settings);
    started.push(proc);
    procs[i] = proc;
    slots[i] = { label, url: proc.url };
    return proc;
  };

  before(
    async () => {
      root = await tempDir('ferry-fleet-');
      db = await createTestDatabase('ferry_fleet');
      receiver = await startReceiver();
      settings = {
        databaseUrl: db.url,
        keysDir: path.join(root, 'keys'),
        artifactsDir: path.join(root, 'artifacts'),
        env: {
          FERRY_SANDBOX: 'off',
          FERRY_LEASE_SECONDS: String(LEASE_SECONDS),
          FERRY_WEBHOOK_ALLOW: '127.0.0.0/8',
        },
      };
      for (const name of ['a', 'b', 'c']) dataDirs.push(path.join(root, name));
      // Bootstrapping first migrates the database and makes the shared keys, before any serve starts.
      auth = await bootstrapShared(dataDirs[0]!, db.url, settings.keysDir);
      await Promise.all([0, 1, 2].map((i) => start(i)));
    },
    { timeout: 120_000 },
  );

  after(
    async () => {
      // Every step runs whatever happened before it; the first error is reported once all are done.
      const results = await Promise.allSettled(started.map((p) => p.stop(10_000)));
      const strays = root ? await sweepStrays(root) : 0;
      results.push(
        ...(await Promise.allSettled([
          receiver?.close(),
          db?.drop(),
          root ? fs.rm(root, { recursive: true, force: true }) : undefined,
        ])),
      );
      const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
      if (failed) throw failed.reason;
      assert.equal(strays, 0, 'no process of the fleet outlived its process group');
    },
    { timeout: 60_000 },
  );

  const runUrl = (proc: { url: string }, app: string, fn: string) => `${proc.url}/v4/${auth.projectId}/${app}/${fn}`;

  it('runs a deploy made through one process on the others at once, and a new build within 1 s', async () => {
    const [a, b, c] = procs as [FleetProcess, FleetProcess, FleetProcess];
    const probe = (v: number) => ({
      'ferry.toml': '[app]\nname = "probe"\n',
      'main.ts': `export function version(): { v: number } { return { v: ${v} }; }\n`,
    });
    await deployFiles(a, auth, 'probe', probe(1));
    for (const other of [b, c]) {
      const res = await http(runUrl(other, 'probe', 'version'), { method: 'POST', token: auth.token, body: {} });
      assert.equal(res.status, 200, `${other.label}: ${res.text}`);
      assert.deepEqual(res.json.result, { v: 1 }, other.label);
    }

    await deployFiles(a, auth, 'probe', probe(2));
    const readyAt = Date.now();
    const answers = await Promise.all(
      [b, c].map(async (other) => {
        const seen: Array<{ sentAt: number; status: number; v: unknown }> = [];
        for (let i = 0; i < 200 && Date.now() < readyAt + 30_000; i++) {
          const sentAt = Date.now();
          const res = await http(runUrl(other, 'probe', 'version'), { method: 'POST', token: auth.token, body: {} });
          seen.push({ sentAt: sentAt - readyAt, status: res.status, v: res.json?.result?.v });
          if (res.json?.result?.v === 2) break;
          await sleep(50);
        }
        return { label: other.label, seen };
      }),
    );
    for (const { label, seen } of answers) {
      const text = `${label} (ms after the build was ready through A): ${JSON.stringify(seen)}`;
      assert.ok(
        seen.every((s) => s.status === 200),
        `every call answered 200 during the switch; ${text}`,
      );
      assert.equal(seen.at(-1)?.v, 2, `the new build answered at last; ${text}`);
      assert.ok(
        seen.every((s) => s.v === 2 || s.sentAt <= 1000),
        `no call sent 1 s after the build was ready ran the old one; ${text}`,
      );
    }
  });

  it('refuses a token revoked through one process on the others within 1 s', async () => {
    const [a, b, c] = procs as [FleetProcess, FleetProcess, FleetProcess];
    const created = await http(`${a.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'fleet-revoke' },
    });
    assert.equal(created.status, 201, created.text);
    const { id, token } = created.json as { id: string; token: string };

    // Callers on B and C keep calling from before the revoke (so any cache there is warm) until the
    // token has been refused a few times in a row. A management read: it checks the token and nothing
    // else, so this test does not depend on B and C running builds.
    let revokeSentAt = Number.POSITIVE_INFINITY;
    let revokeAnsweredAt = Number.POSITIVE_INFINITY;
    const pollers = [b, c].map(async (other) => {
      const seen: Array<{ sentAt: number; status: number }> = [];
      const end = Date.now() + 20_000;
      let refusedInARow = 0;
      // Until refused 3 times in a row and 2 calls were sent past 1 s after the revoke's answer: those calls
      // are the check. Counted by when calls were sent, not by the clock at the loop's turn: on a loaded
      // machine one call can take 300 ms, and the loop once stopped past 1.2 s with its last call sent at
      // 0.88 s, so no call was left to check.
      let sentLate = 0;
      for (let i = 0; i < 400 && Date.now() < end; i++) {
        if (refusedInARow >= 3 && sentLate >= 2) break;
        const sentAt = Date.now();
        const res = await http(`${other.url}/v2/projects/${auth.projectId}`, { token });
        seen.push({ sentAt, status: res.status });
        if (sentAt > revokeAnsweredAt + 1000) sentLate += 1;
        refusedInARow = res.status === 401 && sentAt > revokeAnsweredAt ? refusedInARow + 1 : 0;
        await sleep(50);
      }
      return { label: other.label, seen };
    });
    await sleep(300);
    revokeSentAt = Date.now();
    const revoked = await http(`${a.url}/v2/projects/${auth.projectId}/service-accounts/${id}`, {
      method: 'DELETE',
      token: auth.token,
    });
    revokeAnsweredAt = Date.now();
    assert.equal(revoked.status, 200, revoked.text);

    for (const { label, seen } of await Promise.all(pollers)) {
      const text = `${label} (ms after the revoke's answer): ${JSON.stringify(seen.map((s) => [s.sentAt - revokeAnsweredAt, s.status]))}`;
      assert.ok(
        seen.some((s) => s.sentAt < revokeSentAt && s.status === 200),
        `the token worked there before; ${text}`,
      );
      assert.ok(
        seen.every((s) => s.status === 200 || s.status === 401),
        `only 200 or 401; ${text}`,
      );
      const late = seen.filter((s) => s.sentAt > revokeAnsweredAt + 1000);
      assert.ok(late.length > 0, `calls went on past 1 s after the revoke; ${text}`);
      assert.ok(
        late.every((s) => s.status === 401),
        `every call sent 1 s after the revoke's answer was refused; ${text}`,
      );
    }
  });

  it('runs 1,000 async runs over three processes, one SIGKILLed and restarted mid-way: none lost, none run twice at once', {
    timeout: 240_000,
  }, async (t) => {
    const wallStart = Date.now();
    const [a, b, c] = procs as [FleetProcess, FleetProcess, FleetProcess];
    const evidenceFile = path.join(root, 'evidence.jsonl');
    await deployFiles(a, auth, 'fleet', fleetAppFiles('fleet', evidenceFile));
    const hook = encodeURIComponent(`${receiver!.url}/hook`);
    const callPath = `/v4/${auth.projectId}/fleet/work?async=true&webhookEndpoint=${hook}`;

    // ---- send, kill, restart ----
    const accepted = new Map<number, Accepted>();
    const sendErrors: string[] = [];
    const incarnations: Incarnation[] = [b, c].map((p) => ({
      label: p.label,
      dataDir: p.dataDir,
      from: p.startedAt,
      until: Number.POSITIVE_INFINITY,
    }));
    let killTask: Promise<void> | undefined;
    let killedMidRun = false;
    let restartProblem: string | undefined;
    let openGate!: () => void;
    const gate = new Promise<void>((resolve) => {
      openGate = resolve;
    });

    const killAndRestart = async () => {
      try {
        // The kill must land while A is executing: wait (bounded) until the evidence shows it is.
        const tail = new EvidenceTail(evidenceFile);
        const waitUntil = Date.now() + 15_000;
        while (Date.now() < waitUntil && !killedMidRun) {
          killedMidRun = (await tail.openExecutions()).some((l) => l.sock.startsWith(`${a.dataDir}${path.sep}`));
          if (!killedMidRun) await sleep(5);
        }
        const deadAt = await a.kill();
        slots[0] = { label: 'A', url: undefined };
        incarnations.push({ label: 'A#1', dataDir: a.dataDir, from: a.startedAt, until: deadAt });
        await sleep(RESTART_AFTER_MS);
        const again = await start(0, 'A#2');
        incarnations.push({
          label: 'A#2',
          dataDir: again.dataDir,
          from: again.startedAt,
          until: Number.POSITIVE_INFINITY,
        });
      } catch (err) {
        restartProblem = (err as Error).stack ?? String(err);
      } finally {
        openGate();
      }
    };
    slots[0] = { label: 'A#1', url: a.url };

    let next = 0;
    const sendStart = Date.now();
    const sender = async () => {
      while (next < RUNS) {
        const n = next++;
        await sleep(sendStart + n * PACE_MS - Date.now());
        if (n >= GATE_AT) await within(gate, 60_000);
        try {
          const answer = await submitAsync(slots, n % 3, {
            path: callPath,
            token: auth.token,
            body: { n, ms: sleepOf(n) },
            idempotencyKey: `fleet-${n}`,
          });
          accepted.set(n, answer);
        } catch (err) {
          sendErrors.push((err as Error).message);
        }
        if (accepted.size >= KILL_AFTER && !killTask) killTask = killAndRestart();
      }
    };
    await Promise.all(Array.from({ length: IN_FLIGHT }, sender));
    await (killTask ?? Promise.resolve());
    const sendMs = Date.now() - sendStart;
    const runIds = new Set([...accepted.values()].map((x) => x.runId));
    const nOf = new Map([...accepted].map(([n, x]) => [x.runId, n]));

    // ---- wait for the end: every run terminal, every webhook delivered (both bounded) ----
    const listRuns = async (): Promise<RunRow[]> => {
      const rows: RunRow[] = [];
      let beforeId = '';
      for (let page = 0; page < 20; page++) {
        const res = await http(
          `${b.url}/v2/projects/${auth.projectId}/apps/fleet/runs?limit=500${beforeId ? `&before=${beforeId}` : ''}`,
          { token: auth.token },
        );
        assert.equal(res.status, 200, res.text);
        rows.push(...(res.json.runs as RunRow[]));
        if (!res.json.next_before) break;
        beforeId = res.json.next_before;
      }
      return rows;
    };
    let rows: RunRow[] = [];
    const terminalBy = Date.now() + 120_000;
    while (Date.now() < terminalBy) {
      rows = await listRuns();
      if (rows.length >= runIds.size && rows.every((r) => TERMINAL.has(r.state))) break;
      await sleep(1000);
    }
    const deliveredIds = () => new Set(receiver!.requests.map((r) => String(r.headers['x-request-id'])));
    const deliveredBy = Date.now() + 60_000;
    while (Date.now() < deliveredBy && ![...runIds].every((id) => deliveredIds().has(id))) await sleep(500);
    // A little longer than a lease: a process that wrongly took over finished work would do it by now.
    await sleep((LEASE_SECONDS + 1) * 1000);
    const wallMs = Date.now() - wallStart;

    // ---- read what happened ----
    const { lines } = parseEvidence(`${await fs.readFile(evidenceFile, 'utf8').catch(() => '')}\n`);
    const { executions, problems: evidenceProblems } = collectExecutions(lines, incarnations);
    const byRun = new Map<number, Execution[]>();
    for (const e of executions) byRun.set(e.n, [...(byRun.get(e.n) ?? []), e]);
    const rowById = new Map(rows.map((r) => [r.run_id, r]));
    const deliveries = new Map<string, Array<{ status_code?: number }>>();
    for (const r of receiver!.requests) {
      const id = String(r.headers['x-request-id']);
      deliveries.set(id, [...(deliveries.get(id) ?? []), JSON.parse(r.body.toString('utf8'))]);
    }
    const onKilled = (n: number) => (byRun.get(n) ?? []).some((e) => e.on === 'A#1');
    const interrupted = [...byRun].filter(([, list]) => list.some((e) => e.interrupted)).map(([n]) => n);
    // The run record of every run the kill may have touched, or that ran other than once (bounded).
    const suspects = [...accepted.keys()].filter((n) => onKilled(n) || (byRun.get(n)?.length ?? 0) !== 1);
    const details = new Map<number, RunRow>();
    for (const n of suspects.slice(0, 300)) {
      const res = await http(`${b.url}/v2/projects/${auth.projectId}/apps/fleet/runs/${accepted.get(n)!.runId}`, {
        token: auth.token,
      });
      if (res.status === 200) details.set(n, res.json as RunRow);
    }

    // ---- figures ----
    const count = <T>(items: T[], key: (x: T) => string) =>
      items.reduce<Record<string, number>>((acc, x) => {
        acc[key(x)] = (acc[key(x)] ?? 0) + 1;
        return acc;
      }, {});
    const totalDeliveries = receiver!.requests.length;
    const rerun = [...details.values()].filter((d) => (d.attempts ?? 0) >= 2).length;
    t.diagnostic(`runs accepted: ${runIds.size} of ${RUNS} calls in ${sendMs} ms`);
    t.diagnostic(`202s per process: ${JSON.stringify(count([...accepted.values()], (x) => x.slot))}`);
    t.diagnostic(
      `calls sent again after a connection failure: ${[...accepted.values()].filter((x) => x.connectionFailures > 0).length}`,
    );
    t.diagnostic(`executions per process: ${JSON.stringify(count(executions, (e) => e.on))}`);
    t.diagnostic(`kills: 1 (A, ${killedMidRun ? 'mid-run' : 'NOT seen mid-run'}); restart: ${restartProblem ?? 'ok'}`);
    t.diagnostic(`runs interrupted by the kill: ${interrupted.length}; runs started again (attempts >= 2): ${rerun}`);
    t.diagnostic(
      `run states: ${JSON.stringify(count(rows, (r) => `${r.state}${r.reason ? `/${r.reason}` : ''}${r.error ? `/${r.error.code}` : ''}`))}`,
    );
    t.diagnostic(
      `webhook deliveries received: ${totalDeliveries} for ${deliveries.size} runs; duplicates: ${totalDeliveries - deliveries.size}`,
    );
    t.diagnostic(`wall time: ${wallMs} ms (deploy, sending, draining, deliveries, ${LEASE_SECONDS + 1} s quiet)`);

    // ---- the checks: all are worked out and shown, then asserted in order ----
    const brief = (r: RunRow) => ({
      n: nOf.get(r.run_id),
      run_id: r.run_id,
      state: r.state,
      reason: r.reason,
      error: r.error?.code,
      attempts: r.attempts,
    });
    const checks: Array<{ name: string; bad: unknown[] }> = [];
    const check = (name: string, bad: unknown[]) => checks.push({ name, bad });
    // The harness itself: the scenario happened as described.
    check('the killed process was restarted', restartProblem ? [restartProblem] : []);
    check('every call was accepted (202), by another process while one was down', sendErrors);
    check('one distinct run id per call', accepted.size === RUNS && runIds.size === RUNS ? [] : [runIds.size]);
    check('the kill landed while A was executing', killedMidRun ? [] : ['no execution under way on A']);
    check('the restarted process took calls too', [...accepted.values()].some((x) => x.slot === 'A#2') ? [] : ['none']);
    // Nothing lost, nothing accepted twice.
    check(
      'no run was accepted twice (the same Idempotency-Key sent again elsewhere)',
      rows.filter((r) => !runIds.has(r.run_id)).map(brief),
    );
    check(
      'every accepted run is on record',
      [...runIds].filter((id) => !rowById.has(id)),
    );
    check('every run reached a terminal state', rows.filter((r) => !TERMINAL.has(r.state)).map(brief));
    check(
      'every run succeeded (interrupted ones by running again)',
      rows.filter((r) => r.state !== 'success' || r.error !== null).map(brief),
    );
    check(
      "no run the killed process never executed was ended as interrupted (a starting process ended the others' runs)",
      rows
        .filter((r) => r.reason === 'interrupted' && r.state !== 'success' && !onKilled(nOf.get(r.run_id) ?? -1))
        .map(brief),
    );
    // Executions, from the evidence.
    check('every execution ran on a known process', evidenceProblems);
    check(
      'no execution of a call never accepted',
      executions.filter((e) => !accepted.has(e.n)),
    );
    check(
      'every run executed to its end somewhere',
      [...accepted.keys()].filter((n) => !(byRun.get(n) ?? []).some((e) => !e.interrupted)),
    );
    check(
      'every execution on a live process ended',
      executions.filter((e) => e.end === undefined),
    );
    check(
      'no run executed twice at the same time',
      [...byRun.values()].flatMap((list) => overlapping(list)),
    );
    check(
      'runs never on the killed process executed exactly once',
      [...byRun].filter(([n, list]) => !onKilled(n) && list.length !== 1).map(([n, list]) => ({ n, ran: list })),
    );
    check(
      'no execution started after its run had finished',
      executions.filter((e) => {
        const finished = rowById.get(accepted.get(e.n)?.runId ?? '')?.finished_at;
        return finished && e.start > Date.parse(finished);
      }),
    );
    // The runs the kill interrupted.
    check('the kill interrupted at least one execution', interrupted.length > 0 ? [] : ['none']);
    check('the run records read were all those the kill touched', suspects.length <= 300 ? [] : [suspects.length]);
    check(
      'interrupted runs were started again and succeeded',
      interrupted
        .map((n) => ({ n, detail: details.get(n), ran: byRun.get(n) ?? [] }))
        .filter(
          ({ detail, ran }) =>
            detail?.state !== 'success' ||
            typeof detail.attempts !== 'number' ||
            detail.attempts < 2 ||
            !ran.some((e) => !e.interrupted && e.on !== 'A#1'),
        )
        .map(({ n, detail, ran }) => ({ ...(detail ? brief(detail) : { n }), ran })),
    );
    check(
      'attempts counts every execution',
      [...details]
        .filter(([n, d]) => typeof d.attempts !== 'number' || d.attempts < (byRun.get(n)?.length ?? 0))
        .map(([n, d]) => ({ ...brief(d), executions: byRun.get(n)?.length })),
    );
    // Webhooks.
    check(
      "every run's webhook was delivered",
      [...runIds].filter((id) => !deliveries.has(id)),
    );
    check(
      "every delivery reports the run's success",
      [...deliveries].filter(([, list]) => list.some((p) => p.status_code !== 200)).map(([id, list]) => ({ id, list })),
    );

    const show = (list: unknown[]) => `${list.length}: ${JSON.stringify(list.slice(0, 5)).slice(0, 2000)}`;
    for (const c of checks) {
      t.diagnostic(`${c.bad.length === 0 ? 'ok' : 'FAILED'}: ${c.name}${c.bad.length ? ` (${show(c.bad)})` : ''}`);
    }
    for (const c of checks) assert.equal(c.bad.length, 0, `${c.name}; ${show(c.bad)}`);
  });
});
