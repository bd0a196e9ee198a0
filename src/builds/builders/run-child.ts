/**
 * Running a build's child process (npm, pip, python): no shell, output handed over line by line, and on
 * abort the whole process group killed (package managers start children of their own), SIGTERM then
 * SIGKILL after a grace period. Shared by the per-runtime builders.
 */
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { type BuildContext, BuildFailedError } from './types.js';

const KILL_GRACE_MS = 5_000;

export interface ChildExit {
  code: number | null;
  signal: NodeJS.Signals | null;
}

export function describeExit(exit: ChildExit): string {
  return exit.code === null ? `killed by ${exit.signal ?? 'a signal'}` : `exit code ${exit.code}`;
}

/** Runs a command; resolves with how it exited, rejects when aborted (after the group is gone) or when it cannot start. */
export function runChild(
  command: string,
  args: string[],
  opts: {
    cwd: string;
    env: NodeJS.ProcessEnv;
    onLine: (stream: 'stdout' | 'stderr', line: string) => void;
    signal: AbortSignal;
  },
): Promise<ChildExit> {
  throwIfAborted(opts.signal);
  return new Promise<ChildExit>((resolve, reject) => {
    // detached puts the child in its own process group, so one kill reaches its children too.
    const child = spawn(command, args, {
      cwd: opts.cwd,
      env: opts.env,
      stdio: ['ignore', 'pipe', 'pipe'],
      detached: process.platform !== 'win32',
    });
    let killTimer: NodeJS.Timeout | undefined;
    let settled = false;

    const kill = (sig: NodeJS.Signals) => {
      if (child.pid === undefined) return;
      try {
        if (process.platform === 'win32') child.kill(sig);
        else process.kill(-child.pid, sig);
      } catch {
        // Already gone.
      }
    };
    const onAbort = () => {
      kill('SIGTERM');
      killTimer = setTimeout(() => kill('SIGKILL'), KILL_GRACE_MS);
    };
    const finish = (action: () => void) => {
      if (settled) return;
      settled = true;
      opts.signal.removeEventListener('abort', onAbort);
      if (killTimer) clearTimeout(killTimer);
      action();
    };

    for (const stream of ['stdout', 'stderr'] as const) {
      createInterface({ input: child[stream], crlfDelay: Number.POSITIVE_INFINITY }).on('line', (line) =>
        opts.onLine(stream, line),
      );
    }
    child.on('error', (err) => {
      // Could not start (missing, not executable): the server's problem, not the app's.
      finish(() => reject(new Error(`Could not run ${command}: ${err.message}`, { cause: err })));
    });
    // 'close' waits for the output pipes too, so every line is handed over before the result is known.
    child.on('close', (code, signal) => {
      finish(() => {
        if (opts.signal.aborted) reject(abortError(opts.signal));
        else resolve({ code, signal });
      });
    });
    opts.signal.addEventListener('abort', onAbort, { once: true });
  });
}

export function abortError(signal: AbortSignal): Error {
  if (signal.reason instanceof Error) return signal.reason;
  const err = new Error('The build was cancelled', { cause: signal.reason });
  err.name = 'AbortError';
  return err;
}

export function throwIfAborted(signal: AbortSignal): void {
  if (signal.aborted) throw abortError(signal);
}

export async function isFile(file: string): Promise<boolean> {
  try {
    return (await fs.stat(file)).isFile();
  } catch {
    return false;
  }
}

/** Proxy variables every package manager may need to reach its registry. */
export const PROXY_ENV = ['HTTP_PROXY', 'HTTPS_PROXY', 'NO_PROXY', 'http_proxy', 'https_proxy', 'no_proxy'];

/**
 * Runs one install step of a build (npm, pip) with a minimal environment: the server's may hold secrets
 * (tokens, database URLs), so the tool gets PATH, a HOME in the build cache, `extra`, and only the server
 * variables named in `passed`. Its output goes to the build log; a non-zero exit fails the build.
 */
export async function runInstallStep(
  ctx: BuildContext,
  step: { label: string; command: string; args: string[]; extra: Record<string, string>; passed: readonly string[] },
): Promise<void> {
  const home = path.join(ctx.cacheDir, 'home');
  await fs.mkdir(home, { recursive: true });
  const env: NodeJS.ProcessEnv = {
    PATH: process.env.PATH ?? '/usr/local/bin:/usr/bin:/bin',
    HOME: home,
    ...step.extra,
  };
  for (const name of step.passed) {
    const value = process.env[name];
    if (value !== undefined) env[name] = value;
  }
  const started = Date.now();
  const exit = await runChild(step.command, step.args, {
    cwd: ctx.sourceDir,
    env,
    onLine: (_stream, line) => ctx.log(line),
    signal: ctx.signal,
  });
  if (exit.code !== 0) {
    const how = exit.code === null ? `was killed by ${exit.signal ?? 'a signal'}` : `failed (exit code ${exit.code})`;
    throw new BuildFailedError(`${step.label} ${how}`);
  }
  ctx.log(`${step.label} finished in ${((Date.now() - started) / 1000).toFixed(1)} s`);
}
