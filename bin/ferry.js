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
// stale), and not with FERRY_NO_BUNDLE=1. Its stack traces name the functions and the bundle's lines;
// source maps are not turned on here: Node reads them at load (+34 MiB) and parses them at the first stack
// it formats (+51 MiB, 83 ms), in every process. NODE_OPTIONS=--enable-source-maps maps them to src/*.ts.
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
await import(bundleIsCurrent() ? bundle.href : entry.href);
