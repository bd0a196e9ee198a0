/**
 * Image layers handled the way the server does it: never in its own process, always in a sandbox of their
 * own (sandbox/tree-sandbox.ts), as an unprivileged id that can write nothing but the tree it works on.
 * unpack.ts's and rootfs-diff.ts's own rules keep every entry inside the root; this is the second wall, for
 * the day one of those rules has a hole: untrusted layer data is never processed by a process with root's
 * view of the host.
 *
 * - unpackInSandbox: layers onto a root (a base image into the node's cache, a build's parents into its
 *   scratch root), as the first id of a range (build-ids.ts) that is uid 0 of its user namespace with the
 *   range mapped, so that entries get the image's owners shifted into it; without root, as Ferry's own uid
 *   (uid 0 inside). The layers reach it as descriptors opened here, read-only.
 * - diffInSandbox: what a build step changed in its scratch root, read through a read-only bind by the
 *   build's own range, streamed back as a tar that the server re-packs into the layer (layer-writer.ts).
 *
 * The worker's code is dist/tools/layer-worker.cjs (layer-worker.ts, bundled alone by `npm run build`).
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Readable } from 'node:stream';
import { fileURLToPath } from 'node:url';
import tar from 'tar-stream';
import { type ErrorCode, FerryError } from '../errors.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import { FIRST_INPUT_FD, runTreeTool, TREE_DIR } from '../sandbox/tree-sandbox.js';
import { LAYER_RESULT_PREFIX, type LayerReply, type LayerRequest } from './layer-worker.js';
import type { LayerEntry, LayerWriter } from './layer-writer.js';
import { blobPath } from './oci-layout.js';
import { type DiffResult, type Snapshot, snapshotJson } from './rootfs-diff.js';
import type { IdRange } from './step-sandbox.js';
import type { UnpackLimits, UnpackResult } from './unpack.js';

const WORKER = fileURLToPath(new URL('../../tools/layer-worker.cjs', import.meta.url));
/** What the worker may refuse with: a reply naming anything else is the worker's failure, not the image's. */
const REFUSALS = new Set<string>(['FERRY_IMAGE_LAYER_UNSAFE', 'FERRY_IMAGE_TOO_LARGE', 'FERRY_IMAGE_UNSUPPORTED']);
/** Caps inside the unpacker's namespace (over the mapped ids only): owners, and read-only folders refilled. */
const UNPACK_CAPS = ['CAP_CHOWN', 'CAP_DAC_OVERRIDE', 'CAP_FOWNER'];
/** Caps of the diff, which only reads: every file of the range, whatever its mode. */
const DIFF_CAPS = ['CAP_DAC_READ_SEARCH'];
/** Far beyond real work (gigabytes take minutes): a bound for a worker that hangs. */
const WORKER_TIMEOUT_MS = 60 * 60_000;

let workerCode: Promise<Buffer> | undefined;

function readWorker(): Promise<Buffer> {
  workerCode ??= fs.readFile(WORKER).catch((err: NodeJS.ErrnoException) => {
    workerCode = undefined;
    throw new Error(
      `Ferry's layer worker ${WORKER} is missing (${err.code ?? err.message}): run \`npm run build\` in Ferry's folder`,
    );
  });
  return workerCode;
}

interface WorkerRun {
  caps: SandboxCapabilities;
  root: string;
  rootReadOnly?: boolean;
  inputs: number[];
  ids: IdRange;
  mapRange: boolean;
  keepCaps: string[];
  request: LayerRequest;
  onOutput?: (stream: Readable) => Promise<void>;
  signal?: AbortSignal;
}

/** Runs the worker and reads its reply; its refusals are thrown as they are, any other failure as an Error. */
async function runWorker(run: WorkerRun): Promise<Extract<LayerReply, { ok: true }>> {
  const result = await runTreeTool({
    caps: run.caps,
    script: await readWorker(),
    args: [JSON.stringify(run.request)],
    root: run.root,
    ...(run.rootReadOnly ? { rootReadOnly: true } : {}),
    inputs: run.inputs,
    ids: run.ids,
    mapRange: run.mapRange,
    keepCaps: run.keepCaps,
    timeoutMs: WORKER_TIMEOUT_MS,
    ...(run.onOutput ? { onOutput: run.onOutput } : {}),
    ...(run.signal ? { signal: run.signal } : {}),
  });
  const line = result.stdout.split('\n').find((l) => l.startsWith(LAYER_RESULT_PREFIX));
  if (!line) {
    const how = result.timedOut
      ? 'ran past its time bound'
      : result.signal
        ? `was killed by ${result.signal}`
        : `exited with code ${result.code}`;
    throw new Error(`the layer worker ${how}: ${result.stderr.trim().split('\n').slice(-3).join(' | ')}`);
  }
  const reply = JSON.parse(line.slice(LAYER_RESULT_PREFIX.length)) as LayerReply;
  if (reply.ok) return reply;
  if (reply.code !== null && REFUSALS.has(reply.code)) throw new FerryError(reply.code as ErrorCode, reply.message);
  throw new Error(`the layer worker failed: ${reply.message}`);
}

export interface SandboxedUnpack {
  caps: SandboxCapabilities;
  /** The empty (or partly unpacked) folder to fill; made by Ferry, it is given to `ids.first`. */
  root: string;
  /** The blobs, lowest first: an OCI layout folder and the layer's digest. */
  layers: Array<{ layout: string; digest: string }>;
  limits: UnpackLimits;
  /** Who unpacks: `ids.first` is uid 0 inside, and entries' owners are shifted into the range. */
  ids: IdRange;
  mapRange: boolean;
  /** Make /etc/resolv.conf a regular file (an image for replicas). */
  resolvConf?: boolean;
  signal?: AbortSignal;
}

/** Unpacks in the sandbox. Throws the unpacker's refusals (FERRY_IMAGE_*) as they are, anything else as an Error. */
export async function unpackInSandbox(job: SandboxedUnpack): Promise<UnpackResult> {
  if (job.mapRange) await fs.lchown(job.root, job.ids.first, job.ids.first);
  const fds: number[] = [];
  try {
    for (const layer of job.layers) fds.push(fsSync.openSync(blobPath(layer.layout, layer.digest), 'r'));
    const reply = await runWorker({
      caps: job.caps,
      root: job.root,
      inputs: fds,
      ids: job.ids,
      mapRange: job.mapRange,
      keepCaps: UNPACK_CAPS,
      request: {
        op: 'unpack',
        root: TREE_DIR,
        layers: fds.map((_, i) => FIRST_INPUT_FD + i),
        limits: job.limits,
        owner: { first: 0, count: job.ids.count },
        ...(job.resolvConf ? { resolvConf: true } : {}),
      },
      ...(job.signal ? { signal: job.signal } : {}),
    });
    if (!('bytes' in reply)) throw new Error('the layer worker answered an unpacking with something else');
    return { bytes: reply.bytes, entries: reply.entries };
  } finally {
    for (const fd of fds) fsSync.closeSync(fd);
  }
}

export interface SandboxedDiff {
  caps: SandboxCapabilities;
  /** The build's scratch root, after the step (nothing runs in it any more). */
  root: string;
  /** The snapshot taken before the step (host ids). */
  before: Snapshot;
  /** Where the layer goes. */
  writer: Pick<LayerWriter, 'add'>;
  /** The build's id range. */
  ids: IdRange;
  mapRange: boolean;
  /** Paths Ferry made for the sandbox (mount points), left out. */
  ignore: readonly string[];
  /** A folder of Ferry's own for the snapshot's file (the build's scratch folder). */
  scratch: string;
  /** Bound of the tar's file bytes (the build's disk bound). */
  maxBytes: number;
  signal?: AbortSignal;
}

/** Writes what the step changed to `writer`, read in the sandbox (see the header). */
export async function diffInSandbox(job: SandboxedDiff): Promise<DiffResult> {
  const snapshotFile = path.join(job.scratch, `before-${process.pid}-${Date.now()}.json`);
  await fs.writeFile(snapshotFile, snapshotJson(job.before, job.ids), { mode: 0o600, flag: 'wx' });
  const fd = fsSync.openSync(snapshotFile, 'r');
  try {
    const reply = await runWorker({
      caps: job.caps,
      root: job.root,
      rootReadOnly: true,
      inputs: [fd],
      ids: job.ids,
      mapRange: job.mapRange,
      keepCaps: DIFF_CAPS,
      request: {
        op: 'diff',
        root: TREE_DIR,
        before: FIRST_INPUT_FD,
        ignore: [...job.ignore],
        count: job.ids.count,
        output: FIRST_INPUT_FD + 1,
      },
      onOutput: (stream) => repack(stream, job.writer, job.maxBytes),
      ...(job.signal ? { signal: job.signal } : {}),
    });
    if (!('written' in reply)) throw new Error('the layer worker answered a diff with something else');
    return { written: reply.written, removed: reply.removed };
  } finally {
    fsSync.closeSync(fd);
    await fs.rm(snapshotFile, { force: true });
  }
}

/** Entries of the worker's tar, added to the layer as they come; file bytes bounded by `maxBytes`. */
async function repack(stream: Readable, writer: Pick<LayerWriter, 'add'>, maxBytes: number): Promise<void> {
  const extract = tar.extract();
  stream.pipe(extract);
  let bytes = 0;
  for await (const entry of extract) {
    const h = entry.header;
    const type =
      h.type === 'file' || h.type === 'directory' || h.type === 'symlink' || h.type === 'link' ? h.type : null;
    if (type === null) throw new Error(`the layer worker wrote an entry of type ${String(h.type)}`);
    bytes += h.size ?? 0;
    if (bytes > maxBytes) {
      throw new FerryError(
        'FERRY_IMAGE_TOO_LARGE',
        `the step's layer is larger than ${Math.round(maxBytes / 2 ** 20)} MiB`,
      );
    }
    const layerEntry: LayerEntry = {
      name: h.name.replace(/\/+$/, ''),
      type,
      mode: h.mode ?? 0o644,
      uid: h.uid ?? 0,
      gid: h.gid ?? 0,
      mtime: h.mtime ?? new Date(0),
      ...(type === 'file' ? { size: h.size ?? 0 } : {}),
      ...(h.linkname ? { linkname: h.linkname } : {}),
    };
    // An entry is read to its end before the next one comes: an empty one (a whiteout) is drained here.
    if (type === 'file' && (h.size ?? 0) > 0) await writer.add(layerEntry, entry as unknown as Readable);
    else {
      entry.resume();
      await writer.add(layerEntry);
    }
  }
}
