/**
 * The unpacker's own process, inside the sandbox that unpack-sandbox.ts starts (sandbox/tree-sandbox.ts
 * says what it sees: the root at /tree, writable, and nothing else of the host's to write). Bundled alone
 * into dist/tools/unpack-worker.cjs by `npm run build` (scripts/bundle.mjs), so the sandbox needs nothing
 * of Ferry's install.
 *
 * `node unpack-worker.cjs <request JSON>`: the layers are descriptors the caller opened (the blobs, read
 * only). Prints one line, UNPACK_RESULT_PREFIX and the reply as JSON, and exits 0, whether it unpacked or
 * refused; anything else (a crash, a kill) is the caller's to report.
 */
import fs from 'node:fs';
import { FerryError } from '../errors.js';
import { prepareResolvConf, type UnpackLimits, unpackLayers } from './unpack.js';

export const UNPACK_RESULT_PREFIX = 'FERRY-UNPACK ';

export interface UnpackRequest {
  /** The folder to unpack into, as the worker sees it. */
  root: string;
  /** Descriptors of the layers' blobs, lowest first. */
  layers: number[];
  limits: UnpackLimits;
  /** Entry uid/gid N becomes `first + N` (as the worker's namespace numbers them). */
  owner?: { first: number; count: number };
  /** Make /etc/resolv.conf a regular file for replicas' DNS (images/image-store.ts). */
  resolvConf?: boolean;
}

export type UnpackReply =
  | { ok: true; bytes: number; entries: number }
  | { ok: false; code: string | null; message: string };

async function main(request: UnpackRequest): Promise<UnpackReply> {
  try {
    const result = await unpackLayers(
      request.root,
      request.layers.map((fd) => () => fs.createReadStream('', { fd, autoClose: true })),
      request.limits,
      request.owner ? { owner: request.owner } : {},
    );
    if (request.resolvConf) await prepareResolvConf(request.root);
    return { ok: true, ...result };
  } catch (err) {
    if (err instanceof FerryError) return { ok: false, code: err.code, message: err.message };
    return { ok: false, code: null, message: (err as Error).message ?? String(err) };
  }
}

if ((process.argv[1] && /unpack-worker\.c?js$/.test(process.argv[1])) || process.argv[1] === '/ferry/tool.cjs') {
  void main(JSON.parse(process.argv[2] ?? '{}') as UnpackRequest).then((reply) => {
    process.stdout.write(`${UNPACK_RESULT_PREFIX}${JSON.stringify(reply)}\n`, () => process.exit(0));
  });
}
