/**
 * A sandbox's private /tmp never hides what the sandbox binds under /tmp (issue 43): with Node installed
 * under /tmp, a build step answered `bwrap: execvp /tmp/.../node: No such file or directory`, because its
 * /tmp tmpfs was mounted after the bind of Node's folder (bwrap mounts in the order it is told). Now the
 * tmpfs comes before every bind (sandbox/launch.ts `baseBwrapArgs`, and the unpacker's sandbox,
 * sandbox/tree-sandbox.ts).
 *
 * Real parts: this machine's Node binary, linked (or copied) into a folder under /tmp, runs a child that
 * starts a real build step (sandbox/build-step.ts `runBuildStep`, as the builders do) whose command is that
 * same Node, in the real bubblewrap sandbox (as root: as its own unprivileged uid).
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { pathToFileURL } from 'node:url';
import { REPO_ROOT } from './helpers/ferry.js';

/** The child: one build step whose command is the Node it runs on, under /tmp. Prints its outcome as JSON. */
const CHILD = (dist: string) => `
import fs from 'node:fs/promises';
import path from 'node:path';
const { DEFAULT_BUILD_LIMITS, runBuildStep } = await import(${JSON.stringify(pathToFileURL(path.join(dist, 'sandbox', 'build-step.js')).href)});
const { detectSandbox } = await import(${JSON.stringify(pathToFileURL(path.join(dist, 'sandbox', 'launch.js')).href)});
const { createLoopbackOnlyNetwork } = await import(${JSON.stringify(pathToFileURL(path.join(dist, 'sandbox', 'network.js')).href)});
const work = process.argv[2];
const caps = await detectSandbox();
const lines = [];
const ctx = {
  buildId: 'tmp-binds',
  sourceDir: path.join(work, 'source'),
  outputDir: path.join(work, 'out'),
  cacheDir: path.join(work, 'cache'),
  sandbox: { caps, network: createLoopbackOnlyNetwork(), limits: DEFAULT_BUILD_LIMITS },
  signal: new AbortController().signal,
};
for (const dir of [ctx.sourceDir, ctx.outputDir, ctx.cacheDir]) await fs.mkdir(dir, { recursive: true });
const exit = await runBuildStep(ctx, {
  label: 'node under /tmp',
  command: [process.execPath, '-e', 'console.log("ran " + process.execPath)'],
  env: { PATH: '/usr/bin:/bin' },
  cwd: '/app/source',
  onLine: (stream, line) => lines.push(stream + ': ' + line),
});
console.log(JSON.stringify({ sandboxed: caps.bwrap !== null, execPath: process.execPath, code: exit.code, lines }));
`;

function run(file: string, args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(file, args, { timeout: 120_000, maxBuffer: 4 * 1024 * 1024 }, (err, stdout, stderr) => {
      const code = err ? (typeof err.code === 'number' ? err.code : 1) : 0;
      resolve({ code, stdout, stderr });
    });
  });
}

describe('a sandbox’s /tmp and binds under /tmp', () => {
  let top: string;
  let node: string;
  before(async () => {
    // /tmp itself, whatever TMPDIR says: the bug is about the sandbox's /tmp.
    top = await fs.mkdtemp('/tmp/ferry-tmp-node-');
    // Searchable by others: as root, the step's own uid must reach Node there, as it would a real install.
    await fs.chmod(top, 0o755);
    await fs.mkdir(path.join(top, 'bin'), { mode: 0o755 });
    node = path.join(top, 'bin', 'node');
    const real = await fs.realpath(process.execPath);
    await fs.link(real, node).catch(() => fs.copyFile(real, node));
    await fs.chmod(node, 0o755);
  });
  after(async () => {
    await fs.rm(top, { recursive: true, force: true });
  });

  it('a build step runs the Node installed under /tmp', async () => {
    const script = path.join(top, 'child.mjs');
    await fs.writeFile(script, CHILD(path.join(REPO_ROOT, 'dist', 'src')));
    const work = path.join(top, 'work');
    await fs.mkdir(work, { mode: 0o755 });
    const res = await run(node, [script, work]);
    assert.equal(res.code, 0, `${res.stdout}\n${res.stderr}`);
    const out = JSON.parse(res.stdout.trim().split('\n').pop() ?? '{}') as {
      sandboxed: boolean;
      execPath: string;
      code: number | null;
      lines: string[];
    };
    assert.equal(out.sandboxed, true, 'the step ran in the sandbox (bubblewrap is needed here)');
    assert.ok(out.execPath.startsWith('/tmp/'), out.execPath);
    assert.equal(out.code, 0, out.lines.join('\n'));
    assert.deepEqual(out.lines, [`stdout: ran ${out.execPath}`]);
  });
});
