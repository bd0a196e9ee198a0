/**
 * The dashboard in a real browser: Debian's headless Chromium driven by playwright-core against a real
 * Ferry server on a real socket, with a deployed app and real runs. Signs in (sign-in link and form), sees
 * the app, watches sync and async runs arrive live, opens a run with its logs and webhook attempts,
 * opens a build's file tree, creates a service account (token shown once), revokes it, sets and deletes a
 * secret; sees the cluster table (this server's node) under the apps; checks no request leaves the server's origin and nothing breaks the CSP. Keeps one screenshot
 * per main page in test-output/screenshots/ for review.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { Browser, BrowserContext, Page } from 'playwright-core';
import { DASHBOARD_HEADERS } from '../src/dashboard/assets.js';
import { type ApartBrowser, launchChromiumApart } from './helpers/browser.js';
import {
  deployFiles,
  http,
  REPO_ROOT,
  runCli,
  spawnServe,
  startServer,
  type TestServer,
  tempDir,
  waitFor,
} from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

// page.evaluate callbacks run in the browser. This project compiles without the DOM library, so the few
// browser globals they use are declared here, loosely, in this module only.
// biome-ignore lint/suspicious/noExplicitAny: browser globals, checked by the browser itself
declare const document: any, navigator: any, sessionStorage: any, localStorage: any;

const SHOTS = path.join(REPO_ROOT, 'test-output', 'screenshots');
/**
 * How long to wait for something to show on a page (Playwright's own default): idle, pages render in well
 * under a second, and a busy machine slows Chromium several times over; only a page that never shows it
 * runs into this.
 */
const PAGE_WAIT_MS = 30_000;
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

// The files in-process (Fastify's inject); the Chromium suite below goes over a socket.
describe('dashboard files', () => {
  let server: TestServer;
  before(async () => {
    server = await startServer();
  });
  after(() => server.close());

  it('serves the page at / with a strict CSP and the other security headers', async () => {
    for (const url of [
      '/',
      '/dashboard/',
      '/dashboard/app.js',
      '/dashboard/style.css',
      '/dashboard/vendor/uPlot.esm.js',
    ]) {
      const res = await server.inject(url);
      assert.equal(res.status, 200, url);
      for (const [name, value] of Object.entries(DASHBOARD_HEADERS)) assert.equal(res.headers.get(name), value, url);
    }
    const page = await server.inject(`/`);
    assert.equal(page.headers.get('content-type'), 'text/html; charset=utf-8');
    assert.match(page.text, /<script type="module" src="\/dashboard\/app.js"><\/script>/);
    assert.doesNotMatch(page.text, /https?:\/\//, 'the page names no other host');
    assert.equal(
      (await server.inject(`/dashboard/app.js`)).headers.get('content-type'),
      'text/javascript; charset=utf-8',
    );
    assert.equal((await server.inject(`/dashboard/style.css`)).headers.get('content-type'), 'text/css; charset=utf-8');
    assert.equal(
      (await server.inject(`/dashboard/vendor/uPlot.min.css`)).headers.get('content-type'),
      'text/css; charset=utf-8',
    );
  });

  it('revalidates with an ETag, and answers 404 for anything it does not ship', async () => {
    const first = await server.inject(`/dashboard/app.js`);
    const etag = first.headers.get('etag');
    assert.ok(etag);
    const again = await server.inject(`/dashboard/app.js`, { headers: { 'if-none-match': etag } });
    assert.equal(again.status, 304);
    for (const url of ['/dashboard/nope.js', '/dashboard/vendor/uPlot.cjs.js', '/dashboard/pages', '/dashboard/x.ts']) {
      const res = await server.inject(url);
      assert.equal(res.status, 404, url);
      assert.equal(res.json.error.code, 'FERRY_ROUTE_NOT_FOUND', url);
      assert.equal(res.headers.get('content-security-policy'), DASHBOARD_HEADERS['content-security-policy'], url);
    }
    // Only listed files are served, so no path leaves the folder, however it is spelled.
    for (const url of [
      '/dashboard/%2e%2e/routes.ts',
      '/dashboard/..%2f..%2fpackage.json',
      '/dashboard/../../package.json',
    ]) {
      assert.equal((await server.inject(url)).status, 404, url);
    }
  });

  it('keeps the dashboard routes out of the OpenAPI document', async () => {
    const doc = (await server.inject(`/v2/openapi.json`)).json;
    // The document covers the management API, the run endpoint and readiness (/readyz), nothing else.
    for (const p of Object.keys(doc.paths)) assert.match(p, /^(\/v[24]\/|\/readyz$)/);
    assert.ok(!Object.keys(doc.paths).some((p) => p.includes('dashboard')));
  });
});

describe('dashboard links printed by the CLI', () => {
  it('ferry admin bootstrap prints a sign-in link with the token in the fragment; --json stays as it was', async () => {
    const dataDir = await tempDir();
    const text = await runCli(['admin', 'bootstrap', '--data-dir', dataDir], { FERRY_URL: 'http://127.0.0.1:8123/' });
    assert.equal(text.code, 0, text.stderr);
    const token = /Token \(shown once[^\n]*\n(\S+)/.exec(text.stdout)?.[1];
    assert.ok(token, text.stdout);
    assert.ok(text.stdout.includes(`  http://127.0.0.1:8123/#token=${token}\n`), text.stdout);
    const json = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json']);
    assert.equal(json.code, 0, json.stderr);
    assert.deepEqual(Object.keys(JSON.parse(json.stdout)), ['project_id', 'token']);
    assert.doesNotMatch(json.stdout, /#token=/);
  });

  it('ferry serve prints the dashboard URL once it listens', async () => {
    const serve = await spawnServe(await tempDir());
    try {
      const line = await waitFor(
        async () => /Dashboard: (http:\/\/\S+\/)"/.exec(serve.output())?.[1],
        10_000,
        'the line',
      );
      assert.equal(line, `${serve.url}/`);
    } finally {
      await serve.stop();
    }
  });
});

// A hang guard for the whole suite: about 30 s on a busy machine.
describe('dashboard in Chromium', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  let browser: Browser;
  /** Chromium in its network namespace, and the dashboard's address there. */
  let apart: ApartBrowser | undefined;
  let site: string;
  let context: BrowserContext;
  let page: Page;
  let buildId: string;
  const foreign: string[] = [];
  const problems: string[] = [];
  const ids: { sync?: string; async?: string; hook?: string } = {};

  const shot = async (name: string) => {
    await page.screenshot({ path: path.join(SHOTS, `${name}.png`), fullPage: true });
  };
  const go = async (hash: string, heading: string | RegExp) => {
    await page.evaluate((h) => {
      document.location.hash = h;
    }, hash);
    await page.getByRole('heading', { level: 1, name: heading }).waitFor();
  };
  /** Every form control and button on the page has an accessible name. */
  const assertLabelled = async (where: string) => {
    const unlabelled: string[] = await page.evaluate(() => {
      const out: string[] = [];
      for (const el of document.querySelectorAll('input, select, textarea, button')) {
        if (el.type === 'hidden') continue;
        const byLabel = [...(el.labels ?? [])].map((l) => l.textContent ?? '').join('');
        const byAria =
          el.getAttribute('aria-label') ??
          String(el.getAttribute('aria-labelledby') ?? '')
            .split(' ')
            .map((id: string) => document.getElementById(id)?.textContent ?? '')
            .join('');
        const byText = el.tagName === 'BUTTON' ? (el.textContent ?? '') : '';
        if (!`${byLabel}${byAria}${byText}`.trim()) out.push(String(el.outerHTML).slice(0, 120));
      }
      return out;
    });
    assert.deepEqual(unlabelled, [], `unlabelled controls on ${where}`);
  };

  before(async () => {
    fs.mkdirSync(SHOTS, { recursive: true });
    receiver = await startReceiver();
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    const example = path.join(REPO_ROOT, 'examples', 'hello');
    const build = await deployFiles(server, auth, 'hello', {
      'ferry.toml': fs.readFileSync(path.join(example, 'ferry.toml'), 'utf8'),
      'main.ts': `${fs.readFileSync(path.join(example, 'main.ts'), 'utf8')}
/** Works a while and says so, for the dashboard test. */
export async function slow({ ms = 1500 }: { ms?: number } = {}): Promise<{ slept: number }> {
  console.log(\`working for \${ms} ms\`);
  await new Promise((resolve) => setTimeout(resolve, ms));
  console.error('done working');
  return { slept: ms };
}
`,
      'lib/words.ts': 'export const words = ["ferry"];\n',
    });
    buildId = build.id;
    // Chromium runs in a namespace of its own (test/helpers/browser.ts says why), where the site is as
    // trusted as loopback (a secure context, for the clipboard).
    apart = await launchChromiumApart(server.url);
    browser = apart.browser;
    site = apart.site;
    // A fresh context is a fresh profile: no storage, no cache.
    context = await browser.newContext({ viewport: { width: 1280, height: 860 } });
    await context.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: site });
    const origin = new URL(site).origin;
    context.on('request', (request) => {
      const url = new URL(request.url());
      if (url.protocol !== 'data:' && url.origin !== origin) foreign.push(request.url());
    });
    page = await context.newPage();
    page.on('console', (message) => {
      if (message.type() === 'error') problems.push(message.text());
    });
    page.on('pageerror', (err) => problems.push(String(err)));
  });

  after(async () => {
    await apart?.close();
    await server?.close();
    await receiver?.close();
  });

  it('signs in with the sign-in link, then drops the token from the URL', async () => {
    await page.goto(`${site}/#token=${auth.token}`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor();
    assert.ok(!page.url().includes(auth.token), page.url());
    assert.ok(page.url().endsWith('/#/apps'), page.url());
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), auth.token);
    const card = page.locator('article[data-app="hello"]');
    await card.waitFor();
    assert.match((await card.locator('.app-state').textContent()) ?? '', /active|scaled to zero/);
    await waitFor(async () => /limits 0–2/.test((await card.textContent()) ?? ''), 10_000, 'the replica limits');
    assert.match((await card.textContent()) ?? '', new RegExp(`/v4/${auth.projectId}/hello/run`));
    await card.getByText('curl examples').click();
    for (const mode of ['sync', 'async', 'stream', 'webhook']) {
      await card.getByRole('button', { name: `Copy ${mode} curl example for hello` }).waitFor();
    }
    assert.ok(!((await card.textContent()) ?? '').includes(auth.token), 'no token in the examples');
    await card.getByRole('button', { name: 'Copy sync curl example for hello' }).click();
    const copied = await page.evaluate(() => navigator.clipboard.readText());
    // The page's own origin (the forwarder's address in Chromium's namespace).
    assert.ok(copied.startsWith(`curl -X POST '${site}/v4/${auth.projectId}/hello/run'`), copied);
    // Below the apps, the cluster: this server's node, marked as the one serving the page, with its address.
    const node = page.locator(`table.cluster-nodes tr[data-node="${server.services.node.id}"]`);
    await node.waitFor({ timeout: PAGE_WAIT_MS });
    // The address is in the node's info from a moment after the server listens; the table refreshes every 5 s.
    const nodeText = await waitFor(
      async () => {
        const text = (await node.textContent()) ?? '';
        return text.includes(server.url) ? text : undefined;
      },
      PAGE_WAIT_MS,
      'the server address in the cluster table',
    );
    assert.ok(nodeText.includes('(this page)'), nodeText);
    assert.equal(await node.locator('td').nth(1).textContent(), 'all', 'the role column');
    assert.equal(await page.locator('table.cluster-nodes tbody tr').count(), 1);
    await assertLabelled('apps');
    await shot('apps');
  });

  it('signs out and in again with the sign-in form', async () => {
    await page.getByRole('button', { name: 'Sign out' }).click();
    await page.getByRole('heading', { level: 1, name: 'Sign in to Ferry' }).waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), null);
    await page.getByLabel('Service-account token').fill('not-a-token');
    await page.getByRole('button', { name: 'Sign in' }).click();
    await page.getByText('This is not a Ferry token').waitFor();
    await page.getByLabel('Service-account token').fill(auth.token);
    await page.getByRole('button', { name: 'Sign in' }).click();
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor();
    await page.locator('article[data-app="hello"]').waitFor();
  });

  it('shows sync and async runs as they arrive, the async one marked async, with its final state', async () => {
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Runs' }).click();
    await page.getByRole('heading', { level: 1, name: 'Runs of hello' }).waitFor();
    // The runs are made after the page is open: they must appear without a reload.
    const run = (fn: string, query = '', body: unknown = {}) =>
      http(`${server.url}/v4/${auth.projectId}/hello/${fn}${query}`, { method: 'POST', token: auth.token, body });
    const sync = await run('run', '', { name: 'Dashboard' });
    assert.equal(sync.status, 200, sync.text);
    const accepted = await run('slow', '?async=true', { ms: 1500 });
    assert.equal(accepted.status, 202, accepted.text);
    ids.sync = sync.json.run_id as string;
    ids.async = accepted.json.run_id as string;
    assert.match(ids.async, UUID);

    const syncRow = page.locator(`tr[data-run-id="${ids.sync}"]`);
    const asyncRow = page.locator(`tr[data-run-id="${ids.async}"]`);
    await syncRow.waitFor({ timeout: PAGE_WAIT_MS });
    await asyncRow.waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await syncRow.getAttribute('data-mode'), 'sync');
    assert.equal(await asyncRow.getAttribute('data-mode'), 'async');
    assert.equal((await asyncRow.locator('.mode-async').textContent())?.trim(), 'async');
    assert.equal(await syncRow.locator('.mode-async').count(), 0);
    assert.equal(await syncRow.getAttribute('data-state'), 'success');
    await page.locator(`tr[data-run-id="${ids.async}"][data-state="success"]`).waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal((await asyncRow.locator('.state-success').textContent())?.trim(), 'success');
    // What started each run and its attempts (issue 43).
    for (const row of [syncRow, asyncRow]) {
      assert.equal((await row.locator('td[data-label="Started by"]').textContent())?.trim(), 'call');
      assert.equal((await row.locator('td[data-label="Attempts"]').textContent())?.trim(), '1');
    }
    // Newest first.
    const order = await page
      .locator('tbody tr[data-run-id]')
      .evaluateAll((rows) => rows.map((r) => r.getAttribute('data-run-id')));
    assert.deepEqual(order.slice(0, 2), [ids.async, ids.sync]);

    // Filters: only async runs, then any mode again.
    await page.getByLabel('Mode').selectOption('async');
    await waitFor(async () => (await page.locator('tbody tr[data-run-id]').count()) === 1, 10_000, 'the filter');
    assert.ok(page.url().includes('mode=async'));
    await asyncRow.waitFor();
    await page.getByLabel('Mode').selectOption('');
    await syncRow.waitFor();
    await assertLabelled('runs');
    await shot('runs');
  });

  it('opens a run and shows its timeline, input, result and logs', async () => {
    await page.getByRole('link', { name: `Run ${ids.async}` }).click();
    await page.getByRole('heading', { level: 1, name: /^Run / }).waitFor();
    await page.locator('pre.log').getByText('working for 1500 ms').waitFor();
    await page.locator('pre.log').getByText('done working').waitFor();
    assert.match((await page.locator('pre[aria-label="Input"]').textContent()) ?? '', /"ms": 1500/);
    assert.match((await page.locator('pre[aria-label="Result"]').textContent()) ?? '', /"slept": 1500/);
    assert.equal(await page.locator('.timeline li.done').count(), 3);
    assert.ok(await page.locator('.badges .mode-async').isVisible());
    await assertLabelled('run');
    await shot('run');
  });

  it("shows a run's webhook attempts and redelivers it", async () => {
    const res = await http(
      `${server.url}/v4/${auth.projectId}/hello/run?webhookEndpoint=${encodeURIComponent(`${receiver.url}/hook`)}`,
      { method: 'POST', token: auth.token, body: { name: 'Hook' } },
    );
    assert.equal(res.status, 200, res.text);
    ids.hook = res.json.run_id as string;
    await receiver.waitForRequests(1);
    await go(`#/apps/hello/runs/${ids.hook}`, /^Run /);
    const attempts = page.getByRole('region', { name: 'Webhook attempts' });
    await attempts
      .locator('tbody tr .badge.state-success', { hasText: '200' })
      .first()
      .waitFor({ timeout: PAGE_WAIT_MS });
    await page.getByRole('button', { name: 'Redeliver' }).click();
    await receiver.waitForRequests(2);
    await waitFor(async () => (await attempts.locator('tbody tr').count()) === 2, 15_000, 'the second attempt');
    await assertLabelled('run with webhook');
  });

  it("lists the builds and opens a build's log, file tree and ferry.toml", async () => {
    await page.getByRole('navigation', { name: 'hello sections' }).getByRole('link', { name: 'Builds' }).click();
    await page.getByRole('heading', { level: 1, name: 'Builds of hello' }).waitFor();
    const row = page.locator(`tr[data-build-id="${buildId}"]`);
    await row.waitFor();
    assert.match((await row.textContent()) ?? '', /ready/);
    assert.match((await row.textContent()) ?? '', /active/);
    await assertLabelled('builds');
    await shot('builds');

    await row.getByRole('link').click();
    await page.getByRole('heading', { level: 1, name: /^Build / }).waitFor();
    const tree = page.locator('ul.tree');
    await tree.locator('li.file[data-path="ferry.toml"]').waitFor();
    await tree.locator('li.file[data-path="main.ts"]').waitFor();
    await tree.locator('li.file[data-path="lib/words.ts"]').waitFor();
    assert.ok(await tree.getByText('lib/').isVisible(), 'folders are shown as folders');
    assert.match((await page.locator('pre[aria-label="ferry.toml"]').textContent()) ?? '', /name = "hello"/);
    await page.getByText(/Complete log\. The build is ready\./).waitFor({ timeout: PAGE_WAIT_MS });
    assert.ok(((await page.locator('pre[aria-label="Build log"]').textContent()) ?? '').length > 0);
    await assertLabelled('build');
    await shot('build');
  });

  it('draws the charts of the app', async () => {
    await page.getByRole('navigation', { name: 'hello sections' }).getByRole('link', { name: 'Charts' }).click();
    await page.getByRole('heading', { level: 1, name: 'Charts of hello' }).waitFor();
    await waitFor(async () => (await page.locator('.uplot canvas').count()) === 3, 10_000, 'three charts');
    await page.getByText(/\b3 success, 0 failure/).waitFor();
    await assertLabelled('charts');
    await shot('charts');
  });

  it('creates a service account whose token is shown once, then revokes it', async () => {
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'API keys' }).click();
    await page.getByRole('heading', { level: 1, name: 'API keys' }).waitFor();
    // This session's own account is marked.
    await page.locator('.badge.you').waitFor();
    await page.getByLabel('Name', { exact: true }).fill('ci-deploy');
    await page.getByLabel('Expires on').fill('2030-01-31');
    await page.getByRole('button', { name: 'Create service account' }).click();
    const field = page.getByLabel('Token', { exact: true });
    await field.waitFor();
    const token = await field.inputValue();
    assert.ok(token.split('.').length === 3, token);
    await page.getByText('It will not be shown again').waitFor();
    await page.getByRole('button', { name: 'Copy token for ci-deploy' }).click();
    assert.equal(await page.evaluate(() => navigator.clipboard.readText()), token);
    const row = page.locator('tr[data-name="ci-deploy"]');
    await row.waitFor();
    // The expiry with its time, not only the day (issue 43): the form's day ends at 23:59 UTC.
    assert.match((await row.textContent()) ?? '', /2030-01-31 23:59 UTC/);
    assert.match((await row.textContent()) ?? '', /manage, run/);
    assert.equal((await http(`${server.url}/v2/projects/${auth.projectId}`, { token })).status, 200);
    await assertLabelled('API keys');
    await shot('api-keys');

    await page.reload();
    await page.locator('tr[data-name="ci-deploy"]').waitFor();
    assert.equal(await page.getByLabel('Token', { exact: true }).count(), 0, 'the token panel is gone');
    assert.ok(!(await page.content()).includes(token), 'the token is nowhere on the page after a reload');
    assert.ok(
      !(
        await page.evaluate(() => JSON.stringify({ ...sessionStorage }) + JSON.stringify({ ...localStorage }))
      ).includes(token),
      'the token was not stored',
    );

    await page.getByRole('button', { name: 'Revoke ci-deploy' }).click();
    await page.getByRole('button', { name: 'Yes, revoke' }).click();
    await page.locator('tr[data-name="ci-deploy"] .badge', { hasText: 'revoked' }).waitFor();
    const refused = await http(`${server.url}/v2/projects/${auth.projectId}`, { token });
    assert.equal(refused.status, 401);
    assert.equal(refused.json.error.code, 'FERRY_TOKEN_REVOKED');
  });

  it('sets, lists (names only) and deletes a secret', async () => {
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Secrets' }).click();
    await page.getByRole('heading', { level: 1, name: 'Secrets' }).waitFor();
    await page.getByLabel('Name', { exact: true }).fill('STRIPE_KEY');
    await page.getByLabel('Value', { exact: true }).fill('sk_test_dashboard_value');
    await page.getByRole('button', { name: 'Save secret' }).click();
    await page.locator('tr[data-secret="STRIPE_KEY"]').waitFor();
    assert.equal(await page.getByLabel('Value', { exact: true }).inputValue(), '', 'the value field is cleared');
    assert.ok(!(await page.content()).includes('sk_test_dashboard_value'));
    const listed = await http(`${server.url}/v2/projects/${auth.projectId}/secrets`, { token: auth.token });
    assert.deepEqual(
      listed.json.secrets.map((s: { name: string }) => s.name),
      ['STRIPE_KEY'],
    );
    await assertLabelled('secrets');
    await shot('secrets');
    await page.getByRole('button', { name: 'Delete STRIPE_KEY' }).click();
    await page.getByRole('button', { name: 'Yes, delete' }).click();
    await page.getByText('No secrets.').waitFor();
  });

  it('creates a volume, shows its use and files, and deletes it (issue 27)', async () => {
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Volumes' }).click();
    await page.getByRole('heading', { level: 1, name: 'Volumes' }).waitFor();
    await page.getByLabel('Name', { exact: true }).fill('models');
    await page.getByLabel('Size (MiB)', { exact: true }).fill('32');
    await page.getByRole('button', { name: 'Create volume' }).click();
    await page.locator('tr[data-volume="models"]').waitFor();
    const base = `${server.url}/v2/projects/${auth.projectId}/volumes/models`;
    const put = await http(`${base}/file?path=weights/w.bin`, {
      method: 'PUT',
      token: auth.token,
      body: Buffer.from('w'),
    });
    assert.equal(put.status, 201, put.text);
    await assertLabelled('volumes');
    await shot('volumes');
    await page.getByRole('link', { name: 'models', exact: true }).click();
    await page.getByRole('link', { name: 'weights/' }).click();
    await page.locator('tr[data-entry="w.bin"]').waitFor();
    await assertLabelled('volume files');
    await page.getByRole('button', { name: 'Delete w.bin' }).click();
    await page.getByRole('button', { name: 'Yes, delete' }).click();
    await page.getByText('Empty folder.').waitFor();
    await page.getByRole('link', { name: 'All volumes' }).click();
    await page.getByRole('button', { name: 'Delete models' }).click();
    await page.getByRole('button', { name: 'Yes, delete' }).click();
    await page.getByText('No volumes.').waitFor();
  });

  it('rolls back to a build and deletes another from the builds page (issue 14)', async () => {
    const base = `${server.url}/v2/projects/${auth.projectId}/apps/hello`;
    const files = Object.fromEntries(
      ['ferry.toml', 'main.ts'].map((f) => [f, fs.readFileSync(path.join(REPO_ROOT, 'examples', 'hello', f), 'utf8')]),
    );
    const second = await deployFiles(server, auth, 'hello', { ...files, 'main.ts': `${files['main.ts']}// v2\n` });
    const third = await deployFiles(server, auth, 'hello', { ...files, 'main.ts': `${files['main.ts']}// v3\n` });
    await go('#/apps/hello/builds', 'Builds of hello');
    await page.locator(`tr[data-build-id="${third.id}"] .active-build`).waitFor();
    await assertLabelled('builds with actions');
    // Roll back to the first build.
    await page.getByRole('button', { name: `Activate build ${buildId.slice(-12)}` }).click();
    await page.locator(`tr[data-build-id="${buildId}"] .active-build`).waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal((await http(base, { token: auth.token })).json.active_build_id, buildId);
    // Delete the second (neither active nor being made); the active build offers no delete.
    assert.equal(await page.getByRole('button', { name: `Delete build ${buildId.slice(-12)}` }).count(), 0);
    await page.getByRole('button', { name: `Delete build ${second.id.slice(-12)}` }).click();
    await page.getByRole('button', { name: 'Delete the build' }).click();
    await page.locator(`tr[data-build-id="${second.id}"]`).waitFor({ state: 'detached', timeout: PAGE_WAIT_MS });
    assert.equal((await http(`${base}/builds/${second.id}`, { token: auth.token })).status, 404);
    await shot('builds-actions');
  });

  it('scales an app without a build, and goes back to ferry.toml (issue 14)', async () => {
    const base = `${server.url}/v2/projects/${auth.projectId}/apps/hello`;
    await go('#/apps/hello/settings', 'Settings of hello');
    // The form's own status: the page's live region (#status, for screen readers) repeats the same words,
    // and a locator matching both fails in strict mode when the two are there at once.
    const scalingStatus = page.getByRole('form', { name: 'Scaling' }).getByRole('status');
    await page.getByText('From the active build’s ferry.toml.').waitFor();
    await page.getByLabel('Minimum replicas').fill('1');
    await page.getByLabel('Maximum replicas').fill('3');
    await page.getByRole('button', { name: 'Save scaling' }).click();
    await scalingStatus.getByText('Scaling saved').waitFor({ timeout: PAGE_WAIT_MS });
    const app = (await http(base, { token: auth.token })).json;
    assert.equal(app.scaling.min_replicas, 1);
    assert.equal(app.scaling.max_replicas, 3);
    // Only the fields changed become overrides: the rest still come from ferry.toml.
    assert.deepEqual(app.scaling_override, { min_replicas: 1, max_replicas: 3 });
    await assertLabelled('settings');
    await shot('settings');
    await page.getByRole('button', { name: 'Use ferry.toml again' }).click();
    await scalingStatus.getByText('Scaling from ferry.toml again').waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal((await http(base, { token: auth.token })).json.scaling_override, null);
  });

  it('cancels a running run, and shows a run end as it ends (issue 14)', async () => {
    const call = (ms: number) =>
      http(`${server.url}/v4/${auth.projectId}/hello/slow?async=true`, {
        method: 'POST',
        token: auth.token,
        body: { ms },
      });
    const long = (await call(60_000)).json.run_id as string;
    await waitFor(
      async () =>
        (await http(`${server.url}/v2/projects/${auth.projectId}/apps/hello/runs/${long}`, { token: auth.token })).json
          .state === 'running',
      30_000,
      'the long run to start',
    );
    await go(`#/apps/hello/runs/${long}`, /^Run /);
    await page.getByRole('button', { name: 'Cancel run' }).click();
    await page.getByRole('button', { name: 'Cancel the run' }).click();
    await page.locator('.badges').getByText('cancelled').waitFor({ timeout: PAGE_WAIT_MS });
    await page.getByText('FERRY_RUN_CANCELLED').waitFor();
    // A run still going when its page opens: the page shows its end when it comes, without a reload.
    const short = (await call(3000)).json.run_id as string;
    await go(`#/apps/hello/runs/${short}`, /^Run /);
    await page.locator('.badges').getByText('success').waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await page.getByRole('button', { name: 'Cancel run' }).count(), 0);
  });

  it('deletes an app from its settings (issue 14)', async () => {
    await deployFiles(server, auth, 'scrap', {
      'ferry.toml': '[app]\nname = "scrap"\n',
      'main.ts': 'export function run() { return 1; }\n',
    });
    await go('#/apps/scrap/settings', 'Settings of scrap');
    await page.getByRole('button', { name: 'Delete app scrap' }).click();
    await page.getByRole('button', { name: 'Delete scrap' }).click();
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(
      (await http(`${server.url}/v2/projects/${auth.projectId}/apps/scrap`, { token: auth.token })).status,
      404,
    );
    await page.locator('[data-app="scrap"]').waitFor({ state: 'detached', timeout: PAGE_WAIT_MS });
  });

  it('works at a narrow width and from the keyboard', async () => {
    await page.setViewportSize({ width: 390, height: 844 });
    await go('#/apps', 'Apps');
    await page.locator('article[data-app="hello"]').waitFor();
    const overflow = await page.evaluate(
      () => document.documentElement.scrollWidth - document.documentElement.clientWidth,
    );
    assert.ok(overflow <= 0, `the page scrolls sideways by ${overflow}px at 390px`);
    await shot('apps-narrow');
    await go('#/apps/hello/runs', 'Runs of hello');
    await page.locator(`tr[data-run-id="${ids.sync}"]`).waitFor();
    const runsOverflow = await page.evaluate(
      () => document.documentElement.scrollWidth - document.documentElement.clientWidth,
    );
    assert.ok(runsOverflow <= 0, `the runs page scrolls sideways by ${runsOverflow}px (the table should scroll alone)`);
    await shot('runs-narrow');
    await page.setViewportSize({ width: 1280, height: 860 });

    // From the top of the page: skip link, brand, then the main navigation, by Tab alone.
    await go('#/apps', 'Apps');
    await page.reload();
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor();
    const focused: string[] = [];
    for (let i = 0; i < 4; i++) {
      await page.keyboard.press('Tab');
      focused.push(await page.evaluate(() => document.activeElement?.textContent?.trim() ?? ''));
    }
    assert.deepEqual(focused, ['Skip to content', 'Ferry', 'Apps', 'Runs']);
    await page.keyboard.press('Enter');
    await page.getByRole('heading', { level: 1, name: 'Runs of hello' }).waitFor();
    // The heading shows before the page's data calls end; focus moves once the page has rendered.
    const focusMoved = await page
      .waitForFunction(() => document.activeElement?.tagName === 'H1', undefined, { timeout: PAGE_WAIT_MS })
      .then(() => true)
      .catch(() => false);
    assert.ok(
      focusMoved,
      `focus moves to the new page (it is on ${await page.evaluate(() => document.activeElement?.tagName)})`,
    );
  });

  it('signs out when the server refuses the token', async () => {
    // The session's own token revoked elsewhere (the CLI): the next call is refused and the page says so.
    const own = JSON.parse(Buffer.from(auth.token.split('.')[1]!, 'base64url').toString()).sub as string;
    const other = await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts`, {
      method: 'POST',
      token: auth.token,
      body: { name: 'spare' },
    });
    assert.equal(other.status, 201);
    await http(`${server.url}/v2/projects/${auth.projectId}/service-accounts/${own}`, {
      method: 'DELETE',
      token: other.json.token,
    });
    await page.getByRole('heading', { level: 1, name: 'Sign in to Ferry' }).waitFor({ timeout: PAGE_WAIT_MS });
    await page.getByText(/FERRY_TOKEN_REVOKED/).waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), null);
  });

  it('made no request to another host and broke no CSP rule', () => {
    assert.deepEqual(foreign, []);
    const unexpected = problems.filter(
      // The refused calls of the last test and of the bad sign-in are expected.
      (p) => !/Failed to load resource: the server responded with a status of 401/.test(p),
    );
    assert.deepEqual(unexpected, []);
  });
});
