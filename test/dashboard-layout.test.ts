/**
 * The dashboard's layout measured in Debian's headless Chromium against a real server (issue 43, point 9),
 * at a laptop's width (1366 × 768) and a phone's (390 × 844): a failed build's coded error and a run's
 * attempts wrap between words, never inside a code like `FERRY_IMAGE_REGISTRY_BLOCKED`, in a block as
 * wide as the page; the builds table's error shows whole lines and its action buttons line up; the Cluster
 * table shows its last column; the tab bars show every tab. Each check is a measurement of the laid-out
 * page (client rects, scroll widths), and each page is kept as a screenshot in test-output/screenshots/.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { after, afterEach, before, describe, it } from 'node:test';
import type { Locator, Page } from 'playwright-core';
import { type ApartBrowser, launchChromiumApart } from './helpers/browser.js';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';

// page.evaluate callbacks run in the browser; this project compiles without the DOM library.
// biome-ignore lint/suspicious/noExplicitAny: browser globals, checked by the browser itself
declare const document: any, NodeFilter: any, getComputedStyle: any;

const SHOTS = path.join(REPO_ROOT, 'test-output', 'screenshots');
/** How long to wait for something to show (Playwright's own default; a busy machine slows Chromium). */
const PAGE_WAIT_MS = 30_000;
/** Loopback is refused as a registry unless listed: the build fails at once, with a long coded error. */
const BLOCKED_BASE = '127.0.0.1:9/ferry-test/an-image-with-a-rather-long-name-for-the-layout-test:1';
const BUILD_CODE = 'FERRY_IMAGE_REGISTRY_BLOCKED';
const RUN_CODE = 'FERRY_FUNCTION_ERROR';

const WIDTHS = [
  { width: 1366, height: 768 },
  { width: 390, height: 844 },
] as const;

/**
 * How many lines `text` spans inside the element, the most of any place it occurs: the client rects of a
 * range over exactly its characters (through as many text nodes as it takes), grouped by line. Asked again
 * while the answer is 0 (the text not there yet, or its element replaced by a refresh between finding it
 * and measuring it).
 */
async function linesOf(element: Locator, text: string): Promise<number> {
  const measure = () =>
    element.evaluate((root, wanted) => {
      const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
      const nodes: { node: { data: string }; start: number }[] = [];
      let all = '';
      while (walker.nextNode()) {
        nodes.push({ node: walker.currentNode, start: all.length });
        all += walker.currentNode.data;
      }
      let most = 0;
      for (let at = all.indexOf(wanted); at >= 0; at = all.indexOf(wanted, at + wanted.length)) {
        const tops: number[] = [];
        for (const { node, start } of nodes) {
          const from = Math.max(at, start);
          const to = Math.min(at + wanted.length, start + node.data.length);
          if (from >= to) continue;
          const range = document.createRange();
          range.setStart(node, from - start);
          range.setEnd(node, to - start);
          for (const rect of range.getClientRects()) if (rect.width > 0) tops.push(rect.top);
        }
        // Rects on one line share their top within a few pixels (a code's smaller font sits a little lower).
        const lines: number[] = [];
        for (const top of tops.sort((a, b) => a - b)) {
          if (lines.every((line) => Math.abs(line - top) > 6)) lines.push(top);
        }
        most = Math.max(most, lines.length);
      }
      return most;
    }, text);
  return waitFor(async () => (await measure()) || undefined, PAGE_WAIT_MS, `${text} laid out`);
}

/** The width of the content box of `main`, the column every page lays out in. */
async function contentWidth(page: Page): Promise<number> {
  return page.locator('main').evaluate((main) => {
    const style = getComputedStyle(main);
    return main.clientWidth - Number.parseFloat(style.paddingLeft) - Number.parseFloat(style.paddingRight);
  });
}

/** The `dd` of a fact (`dl.facts`) by its name. */
function fact(page: Page, name: string): Locator {
  return page
    .locator('dl.facts > div')
    .filter({ has: page.locator('dt', { hasText: name }) })
    .locator('dd');
}

describe('dashboard layout at 1366 and 390 px (issue 43)', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let apart: ApartBrowser | undefined;
  let page: Page;
  let failedId = '';
  let readyId = '';
  let runId = '';
  const problems: string[] = [];
  const seen: string[] = [];

  const go = async (hash: string, heading: string | RegExp) => {
    await page.evaluate((h) => {
      document.location.hash = h;
    }, hash);
    await page.getByRole('heading', { level: 1, name: heading }).waitFor({ timeout: PAGE_WAIT_MS });
  };
  const shot = (name: string) => page.screenshot({ path: path.join(SHOTS, `${name}.png`), fullPage: true });

  before(async () => {
    fs.mkdirSync(SHOTS, { recursive: true });
    server = await startServer();
    auth = await server.bootstrap();
    const files = {
      'ferry.toml': '[app]\nname = "layout"\n[retries]\nmax_attempts = 2\ninitial_delay = 1\non = ["failure"]\n',
      'main.ts': "export function run() { return 1; }\nexport function fail() { throw new Error('no luck'); }\n",
    };
    // Two ready builds (the older offers Activate and Delete, the active one nothing), then a failed one.
    readyId = (await deployFiles(server, auth, 'layout', files)).id;
    await deployFiles(server, auth, 'layout', { ...files, 'main.ts': `${files['main.ts']}// v2\n` });
    const failed = await deployFiles(
      server,
      auth,
      'layout',
      { ...files, 'ferry.toml': `[app]\nname = "layout"\n[image]\nbase = "${BLOCKED_BASE}"\n` },
      { expect: 'failed' },
    );
    failedId = failed.id;
    const error = (
      await http(`${server.url}/v2/projects/${auth.projectId}/apps/layout/builds/${failedId}`, {
        token: auth.token,
      })
    ).json.error as string;
    assert.ok(error.startsWith(`${BUILD_CODE}: `), error);
    assert.ok(error.length > 200, error);
    // An async run that fails on both its attempts: its page lists them with their codes.
    const call = await http(`${server.url}/v4/${auth.projectId}/layout/fail?async=true`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(call.status, 202, call.text);
    runId = call.json.run_id;
    await waitFor(
      async () => {
        const run = await http(`${server.url}/v2/projects/${auth.projectId}/apps/layout/runs/${runId}`, {
          token: auth.token,
        });
        return run.json.state === 'failure' && run.json.attempt_history?.length === 2;
      },
      90_000,
      'the run to fail twice',
    );
    apart = await launchChromiumApart(server.url);
    const context = await apart.browser.newContext({ viewport: WIDTHS[0] });
    page = await context.newPage();
    page.on('pageerror', (err) => problems.push(String(err)));
    page.on('console', (m) => {
      seen.push(`console.${m.type()}: ${m.text()}`);
      if (m.type() === 'error') problems.push(m.text());
    });
    page.on('requestfailed', (r) => seen.push(`request failed: ${r.method()} ${r.url()}: ${r.failure()?.errorText}`));
    await page.goto(`${apart.site}/#token=${auth.token}`);
    await page.getByRole('heading', { level: 1, name: 'Apps' }).waitFor({ timeout: PAGE_WAIT_MS });
  });

  afterEach((t) => {
    if (t.passed === false) console.log(`what the page saw:\n${seen.slice(-50).join('\n')}`);
  });

  after(async () => {
    await apart?.close();
    await server?.close();
  });

  for (const { width, height } of WIDTHS) {
    describe(`at ${width} × ${height}`, () => {
      before(async () => {
        await page.setViewportSize({ width, height });
      });

      it('shows a failed build’s error wide, wrapped between words, its codes whole', async () => {
        await go(`#/apps/layout/builds/${failedId}`, /^Build /);
        // The summary is drawn again when the log has been read to its end; measured after that.
        await page.getByText('The build is failed.').waitFor({ timeout: PAGE_WAIT_MS });
        const error = fact(page, 'Error');
        await error.waitFor({ timeout: PAGE_WAIT_MS });
        for (const code of [BUILD_CODE, 'FERRY_INSECURE_REGISTRIES', 'FERRY_REGISTRY_ALLOW']) {
          assert.equal(await linesOf(error, code), 1, `${code} on one line`);
        }
        const share = ((await error.boundingBox())?.width ?? 0) / (await contentWidth(page));
        assert.ok(share >= 0.6, `the error takes ${Math.round(share * 100)}% of the page's width`);
        await shot(`layout-build-${width}`);
      });

      it('shows a run’s attempts and reason wide, their codes whole', async () => {
        await go(`#/apps/layout/runs/${runId}`, /^Run /);
        const attempts = fact(page, 'Attempts');
        await attempts.waitFor({ timeout: PAGE_WAIT_MS });
        await page.locator('pre.error').waitFor({ timeout: PAGE_WAIT_MS });
        const text = (await attempts.textContent()) ?? '';
        assert.equal(text.split(RUN_CODE).length - 1, 2, text);
        // Both codes of the attempts, and the reason's.
        assert.equal(await linesOf(attempts, RUN_CODE), 1, `${RUN_CODE} of the attempts on one line`);
        assert.equal(await linesOf(fact(page, 'Reason'), RUN_CODE), 1, `${RUN_CODE} of the reason on one line`);
        const share = ((await attempts.boundingBox())?.width ?? 0) / (await contentWidth(page));
        assert.ok(share >= 0.6, `the attempts take ${Math.round(share * 100)}% of the page's width`);
        await shot(`layout-run-${width}`);
      });

      it('shows the builds table’s errors in whole lines and its action buttons in line', async () => {
        await go('#/apps/layout/builds', 'Builds of layout');
        const row = page.locator(`tr[data-build-id="${failedId}"]`);
        await row.waitFor({ timeout: PAGE_WAIT_MS });
        await page.locator(`tr[data-build-id="${readyId}"] button`).first().waitFor({ timeout: PAGE_WAIT_MS });
        const error = row.locator('td.build-error .error-text');
        // Wrapped, not cut at the cell's edge (up to three lines; the build's page has the rest), and its
        // code whole.
        const lines = await linesOf(error, BUILD_CODE);
        const cut = await error.evaluate((el) => el.scrollWidth - el.clientWidth);
        assert.ok(lines === 1 && cut <= 1, `${BUILD_CODE} on ${lines} lines, the error cut ${cut}px short`);
        // A row's buttons side by side, and the same action at the same x in every row: Delete under
        // Delete, with or without an Activate before it.
        const { lefts, stacked } = await page.locator('table tbody tr').evaluateAll((rows) => {
          const out: Record<string, number[]> = {};
          let stacked = 0;
          for (const tr of rows) {
            const tops: number[] = [];
            for (const button of tr.querySelectorAll('td:last-child button')) {
              const box = button.getBoundingClientRect();
              const xs = out[button.textContent] ?? [];
              xs.push(Math.round(box.left));
              out[button.textContent] = xs;
              tops.push(box.top);
            }
            if (tops.length > 0 && Math.max(...tops) - Math.min(...tops) > 2) stacked++;
          }
          return { lefts: out, stacked };
        });
        assert.equal(lefts.Delete?.length, 2, JSON.stringify(lefts));
        assert.equal(lefts.Activate?.length, 1, JSON.stringify(lefts));
        const spread = Object.values(lefts).map((xs) => Math.max(...xs) - Math.min(...xs));
        assert.ok(
          stacked === 0 && spread.every((px) => px <= 2),
          `${stacked} rows with buttons one above the other; buttons start at x ${JSON.stringify(lefts)}`,
        );
        // Each action cell is a cell of the Actions column, under its heading.
        const columns = await page.locator('table').evaluate((table) => {
          const head = [...table.querySelectorAll('thead th')].at(-1).getBoundingClientRect();
          return [...table.querySelectorAll('tbody td:last-child')].map((td) => {
            const r = td.getBoundingClientRect();
            return { display: getComputedStyle(td).display, left: r.left - head.left, right: r.right - head.right };
          });
        });
        for (const cell of columns) {
          assert.ok(
            cell.display === 'table-cell' && Math.abs(cell.left) <= 1 && Math.abs(cell.right) <= 1,
            JSON.stringify(cell),
          );
        }
        if (width >= 1366) {
          // At a laptop's width the whole table fits: nothing to scroll sideways for the Actions.
          const wrap = page.locator('.table-wrap');
          const hidden = await wrap.evaluate((el) => el.scrollWidth - el.clientWidth);
          assert.ok(hidden <= 0, `the builds table hides ${hidden}px to the right`);
        }
        await shot(`layout-builds-${width}`);
      });

      it('shows the Cluster table’s last column', async () => {
        await go('#/apps', 'Apps');
        const table = page.locator('table.cluster-nodes');
        const last = table.locator('tbody tr').first().locator('td').last();
        await last.waitFor({ timeout: PAGE_WAIT_MS });
        await waitFor(async () => ((await last.textContent()) ?? '').trim() !== '', PAGE_WAIT_MS, 'the node row');
        const measured = await table.evaluate((el) => {
          const wrap = el.closest('.table-wrap');
          const box = wrap.getBoundingClientRect();
          const cells = [...el.querySelectorAll('tbody tr:first-child td')];
          const head = [...el.querySelectorAll('thead th')];
          const visible = (r: { left: number; right: number; width: number }) =>
            r.width > 0 && r.left >= box.left - 1 && r.right <= box.right + 1;
          return {
            scrolls: wrap.scrollWidth - wrap.clientWidth,
            page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
            lastCell: visible(cells.at(-1).getBoundingClientRect()),
            // On a phone the head may give way to a label in each cell; when it shows, it shows whole.
            lastHead:
              getComputedStyle(el.querySelector('thead')).display === 'none' ||
              visible(head.at(-1).getBoundingClientRect()),
          };
        });
        assert.deepEqual(measured, { scrolls: 0, page: 0, lastCell: true, lastHead: true });
        // The apps of a node break between names, never inside one.
        const apps = table.locator('tbody tr').first().locator('td').nth(7);
        assert.equal(await linesOf(apps, 'layout'), 1, 'the app name on one line');
        await shot(`layout-cluster-${width}`);
      });

      it('shows every tab of both tab bars', async () => {
        await go('#/apps/layout/builds', 'Builds of layout');
        const bars = [page.locator('#nav'), page.locator('nav.tabs')];
        const names: string[] = [];
        for (const bar of bars) {
          const measured = await bar.evaluate((nav) => ({
            scrolls: nav.scrollWidth - nav.clientWidth,
            hidden: [...nav.querySelectorAll('a')]
              .filter((a) => {
                const r = a.getBoundingClientRect();
                const box = nav.getBoundingClientRect();
                return !(
                  r.width > 0 &&
                  r.left >= Math.max(0, box.left) - 1 &&
                  r.right <= Math.min(document.documentElement.clientWidth, box.right) + 1
                );
              })
              .map((a) => a.textContent),
            names: [...nav.querySelectorAll('a')].map((a) => a.textContent),
          }));
          names.push(...measured.names);
          assert.deepEqual({ scrolls: measured.scrolls, hidden: measured.hidden }, { scrolls: 0, hidden: [] });
        }
        for (const tab of ['Secrets', 'Volumes', 'Schedules', 'Settings']) assert.ok(names.includes(tab), tab);
        await shot(`layout-tabs-${width}`);
      });
    });
  }

  it('logged no error in the page', () => {
    assert.deepEqual(problems, []);
  });
});
