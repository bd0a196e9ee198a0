/**
 * A harness for builder tests: temporary `<build>/{source,out}` workspaces copied from fixtures, a build
 * runner that records the log, outcome assertions, and checks that no child process outlived a build.
 * Call `buildHarness` at a test file's top level: it registers the before/after hooks of its temp folder.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before } from 'node:test';
import { parseAppConfig } from '../../src/apps/app-config.js';
import { BuildFailedError } from '../../src/builds/build-failed.js';
import type { Builder, BuildResult } from '../../src/builds/builder.js';
import { DEFAULT_BUILD_LIMITS } from '../../src/sandbox/build-step.js';
import { detectSandbox, probeSandbox, type SandboxCapabilities } from '../../src/sandbox/launch.js';
import { createLoopbackOnlyNetwork, type SandboxNetwork, type SandboxNetworkLease } from '../../src/sandbox/network.js';
import { REPO_ROOT } from './ferry.js';

/** Fixtures stay in the source tree (tests run compiled from dist/test). */
export const FIXTURES = path.join(REPO_ROOT, 'test', 'fixtures');

export interface Workspace {
  root: string;
  sourceDir: string;
  outputDir: string;
}

export interface Outcome {
  result?: BuildResult;
  error?: unknown;
  lines: string[];
  ms: number;
}

export interface BuildHarness {
  readonly tmpRoot: string;
  readonly cacheDir: string;
  /** A fresh workspace; `source` starts as a copy of the fixture (or empty), plus any extra files. */
  workspace(fixture: string | null, files?: Record<string, string | Buffer>): Promise<Workspace>;
  runBuild(
    ws: Workspace,
    opts?: {
      builder?: Builder;
      signal?: AbortSignal;
      onLog?: (line: string) => void;
      network?: SandboxNetwork;
      /** The sandbox's capabilities (default: this machine's, `detectSandbox()`); see `unsandboxed()`. */
      caps?: SandboxCapabilities;
    },
  ): Promise<Outcome>;
}

export function buildHarness(name: string, defaultBuilder: () => Builder): BuildHarness {
  let tmpRoot = '';
  let counter = 0;
  before(async () => {
    tmpRoot = await fs.mkdtemp(path.join(os.tmpdir(), `ferry-builder-${name}-`));
  });
  after(async () => {
    await fs.rm(tmpRoot, { recursive: true, force: true });
  });
  const harness: BuildHarness = {
    get tmpRoot() {
      return tmpRoot;
    },
    get cacheDir() {
      return path.join(tmpRoot, 'cache');
    },
    async workspace(fixture, files = {}) {
      counter += 1;
      const root = path.join(tmpRoot, `build-${counter}`);
      const sourceDir = path.join(root, 'source');
      const outputDir = path.join(root, 'out');
      await fs.mkdir(outputDir, { recursive: true });
      if (fixture) await fs.cp(path.join(FIXTURES, fixture), sourceDir, { recursive: true });
      else await fs.mkdir(sourceDir, { recursive: true });
      for (const [file, data] of Object.entries(files)) {
        await fs.mkdir(path.dirname(path.join(sourceDir, file)), { recursive: true });
        await fs.writeFile(path.join(sourceDir, file), data);
      }
      return { root, sourceDir, outputDir };
    },
    async runBuild(ws, opts = {}) {
      const config = parseAppConfig(await fs.readFile(path.join(ws.sourceDir, 'ferry.toml'), 'utf8'));
      const lines: string[] = [];
      const builder = opts.builder ?? defaultBuilder();
      const started = Date.now();
      try {
        const result = await builder.build({
          buildId: 'b_test',
          sourceDir: ws.sourceDir,
          outputDir: ws.outputDir,
          cacheDir: harness.cacheDir,
          sandbox: {
            caps: opts.caps ?? (await detectSandbox()),
            network: opts.network ?? createLoopbackOnlyNetwork(),
            limits: DEFAULT_BUILD_LIMITS,
          },
          config,
          log: (line) => {
            lines.push(line);
            opts.onLog?.(line);
          },
          signal: opts.signal ?? new AbortController().signal,
        });
        return { result, lines, ms: Date.now() - started };
      } catch (error) {
        return { error, lines, ms: Date.now() - started };
      }
    },
  };
  return harness;
}

let unsandboxedCaps: Promise<SandboxCapabilities> | undefined;

/** This machine's capabilities with bubblewrap switched off (FERRY_SANDBOX=off): steps run as plain processes. */
export function unsandboxed(): Promise<SandboxCapabilities> {
  unsandboxedCaps ??= probeSandbox({ ...process.env, FERRY_SANDBOX: 'off' });
  return unsandboxedCaps;
}

export function assertReady(outcome: Outcome): BuildResult {
  if (outcome.error) assert.fail(`build failed: ${String(outcome.error)}\n${outcome.lines.join('\n')}`);
  return outcome.result!;
}

export function assertFailed(outcome: Outcome, message: RegExp): BuildFailedError {
  assert.ok(outcome.error, `expected the build to fail; log:\n${outcome.lines.join('\n')}`);
  assert.ok(outcome.error instanceof BuildFailedError, `expected BuildFailedError, got ${String(outcome.error)}`);
  assert.match(outcome.error.message, message);
  return outcome.error;
}

/** Linux: true for a live process (a zombie counts as gone, since only its exit status is left). */
export function isAlive(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
  } catch {
    try {
      process.kill(pid, 0);
      return true;
    } catch {
      return false;
    }
  }
}

/** Live processes whose working folder is inside `dir` (what a package manager and its children would have). */
export async function processesIn(dir: string): Promise<number[]> {
  const real = await fs.realpath(dir);
  const found: number[] = [];
  for (const entry of await fs.readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    const cwd = await fs.readlink(`/proc/${entry}/cwd`).catch(() => null);
    if (cwd && (cwd === real || cwd.startsWith(`${real}/`)) && isAlive(Number(entry))) found.push(Number(entry));
  }
  return found;
}

/** Waits (at most 5 s) until none of `pids` is alive; fails naming those that are. */
export async function waitUntilGone(pids: number[]): Promise<void> {
  const end = Date.now() + 5_000;
  for (;;) {
    const alive = pids.filter(isAlive);
    if (alive.length === 0) return;
    if (Date.now() > end) assert.fail(`processes ${alive.join(', ')} are still running`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Live processes whose command line is exactly `args` (seen from the host, whatever namespace they are in). */
export async function processesWithArgs(args: string[]): Promise<number[]> {
  const wanted = `${args.join('\0')}\0`;
  const found: number[] = [];
  for (const entry of await fs.readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(entry)) continue;
    const cmdline = await fs.readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => null);
    if (cmdline === wanted && isAlive(Number(entry))) found.push(Number(entry));
  }
  return found;
}

/**
 * A network provider that lends every build step this test process's own network namespace (joined with
 * nsenter, as a real provider's namespace is), so a package manager in the sandbox reaches a registry
 * the test serves on 127.0.0.1. Needs root, as nsenter does.
 */
export function shareTestNetwork(): SandboxNetwork {
  const lease: SandboxNetworkLease = {
    netnsPath: `/proc/${process.pid}/ns/net`,
    resolvConf: null,
    release: async () => {},
  };
  return {
    mode: 'veth',
    describe: () => "test: the test process's own network namespace",
    acquire: async () => lease,
    close: async () => {},
  };
}
