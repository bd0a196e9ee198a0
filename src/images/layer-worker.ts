/**
 * The process that handles image layers as untrusted data, inside the sandbox that layer-sandbox.ts starts
 * (sandbox/tree-sandbox.ts says what it sees: the tree at /tree and nothing else of the host's to write).
 * Bundled alone into dist/tools/layer-worker.cjs by `npm run build` (scripts/bundle.mjs), so the sandbox
 * needs nothing of Ferry's install. Two jobs:
 *
 * - `unpack`: layers (descriptors of their blobs, read-only) onto the root (unpack.ts's rules);
 * - `diff`: what a build step changed in the root since a snapshot (rootfs-diff.ts), written as an
 *   uncompressed tar to an output descriptor; the server re-packs it into the layer (layer-writer.ts).
 *
 * `node layer-worker.cjs <request JSON>` prints one line, LAYER_RESULT_PREFIX and the reply as JSON, and
 * exits 0, whether it did the job or refused; anything else (a crash, a kill) is the caller's to report.
 */
import fs from 'node:fs';
import { pipeline } from 'node:stream/promises';
import tar from 'tar-stream';
import { FerryError } from '../errors.js';
import { addTarEntry, type LayerEntry } from './layer-writer.js';
import { snapshotFromJson, writeRootDiff } from './rootfs-diff.js';
import { prepareResolvConf, type UnpackLimits, unpackLayers } from './unpack.js';

export const LAYER_RESULT_PREFIX = 'FERRY-LAYER ';

export type LayerRequest =
  | {
      op: 'unpack';
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
  | {
      op: 'diff';
      root: string;
      /** Descriptor of the snapshot taken before the step (rootfs-diff.ts snapshotJson). */
      before: number;
      /** Paths Ferry made for the sandbox (mount points), left out. */
      ignore: string[];
      /** Ids the worker's namespace maps (from 0). */
      count: number;
      /** Descriptor the tar is written to. */
      output: number;
    };

export type LayerReply =
  | { ok: true; bytes: number; entries: number }
  | { ok: true; written: number; removed: number }
  | { ok: false; code: string | null; message: string };

async function diff(request: Extract<LayerRequest, { op: 'diff' }>) {
  const before = snapshotFromJson(fs.readFileSync(request.before, 'utf8'));
  const pack = tar.pack();
  const done = pipeline(pack, fs.createWriteStream('', { fd: request.output }));
  const sink = {
    add: (entry: LayerEntry, body?: NodeJS.ReadableStream | Buffer) => addTarEntry(pack, entry, body as never),
  };
  const result = await writeRootDiff(request.root, before, sink, { first: 0, count: request.count }, request.ignore);
  pack.finalize();
  await done;
  return result;
}

async function main(request: LayerRequest): Promise<LayerReply> {
  try {
    if (request.op === 'diff') return { ok: true, ...(await diff(request)) };
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

if (process.argv[1] === '/ferry/tool.cjs' || /layer-worker\.c?js$/.test(process.argv[1] ?? '')) {
  void main(JSON.parse(process.argv[2] ?? '{}') as LayerRequest).then((reply) => {
    process.stdout.write(`${LAYER_RESULT_PREFIX}${JSON.stringify(reply)}\n`, () => process.exit(0));
  });
}
