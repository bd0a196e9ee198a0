#!/usr/bin/env node
// The `ferry` command. The TypeScript sources are compiled to dist/ by `npm install` (the prepare script).
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const entry = new URL('../dist/src/cli/index.js', import.meta.url);
if (!existsSync(fileURLToPath(entry))) {
  process.stderr.write('ferry: dist/ is missing; run `npm install` (or `npm run build`) in the Ferry folder first.\n');
  process.exit(1);
}
await import(entry.href);
