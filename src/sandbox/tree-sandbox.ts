/**
 * Ferry's own tools over an untrusted tree (the unpacking of image layers: images/layer-sandbox.ts), run
 * where a bug in them could reach nothing but that tree. The tool is Ferry's code, but the data it reads
 * (layers anyone can push, the root a stranger's `RUN` lines left) is a stranger's, and a path-handling
 * bug once let a layer empty and chmod host folders while Ferry ran as root (issue 43). So the tool runs:
 *
 * - as an unprivileged host id: as root, the first id of a range of its own (images/build-ids.ts), mapped
 *   with the range as uid 0 inside its user namespace so that it can give files the image's owners, and
 *   keeping only the capabilities the caller names (CAP_CHOWN, ...), which are valid over those ids only;
 *   without root, Ferry's own uid, as bwrap maps it;
 * - in its own mount, PID, IPC, UTS, network (loopback only) and user namespaces, seeing the host's /usr
 *   and system links read-only, Node's folder read-only, a fresh /proc, a minimal /dev, a private /tmp,
 *   and the tree, writable, at `/tree`; not /etc, not the data folder, nothing else of the host; every
 *   other mount, bwrap's own root included, read-only;
 * - reading its input through descriptors the caller opened (fd 7, 8, …: the layer blobs), so that the
 *   folder holding them (the pull's scratch, 0700) need not be reachable, nor visible; and writing what
 *   it produces (a build step's diff) to a pipe the caller reads;
 * - with the tool's code handed over as data (bound read-only at /ferry/tool.cjs), one self-contained
 *   file: nothing of Ferry's install needs to be visible either;
 * - with a wall-clock bound, killed with its whole namespace when it passes it or the caller aborts.
 *
 * Binds are by path, never by an open folder's descriptor: a folder descriptor that reached the tool
 * would be a way out of its mount namespace (`openat(fd, "..")` walks the host's tree).
 */
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Readable, Writable } from 'node:stream';
import { dropPrivilegesArgs, unreachableByOthers } from './identity.js';
import { HOST_SYSTEM_ROOTS, type SandboxCapabilities, WRAPPER_ENV } from './launch.js';
import { mapWhenReady } from './userns-map.js';

/** Where the tree is inside. */
export const TREE_DIR = '/tree';
const TOOL_PATH = '/ferry/tool.cjs';
/** The first descriptor of the caller's inputs, inside as outside. */
export const FIRST_INPUT_FD = 7;
const MAX_STDOUT_BYTES = 1024 * 1024;
const STDERR_TAIL_BYTES = 8 * 1024;

export interface TreeToolRun {
  caps: SandboxCapabilities;
  /** The tool: one self-contained CommonJS file, run by this process's Node. */
  script: Buffer;
  /** Its arguments (after the script). */
  args: string[];
  /** Host folder bound writable at TREE_DIR. It must belong to `ids.first`, uid 0 inside. */
  root: string;
  /** Bind the tree read-only instead (a tool that only reads it). */
  rootReadOnly?: boolean;
  /**
   * A stream the tool writes (its descriptor, FIRST_INPUT_FD + inputs.length, is the one after the
   * inputs), handed to this consumer as the tool starts; the run ends when both have. A consumer that
   * fails kills the tool.
   */
  onOutput?: (stream: Readable) => Promise<void>;
  /** Descriptors open for reading that the tool gets as FIRST_INPUT_FD, FIRST_INPUT_FD + 1, … */
  inputs: number[];
  /** Who it runs as: host `ids.first + n` is `n` inside. */
  ids: { first: number; count: number };
  /** Whether Ferry writes the range's maps (it is root); else bwrap maps uid 0 to Ferry's own uid. */
  mapRange: boolean;
  /** Capabilities kept inside the namespace (`CAP_CHOWN`, …); none by default. */
  keepCaps?: string[];
  timeoutMs: number;
  signal?: AbortSignal;
}

export interface TreeToolResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  /** What it printed (at most 1 MiB). */
  stdout: string;
  /** The last 8 KiB of its stderr. */
  stderr: string;
  timedOut: boolean;
}

/** Runs the tool; rejects only when the sandbox cannot be started, or with the signal's reason. */
export async function runTreeTool(run: TreeToolRun): Promise<TreeToolResult> {
  const { caps } = run;
  if (!caps.bwrap)
    throw new Error(
      'Ferry runs its tools over untrusted trees in the bubblewrap sandbox, which this server does not have',
    );
  if (run.signal?.aborted) throw run.signal.reason;
  const nodeDir = path.dirname(process.execPath);
  if (run.mapRange) {
    for (const host of [run.root, process.execPath]) {
      const blocked = await unreachableByOthers(host);
      if (blocked) {
        throw new Error(
          `Ferry's sandboxed tools run as an unprivileged uid, which cannot enter ${blocked} (on the way to ${host}): give it o+x, or move the folder`,
        );
      }
    }
  }
  const options = [
    '--unshare-all',
    '--unshare-user',
    '--uid',
    '0',
    '--gid',
    '0',
    // Not with maps written from outside: bwrap refuses --disable-userns with --userns-block-fd.
    ...(caps.bwrapFeatures.disableUserns && !run.mapRange ? ['--disable-userns'] : []),
    '--die-with-parent',
    '--new-session',
    ...(run.mapRange ? ['--info-fd', '3', '--userns-block-fd', '5'] : []),
    '--cap-drop',
    'ALL',
    ...(run.keepCaps ?? []).flatMap((cap) => ['--cap-add', cap]),
    // Before every bind: bwrap mounts in order, and a Node installed under /tmp, bound at its own path,
    // would be hidden by a /tmp mounted after it (issue 43; sandbox/launch.ts baseBwrapArgs).
    '--tmpfs',
    '/tmp',
    ...(await systemArgs(nodeDir)),
    '--proc',
    '/proc',
    '--dev',
    '/dev',
    '--ro-bind-data',
    '6',
    TOOL_PATH,
    run.rootReadOnly ? '--ro-bind' : '--bind',
    run.root,
    TREE_DIR,
    // bwrap's own root (a tmpfs holding the mount points) read-only too: only /tree and /tmp take writes.
    '--remount-ro',
    '/',
    '--chdir',
    TREE_DIR,
    '--clearenv',
    '--setenv',
    'PATH',
    '/usr/bin:/bin',
  ];
  const argsBlob = Buffer.from(options.map((arg) => `${arg}\0`).join(''));
  let file = caps.bwrap;
  let argv = ['--args', '4', '--', process.execPath, TOOL_PATH, ...run.args];
  if (run.mapRange && caps.identity) {
    const [setpriv, ...drop] = dropPrivilegesArgs(caps.identity, run.ids.first);
    argv = [...drop, file, ...argv];
    file = setpriv!;
  }
  const child = spawn(file, argv, {
    cwd: '/',
    env: { ...WRAPPER_ENV },
    // 3: bwrap's info (its child's pid); 4: its options; 5: the user namespace's go-ahead; 6: the tool.
    stdio: [
      'ignore',
      'pipe',
      'pipe',
      'pipe',
      'pipe',
      'pipe',
      'pipe',
      ...run.inputs,
      ...(run.onOutput ? ['pipe' as const] : []),
    ],
  });
  const pipes = child.stdio as unknown as Array<Readable & Writable>;
  for (const fd of [4, 5, 6]) pipes[fd]!.on('error', () => {});
  pipes[4]!.end(argsBlob);
  pipes[6]!.end(run.script);
  let timedOut = false;
  const kill = () => child.kill('SIGKILL');
  if (run.mapRange) {
    void mapWhenReady(pipes[3]!, run.ids)
      .then(() => pipes[5]!.end('x'))
      .catch(kill);
  } else {
    pipes[3]!.resume();
    pipes[5]!.end();
  }
  const timer = setTimeout(() => {
    timedOut = true;
    kill();
  }, run.timeoutMs);
  run.signal?.addEventListener('abort', kill, { once: true });
  const output = run.onOutput?.(pipes[FIRST_INPUT_FD + run.inputs.length]!).catch((err: unknown) => {
    kill();
    throw err;
  });
  output?.catch(() => {}); // awaited below, once the tool has ended: not an unhandled rejection meanwhile
  try {
    let stdout = '';
    let stderr = '';
    child.stdout!.setEncoding('utf8').on('data', (chunk: string) => {
      if (stdout.length < MAX_STDOUT_BYTES) stdout += chunk.slice(0, MAX_STDOUT_BYTES - stdout.length);
    });
    child.stderr!.setEncoding('utf8').on('data', (chunk: string) => {
      stderr = (stderr + chunk).slice(-STDERR_TAIL_BYTES);
    });
    const exit = await new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve, reject) => {
      child.on('error', (err) => reject(new Error(`the tool sandbox could not start (${err.message})`)));
      child.on('close', (code, signal) => resolve({ code, signal }));
    });
    await output;
    if (run.signal?.aborted) throw run.signal.reason;
    return { ...exit, stdout, stderr, timedOut };
  } finally {
    clearTimeout(timer);
    run.signal?.removeEventListener('abort', kill);
  }
}

/** The host's /usr and its system links, read-only, and Node's own folder when it lies elsewhere. */
async function systemArgs(nodeDir: string): Promise<string[]> {
  const args: string[] = [];
  const roots: string[] = [];
  for (const dir of HOST_SYSTEM_ROOTS) {
    if (dir === '/etc') continue; // nothing the tool needs, and what a confused one should not read
    const stat = await fs.lstat(dir).catch(() => null);
    if (!stat) continue;
    if (stat.isSymbolicLink()) args.push('--symlink', await fs.readlink(dir), dir);
    else if (stat.isDirectory()) {
      args.push('--ro-bind', dir, dir);
      roots.push(await fs.realpath(dir).catch(() => dir));
    }
  }
  const realNodeDir = await fs.realpath(nodeDir).catch(() => nodeDir);
  if (!roots.some((root) => realNodeDir === root || realNodeDir.startsWith(`${root}/`))) {
    args.push('--ro-bind', nodeDir, nodeDir);
  }
  return args;
}
