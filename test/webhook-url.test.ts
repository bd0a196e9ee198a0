/**
 * One rule for every webhook URL (issue 43, point 6): the same table of bad URLs is fed to every place
 * that takes one, and each refuses every row with its own coded answer: the run endpoint's
 * `webhookEndpoint` on a Cortex call (sync and async) and through the custom proxy (`400
 * FERRY_WEBHOOK_URL_INVALID`, nothing stored), a schedule's `webhook` in ferry.toml at upload (`400
 * FERRY_CONFIG_INVALID` naming the key) and in `ferry deploy`, which refuses before it uploads. A good URL
 * is stored the same way (normalized) by a run and by a schedule. No answer repeats the URL's password.
 * Which addresses a delivery may reach is the server's setting: the run endpoint refuses a literal address
 * in a blocked range at intake (issue 43), and a name is checked at delivery, on what it resolves to then.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { blockedReason, parseAllowList } from '../src/webhooks/address-guard.js';
import { MAX_WEBHOOK_URL_LENGTH, parseWebhookUrl } from '../src/webhooks/webhook-url.js';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir } from './helpers/ferry.js';

/** [what is wrong, the URL, what the refusal says]. */
const BAD: ReadonlyArray<readonly [string, string, RegExp]> = [
  ['user name and password', 'https://user:secret@example.com/hook', /user name or password/],
  ['user name only', 'https://user@example.com/hook', /user name or password/],
  ['password only', 'http://:secret@example.com/hook', /user name or password/],
  ['another scheme', 'ftp://example.com/hook', /absolute http/],
  ['javascript', 'javascript:alert(1)', /absolute http/],
  ['a relative URL', '/hook', /absolute http/],
  ['no scheme', 'example.com/hook', /absolute http/],
  ['empty', '', /absolute http/],
  ['too long', `https://example.com/${'a'.repeat(MAX_WEBHOOK_URL_LENGTH)}`, /at most 2048/],
  ['too long once encoded', `https://example.com/${' '.repeat(MAX_WEBHOOK_URL_LENGTH - 100)}x`, /at most 2048/],
];

/** A good URL and how every place stores it. */
const GOOD = 'HTTPS://Hooks.Example.INVALID:443/a b?x=1';
const NORMALIZED = 'https://hooks.example.invalid/a%20b?x=1';

const CORTEX = 'export function run() { return { ok: true }; }\n';
const CUSTOM_SERVER =
  "import http from 'node:http';\nhttp.createServer((req, res) => res.end('ok')).listen(Number(process.env.PORT ?? 8080));\n";

function scheduleToml(app: string, webhook: string): string {
  return `[app]\nname = "${app}"\n[[schedules]]\nname = "tick"\ncron = "@daily"\nwebhook = ${JSON.stringify(webhook)}\n`;
}

/** Every way the run endpoint takes a webhookEndpoint: Cortex and custom apps, sync and async. */
const RUN_ENDPOINTS = [
  ['cortex', '/run'],
  ['cortex', '/run?async=true'],
  ['custom', '/hook/path'],
  ['custom', '/hook/path?async=true'],
] as const;

describe('one rule for every webhook URL', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const countRuns = async () =>
    Number(
      (
        await server.services.store
          .selectFrom('runs')
          .select((e) => e.fn.countAll().as('n'))
          .executeTakeFirstOrThrow()
      ).n,
    );
  const callWith = (app: string, rest: string, webhook: string) =>
    http(
      `${server.url}/v4/${auth.projectId}/${app}${rest}${rest.includes('?') ? '&' : '?'}webhookEndpoint=${encodeURIComponent(webhook)}`,
      {
        method: 'POST',
        token: auth.token,
        body: {},
      },
    );

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'cortex', { 'ferry.toml': '[app]\nname = "cortex"\n', 'main.ts': CORTEX });
    await deployFiles(server, auth, 'custom', {
      'ferry.toml':
        '[app]\nname = "custom"\nruntime = "custom"\n\n[runtime.custom]\nentrypoint = ["node", "server.mjs"]\nport = 8080\n',
      'server.mjs': CUSTOM_SERVER,
    });
  });
  after(() => server?.close());

  it('the validator refuses each bad URL saying why, without repeating it', () => {
    for (const [what, url, says] of BAD) {
      assert.throws(
        () => parseWebhookUrl(url),
        (err: Error) => {
          assert.equal(err.name, 'WebhookUrlError', what);
          assert.match(err.message, says, what);
          assert.doesNotMatch(err.message, /secret/, what);
          return true;
        },
        what,
      );
    }
    assert.equal(parseWebhookUrl(GOOD), NORMALIZED);
  });

  it('the run endpoint refuses each bad webhookEndpoint, on Cortex calls and custom apps, storing nothing', async () => {
    const before = await countRuns();
    for (const [what, url, says] of BAD) {
      for (const [app, rest] of RUN_ENDPOINTS) {
        const res = await callWith(app, rest, url);
        assert.equal(res.status, 400, `${what} on ${app}${rest}: ${res.text}`);
        assert.equal(res.json.error.code, 'FERRY_WEBHOOK_URL_INVALID', `${what} on ${app}${rest}`);
        assert.match(res.json.error.message, says, `${what} on ${app}${rest}`);
        assert.doesNotMatch(res.text, /secret/, `${what} on ${app}${rest}: the answer repeats no password`);
      }
    }
    assert.equal(await countRuns(), before, 'no run was stored');
  });

  it('an upload refuses a schedule with each bad webhook, naming the key', async () => {
    for (const [what, url, says] of BAD) {
      const zip = await zipFiles({ 'ferry.toml': scheduleToml('hooked', url), 'main.ts': CORTEX });
      const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/hooked/builds`, {
        method: 'POST',
        token: auth.token,
        body: zip,
        headers: { 'content-type': 'application/zip' },
      });
      assert.equal(res.status, 400, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_CONFIG_INVALID', what);
      assert.match(res.json.error.message, /schedules\.0\.webhook/, what);
      assert.match(res.json.error.message, says, what);
      assert.doesNotMatch(res.text, /secret/, `${what}: the answer repeats no password`);
    }
    const app = await http(`${server.url}/v2/projects/${auth.projectId}/apps/hooked`, { token: auth.token });
    assert.equal(app.status, 404, 'no upload made the app');
  });

  it('ferry deploy refuses a schedule with each bad webhook before it uploads', async () => {
    const home = await tempDir('ferry-home-');
    const env = { HOME: home, FERRY_URL: server.url, FERRY_TOKEN: auth.token, FERRY_PROJECT: auth.projectId };
    for (const [what, url, says] of BAD) {
      const dir = await tempDir('ferry-app-');
      await fs.writeFile(path.join(dir, 'ferry.toml'), scheduleToml('hooked-cli', url));
      await fs.writeFile(path.join(dir, 'main.ts'), CORTEX);
      const res = await runCli(['deploy', dir], env);
      assert.equal(res.code, 1, `${what}: ${res.stdout}\n${res.stderr}`);
      assert.match(res.stderr, /^ferry: .*schedules\.0\.webhook/m, what);
      assert.match(res.stderr, says, what);
      assert.doesNotMatch(res.stderr, /secret/, `${what}: the error repeats no password`);
      assert.doesNotMatch(res.stdout, /uploaded/, what);
    }
    const app = await http(`${server.url}/v2/projects/${auth.projectId}/apps/hooked-cli`, { token: auth.token });
    assert.equal(app.status, 404, 'nothing was uploaded');
  });

  it('the run endpoint refuses a literal address in a blocked range at intake, naming FERRY_WEBHOOK_ALLOW (issue 43)', async () => {
    // Before, each was answered 202 (or 200) and its delivery failed later, out of the caller's sight.
    const blocked: ReadonlyArray<readonly [string, RegExp]> = [
      ['http://127.0.0.1:9/hook', /127\.0\.0\.1 is loopback/],
      ['http://2130706433:9/hook', /127\.0\.0\.1 is loopback/], // URL writes it as 127.0.0.1
      ['http://[::1]:9/hook', /::1 is loopback/],
      ['http://[::ffff:10.0.0.1]/hook', /::ffff:a00:1 is private/],
      ['https://169.254.169.254/latest/meta-data/', /is cloud metadata/],
      ['http://192.168.1.20:8080/', /is private/],
    ];
    const before = await countRuns();
    for (const [url, says] of blocked) {
      for (const [app, rest] of RUN_ENDPOINTS) {
        const res = await callWith(app, rest, url);
        assert.equal(res.status, 400, `${url} on ${app}${rest}: ${res.text}`);
        assert.equal(res.json.error.code, 'FERRY_WEBHOOK_URL_INVALID', `${url} on ${app}${rest}`);
        assert.match(res.json.error.message, /^webhookEndpoint must not be an address in a blocked range: /);
        assert.match(res.json.error.message, says, `${url} on ${app}${rest}`);
        assert.match(res.json.error.message, /FERRY_WEBHOOK_ALLOW/, 'the refusal names the setting');
      }
    }
    assert.equal(await countRuns(), before, 'no run was stored');

    // Allowed ranges pass the same check, and a name is still judged at delivery only (what it resolves to then).
    const loopbackAllowed = parseAllowList('127.0.0.0/8');
    assert.equal(
      parseWebhookUrl('http://127.0.0.1:9/hook', { blocked: (a) => blockedReason(a, loopbackAllowed) }),
      'http://127.0.0.1:9/hook',
    );
    const named = await callWith('cortex', '/run?async=true', 'http://localhost:9/hook');
    assert.equal(named.status, 202, named.text);
  });

  it('a good URL is stored the same way by a run and by a schedule', async () => {
    assert.equal(parseAppConfig(scheduleToml('x', GOOD)).schedules[0]?.webhook, NORMALIZED);
    const accepted = await callWith('cortex', '/run?async=true', GOOD);
    assert.equal(accepted.status, 202, accepted.text);
    const run = await server.services.store
      .selectFrom('runs')
      .select('webhook_endpoint')
      .where('id', '=', accepted.json.run_id)
      .executeTakeFirstOrThrow();
    assert.equal(run.webhook_endpoint, NORMALIZED);

    await deployFiles(server, auth, 'scheduled', { 'ferry.toml': scheduleToml('scheduled', GOOD), 'main.ts': CORTEX });
    const listed = await http(`${server.url}/v2/projects/${auth.projectId}/apps/scheduled/schedules`, {
      token: auth.token,
    });
    assert.equal(listed.status, 200, listed.text);
    assert.equal(listed.json.schedules[0].webhook, NORMALIZED);
  });
});
