#!/usr/bin/env node
import { spawnSync } from 'node:child_process';
// Runs the compiled test files under dist/test with Node's own test runner (spec reporter, so the run
// ends with its summary, which scripts/test-reporter.mjs precedes with the suite's wall time and its ten
// slowest files). `npm test` builds first. Pass file name fragments to run only some:
//   npm run test:only -- zip auth
// The files under dist/test/postgres/ run tests again on PostgreSQL (test/helpers/store.ts). When they are
// selected and PostgreSQL's port is closed, scripts/start-services.sh starts it first; if it cannot, the
// tests still run and the PostgreSQL ones fail saying why (they never skip).
//
// The selected files are first bundled with esbuild into dist/test-bundle/ (scripts/esbuild-node.mjs: each
// file with what it imports, Ferry's code and its dependencies, in a few large files), and run from there:
// a test process then starts in about 0.65 s less CPU than when it loads ~500 modules one by one, which
// over the suite's ~160 files is about a sixth of its CPU. The code tested is the same tsc output,
// bundled as `ferry` itself is (scripts/bundle.mjs), and failures still point at test/*.ts and src/*.ts
// through the source maps. FERRY_TEST_UNBUNDLED=1 runs dist/test/ as tsc wrote it.
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import { bundleForNode } from './esbuild-node.mjs';

const repo = path.resolve(import.meta.dirname, '..');
const compiled = path.join(repo, 'dist', 'test');
const unbundled = process.env.FERRY_TEST_UNBUNDLED === '1';
const root = unbundled ? compiled : path.join(repo, 'dist', 'test-bundle');
const filters = process.argv.slice(2);
// The files that take longest start first, so that none of them ends the run alone while the other slots
// are idle: scripts/test-times.tsv holds each file's own time in a full run (seconds first, the file last;
// `FERRY_TEST_TIMES=scripts/test-times.tsv npm run test:only` writes it anew). Files it does not name
// (new ones) follow, in name order.
const timesFile = path.join(repo, 'scripts', 'test-times.tsv');
/**
 * One name for a test file however it is written: `security/limits.test` for test/security/limits.test.ts
 * (the reporter's source-mapped name), dist/test/security/limits.test.js (tsc's), security/limits.test.js
 * (as selected below) and dist/test-bundle/042-security--limits.test.js (a bundle's). Until 2026-11-27 the
 * names in the file (`security/limits.test`) never matched the selected ones (`….test.js`), so no file was
 * ranked and the suite ran in name order.
 */
function testName(file) {
  return file
    .split(path.sep)
    .join('/')
    .replace(/^(dist\/)?(test-bundle\/\d+-|test\/)?/, '')
    .replace(/--/g, '/')
    .replace(/\.(ts|js)$/, '');
}
const seconds = new Map(
  (existsSync(timesFile) ? readFileSync(timesFile, 'utf8') : '')
    .split('\n')
    .filter((line) => line.trim() !== '')
    .map((line) => {
      const fields = line.split('\t');
      return [testName(fields[fields.length - 1]), Number(fields[0])];
    }),
);
const rank = (f) => -(seconds.get(testName(f)) ?? -1);
const selected = readdirSync(compiled, { recursive: true })
  .map(String)
  .filter((f) => f.endsWith('.test.js'))
  .filter((f) => filters.length === 0 || filters.some((x) => f.includes(x)))
  .sort()
  .sort((a, b) => rank(a) - rank(b));
if (selected.length === 0) {
  console.error('no test files matched');
  process.exit(1);
}
// Node's runner starts the files it is given in the order of their names, whatever order they are passed
// in; so each bundled file's name starts with its place in `selected` (longest first, as above).
// Unbundled, dist/test/ runs in name order.
const width = String(selected.length).length;
const bundled = selected.map((f, i) => ({
  in: path.join(compiled, f),
  out: `${String(i).padStart(width, '0')}-${f.replace(/\.js$/, '').split(path.sep).join('--')}`,
}));
if (!unbundled) {
  await bundleForNode({
    entryPoints: bundled,
    outdir: root,
    // Only the dashboard's browser tests load it, and it loads files of its own folder.
    external: ['playwright-core'],
  });
}
const files = unbundled ? selected.map((f) => path.join(root, f)) : bundled.map((b) => path.join(root, `${b.out}.js`));

/** Whether something accepts TCP connections at host:port (within 2 s). */
function portOpen(host, port) {
  return new Promise((resolve) => {
    const socket = net.connect({ host, port, timeout: 2000 });
    const done = (open) => {
      socket.destroy();
      resolve(open);
    };
    socket.once('connect', () => done(true));
    socket.once('timeout', () => done(false));
    socket.once('error', () => done(false));
  });
}

if (files.some((f) => f.includes(`${path.sep}postgres${path.sep}`))) {
  const admin = new URL(process.env.FERRY_TEST_PG_ADMIN_URL || 'postgres://postgres@127.0.0.1:5432/postgres');
  if (!(await portOpen(admin.hostname, Number(admin.port || 5432)))) {
    console.log(
      `PostgreSQL does not answer at ${admin.hostname}:${admin.port || 5432}: running scripts/start-services.sh`,
    );
    const started = spawnSync('bash', [path.join(repo, 'scripts', 'start-services.sh')], { stdio: 'inherit' });
    if (started.status !== 0)
      console.error('\nscripts/start-services.sh failed: the PostgreSQL tests will fail (see above why)\n');
  }
}

// Six files at a time on this 2-core machine (FERRY_TEST_CONCURRENCY sets another number). Most files
// spend most of their time waiting on real timers, sockets and child processes, not on the CPU. Measured
// on 2026-11-26, quiet machine, every test passing: from dist/test, 484 s four at a time and 400 s six at a
// time (570 s of CPU); bundled, 388 s six at a time (531 s of CPU) and 409 s eight at a time (the files
// then slow each other down more than they overlap).
const concurrency = Number(process.env.FERRY_TEST_CONCURRENCY) > 0 ? Number(process.env.FERRY_TEST_CONCURRENCY) : 6;

// Each file must end within this time (FERRY_TEST_FILE_TIMEOUT_S, default 600 s, twelve times the slowest
// file's quiet figure). A file that does not end (a test waiting forever, or a handle left open so its
// process never exits) then fails, named, with Node's "test timed out", and the run goes on; without it,
// one such file held the whole run until CI's limit, with no word of which file it was.
const fileTimeoutS =
  Number(process.env.FERRY_TEST_FILE_TIMEOUT_S) > 0 ? Number(process.env.FERRY_TEST_FILE_TIMEOUT_S) : 600;

const result = spawnSync(
  process.execPath,
  [
    '--enable-source-maps',
    '--test',
    // The spec reporter, with the suite's wall time and its ten slowest files just before the summary.
    `--test-reporter=${new URL('./test-reporter.mjs', import.meta.url).href}`,
    '--test-reporter-destination=stdout',
    `--test-concurrency=${concurrency}`,
    `--test-timeout=${fileTimeoutS * 1000}`,
    ...files,
  ],
  { stdio: 'inherit' },
);
process.exit(result.status ?? 1);
