#!/usr/bin/env node
import { spawnSync } from 'node:child_process';
// Runs the compiled test files under dist/test with Node's own test runner (spec reporter, so the run
// ends with its summary). `npm test` builds first. Pass file name fragments to run only some:
//   npm run test:only -- zip auth
import { readdirSync } from 'node:fs';
import path from 'node:path';

const root = path.resolve(import.meta.dirname, '..', 'dist', 'test');
const filters = process.argv.slice(2);
const files = readdirSync(root, { recursive: true })
  .map(String)
  .filter((f) => f.endsWith('.test.js'))
  .filter((f) => filters.length === 0 || filters.some((x) => f.includes(x)))
  .sort()
  .map((f) => path.join(root, f));
if (files.length === 0) {
  console.error('no test files matched');
  process.exit(1);
}
const result = spawnSync(
  process.execPath,
  ['--enable-source-maps', '--test', '--test-reporter=spec', '--test-concurrency=2', ...files],
  { stdio: 'inherit' },
);
process.exit(result.status ?? 1);
