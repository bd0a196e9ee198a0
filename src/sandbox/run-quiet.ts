/**
 * Runs a short host command (a probe, or a tool fed a script on stdin such as `ip -batch -` or `nft -f -`)
 * with a bounded time and a minimal environment, and collects what it printed. Never throws: a missing
 * binary or a timeout is in the result.
 */
import { spawn } from 'node:child_process';

export interface QuietResult {
  code: number | null;
  stdout: string;
  stderr: string;
  timedOut: boolean;
  error?: string;
}

/** The environment of host-side helpers: nothing of the server's own (an LD_PRELOAD must not reach them). */
export const WRAPPER_ENV = { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' };

export function runQuiet(
  file: string,
  args: string[],
  timeoutMs: number,
  env: Record<string, string> = WRAPPER_ENV,
  input?: string,
  /** Descriptors of this process the command gets as its fd 3, 4, … (flock(1) locks one: veth-network.ts). */
  extraFds: number[] = [],
): Promise<QuietResult> {
  return new Promise((resolve) => {
    const child = spawn(file, args, {
      env,
      stdio: [input === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe', ...extraFds],
    });
    if (input !== undefined) {
      child.stdin?.on('error', () => {}); // the tool exited before reading it: its exit code says why
      child.stdin?.end(input);
    }
    let stdout = '';
    let stderr = '';
    let timedOut = false;
    child.stdout?.setEncoding('utf8').on('data', (chunk: string) => {
      stdout += chunk;
    });
    child.stderr?.setEncoding('utf8').on('data', (chunk: string) => {
      stderr += chunk;
    });
    const timer = setTimeout(() => {
      timedOut = true;
      child.kill('SIGKILL');
    }, timeoutMs);
    child.on('error', (err) => {
      clearTimeout(timer);
      resolve({ code: null, stdout, stderr, timedOut, error: err.message });
    });
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr, timedOut });
    });
  });
}
