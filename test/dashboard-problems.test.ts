/**
 * The dashboard when things are wrong (issue 11, points 13 and 14), in Debian's headless Chromium against
 * a real server: a sign-in link opened in a tab that already shows the dashboard, an app whose replicas
 * cannot start, an app without a public function, a failed build's error in the builds table, and chart
 * hover boxes for an app without runs.
 */
import assert from 'node:assert/strict';
import { after, afterEach, before, describe, it } from 'node:test';
import type { Page } from 'playwright-core';
import { type ApartBrowser, launchChromiumApart } from './helpers/browser.js';
import { deployFiles, http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

// biome-ignore lint/suspicious/noExplicitAny: browser globals, checked by the browser itself
declare const document: any, sessionStorage: any;

describe('dashboard problems in Chromium', { timeout: 180_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let second: { projectId: string; token: string };
  let apart: ApartBrowser | undefined;
  /** The server's address as Chromium reaches it. */
  let site: string;
  let page: Page;
  const problems: string[] = [];
  const seen: string[] = [];

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    second = await server.bootstrap('second');
    const toml = (name: string) => `[app]\nname = "${name}"\n`;
    await deployFiles(server, auth, 'boom', {
      'ferry.toml': toml('boom'),
      'main.ts':
        "const broken = true;\nif (broken) throw new Error('kaboom at load');\nexport function run() {\n  return 1;\n}\n",
    });
    await deployFiles(server, auth, 'nofn', {
      'ferry.toml': toml('nofn'),
      'main.ts': 'export default function () {\n  return 1;\n}\n',
    });
    await deployFiles(
      server,
      auth,
      'broken',
      { 'ferry.toml': toml('broken'), 'main.ts': 'export function run( {\n' },
      { expect: 'failed' },
    );
    const res = await http(`${server.url}/v4/${auth.projectId}/boom/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 502, res.text);
    // In a namespace of its own (test/helpers/browser.ts): in the host's, the veths of other files'
    // sandboxes made Chromium abort the page's module loads with ERR_NETWORK_CHANGED, and every test here
    // then timed out waiting for its first heading (CI, with other files running alongside).
    apart = await launchChromiumApart(server.url);
    site = apart.site;
    const context = await apart.browser.newContext({ viewport: { width: 1280, height: 900 } });
    page = await context.newPage();
    page.on('pageerror', (err) => problems.push(String(err)));
    // What the page saw, printed when a test fails (it told the ERR_NETWORK_CHANGED above): its console,
    // and requests that failed.
    page.on('console', (m) => seen.push(`console.${m.type()}: ${m.text()}`));
    page.on('requestfailed', (r) => seen.push(`request failed: ${r.method()} ${r.url()}: ${r.failure()?.errorText}`));
    page.on('crash', () => seen.push('the page crashed'));
  });

  afterEach((t) => {
    if (t.passed === false) console.log(`what the page saw:\n${seen.slice(-50).join('\n')}`);
  });

  after(async () => {
    await apart?.close();
    await server?.close();
  });

  it('shows why an app does not serve: replicas that cannot start, or no public function', async () => {
    await page.goto(`${site}/#token=${auth.token}`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor();
    const boom = page.locator('article[data-app="boom"]');
    await boom.locator('.app-state', { hasText: 'cannot start' }).waitFor({ timeout: 15_000 });
    const problem = (await boom.locator('.card-problem').textContent()) ?? '';
    assert.match(problem, /cannot start/);
    assert.match(problem, /kaboom at load/);
    assert.doesNotMatch((await boom.textContent()) ?? '', /scaled to zero/);

    const nofn = page.locator('article[data-app="nofn"]');
    await nofn.locator('.app-state', { hasText: 'no public function' }).waitFor({ timeout: 15_000 });
    assert.match((await nofn.locator('.card-problem').textContent()) ?? '', /No public function/);
    assert.equal((await nofn.locator('dd.functions').textContent())?.trim(), 'none');
    assert.equal((await boom.locator('dd.functions').textContent())?.trim(), 'run');
  });

  it('shows the error of a failed build in the builds table', async () => {
    await page.evaluate(() => {
      document.location.hash = '#/apps/broken/builds';
    });
    await page.getByRole('heading', { level: 1, name: 'Builds of broken' }).waitFor();
    await page.getByRole('columnheader', { name: 'Error' }).waitFor();
    const build = await http(`${server.url}/v2/projects/${auth.projectId}/apps/broken/builds`, { token: auth.token });
    const error = String(build.json.builds[0].error);
    assert.ok(error.length > 0);
    const cell = page.locator(`tr[data-build-id="${build.json.builds[0].id}"] td.build-error`);
    await cell.waitFor();
    assert.equal((await cell.textContent())?.trim(), error);
  });

  it('shows no placeholder in the chart hover boxes of an app without runs', async () => {
    await page.evaluate(() => {
      document.location.hash = '#/apps/nofn/charts';
    });
    await page.getByRole('heading', { level: 1, name: 'Charts of nofn' }).waitFor();
    await waitFor(async () => (await page.locator('.uplot canvas').count()) === 3, 15_000, 'three charts');
    const legends = async () =>
      page
        .locator('.chart')
        .evaluateAll((figures) =>
          figures.map((f) => [...f.querySelectorAll('.u-legend, .legend')].map((l) => l.textContent).join(' ')),
        );
    const placeholder = /--|—|\bundefined\b|\bnull\b|NaN/;
    for (const text of await legends()) assert.doesNotMatch(text, placeholder, text);
    assert.match((await legends()).join(' '), /no finished runs/);
    // With the pointer over each plot: the hover box shows the minute under it, in words when it is empty.
    for (const over of await page.locator('.u-over').all()) {
      const box = await over.boundingBox();
      assert.ok(box);
      await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
      for (const text of await legends()) assert.doesNotMatch(text, placeholder, text);
    }
  });

  it('takes a sign-in link opened in a tab that already shows the dashboard', async () => {
    await page.evaluate(() => {
      document.location.hash = '#/apps';
    });
    await page.locator('article[data-app="boom"]').waitFor();
    // Same document, new fragment: no reload, only a hashchange.
    await page.goto(`${site}/#token=${second.token}`);
    await waitFor(
      async () => ((await page.locator('#project').textContent()) ?? '').includes(second.projectId),
      15_000,
      'the project of the new link',
    );
    assert.ok(!page.url().includes(second.token), page.url());
    assert.ok(page.url().endsWith('/#/apps'), page.url());
    assert.equal(await page.evaluate(() => sessionStorage.getItem('ferry.token')), second.token);
    await page.getByText('No apps yet').first().waitFor();
    assert.equal(await page.locator('article[data-app="boom"]').count(), 0, 'the other project’s apps are gone');
    assert.deepEqual(problems, []);
  });
});
