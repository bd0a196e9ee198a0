/**
 * Webhook delivery against real receivers on loopback: every row of the retry table case by case
 * (attempts counted, gaps measured), signatures recomputed here from the raw bytes received, the
 * TypeScript verifier and the Python snippet of docs/webhooks.md on real deliveries, the address guard,
 * restarts, redelivery, the 7-day secret purge, and throughput.
 *
 * The deliverer is driven directly on a real store (one per test, so no two deliverers ever share an
 * outbox: a SQLite file, or a fresh PostgreSQL database under test/postgres/); rows are inserted as the
 * run recorder writes them.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHmac, randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { describe, it, type TestContext } from 'node:test';
import { pino } from 'pino';
import { createNodeLease } from '../src/cluster/node.js';
import { createRecovery } from '../src/cluster/recovery.js';
import { FerryError } from '../src/errors.js';
import { uuidv7 } from '../src/ids.js';
import type { Store } from '../src/store/index.js';
import { blockedReason, embeddedIpv4, parseAllowList } from '../src/webhooks/address-guard.js';
import { createWebhookDeliverer, type WebhookDelivererOptions } from '../src/webhooks/deliverer.js';
import {
  classifyStatus,
  DEFAULT_RETRY_DELAYS_MS,
  MAX_RETRY_DELAY_MS,
  nextStep,
  resolveRetryDelays,
} from '../src/webhooks/retry-policy.js';
import { decryptWebhookSecret, encryptWebhookSecret } from '../src/webhooks/secret.js';
import { signWebhook, verifyWebhook } from '../src/webhooks/signature.js';
import { webhookView } from '../src/webhooks/view.js';
import { REPO_ROOT, http as request, startServer, tempDir, waitFor } from './helpers/ferry.js';
import { type Received, type Receiver, type Step, startReceiver } from './helpers/receiver.js';
import { openTestStore } from './helpers/store.js';

const KEY = randomBytes(32);
const LOOPBACK = '127.0.0.0/8,::1/128';
const FAST: readonly [number, number] = [100, 200];
const PROJECT = 'p-0000abcd';
const APP = 'hooks';

// biome-ignore lint/suspicious/noExplicitAny: log lines are free-form JSON
type LogLine = Record<string, any>;

interface Harness {
  store: Store;
  logs: LogLine[];
  deliverer: ReturnType<typeof createWebhookDeliverer>;
  /** A new deliverer on the same store (the old one must be closed first). */
  restart(overrides?: Partial<WebhookDelivererOptions>): ReturnType<typeof createWebhookDeliverer>;
  /** Inserts a finished run and its outbox row; `due: false` makes the row wait (until set due). */
  add(url: string, options?: { secret?: string; due?: boolean }): Promise<{ runId: string; payload: string }>;
  /** Makes a waiting row due now. */
  due(runId: string): Promise<void>;
  /** Resolves with the delivery once it is delivered or failed. */
  settled(runId: string, ms?: number): Promise<{ state: string; attempts: number }>;
  attempts(
    runId: string,
  ): Promise<
    Array<{ attempt: number; at: string; status_code: number | null; error: string | null; duration_ms: number }>
  >;
}

async function harness(t: TestContext, overrides: Partial<WebhookDelivererOptions> = {}): Promise<Harness> {
  const dir = await tempDir('ferry-webhooks-');
  const opened = await openTestStore(dir);
  const { store } = opened;
  const logs: LogLine[] = [];
  const logger = pino({ level: 'debug' }, { write: (line: string) => void logs.push(JSON.parse(line)) });
  const make = (o: Partial<WebhookDelivererOptions>) => {
    const d = createWebhookDeliverer({
      store,
      logger,
      secretsKey: KEY,
      allow: LOOPBACK,
      retryDelaysMs: FAST,
      attemptTimeoutMs: 2_000,
      ...overrides,
      ...o,
    });
    d.start();
    return d;
  };
  const h: Harness = {
    store,
    logs,
    deliverer: make({}),
    restart(o = {}) {
      h.deliverer = make(o);
      return h.deliverer;
    },
    async add(url, options = {}) {
      const runId = uuidv7();
      const now = new Date().toISOString();
      const payload = JSON.stringify({
        run_id: runId,
        timestamp: Math.floor(Date.now() / 1000),
        status_code: 200,
        run_time_ms: 7,
        result: { greeting: 'Grüße ✓', n: 1.5 },
      });
      await store
        .insertInto('runs')
        .values({
          id: runId,
          project_id: PROJECT,
          app_id: APP,
          build_id: null,
          function_name: 'main',
          mode: 'sync',
          state: 'success',
          status_code: 200,
          input: null,
          result: null,
          error_code: null,
          error_message: null,
          reason: null,
          cold_start: 0,
          webhook_endpoint: url,
          webhook_secret: options.secret === undefined ? null : encryptWebhookSecret(KEY, runId, options.secret),
          idempotency_key: null,
          created_at: now,
          started_at: now,
          finished_at: now,
          run_time_ms: 7,
        })
        .execute();
      await store
        .insertInto('webhook_deliveries')
        .values({
          run_id: runId,
          url,
          payload,
          state: 'pending',
          attempts: 0,
          next_attempt_at: options.due === false ? '9999-01-01T00:00:00.000Z' : now,
          created_at: now,
          updated_at: now,
        })
        .execute();
      h.deliverer.wake();
      return { runId, payload };
    },
    async due(runId) {
      await store
        .updateTable('webhook_deliveries')
        .set({ next_attempt_at: new Date().toISOString() })
        .where('run_id', '=', runId)
        .execute();
      h.deliverer.wake();
    },
    async settled(runId, ms = 20_000) {
      return waitFor(
        async () => {
          const row = await store
            .selectFrom('webhook_deliveries')
            .select(['state', 'attempts'])
            .where('run_id', '=', runId)
            .executeTakeFirstOrThrow();
          return row.state === 'delivered' || row.state === 'failed' ? row : undefined;
        },
        ms,
        `delivery of ${runId}`,
      );
    },
    attempts(runId) {
      return store
        .selectFrom('webhook_attempts')
        .select(['attempt', 'at', 'status_code', 'error', 'duration_ms'])
        .where('run_id', '=', runId)
        .orderBy('attempt')
        .execute();
    },
  };
  t.after(async () => {
    await h.deliverer.close();
    await opened.close();
    await fs.rm(dir, { recursive: true, force: true });
  });
  return h;
}

async function receiver(t: TestContext, steps: Step[] = [], host?: string): Promise<Receiver> {
  const r = await startReceiver({ steps, ...(host ? { host } : {}) });
  t.after(() => r.close());
  return r;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/**
 * How long to watch for an attempt that must not come (after a delivery ended): five times the longest FAST
 * delay, so a wrongly scheduled retry has long reached the receiver even on a busy machine.
 */
const QUIET_MS = 5 * FAST[1];
const gaps = (reqs: Received[]) => reqs.slice(1).map((r, i) => r.at - reqs[i]!.at);
/**
 * The gaps between the attempts' starts as the deliverer recorded them (`webhook_attempts.at`, its own
 * clock): the lower bounds of the delays are asserted on these. Gaps between arrivals at the receiver can
 * be shorter than the delay on a loaded machine (the first request slow to arrive, the next one quick: seen
 * once as a 363 ms gap for a 400 ms timeout-plus-delay).
 */
const startGaps = (attempts: Array<{ at: string }>) =>
  attempts.slice(1).map((a, i) => Date.parse(a.at) - Date.parse(attempts[i]!.at));

/** A loopback port nothing listens on. */
async function closedPort(): Promise<number> {
  const server = http.createServer();
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  const { port } = server.address() as AddressInfo;
  await new Promise<void>((r) => server.close(() => r()));
  return port;
}

function expectedSignature(secret: string, req: Received): string {
  const id = String(req.headers['x-request-id']);
  const ts = String(req.headers['x-service-webhook-timestamp']);
  const mac = createHmac('sha256', Buffer.from(secret, 'utf8'));
  mac.update(Buffer.concat([Buffer.from(`${id}.${ts}.`, 'utf8'), req.body]));
  return `v1,${mac.digest('hex')}`;
}

describe('retry policy', () => {
  it('classifies statuses exactly as spec section 6 says', () => {
    for (const s of [200, 201, 202, 204, 299]) assert.equal(classifyStatus(s), 'delivered', String(s));
    assert.equal(classifyStatus(404), 'retry');
    for (const s of [400, 401, 403, 405, 409, 410, 413, 422, 429, 499])
      assert.equal(classifyStatus(s), 'permanent', String(s));
    for (const s of [500, 501, 502, 503, 504, 599]) assert.equal(classifyStatus(s), 'permanent', String(s));
    for (const s of [100, 101, 199, 300, 301, 302, 303, 304, 307, 308, 399])
      assert.equal(classifyStatus(s), 'retry', String(s));
  });

  it('allows 3 attempts and waits at most 5 s between them', () => {
    assert.deepEqual(DEFAULT_RETRY_DELAYS_MS, [1_000, 3_000]);
    assert.deepEqual(resolveRetryDelays([10_000, -5]), [MAX_RETRY_DELAY_MS, 0]);
    assert.deepEqual(resolveRetryDelays([250]), [250, 250]);
    assert.deepEqual(nextStep('retry', 1, [10, 20]), { state: 'pending', delayMs: 10 });
    assert.deepEqual(nextStep('retry', 2, [10, 20]), { state: 'pending', delayMs: 20 });
    assert.deepEqual(nextStep('retry', 3, [10, 20]), { state: 'failed' });
    assert.deepEqual(nextStep('permanent', 1, [10, 20]), { state: 'failed' });
    assert.deepEqual(nextStep('delivered', 3, [10, 20]), { state: 'delivered' });
  });
});

describe('delivery outcomes against a real receiver', () => {
  it('200: one attempt, delivered, with the stored payload bytes and the run id header', async (t) => {
    const h = await harness(t);
    const r = await receiver(t, [200]);
    const { runId, payload } = await h.add(`${r.url}/hook?x=1`);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 1 });
    await sleep(QUIET_MS);
    assert.equal(r.requests.length, 1);
    const [req] = r.requests;
    assert.equal(req!.method, 'POST');
    assert.equal(req!.path, '/hook?x=1');
    assert.equal(req!.headers['content-type'], 'application/json');
    assert.equal(req!.headers['x-request-id'], runId);
    assert.equal(req!.headers['x-service-webhook-signature'], undefined, 'unsigned without a secret');
    assert.equal(req!.headers['x-service-webhook-timestamp'], undefined);
    assert.ok(req!.body.equals(Buffer.from(payload, 'utf8')));
    const [a] = await h.attempts(runId);
    assert.equal(a!.attempt, 1);
    assert.equal(a!.status_code, 200);
    assert.equal(a!.error, null);
    assert.ok(a!.duration_ms >= 0);
    const view = await webhookView(h.store, runId);
    assert.equal(view?.state, 'delivered');
    assert.equal(view?.url, `${r.url}/hook?x=1`);
    assert.equal(view?.next_attempt_at, null);
    assert.equal(view?.attempts.length, 1);
    assert.equal(await webhookView(h.store, uuidv7()), null);
  });

  it('404, 404, 200: three attempts, delivered, waiting the configured delays', async (t) => {
    const h = await harness(t);
    const r = await receiver(t, [404, 404, 200]);
    const { runId } = await h.add(`${r.url}/`);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 3 });
    const [g1, g2] = gaps(r.requests);
    const [s1, s2] = startGaps(await h.attempts(runId));
    assert.ok(s1! >= FAST[0] - 2 && g1! < 2_000, `gap 1 was ${s1} ms (${g1} ms at the receiver)`);
    assert.ok(s2! >= FAST[1] - 2 && g2! < 2_000, `gap 2 was ${s2} ms (${g2} ms at the receiver)`);
    assert.deepEqual(
      (await h.attempts(runId)).map((a) => [a.attempt, a.status_code]),
      [
        [1, 404],
        [2, 404],
        [3, 200],
      ],
    );
  });

  it('404 three times: three attempts, then failed and logged with the run id', async (t) => {
    const h = await harness(t);
    const r = await receiver(t, [404, 404, 404, 200]);
    const { runId } = await h.add(`${r.url}/`);
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 3 });
    await sleep(QUIET_MS);
    assert.equal(r.requests.length, 3, 'no fourth attempt');
    const warn = h.logs.find((l) => l.level === 40 && l.runId === runId);
    assert.ok(warn, 'a warning names the run');
    assert.match(warn.msg, /failed after 3 attempts/);
    assert.equal(warn.status, 404);
  });

  it('400, 410, 500, 503: one attempt each, failed, never retried', async (t) => {
    const h = await harness(t);
    const cases = await Promise.all(
      [400, 410, 500, 503].map(async (status) => {
        const r = await receiver(t, [status, 200, 200]);
        return { status, r, ...(await h.add(`${r.url}/`)) };
      }),
    );
    for (const c of cases)
      assert.deepEqual(await h.settled(c.runId), { state: 'failed', attempts: 1 }, String(c.status));
    await sleep(QUIET_MS);
    for (const c of cases) {
      assert.equal(c.r.requests.length, 1, `${c.status} was retried`);
      assert.equal((await h.attempts(c.runId))[0]?.status_code, c.status);
      assert.ok(h.logs.some((l) => l.level === 40 && l.runId === c.runId && /permanently/.test(l.msg)));
    }
  });

  it('302: retried as "other non-2xx" and never followed', async (t) => {
    const h = await harness(t);
    const r = await receiver(t);
    r.fallback = { status: 302, headers: { location: `${r.url}/elsewhere` } };
    const { runId } = await h.add(`${r.url}/hook`);
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 3 });
    await sleep(QUIET_MS);
    assert.deepEqual(
      r.requests.map((q) => q.path),
      ['/hook', '/hook', '/hook'],
    );
    for (const a of await h.attempts(runId)) {
      assert.equal(a.status_code, 302);
      assert.equal(a.error, 'redirect not followed');
    }
  });

  it('connection refused: three attempts with the network error recorded', async (t) => {
    const h = await harness(t);
    const port = await closedPort();
    const { runId } = await h.add(`http://127.0.0.1:${port}/`);
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 3 });
    const attempts = await h.attempts(runId);
    assert.equal(attempts.length, 3);
    for (const a of attempts) {
      assert.equal(a.status_code, null);
      assert.match(a.error ?? '', /ECONNREFUSED/);
    }
    const at = attempts.map((a) => Date.parse(a.at));
    assert.ok(at[1]! - at[0]! >= FAST[0] - 5 && at[2]! - at[1]! >= FAST[1] - 5, `attempt times ${at.join(', ')}`);
  });

  it('a connection dropped without a response is retried', async (t) => {
    const h = await harness(t);
    const r = await receiver(t, ['close', 200]);
    const { runId } = await h.add(`${r.url}/`);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 2 });
    const [first] = await h.attempts(runId);
    assert.equal(first?.status_code, null);
    assert.ok(first?.error);
  });

  it('a receiver that hangs past the attempt timeout: retried, three attempts', async (t) => {
    const h = await harness(t, { attemptTimeoutMs: 300 });
    const r = await receiver(t, ['hang', 'hang', 'hang', 200]);
    const { runId } = await h.add(`${r.url}/`);
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 3 });
    assert.equal(r.requests.length, 3);
    for (const a of await h.attempts(runId)) {
      assert.equal(a.error, 'timed out after 300 ms');
      // Cut by the 300 ms timeout (the receiver never answers): the upper bound only tells it from a hang,
      // generous because a loaded machine (the PostgreSQL run of this file) can be slow to fire the timer.
      assert.ok(a.duration_ms >= 290 && a.duration_ms < 10_000, `duration ${a.duration_ms}`);
    }
    // Attempt n+1 arrives one timeout plus one delay after attempt n.
    const [s1, s2] = startGaps(await h.attempts(runId));
    assert.ok(s1! >= 300 + FAST[0] - 2, `gap 1 ${s1}`);
    assert.ok(s2! >= 300 + FAST[1] - 2, `gap 2 ${s2}`);
  });
});

describe('signatures on real deliveries', () => {
  const secret = `whsec_${randomBytes(12).toString('hex')}_ü`;

  it('with the default delays: gaps of 1 s and 3 s (at most 5 s), one request id, a fresh signed timestamp per attempt', async (t) => {
    const h = await harness(t, { retryDelaysMs: undefined });
    const r = await receiver(t, [404, 404, 200]);
    const { runId, payload } = await h.add(`${r.url}/signed`, { secret });
    assert.deepEqual(await h.settled(runId, 30_000), { state: 'delivered', attempts: 3 });
    const reqs = r.requests;
    assert.equal(reqs.length, 3);
    const [g1, g2] = gaps(reqs);
    const [s1, s2] = startGaps(await h.attempts(runId));
    // A timer never fires early, so the delays are exact lower bounds of the deliverer's own gaps. Above
    // them, 2 s of room for a late wake-up on a busy machine (idle: a few ms): that still tells the 1 s delay
    // from the 3 s one, and the second gap stays within the 5 s cap.
    assert.ok(s1! >= 1_000 - 2 && g1! < 1_000 + 2_000, `gap 1 was ${s1} ms (${g1} ms at the receiver)`);
    assert.ok(s2! >= 3_000 - 2 && g2! <= MAX_RETRY_DELAY_MS, `gap 2 was ${s2} ms (${g2} ms at the receiver)`);

    const stamps = reqs.map((q) => Number(q.headers['x-service-webhook-timestamp']));
    for (const [i, q] of reqs.entries()) {
      assert.equal(q.headers['x-request-id'], runId, 'same X-Request-Id on every attempt');
      assert.ok(q.body.equals(Buffer.from(payload, 'utf8')), 'the exact stored bytes');
      const ts = stamps[i]!;
      assert.ok(Math.abs(ts - Math.floor(q.wallAt / 1000)) <= 1, 'timestamp is when the attempt was sent');
      assert.match(String(q.headers['x-service-webhook-signature']), /^v1,[0-9a-f]{64}$/);
      assert.equal(q.headers['x-service-webhook-signature'], expectedSignature(secret, q));
      assert.equal(verifyWebhook(secret, q.headers, q.body), true);
    }
    assert.ok(stamps[0]! < stamps[2]!, `timestamps ${stamps.join(', ')} are fresh per attempt`);
    assert.notEqual(reqs[0]!.headers['x-service-webhook-signature'], reqs[2]!.headers['x-service-webhook-signature']);

    // The TypeScript verifier refuses what it must.
    const q = reqs[2]!;
    const ts = stamps[2]!;
    const tampered = Buffer.from(q.body);
    tampered[tampered.length - 2] = (tampered[tampered.length - 2] ?? 0) ^ 1;
    assert.equal(verifyWebhook(secret, q.headers, tampered), false, 'tampered body');
    assert.equal(verifyWebhook(`${secret}x`, q.headers, q.body), false, 'wrong secret');
    assert.equal(verifyWebhook(secret, q.headers, q.body, { now: (ts + 301) * 1000 }), false, 'stale');
    assert.equal(verifyWebhook(secret, q.headers, q.body, { now: (ts - 301) * 1000 }), false, 'from the future');
    assert.equal(verifyWebhook(secret, q.headers, q.body, { now: (ts + 299) * 1000 }), true);
    assert.equal(verifyWebhook(secret, q.headers, q.body, { now: (ts + 20) * 1000, toleranceSeconds: 10 }), false);
    assert.equal(verifyWebhook(secret, { ...q.headers, 'x-request-id': uuidv7() }, q.body), false, 'other id');
    assert.equal(verifyWebhook(secret, { ...q.headers, 'x-service-webhook-signature': undefined }, q.body), false);
    assert.equal(
      verifyWebhook(
        secret,
        { ...q.headers, 'x-service-webhook-signature': String(q.headers['x-service-webhook-signature']).slice(3) },
        q.body,
      ),
      false,
      'no v1, prefix',
    );
    const fetchHeaders = new Headers();
    for (const [k, v] of Object.entries(q.headers)) if (typeof v === 'string') fetchHeaders.set(k, v);
    assert.equal(verifyWebhook(secret, fetchHeaders, q.body.toString('utf8')), true, 'Headers and a string body');
    const upper = Object.fromEntries(Object.entries(q.headers).map(([k, v]) => [k.toUpperCase(), v]));
    assert.equal(verifyWebhook(secret, upper, new Uint8Array(q.body)), true, 'header names in any case');
    assert.equal(
      signWebhook(secret, runId, ts, q.body),
      q.headers['x-service-webhook-signature'],
      'signWebhook agrees with what was sent',
    );

    // The Python snippet of docs/webhooks.md, run as it is printed there.
    const doc = await fs.readFile(path.join(REPO_ROOT, 'docs', 'webhooks.md'), 'utf8');
    const snippet = /```python\n([\s\S]*?)```/.exec(doc)?.[1];
    assert.ok(snippet, 'docs/webhooks.md has a python snippet');
    const dir = await tempDir('ferry-webhook-py-');
    t.after(() => fs.rm(dir, { recursive: true, force: true }));
    const script = path.join(dir, 'verify.py');
    await fs.writeFile(
      script,
      `${snippet}\n\nimport base64, json, sys\nd = json.load(sys.stdin)\nok = verify_webhook(sys.argv[1], d["headers"], base64.b64decode(d["body"]))\nprint("valid" if ok else "invalid")\n`,
    );
    const python = (secretArg: string, body: Buffer, headers = q.headers) => {
      const out = spawnSync('python3', [script, secretArg], {
        input: JSON.stringify({ headers, body: body.toString('base64') }),
        encoding: 'utf8',
      });
      assert.equal(out.status, 0, out.stderr);
      return out.stdout.trim();
    };
    assert.equal(python(secret, q.body), 'valid');
    assert.equal(python(secret, tampered), 'invalid');
    assert.equal(python(`${secret}x`, q.body), 'invalid');
    assert.equal(python(secret, q.body, { ...q.headers, 'x-service-webhook-timestamp': String(ts - 600) }), 'invalid');
    const upperHeaders = Object.fromEntries(Object.entries(q.headers).map(([k, v]) => [k.toUpperCase(), v]));
    assert.equal(python(secret, q.body, upperHeaders as typeof q.headers), 'valid');
  });

  it('stores the secret encrypted and bound to the run; an undecryptable secret fails the delivery unsent', async (t) => {
    const h = await harness(t);
    const r = await receiver(t, [200]);
    const { runId } = await h.add(`${r.url}/`, { secret: 'hunter2' });
    const row = await h.store
      .selectFrom('runs')
      .select('webhook_secret')
      .where('id', '=', runId)
      .executeTakeFirstOrThrow();
    assert.ok(row.webhook_secret && !row.webhook_secret.includes('hunter2'));
    assert.equal(decryptWebhookSecret(KEY, runId, row.webhook_secret), 'hunter2');
    assert.throws(() => decryptWebhookSecret(KEY, uuidv7(), row.webhook_secret!), /does not decrypt/);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 1 });

    // A secret copied from another run's row does not decrypt: the delivery fails, never sent unsigned.
    const moved = await h.add(`${r.url}/moved`, { secret: 'other', due: false });
    await h.store
      .updateTable('runs')
      .set({ webhook_secret: row.webhook_secret })
      .where('id', '=', moved.runId)
      .execute();
    await h.due(moved.runId);
    assert.deepEqual(await h.settled(moved.runId), { state: 'failed', attempts: 1 });
    assert.match((await h.attempts(moved.runId))[0]?.error ?? '', /does not decrypt/);
    assert.deepEqual(
      r.requests.map((q) => q.path),
      ['/'],
    );
  });
});

describe('address guard', () => {
  it('knows the blocked ranges, IPv4 and IPv6, mapped and embedded forms included', () => {
    const none = parseAllowList('');
    const blocked: Record<string, RegExp> = {
      '127.0.0.1': /loopback/,
      '127.255.0.9': /loopback/,
      '::1': /loopback/,
      '10.1.2.3': /private/,
      '172.16.0.1': /private/,
      '172.31.255.255': /private/,
      '192.168.1.1': /private/,
      '100.64.0.1': /carrier-grade NAT/,
      '169.254.169.254': /cloud metadata/,
      '169.254.10.10': /link-local/,
      'fe80::1': /link-local/,
      'fe80::1%eth0': /link-local/,
      'fc00::1': /unique-local/,
      'fd12:3456::1': /unique-local/,
      '0.0.0.0': /unspecified/,
      '::': /unspecified/,
      '224.0.0.1': /multicast/,
      'ff02::1': /multicast/,
      '255.255.255.255': /broadcast/,
      '::ffff:127.0.0.1': /loopback/,
      '::ffff:7f00:1': /loopback/,
      '::ffff:10.0.0.1': /private/,
      '::ffff:169.254.169.254': /cloud metadata/,
      '::10.0.0.1': /private/,
      '64:ff9b::10.0.0.1': /private, as 10\.0\.0\.1/,
      '64:ff9b::a9fe:a9fe': /cloud metadata, as 169\.254\.169\.254/,
      '2002:7f00:1::': /loopback, as 127\.0\.0\.1/,
      '2002:c0a8:0101::1': /private, as 192\.168\.1\.1/,
    };
    for (const [address, reason] of Object.entries(blocked)) {
      assert.match(blockedReason(address, none) ?? 'allowed', reason, address);
    }
    for (const address of [
      '8.8.8.8',
      '1.1.1.1',
      '172.32.0.1',
      '100.128.0.1',
      '2606:4700::1111',
      '64:ff9b::808:808',
      '2002:808:808::1',
      '::ffff:8.8.8.8',
    ]) {
      assert.equal(blockedReason(address, none), undefined, address);
    }
    assert.equal(embeddedIpv4('::ffff:1.2.3.4'), '1.2.3.4');
    assert.equal(embeddedIpv4('2606:4700::1111'), undefined);

    const allow = parseAllowList(' 127.0.0.0/8 , ::1/128,10.20.0.0/16, 192.168.1.7 ');
    assert.deepEqual(allow.ranges, ['127.0.0.0/8', '::1/128', '10.20.0.0/16', '192.168.1.7/32']);
    for (const address of ['127.0.0.1', '::1', '::ffff:127.0.0.1', '10.20.3.4', '192.168.1.7']) {
      assert.equal(blockedReason(address, allow), undefined, address);
    }
    assert.match(blockedReason('10.21.0.1', allow) ?? '', /private/);
    assert.match(blockedReason('192.168.1.8', allow) ?? '', /private/);
  });

  it('parseAllowList names the bad entry', () => {
    assert.throws(() => parseAllowList('10.0.0.0/8,nonsense'), /"nonsense" is not a CIDR/);
    assert.throws(
      () => parseAllowList('10.0.0.0/33'),
      /"10\.0\.0\.0\/33" has a bad prefix length; IPv4 allows 0 to 32/,
    );
    assert.throws(() => parseAllowList('::1/129'), /IPv6 allows 0 to 128/);
    assert.throws(() => parseAllowList('10.0.0.0/x'), /bad prefix/);
    assert.throws(() => parseAllowList('10.0.0.0/'), /bad prefix/);
    assert.deepEqual(parseAllowList(' , ').ranges, []);
  });

  it('refuses loopback, private and metadata targets at connect time unless allowed; nothing reaches the receiver', async (t) => {
    const v4 = await receiver(t, []);
    const v6 = await receiver(t, [], '::1');
    // A name whose answer is an internal address (a rebinding attacker's DNS), and a mixed answer.
    const lookup = async (host: string) => {
      if (host === 'rebind.example') return [{ address: '127.0.0.1', family: 4 }];
      if (host === 'mixed.example')
        return [
          { address: '93.184.215.14', family: 4 },
          { address: '127.0.0.1', family: 4 },
        ];
      throw Object.assign(new Error(`getaddrinfo ENOTFOUND ${host}`), { code: 'ENOTFOUND', hostname: host });
    };
    const targets: Array<[string, RegExp]> = [
      [`${v4.url}/`, /address 127\.0\.0\.1 is in a blocked range \(loopback\); allow it with FERRY_WEBHOOK_ALLOW/],
      [`${v6.url}/`, /address ::1 is in a blocked range \(loopback\)/],
      [`http://[::ffff:127.0.0.1]:${v4.port}/`, /address ::ffff:7f00:1 is in a blocked range \(loopback/],
      [`http://localhost:${v4.port}/`, /blocked range \(loopback\)/],
      [`http://rebind.example:${v4.port}/`, /address 127\.0\.0\.1 is in a blocked range/],
      [`http://mixed.example:${v4.port}/`, /address 127\.0\.0\.1 is in a blocked range/],
      ['http://10.0.0.1:9/', /address 10\.0\.0\.1 is in a blocked range \(private\)/],
      ['http://169.254.169.254/latest/meta-data/', /\(cloud metadata\)/],
      ['https://192.168.0.1/', /\(private\)/],
      ['http://[fd00::1]:8080/', /\(unique-local\)/],
      ['http://0.0.0.0:80/', /\(unspecified\)/],
    ];
    const h = await harness(t, {
      allow: '',
      lookup: (host) => (host === 'localhost' ? defaultLookup(host) : lookup(host)),
    });
    const runs = await Promise.all(targets.map(async ([url, why]) => ({ url, why, ...(await h.add(url)) })));
    for (const run of runs) {
      assert.deepEqual(await h.settled(run.runId), { state: 'failed', attempts: 1 }, run.url);
      const [a] = await h.attempts(run.runId);
      assert.match(a?.error ?? '', run.why, run.url);
      assert.equal(a?.status_code, null);
    }
    await sleep(QUIET_MS);
    assert.equal(v4.requests.length + v6.requests.length, 0, 'no request reached a receiver');
  });

  it('permits allowed ranges (FERRY_WEBHOOK_ALLOW), by address and by name', async (t) => {
    const v4 = await receiver(t, []);
    const v6 = await receiver(t, [], '::1');
    const h = await harness(t, { allow: LOOPBACK });
    const urls = [
      `${v4.url}/a`,
      `${v6.url}/b`,
      `http://localhost:${v4.port}/c`,
      `http://[::ffff:127.0.0.1]:${v4.port}/d`,
    ];
    const runs = await Promise.all(urls.map((u) => h.add(u)));
    for (const run of runs) assert.deepEqual(await h.settled(run.runId), { state: 'delivered', attempts: 1 });
    assert.deepEqual(v4.requests.map((q) => q.path).sort(), ['/a', '/c', '/d']);
    assert.deepEqual(
      v6.requests.map((q) => q.path),
      ['/b'],
    );

    // Only what is listed: loopback allowed does not open 10/8.
    const { runId } = await h.add('http://10.0.0.1:9/');
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 1 });
  });
});

async function defaultLookup(host: string) {
  const dns = await import('node:dns');
  return dns.promises.lookup(host, { all: true, verbatim: true });
}

describe('durability, redelivery and the secret purge', () => {
  it('a delivery waiting for its retry completes after the deliverer is replaced', async (t) => {
    // A retry delay no test step can outlast, so the retry is surely still waiting when the deliverer closes
    // (800 ms could pass on a busy machine before the close); after the restart it is made due at once.
    const h = await harness(t, { retryDelaysMs: [60_000, 60_000] });
    const r = await receiver(t, [404, 200]);
    const { runId } = await h.add(`${r.url}/`, { secret: 's3cret' });
    await waitFor(async () => r.requests.length === 1, 15_000, 'first attempt');
    await waitFor(
      async () =>
        (
          await h.store
            .selectFrom('webhook_deliveries')
            .select(['state', 'attempts'])
            .where('run_id', '=', runId)
            .executeTakeFirst()
        )?.attempts === 1,
      15_000,
      'first attempt recorded',
    );
    await h.deliverer.close();
    const row = await h.store
      .selectFrom('webhook_deliveries')
      .selectAll()
      .where('run_id', '=', runId)
      .executeTakeFirstOrThrow();
    assert.equal(row.state, 'pending');
    h.restart();
    await h.due(runId);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 2 });
    assert.deepEqual(
      (await h.attempts(runId)).map((a) => [a.attempt, a.status_code]),
      [
        [1, 404],
        [2, 200],
      ],
    );
    assert.equal(r.requests[1]?.headers['x-request-id'], runId);
    assert.equal(verifyWebhook('s3cret', r.requests[1]!.headers, r.requests[1]!.body), true);
  });

  it('an attempt cut short by close, or left `sending` by a dead node, is sent again; a live node keeps its own', async (t) => {
    const h = await harness(t, { closeGraceMs: 100 });
    const r = await receiver(t, ['hang']);
    const cut = await h.add(`${r.url}/cut`);
    await r.waitForRequests(1);
    await h.deliverer.close();
    const row = await h.store
      .selectFrom('webhook_deliveries')
      .selectAll()
      .where('run_id', '=', cut.runId)
      .executeTakeFirstOrThrow();
    assert.deepEqual([row.state, row.attempts], ['pending', 0], 'back to pending, budget untouched');
    assert.equal((await h.attempts(cut.runId)).length, 0);

    // As a process killed mid-attempt leaves it: `sending`, held by a node whose lease has run out.
    const dead = await h.add(`${r.url}/dead`);
    const past = new Date(Date.now() - 60_000).toISOString();
    await h.store
      .insertInto('nodes')
      .values({ id: 'killed-node', started_at: past, lease_until: past, info: '{}' })
      .execute();
    await h.store
      .updateTable('webhook_deliveries')
      .set({ state: 'sending', owner: 'killed-node' })
      .where('run_id', '=', dead.runId)
      .execute();
    // And one held by a live node: nobody else may send it.
    const alive = await h.add(`${r.url}/alive`);
    const future = new Date(Date.now() + 3_600_000).toISOString();
    await h.store
      .insertInto('nodes')
      .values({ id: 'live-node', started_at: past, lease_until: future, info: '{}' })
      .execute();
    await h.store
      .updateTable('webhook_deliveries')
      .set({ state: 'sending', owner: 'live-node' })
      .where('run_id', '=', alive.runId)
      .execute();

    h.restart();
    assert.deepEqual(await h.settled(cut.runId), { state: 'delivered', attempts: 1 });
    const logger = pino({ level: 'info' }, { write: (line: string) => void h.logs.push(JSON.parse(line)) });
    // A short lease, and a wait past it: a node judges others' leases only once its own renewals have been
    // steady for a whole lease.
    const node = createNodeLease({ store: h.store, dataDir: await tempDir('ferry-node-'), logger, ttlMs: 200 });
    await node.start();
    await waitFor(async () => node.canJudge(), 10_000, 'a steady lease');
    const recovery = createRecovery({ store: h.store, node, logger, onRecovered: () => h.deliverer.wake() });
    assert.equal((await recovery.sweep()).deliveries, 1);
    assert.deepEqual(await h.settled(dead.runId), { state: 'delivered', attempts: 1 });
    assert.deepEqual(r.requests.map((q) => q.path).sort(), ['/cut', '/cut', '/dead']);
    assert.ok(h.logs.some((l) => /lease ran out/.test(l.msg ?? '')));
    const held = await h.store
      .selectFrom('webhook_deliveries')
      .select(['state', 'owner'])
      .where('run_id', '=', alive.runId)
      .executeTakeFirstOrThrow();
    assert.deepEqual(held, { state: 'sending', owner: 'live-node' }, 'a live node keeps what it holds');
    await node.close();
  });

  it('redeliver: a fresh budget of 3 attempts, numbered on; 404, 409 and 410 when it cannot', async (t) => {
    let offset = 0;
    const h = await harness(t, { clock: () => Date.now() + offset });
    const r = await receiver(t, [200, 400]);
    const { runId } = await h.add(`${r.url}/`);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 1 });

    await h.deliverer.redeliver(PROJECT, APP, runId);
    assert.deepEqual(await h.settled(runId), { state: 'failed', attempts: 1 });
    r.script([404, 404, 200]);
    await h.deliverer.redeliver(PROJECT, APP, runId);
    assert.deepEqual(await h.settled(runId), { state: 'delivered', attempts: 3 });
    assert.deepEqual(
      (await h.attempts(runId)).map((a) => [a.attempt, a.status_code]),
      [
        [1, 200],
        [2, 400],
        [3, 404],
        [4, 404],
        [5, 200],
      ],
    );
    assert.equal(new Set(r.requests.map((q) => q.headers['x-request-id'])).size, 1);

    const code = async (p: Promise<unknown>) => {
      try {
        await p;
        return 'resolved';
      } catch (err) {
        return err instanceof FerryError ? `${err.status} ${err.code}` : String(err);
      }
    };
    assert.equal(await code(h.deliverer.redeliver(PROJECT, APP, uuidv7())), '404 FERRY_RUN_NOT_FOUND');
    assert.equal(await code(h.deliverer.redeliver(PROJECT, 'other-app', runId)), '404 FERRY_RUN_NOT_FOUND');
    const bare = await h.add(`${r.url}/`, { due: false });
    await h.store.deleteFrom('webhook_deliveries').where('run_id', '=', bare.runId).execute();
    assert.equal(await code(h.deliverer.redeliver(PROJECT, APP, bare.runId)), '409 FERRY_NO_WEBHOOK');

    offset = 7 * 24 * 3600 * 1000 + 60_000;
    assert.equal(await code(h.deliverer.redeliver(PROJECT, APP, runId)), '410 FERRY_WEBHOOK_EXPIRED');
  });

  it('erases the signing secret 7 days after the delivery ended (fake clock), and only then', async (t) => {
    let offset = 0;
    const h = await harness(t, { clock: () => Date.now() + offset, purgeIntervalMs: 50 });
    const r = await receiver(t, [200]);
    const secretOf = async (id: string) =>
      (await h.store.selectFrom('runs').select('webhook_secret').where('id', '=', id).executeTakeFirstOrThrow())
        .webhook_secret;
    const done = await h.add(`${r.url}/`, { secret: 'k' });
    await h.settled(done.runId);
    // A delivery still waiting keeps its secret however old it is.
    const waiting = await h.add(`${r.url}/`, { secret: 'k', due: false });
    // A run that ended without a delivery row at all (interrupted before the outbox was written).
    const orphan = await h.add(`${r.url}/`, { secret: 'k', due: false });
    await h.store.deleteFrom('webhook_deliveries').where('run_id', '=', orphan.runId).execute();

    assert.equal(await h.deliverer.purgeSecrets(), 0);
    offset = 7 * 24 * 3600 * 1000 - 60_000;
    assert.equal(await h.deliverer.purgeSecrets(), 0, 'not before 7 days');
    assert.ok(await secretOf(done.runId));

    offset = 7 * 24 * 3600 * 1000 + 60_000;
    // The periodic purge (every 50 ms here) gets there by itself.
    await waitFor(async () => (await secretOf(done.runId)) === null, 5_000, 'the periodic purge');
    await waitFor(async () => (await secretOf(orphan.runId)) === null, 5_000, 'the orphan purge');
    assert.ok(await secretOf(waiting.runId), 'a pending delivery keeps its secret');
  });
});

describe('the redeliver route on a real server', () => {
  it('POST …/webhook/redeliver answers 202 and sends again; GET …/runs/{id} shows the attempts', async (t) => {
    const server = await startServer({ webhookAllow: LOOPBACK });
    t.after(() => server.close());
    const { projectId, token } = await server.bootstrap();
    const r = await receiver(t, [200, 200]);
    const { store } = server.services;
    const runId = uuidv7();
    const now = new Date().toISOString();
    await store
      .insertInto('runs')
      .values({
        id: runId,
        project_id: projectId,
        app_id: APP,
        build_id: null,
        function_name: 'main',
        mode: 'async',
        state: 'success',
        status_code: 200,
        input: null,
        result: null,
        error_code: null,
        error_message: null,
        reason: null,
        cold_start: 0,
        webhook_endpoint: `${r.url}/`,
        webhook_secret: encryptWebhookSecret(server.services.secretsKey, runId, 'route-secret'),
        idempotency_key: null,
        created_at: now,
        started_at: now,
        finished_at: now,
        run_time_ms: 1,
      })
      .execute();
    await store
      .insertInto('webhook_deliveries')
      .values({
        run_id: runId,
        url: `${r.url}/`,
        payload: JSON.stringify({ run_id: runId, timestamp: 1, status_code: 200, run_time_ms: 1, result: null }),
        state: 'pending',
        attempts: 0,
        next_attempt_at: now,
        created_at: now,
        updated_at: now,
      })
      .execute();
    server.services.webhooks.wake();
    await r.waitForRequests(1);

    const base = `${server.url}/v2/projects/${projectId}/apps/${APP}/runs`;
    const res = await request(`${base}/${runId}/webhook/redeliver`, { method: 'POST', token });
    assert.equal(res.status, 202, res.text);
    assert.deepEqual(res.json, { run_id: runId, state: 'pending' });
    const [, second] = await r.waitForRequests(2);
    assert.equal(verifyWebhook('route-secret', second!.headers, second!.body), true);

    const shown = await waitFor(async () => {
      const got = await request(`${base}/${runId}`, { token });
      return got.json?.webhook?.state === 'delivered' ? got.json.webhook : undefined;
    }, 5_000);
    assert.equal(shown.url, `${r.url}/`);
    assert.deepEqual(
      shown.attempts.map((a: { attempt: number; status_code: number }) => [a.attempt, a.status_code]),
      [
        [1, 200],
        [2, 200],
      ],
    );

    const unknown = await request(`${base}/${uuidv7()}/webhook/redeliver`, { method: 'POST', token });
    assert.equal(unknown.status, 404);
    assert.equal(unknown.json.error.code, 'FERRY_RUN_NOT_FOUND');
    const anonymous = await request(`${base}/${runId}/webhook/redeliver`, { method: 'POST' });
    assert.equal(anonymous.status, 401);
    await store.deleteFrom('webhook_deliveries').where('run_id', '=', runId).execute();
    const none = await request(`${base}/${runId}/webhook/redeliver`, { method: 'POST', token });
    assert.equal(none.status, 409);
    assert.equal(none.json.error.code, 'FERRY_NO_WEBHOOK');
  });
});

describe('throughput', () => {
  it('delivers a burst to a loopback receiver quickly, each exactly once', async (t) => {
    // An attempt that times out is sent again (at least once delivery), though the receiver may have had it:
    // exactly once holds only while none does. The receiver shares this process, and on a busy machine 64
    // concurrent requests can take longer than the harness's 2 s, so attempts here get a timeout no run reaches.
    const h = await harness(t, { attemptTimeoutMs: 60_000 });
    const r = await receiver(t, []);
    const n = 2_000;
    const now = new Date().toISOString();
    const ids: string[] = [];
    // Written the way the recorder writes a burst: many rows per transaction.
    for (let i = 0; i < n; i += 500) {
      const rows = Array.from({ length: Math.min(500, n - i) }, () => {
        const id = uuidv7();
        ids.push(id);
        return {
          run_id: id,
          url: `${r.url}/burst`,
          payload: JSON.stringify({ run_id: id, timestamp: 1, status_code: 200, run_time_ms: 1, result: i }),
          state: 'pending',
          attempts: 0,
          next_attempt_at: now,
          created_at: now,
          updated_at: now,
        };
      });
      await h.store.insertInto('webhook_deliveries').values(rows).execute();
    }
    const t0 = performance.now();
    h.deliverer.wake();
    await waitFor(
      async () => {
        const row = await h.store
          .selectFrom('webhook_deliveries')
          .select((eb) => eb.fn.countAll<number>().as('n'))
          .where('state', '=', 'delivered')
          .executeTakeFirstOrThrow();
        return Number(row.n) === n;
      },
      120_000,
      'the burst',
    );
    const seconds = (performance.now() - t0) / 1000;
    const rate = Math.round(n / seconds);
    t.diagnostic(`${n} deliveries in ${seconds.toFixed(2)} s: ${rate}/s`);
    assert.equal(r.requests.length, n, 'each delivery sent exactly once');
    assert.equal(new Set(r.requests.map((q) => q.headers['x-request-id'])).size, n);
    // The figure is reported; bench/webhooks.mjs is where throughput is measured. This floor only catches a
    // collapse (say, one delivery per timer wake-up): 76-97/s were measured with a load average of 15 on 2
    // cores plus a busy loop, where plain concurrent POSTs to this receiver made 165/s, so the old 250/s
    // floor failed there; 25/s stays well below that.
    assert.ok(rate >= 25, `only ${rate} deliveries/s`);
  });
});
