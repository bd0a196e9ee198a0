#!/usr/bin/env node
import { execFileSync } from 'node:child_process';
// Bundles the compiled command (dist/src/cli/index.js and all it imports, dependencies included) into
// dist/bundle/ with esbuild, one chunk per lazily loaded command, so that a `ferry` process loads a few
// large files instead of about a thousand modules: `ferry serve` is ready in about half the CPU (1.4 s to
// 0.6 s here), which every worker, gateway and test process started pays. bin/ferry.js runs the bundle
// when it is as new as dist/src (see there); `npm run build` makes both. How a bundle keeps each module's
// own location, and what stays outside it: scripts/esbuild-node.mjs. Stack traces name functions and
// bundle lines; the source map (through tsc's maps) leads them back to src/*.ts under
// NODE_OPTIONS=--enable-source-maps (off by default: it costs memory, bin/ferry.js says).
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as esbuild from 'esbuild';
import { bundleForNode } from './esbuild-node.mjs';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const outdir = path.join(root, 'dist', 'bundle');
const entry = path.join(root, 'dist', 'src', 'cli', 'index.js');

const started = Date.now();
const { files, bytes } = await bundleForNode({ entryPoints: [entry], outdir });
// What bin/ferry.js compares with dist/src: tsc writes every file of dist/src on each run, so the entry's
// time tells whether dist/src changed since.
await fs.writeFile(path.join(outdir, 'made-from'), String((await fs.stat(entry)).mtimeMs));
console.log(
  `bundle: ${files} files, ${(bytes / 1024 / 1024).toFixed(1)} MiB with maps, in ${Date.now() - started} ms (dist/bundle)`,
);

// The worker over untrusted image layers (src/images/layer-worker.ts: unpacking, a build step's diff),
// bundled alone into one CommonJS file with what it imports: Ferry hands it to its sandbox as data (src/sandbox/tree-sandbox.ts), which then needs
// nothing of Ferry's install, not even node_modules.
const tools = path.join(root, 'dist', 'tools');
await fs.mkdir(tools, { recursive: true });
await esbuild.build({
  entryPoints: [path.join(root, 'dist', 'src', 'images', 'layer-worker.js')],
  outfile: path.join(tools, 'layer-worker.cjs'),
  bundle: true,
  format: 'cjs',
  platform: 'node',
  target: 'node20',
  logLevel: 'warning',
});

// The commit the build was made from, for what runs without the checkout's .git (a kit carried to a bare
// host: bench/lib.mjs's machine report). Nothing when this is not a git checkout.
try {
  let commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: root, encoding: 'utf8' }).trim();
  if (execFileSync('git', ['status', '--porcelain', '--', 'src'], { cwd: root, encoding: 'utf8' }).trim()) {
    commit += ' (src/ had uncommitted changes)';
  }
  await fs.writeFile(
    path.join(root, 'dist', 'build-info.json'),
    `${JSON.stringify({ commit, builtAt: new Date().toISOString() })}\n`,
  );
} catch {
  await fs.rm(path.join(root, 'dist', 'build-info.json'), { force: true });
}
