/**
 * Webhook forwarding through the run endpoint (spec 4.5, 5): sync, async and streaming calls with
 * webhookEndpoint, signatures recomputed from the bytes received, a slow receiver never delaying the
 * caller, attempts shown on the run, and redelivery. Also: project secrets reach new replicas.
 */
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';
import { endEvent, streamWire } from './helpers/stream.js';

describe('webhooks through the run endpoint', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  const hook = (path = '/hook') => encodeURIComponent(`${receiver.url}${path}`);
  const call = (fn: string, query: string, body: unknown = {}, headers: Record<string, string> = {}) =>
    http(`${server.url}/v4/${auth.projectId}/hooked/${fn}?${query}`, {
      method: 'POST',
      token: auth.token,
      body,
      headers,
    });

  before(async () => {
    receiver = await startReceiver();
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    const secret = await http(`${server.url}/v2/projects/${auth.projectId}/secrets/API_KEY`, {
      method: 'PUT',
      token: auth.token,
      body: { value: 'sk-test-123' },
    });
    assert.equal(secret.status, 200, secret.text);
    await deployFiles(server, auth, 'hooked', {
      'ferry.toml': '[app]\nname = "hooked"\n',
      'main.ts': `
export function run({ x = 1 }: { x?: number }) { return { x }; }
export function fail() { throw new Error('nope'); }
export function secret() { return process.env.API_KEY ?? null; }
export async function* items() { yield 'a'; yield { b: 2 }; }
`,
    });
  });
  after(async () => {
    await server.close();
    await receiver.close();
  });

  it('gives project secrets to replicas as environment variables', async () => {
    const res = await call('secret', '');
    assert.equal(res.json.result, 'sk-test-123');
  });

  it('forwards a sync call signed, with the full payload, without delaying the caller', async () => {
    receiver.script(['hang']);
    const started = Date.now();
    const res = await call('run', `webhookEndpoint=${hook()}`, { x: 7 }, { 'x-webhook-secret': 'whsec_test' });
    const elapsed = Date.now() - started;
    assert.equal(res.status, 200);
    assert.deepEqual(res.json.result, { x: 7 });
    // A caller held up by the delivery would wait a whole attempt against the hanging receiver: at least the
    // 10 s attempt timeout (FERRY_WEBHOOK_TIMEOUT_MS's default). Idle, the call takes a few ms.
    assert.ok(elapsed < 10_000, `the caller waited ${elapsed} ms on a receiver that hangs`);
    const [first] = await receiver.waitForRequests(1, 10_000);
    assert.ok(first);
    assert.equal(first.method, 'POST');
    assert.equal(first.headers['content-type'], 'application/json');
    const body = JSON.parse(first.body.toString('utf8'));
    assert.equal(body.run_id, res.json.run_id);
    assert.equal(body.state, 'success');
    assert.deepEqual(body.result, { x: 7 });
    assert.equal(body.status_code, 200);
    assert.equal(typeof body.timestamp, 'number');
    assert.equal(typeof body.run_time_ms, 'number');
    const id = String(first.headers['x-request-id']);
    const ts = String(first.headers['x-service-webhook-timestamp']);
    assert.equal(id, res.json.run_id);
    const expected = createHmac('sha256', 'whsec_test').update(`${id}.${ts}.`).update(first.body).digest('hex');
    assert.equal(first.headers['x-service-webhook-signature'], `v1,${expected}`);
  });

  it('forwards an async call, with the error of a failed run, unsigned without a secret', async () => {
    receiver.script([200]);
    const res = await call('fail', `async=true&webhookEndpoint=${hook('/async')}`);
    assert.equal(res.status, 202);
    // Found by path: the retry of the first test's hanging attempt may reach the receiver meanwhile.
    const delivery = await waitFor(
      async () => receiver.requests.find((r) => r.path === '/async'),
      15_000,
      'the /async delivery',
    );
    const body = JSON.parse(delivery.body.toString('utf8'));
    assert.equal(body.run_id, res.json.run_id);
    assert.equal(body.state, 'failure');
    assert.equal(body.status_code, 500);
    assert.equal(body.error.code, 'FERRY_FUNCTION_ERROR');
    assert.equal(body.result, undefined);
    assert.equal(delivery.headers['x-service-webhook-signature'], undefined);
    assert.equal(delivery.headers['x-request-id'], res.json.run_id);
    const run = await waitFor(async () => {
      const r = await http(`${server.url}/v2/projects/${auth.projectId}/apps/hooked/runs/${res.json.run_id}`, {
        token: auth.token,
      });
      return r.json.webhook?.state === 'delivered' ? r.json : undefined;
    });
    assert.equal(run.webhook.attempts.length, 1);
    assert.equal(run.webhook.attempts[0].status_code, 200);
    const metrics = (await http(`${server.url}/metrics`)).text;
    assert.match(metrics, /^ferry_webhook_attempts_total\{outcome="delivered",node="[^"]+",role="all"\} [1-9]/m);
    assert.match(metrics, /^ferry_webhook_deliveries_total\{state="delivered",node="[^"]+",role="all"\} [1-9]/m);
  });

  it("sends a streaming call's items as the webhook result", async () => {
    receiver.script([200]);
    const res = await fetch(`${server.url}/v4/${auth.projectId}/hooked/items?webhookEndpoint=${hook('/stream')}`, {
      method: 'POST',
      headers: {
        authorization: `Bearer ${auth.token}`,
        accept: 'text/event-stream',
        'content-type': 'application/json',
      },
      body: '{}',
    });
    const runId = String(res.headers.get('x-request-id'));
    assert.equal(await res.text(), streamWire(runId, ['a', '{"b":2}', endEvent(runId)]));
    const delivery = await waitFor(
      async () => receiver.requests.find((r) => r.path === '/stream'),
      15_000,
      'the /stream delivery',
    );
    const streamed = JSON.parse(delivery.body.toString('utf8'));
    assert.equal(streamed.state, 'success');
    assert.deepEqual(streamed.result, ['a', { b: 2 }]);
  });

  it('redelivers on request', async () => {
    receiver.script([200]);
    const res = await call('run', `webhookEndpoint=${hook('/again')}`);
    // Waited for by path: counting requests would race the delivery, which may arrive before the call returns,
    // and the retry of the first test's hanging attempt.
    await waitFor(async () => receiver.requests.some((r) => r.path === '/again') || undefined, 15_000, 'the delivery');
    const count = receiver.requests.filter((r) => r.path === '/again').length;
    receiver.script([200]);
    const redo = await http(
      `${server.url}/v2/projects/${auth.projectId}/apps/hooked/runs/${res.json.run_id}/webhook/redeliver`,
      { method: 'POST', token: auth.token },
    );
    assert.equal(redo.status, 202, redo.text);
    await waitFor(async () => receiver.requests.filter((r) => r.path === '/again').length > count || undefined, 15_000);
  });
});
