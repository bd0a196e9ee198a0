/**
 * The dashboard's files: a small single-page app of hand-written HTML, CSS and ES modules (no build step, no
 * bundler, no CDN), served by http/routes/dashboard.ts. The page signs in with a service-account token and
 * then uses the same `/v2` API as the CLI with that token: the server gives the dashboard no privileges of
 * its own.
 *
 * Files come from `src/dashboard/static` (the TypeScript build does not copy them), found relative to this
 * module both when it runs compiled (`dist/src/dashboard/assets.js`) and from source; uPlot comes from
 * `node_modules/uplot/dist` and is served under `/dashboard/vendor/`.
 */
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Logger } from 'pino';

/** Sent with every dashboard response: the page may load and call only its own origin. */
export const DASHBOARD_HEADERS: Readonly<Record<string, string>> = {
  'cache-control': 'no-cache',
  'content-security-policy':
    "default-src 'self'; connect-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'",
  'x-content-type-options': 'nosniff',
  'referrer-policy': 'no-referrer',
};

export const CONTENT_TYPES: Readonly<Record<string, string>> = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.svg': 'image/svg+xml',
  '.png': 'image/png',
  '.ico': 'image/x-icon',
};

/** The folder of the static files: next to this module from source, or in the repository from dist/. */
export function staticRoot(): string | undefined {
  const candidates = [
    new URL('./static/', import.meta.url),
    new URL('../../../src/dashboard/static/', import.meta.url),
  ];
  for (const candidate of candidates) {
    const dir = fileURLToPath(candidate);
    if (fs.existsSync(path.join(dir, 'index.html'))) return dir;
  }
  return undefined;
}

/** URL path (under /dashboard/) to file, for every file the dashboard serves; nothing else is reachable. */
export function dashboardAssets(logger: Pick<Logger, 'warn'>): Map<string, string> {
  const assets = new Map<string, string>();
  const root = staticRoot();
  if (root) {
    for (const name of fs.readdirSync(root, { recursive: true, encoding: 'utf8' })) {
      const file = path.join(root, name);
      if (!(path.extname(name) in CONTENT_TYPES) || !fs.statSync(file).isFile()) continue;
      assets.set(name.split(path.sep).join('/'), file);
    }
  } else {
    logger.warn('the dashboard files (src/dashboard/static) are missing; the dashboard is not served');
  }
  try {
    const require = createRequire(import.meta.url);
    assets.set('vendor/uPlot.esm.js', require.resolve('uplot/dist/uPlot.esm.js'));
    assets.set('vendor/uPlot.min.css', require.resolve('uplot/dist/uPlot.min.css'));
  } catch {
    logger.warn('uplot is not installed; the dashboard charts will not load');
  }
  return assets;
}
