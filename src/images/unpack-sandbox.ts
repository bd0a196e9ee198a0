/**
 * Unpacking an image's layers the way the server does it: in a sandbox of its own (sandbox/tree-sandbox.ts),
 * as an unprivileged id that can write nothing but the root it fills. unpack.ts's own rules keep every
 * entry inside the root; this is the second wall, for the day one of those rules has a hole: untrusted
 * layer data is never processed by a process with root's view of the host.
 *
 * As root the unpacker runs as the first id of a range (build-ids.ts: a build's own range for its scratch
 * root, one held for the unpacking for the image cache), uid 0 of its user namespace with the range
 * mapped, so that entries get the owners the image gives them, shifted into the range. Without root it
 * runs as Ferry's own uid, which bwrap maps to uid 0 inside. The layers reach it as descriptors opened
 * here, read-only.
 *
 * The worker's code is dist/tools/unpack-worker.cjs (unpack-worker.ts, bundled alone by `npm run build`).
 */
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { type ErrorCode, FerryError } from '../errors.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import { FIRST_INPUT_FD, runTreeTool, TREE_DIR } from '../sandbox/tree-sandbox.js';
import { blobPath } from './oci-layout.js';
import type { IdRange } from './step-sandbox.js';
import type { UnpackLimits, UnpackResult } from './unpack.js';
import { UNPACK_RESULT_PREFIX, type UnpackReply, type UnpackRequest } from './unpack-worker.js';

const WORKER = fileURLToPath(new URL('../../tools/unpack-worker.cjs', import.meta.url));
/** What the worker may refuse with: a reply naming anything else is the worker's failure, not the image's. */
const REFUSALS = new Set<string>(['FERRY_IMAGE_LAYER_UNSAFE', 'FERRY_IMAGE_TOO_LARGE', 'FERRY_IMAGE_UNSUPPORTED']);
/** Caps inside the unpacker's namespace (over the mapped ids only): owners, and read-only folders refilled. */
const UNPACK_CAPS = ['CAP_CHOWN', 'CAP_DAC_OVERRIDE', 'CAP_FOWNER'];
/** Far beyond a real unpacking (gigabytes take minutes): a bound for a worker that hangs. */
const UNPACK_TIMEOUT_MS = 60 * 60_000;

let workerCode: Promise<Buffer> | undefined;

function readWorker(): Promise<Buffer> {
  workerCode ??= fs.readFile(WORKER).catch((err: NodeJS.ErrnoException) => {
    workerCode = undefined;
    throw new Error(
      `Ferry's layer unpacker ${WORKER} is missing (${err.code ?? err.message}): run \`npm run build\` in Ferry's folder`,
    );
  });
  return workerCode;
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
  const script = await readWorker();
  if (job.mapRange) await fs.lchown(job.root, job.ids.first, job.ids.first);
  const fds: number[] = [];
  try {
    for (const layer of job.layers) fds.push(fsSync.openSync(blobPath(layer.layout, layer.digest), 'r'));
    const request: UnpackRequest = {
      root: TREE_DIR,
      layers: fds.map((_, i) => FIRST_INPUT_FD + i),
      limits: job.limits,
      owner: { first: 0, count: job.ids.count },
      ...(job.resolvConf ? { resolvConf: true } : {}),
    };
    const result = await runTreeTool({
      caps: job.caps,
      script,
      args: [JSON.stringify(request)],
      root: job.root,
      inputs: fds,
      ids: job.ids,
      mapRange: job.mapRange,
      keepCaps: UNPACK_CAPS,
      timeoutMs: UNPACK_TIMEOUT_MS,
      ...(job.signal ? { signal: job.signal } : {}),
    });
    const line = result.stdout.split('\n').find((l) => l.startsWith(UNPACK_RESULT_PREFIX));
    if (!line) {
      const how = result.timedOut
        ? 'ran past its time bound'
        : result.signal
          ? `was killed by ${result.signal}`
          : `exited with code ${result.code}`;
      throw new Error(`the layer unpacker ${how}: ${result.stderr.trim().split('\n').slice(-3).join(' | ')}`);
    }
    const reply = JSON.parse(line.slice(UNPACK_RESULT_PREFIX.length)) as UnpackReply;
    if (reply.ok) return { bytes: reply.bytes, entries: reply.entries };
    if (reply.code !== null && REFUSALS.has(reply.code)) throw new FerryError(reply.code as ErrorCode, reply.message);
    throw new Error(`the layer unpacker failed: ${reply.message}`);
  } finally {
    for (const fd of fds) fsSync.closeSync(fd);
  }
}
