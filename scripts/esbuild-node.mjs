// What scripts/bundle.mjs (the `ferry` command) and scripts/bundle-tests.mjs (the test files) share: an
// esbuild bundle of compiled modules for Node.js in which every module still finds files where it was
// compiled to, not next to the bundle.
//
// - A module that finds files next to itself (`new URL('./bootstrap.js', import.meta.url)`, a test's
//   fixtures, a CommonJS package's `__dirname`) would look in the bundle's folder: `import.meta.url`,
//   `import.meta.dirname`, `__dirname` and `__filename` are replaced in each module by its own original
//   location, so runtime files, the dashboard's assets, fixtures and packages' own files are found where
//   they are.
// - Packages that start workers or binaries from their own folder (pino's transports, esbuild) and
//   native ones (better-sqlite3) stay outside, loaded from node_modules as before.
// - The source map leads through tsc's maps back to the .ts files (Node's --enable-source-maps).
import fs from 'node:fs/promises';
import path from 'node:path';
import * as esbuild from 'esbuild';

/** Packages never bundled: each loads files of its own folder, or is native. */
export const EXTERNAL = ['better-sqlite3', 'esbuild', 'pino', 'pino-pretty', 'thread-stream', 'pg-native'];

/** The esbuild plugin that keeps each module's own location (see the header). */
function originalLocations(outdir) {
  return {
    name: 'original-locations',
    setup(build) {
      build.onLoad({ filter: /\.(m?js|cjs)$/ }, async (args) => {
        const text = await fs.readFile(args.path, 'utf8');
        const usesMeta = text.includes('import.meta.url') || text.includes('import.meta.dirname');
        const usesDir = /\b__(dirname|filename)\b/.test(text);
        if (!usesMeta && !usesDir) return undefined;
        const rel = path.relative(outdir, args.path).split(path.sep).join('/');
        const here = `new URL(${JSON.stringify(rel)}, import.meta.url)`;
        // CommonJS modules are wrapped in a function by esbuild: their own names shadow nothing else.
        const commonJs = !/^\s*(import|export)\b/m.test(text);
        let contents = text;
        if (usesMeta && !commonJs) {
          // In code only, never in strings (the Node builder writes `import.meta.url` into user bundles).
          const define = { 'import.meta.url': '__ferryModuleUrl', 'import.meta.dirname': '__ferryModuleDir' };
          contents = (await esbuild.transform(text, { define, format: 'esm' })).code;
          contents = `const __ferryModuleUrl = ${here}.href; const __ferryModuleDir = __ferryDirname(__ferryFileURLToPath(__ferryModuleUrl));\n${contents}`;
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
}

/**
 * Bundles `entryPoints` (compiled .js files) into `outdir`, one output per entry named by its path under
 * `outbase`, shared code in chunks. Returns the number of .js files written and their bytes with maps.
 */
export async function bundleForNode({ entryPoints, outdir, outbase, external = [] }) {
  await fs.rm(outdir, { recursive: true, force: true });
  const result = await esbuild.build({
    entryPoints,
    outdir,
    outbase,
    bundle: true,
    splitting: true,
    format: 'esm',
    platform: 'node',
    target: 'node20',
    sourcemap: 'linked',
    metafile: true,
    logLevel: 'warning',
    external: [...EXTERNAL, ...external],
    banner: {
      js: [
        "import { createRequire as __ferryCreateRequire } from 'node:module';",
        "import { fileURLToPath as __ferryFileURLToPath } from 'node:url';",
        "import { dirname as __ferryDirname, join as __ferryJoin } from 'node:path';",
        'const require = __ferryCreateRequire(import.meta.url);',
        'const __ferryBundleDir = __ferryDirname(__ferryFileURLToPath(import.meta.url));',
      ].join(' '),
    },
    plugins: [originalLocations(outdir)],
  });
  const outputs = Object.entries(result.metafile.outputs);
  return {
    files: outputs.filter(([f]) => f.endsWith('.js')).length,
    bytes: outputs.reduce((sum, [, o]) => sum + o.bytes, 0),
  };
}
