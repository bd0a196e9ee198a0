/** Keeps src/errors.ts and docs/errors.md in step: every code documented with its status, no stale entries. */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { it } from 'node:test';
import { ERRORS } from '../src/errors.js';
import { REPO_ROOT } from './helpers/ferry.js';

it('docs/errors.md documents every error code with its status, and nothing else', async () => {
  const doc = await fs.readFile(path.join(REPO_ROOT, 'docs', 'errors.md'), 'utf8');
  const rows = new Map<string, number>();
  for (const match of doc.matchAll(/^\| `(FERRY_[A-Z_]+)`\s*\| (\d{3})\s*\|/gm)) rows.set(match[1]!, Number(match[2]));
  for (const [code, { status }] of Object.entries(ERRORS)) {
    assert.equal(rows.get(code), status, `${code} (${status}) is missing from docs/errors.md or has another status`);
  }
  for (const code of rows.keys())
    assert.ok(code in ERRORS, `docs/errors.md lists ${code}, which src/errors.ts does not have`);
});
