/**
 * Issue 43, point 8, in a real browser (Debian's Chromium, test/helpers/browser.ts): a user signed in to the
 * dashboard for project A opens, in the same tab, a page that tenant B's custom app serves on the same port
 * (test/fixtures/security/origin-thief: it reads the dashboard's token from session storage, sends it to
 * its server, and registers a service worker for `/`). On a single port the page runs, sandboxed: it reads
 * no token, its server receives none, no worker is registered, and the dashboard still works. Text from
 * outside (a run's log and result, an account's name) shows its bidirectional and escape controls as
 * visible escapes instead of obeying them. With a run port (FERRY_RUN_PORT) the dashboard's run URLs point
 * there.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { BrowserContext, Page } from 'playwright-core';
import { type ApartBrowser, launchChromiumApart } from './helpers/browser.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';

// page.evaluate callbacks run in the browser; this project compiles without the DOM library.
// biome-ignore lint/suspicious/noExplicitAny: browser globals, checked by the browser itself
declare const navigator: any, sessionStorage: any;

/** How long to wait for something to show on a page (Playwright's own default; see test/dashboard.test.ts). */
const PAGE_WAIT_MS = 30_000;
const THIEF = path.join(REPO_ROOT, 'test', 'fixtures', 'security', 'origin-thief');
/** For review, as test/dashboard.test.ts keeps them. */
const SHOTS = path.join(REPO_ROOT, 'test-output', 'screenshots');
/** Right-to-left override: "invoice" RLO "fdp.exe" reads as "invoiceexe.pdf". */
const RLO = '\u202E';
/** The controls the dashboard must show, not obey (bidi embeddings, overrides, isolates; C0, DEL, C1). */
// biome-ignore lint/suspicious/noControlCharactersInRegex: finding control characters is the point
const HIDDEN = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/u;

function folderFiles(dir: string): Record<string, string> {
  const files: Record<string, string> = {};
  for (const entry of fs.readdirSync(dir)) files[entry] = fs.readFileSync(path.join(dir, entry), 'utf8');
  return files;
}

describe("a tenant's page on the dashboard's port, in Chromium", { timeout: 300_000 }, () => {
  let server: TestServer;
  let a: { projectId: string; token: string };
  let b: { projectId: string; token: string };
  let apart: ApartBrowser | undefined;
  let site: string;
  let context: BrowserContext;
  let page: Page;
  const problems: string[] = [];

  before(async () => {
    server = await startServer();
    a = await server.bootstrap('tenant-a');
    b = await server.bootstrap('tenant-b');
    assert.notEqual(a.projectId, b.projectId);
    await deployFiles(server, b, 'evil', folderFiles(THIEF));
    // Project A's own app: a function whose log and result carry controls.
    await deployFiles(server, a, 'bidi', {
      'ferry.toml': '[app]\nname = "bidi"\n',
      'main.ts': `export function run(): { text: string } {
  console.log('log \\u202Eevil\\u001b[31mred\\u0007 done');
  return { text: 'result \\u2066x\\u2069 \\u202Eevil \\u009b2J \\u007f' };
}
`,
    });
    apart = await launchChromiumApart(server.url);
    site = apart.site;
    context = await apart.browser.newContext({ viewport: { width: 1280, height: 860 } });
    page = await context.newPage();
    page.on('pageerror', (err) => problems.push(String(err)));
  });

  after(async () => {
    await apart?.close();
    await server?.close();
  });

  it("runs a tenant's page sandboxed: it reads no token and registers no worker", async () => {
    await page.goto(`${site}/#token=${a.token}`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), a.token);
    // On a single port, the run URLs are the page's own origin, as ever.
    const card = page.locator('article[data-app="bidi"]');
    await card.waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await card.locator('code.run-url').textContent(), `${site}/v4/${a.projectId}/bidi/run`);

    // Same tab, B's app on the dashboard's port (as a link from anywhere would open it).
    await page.goto(`${site}/v4/${b.projectId}/evil/`);
    await page.locator('body[data-done="1"]').waitFor({ timeout: PAGE_WAIT_MS });
    const out = JSON.parse((await page.locator('#out').textContent()) ?? '{}') as Record<string, string>;
    assert.notEqual(out.token, a.token, 'the page read the dashboard token');
    assert.match(out.token ?? '', /^blocked: SecurityError$/, JSON.stringify(out));
    assert.match(out.worker ?? '', /^blocked: /, JSON.stringify(out));
    assert.equal(out.origin, 'null', 'the page runs in an opaque origin');

    // What the page sent home reached B's server (its app log), without the token.
    const stolen = await waitFor(
      async () => {
        const log = await http(`${server.url}/v2/projects/${b.projectId}/apps/evil/logs`, { token: b.token });
        const lines = (log.json.lines as Array<{ line: string }>)
          .map((l) => l.line)
          .filter((l) => l.startsWith('STOLEN'));
        return lines.length > 0 ? lines : undefined;
      },
      PAGE_WAIT_MS,
      "the page's request to its server",
    );
    assert.ok(!stolen.join('\n').includes(a.token), stolen.join('\n'));

    // Back on the dashboard: still signed in, and no service worker controls it.
    await page.goto(`${site}/#/apps`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), a.token);
    const workers = await page.evaluate(async () =>
      (await navigator.serviceWorker.getRegistrations()).map((r: { scope: string }) => r.scope),
    );
    assert.deepEqual(workers, []);
    assert.equal(await page.evaluate(() => navigator.serviceWorker.controller), null);
  });

  it("shows the controls in a run's log and result and in names as escapes, not obeying them", async () => {
    const res = await http(`${server.url}/v4/${a.projectId}/bidi/run`, { method: 'POST', token: a.token, body: {} });
    assert.equal(res.status, 200, res.text);
    const runId = res.json.run_id as string;
    const account = await http(`${server.url}/v2/projects/${a.projectId}/service-accounts`, {
      method: 'POST',
      token: a.token,
      body: { name: `invoice${RLO}fdp.exe\u001b[2J` },
    });
    assert.equal(account.status, 201, account.text);

    // Signed in afresh, whatever the test before left in this tab.
    await page.goto(`${site}/#token=${a.token}`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor({ timeout: PAGE_WAIT_MS });
    await page.goto(`${site}/#/apps/bidi/runs/${runId}`);
    const log = page.locator('pre.log');
    await log.waitFor({ timeout: PAGE_WAIT_MS });
    const logText = await waitFor(
      async () => {
        const text = (await log.textContent()) ?? '';
        return text.includes(' done') ? text : undefined;
      },
      PAGE_WAIT_MS,
      'the log line',
    );
    assert.ok(logText.includes('log \\u202Eevil\\u001B[31mred\\u0007 done'), logText);
    assert.doesNotMatch(logText, HIDDEN);
    assert.ok((await log.locator('span.ctl').count()) >= 3);
    const result = (await page.locator('pre[aria-label="Result"]').textContent()) ?? '';
    assert.ok(result.includes('result \\u2066x\\u2069 \\u202Eevil \\u009B2J \\u007F'), result);
    assert.doesNotMatch(result, HIDDEN);
    fs.mkdirSync(SHOTS, { recursive: true });
    await page.screenshot({ path: path.join(SHOTS, 'run-controls.png'), fullPage: true });

    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'API keys' }).click();
    await page.getByRole('heading', { level: 1, name: 'API keys' }).waitFor({ timeout: PAGE_WAIT_MS });
    const name = page.locator(`tr[data-account-id="${account.json.id}"] .sa-name`);
    await name.waitFor({ timeout: PAGE_WAIT_MS });
    assert.equal(await name.textContent(), 'invoice\\u202Efdp.exe\\u001B[2J');
    assert.deepEqual(problems, []);
  });
});

describe('the dashboard with a run port (FERRY_RUN_PORT), in Chromium', { timeout: 300_000 }, () => {
  let server: TestServer;
  let apart: ApartBrowser | undefined;

  before(async () => {
    server = await startServer({ runPort: 0 });
  });
  after(async () => {
    await apart?.close();
    await server?.close();
  });

  it("shows run URLs on the run port, at the page's own host name", async () => {
    const auth = await server.bootstrap();
    await deployFiles(server, auth, 'evil', folderFiles(THIEF));
    apart = await launchChromiumApart(server.url);
    const page = await (await apart.browser.newContext()).newPage();
    await page.goto(`${apart.site}/#token=${auth.token}`);
    const card = page.locator('article[data-app="evil"]');
    await card.waitFor({ timeout: PAGE_WAIT_MS });
    const runPort = new URL(server.runUrl!).port;
    const base = `http://${new URL(apart.site).hostname}:${runPort}/v4/${auth.projectId}/evil`;
    assert.equal(await card.locator('code.run-url').textContent(), `${base}/run`);
    await card.getByText('curl examples').click();
    assert.match(
      (await card.locator('.example pre').first().textContent()) ?? '',
      new RegExp(`^curl -X POST '${base}/run'`),
    );
  });
});
