/**
 * Ferry's own Node inside a sandbox whose `/` is an image: the Node bootstrap (cortex TypeScript and
 * JavaScript) and the custom runtime's supervisor run on it, so an image needs no Node of its own, and
 * any image works, glibc or musl, with or without a `node`.
 *
 * How: the Node binary and the shared libraries it links (as `ldd` lists them, the dynamic loader too)
 * are bound read-only under `/ferry/node/`, and Node is started through that loader with
 * `--library-path /ferry/node/lib`: nothing of the image's own libc is used, and nothing of it is
 * changed. The loader's option is not an environment variable, so the programs Node starts (the user's
 * server, started by the supervisor) run on the image's own libraries, as the image intends.
 *
 * A statically linked Node is bound alone and run directly.
 */
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { findExecutable } from './launch.js';
import { WRAPPER_ENV } from './run-quiet.js';

export interface NodeBinding {
  /** Host files bound read-only at sandbox paths. */
  files: Array<{ host: string; sandbox: string }>;
  /** The command prefix that runs Node inside (its options and script follow). */
  argv: string[];
}

/** Where Ferry's Node is inside an image's sandbox. */
export const NODE_IN_IMAGE_DIR = '/ferry/node';

let cached: Promise<NodeBinding> | undefined;

/** The binding of this process's Node (worked out once, from `ldd`). Throws when it cannot be. */
export function ferryNodeBinding(): Promise<NodeBinding> {
  cached ??= lookUp(process.execPath).catch((err: unknown) => {
    cached = undefined;
    throw err;
  });
  return cached;
}

async function lookUp(execPath: string): Promise<NodeBinding> {
  const node = await fs.realpath(execPath);
  const nodeInside = `${NODE_IN_IMAGE_DIR}/node`;
  const ldd = await findExecutable('ldd', WRAPPER_ENV);
  if (!ldd) throw new Error('ldd (libc-bin) not found: cannot tell which libraries Node needs inside an image');
  const output = await new Promise<string>((resolve, reject) => {
    execFile(ldd, [node], { timeout: 10_000, env: WRAPPER_ENV }, (err, stdout, stderr) => {
      // "not a dynamic executable" exits 1: a static Node, bound alone.
      if (err && !/not a dynamic executable|statically linked/.test(`${stdout}${stderr}`)) reject(err);
      else resolve(`${stdout}${stderr}`);
    });
  });
  if (/not a dynamic executable|statically linked/.test(output)) {
    return { files: [{ host: node, sandbox: nodeInside }], argv: [nodeInside] };
  }
  const libDir = `${NODE_IN_IMAGE_DIR}/lib`;
  const files = [{ host: node, sandbox: nodeInside }];
  let loader: string | undefined;
  const seen = new Set<string>();
  for (const line of output.split('\n')) {
    const linked = /^\s*(\S+)\s+=>\s+(\/\S+)\s+\(0x[0-9a-f]+\)/.exec(line);
    const direct = /^\s*(\/\S+)\s+\(0x[0-9a-f]+\)/.exec(line);
    if (linked) {
      const [, name, host] = linked as unknown as [string, string, string];
      if (seen.has(name)) continue;
      seen.add(name);
      files.push({ host: await fs.realpath(host), sandbox: `${libDir}/${name}` });
    } else if (direct) {
      const host = direct[1]!;
      loader = `${libDir}/${path.basename(host)}`;
      if (!seen.has(path.basename(host))) {
        seen.add(path.basename(host));
        files.push({ host: await fs.realpath(host), sandbox: loader });
      }
    }
  }
  if (!loader) throw new Error(`ldd named no dynamic loader for ${node}`);
  return { files, argv: [loader, '--library-path', libDir, nodeInside] };
}
