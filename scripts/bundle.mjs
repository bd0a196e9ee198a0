#!/usr/bin/env node
// Bundles the compiled command (dist/src/cli/index.js and all it imports, dependencies included) into
// dist/bundle/ with esbuild, one chunk per lazily loaded command, so that a `ferry` process loads a few
// large files instead of about a thousand modules: `ferry serve` is ready in about half the CPU (1.4 s to
// 0.6 s here), which every worker, gateway and test process started pays. bin/ferry.js runs the bundle
// when it is as new as dist/src (see there); `npm run build` makes both.
//
// What a bundle changes, and how it is kept the same:
// - A module that finds files next to itself (`new URL('./bootstrap.js', import.meta.url)`, a CommonJS
//   package's `__dirname`) would look in dist/bundle/: `import.meta.url`, `__dirname` and `__filename` are
//   replaced in each module by its own original location, so runtime files, the dashboard's assets and
//   packages' own files are found where they are.
// - Packages that start workers or binaries from their own folder (pino's transports, esbuild) and
//   native ones (better-sqlite3) stay outside, loaded from node_modules as before.
// - Stack traces name functions and bundle lines; the source map (through tsc's maps) leads them back to
//   src/*.ts under NODE_OPTIONS=--enable-source-maps (off by default: it costs memory, bin/ferry.js says).
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as esbuild from 'esbuild';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const outdir = path.join(root, 'dist', 'bundle');
const entry = path.join(root, 'dist', 'src', 'cli', 'index.js');

/** `import.meta.url`, `__dirname`, `__filename` of each module: where the module itself is, not the bundle. */
const originalLocations = {
  name: 'original-locations',
  setup(build) {
    build.onLoad({ filter: /\.(m?js|cjs)$/ }, async (args) => {
      const text = await fs.readFile(args.path, 'utf8');
      const usesMeta = text.includes('import.meta.url');
      const usesDir = /\b__(dirname|filename)\b/.test(text);
      if (!usesMeta && !usesDir) return undefined;
      const rel = path.relative(outdir, args.path).split(path.sep).join('/');
      const here = `new URL(${JSON.stringify(rel)}, import.meta.url)`;
      // CommonJS modules are wrapped in a function by esbuild: their own names shadow nothing else.
      const commonJs = !/^\s*(import|export)\b/m.test(text);
      let contents = text;
      if (usesMeta && !commonJs) {
        // In code only, never in strings (the Node builder writes `import.meta.url` into user bundles).
        contents = (await esbuild.transform(text, { define: { 'import.meta.url': '__ferryModuleUrl' }, format: 'esm' }))
          .code;
        contents = `const __ferryModuleUrl = ${here}.href;\n${contents}`;
      }
      if (usesDir && commonJs) {
        // No `import.meta` here: esbuild would take the module for an ES module, with no exports.
        const file = `__ferryJoin(__ferryBundleDir, ${JSON.stringify(rel)})`;
        const strict = /^\s*(['"])use strict\1;?/.exec(contents)?.[0] ?? '';
        contents = `${strict}${strict ? ';' : ''}var __filename = ${file}; var __dirname = __ferryDirname(__filename);\n${contents.slice(strict.length)}`;
      }
      return { contents, loader: 'js', resolveDir: path.dirname(args.path) };
    });
  },
};

await fs.rm(outdir, { recursive: true, force: true });
const started = Date.now();
const result = await esbuild.build({
  entryPoints: [entry],
  outdir,
  bundle: true,
  splitting: true,
  format: 'esm',
  platform: 'node',
  target: 'node20',
  sourcemap: 'linked',
  metafile: true,
  logLevel: 'warning',
  external: ['better-sqlite3', 'esbuild', 'pino', 'pino-pretty', 'thread-stream', 'pg-native'],
  banner: {
    js: [
      "import { createRequire as __ferryCreateRequire } from 'node:module';",
      "import { fileURLToPath as __ferryFileURLToPath } from 'node:url';",
      "import { dirname as __ferryDirname, join as __ferryJoin } from 'node:path';",
      'const require = __ferryCreateRequire(import.meta.url);',
      'const __ferryBundleDir = __ferryDirname(__ferryFileURLToPath(import.meta.url));',
    ].join(' '),
  },
  plugins: [originalLocations],
});
const bytes = Object.values(result.metafile.outputs).reduce((sum, o) => sum + o.bytes, 0);
const files = Object.keys(result.metafile.outputs).filter((f) => f.endsWith('.js')).length;
// What bin/ferry.js compares with dist/src: tsc writes every file of dist/src on each run, so the entry's
// time tells whether dist/src changed since.
await fs.writeFile(path.join(outdir, 'made-from'), String((await fs.stat(entry)).mtimeMs));
console.log(
  `bundle: ${files} files, ${(bytes / 1024 / 1024).toFixed(1)} MiB with maps, in ${Date.now() - started} ms (dist/bundle)`,
);
