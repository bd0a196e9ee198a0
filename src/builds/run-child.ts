/**
 * Running a build step as a plain child process, when there is no sandbox (sandbox/build-step.ts decides):
 * no shell, output handed over line by line, and on abort the whole process group killed (package
 * managers start children of their own), SIGTERM then SIGKILL after a grace period. Also the small
 * helpers the per-runtime builders share.
 */
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import { createInterface } from 'node:readline';

const KILL_GRACE_MS = 5_000;

export interface ChildExit {
  code: number | null;
  signal: NodeJS.Signals | null;
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
