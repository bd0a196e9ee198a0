#!/usr/bin/env node
// The `ferry` command. The TypeScript sources are compiled to dist/ by `npm install` (the prepare script).
import { existsSync, readFileSync, statSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const entry = new URL('../dist/src/cli/index.js', import.meta.url);
if (!existsSync(fileURLToPath(entry))) {
  process.stderr.write('ferry: dist/ is missing; run `npm install` (or `npm run build`) in the Ferry folder first.\n');
  process.exit(1);
}

// The bundle (scripts/bundle.mjs, made by `npm run build`) starts in about half the CPU of the ~1000
// modules of dist/src. It is run only when made from the dist/src there is now (a `tsc` alone leaves it
// stale), and not with FERRY_NO_BUNDLE=1. Its stack traces are mapped back to src/ through its source map.
const bundle = new URL('../dist/bundle/index.js', import.meta.url);
function bundleIsCurrent() {
  if (process.env.FERRY_NO_BUNDLE === '1') return false;
  try {
    const madeFrom = Number(readFileSync(new URL('../dist/bundle/made-from', import.meta.url), 'utf8'));
    return statSync(entry).mtimeMs <= madeFrom && existsSync(bundle);
  } catch {
    return false;
  }
}
if (bundleIsCurrent()) {
  process.setSourceMapsEnabled(true);
  await import(bundle.href);
} else {
  await import(entry.href);
}
