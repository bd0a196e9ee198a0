/**
 * The seam between a deploy's build and the image steps that run untrusted code: `[image].apt`,
 * `[image].run` and `[image].dockerfile`. The build (images/build-image.ts) calls `buildImageSteps` only
 * for a spec that has such steps (`needsImageBuild`); a spec that names only `base` (and `env`) needs no
 * step, and its base image is run as pulled.
 *
 * The steps themselves are image-builder.ts's `buildImage` (apt/run and Dockerfiles in Ferry's bwrap
 * sandbox, a layer cache per project). It is not connected here yet: it wants the base as a pulled OCI
 * layout (ImageStore.acquire removes its pull's layout once unpacked), the node's build cache folder, an
 * output folder, the sandbox and its limits; and its result, an OCI layout, must be unpacked into the
 * node's cache as a pulled image is. Until then such a spec fails its build with the coded error below,
 * naming the step.
 *
 * Contract for the implementation that replaces the body of `buildImageSteps`:
 * - `baseRootfs` is the pinned, read-only unpacked root of the base (absent for a Dockerfile, whose
 *   `FROM` names its own base); never write into it: it is shared by every build and replica of its digest.
 * - `contextDir` is the app folder as uploaded (the Dockerfile's build context).
 * - `projectId` keys the layer cache: one project's cache never feeds another's build.
 * - `log` takes one line per call (each step's `cached` or not); `signal` aborts every child process.
 * - Failures are `ImageBuildError`s (a FERRY_IMAGE_* code, the step, the cause), never a host path.
 * - The result is an OCI layout folder with the built image, and its manifest digest; the build then
 *   unpacks it into the node's image cache as it does a pulled image (ImageStore).
 */

import { BuildFailedError } from '../builds/builder.js';
import type { ErrorCode } from '../errors.js';
import type { ImageSpec } from './image-spec.js';

export interface ImageBuildInput {
  spec: ImageSpec;
  /** The base image's unpacked root (read-only, pinned), for `base` + `apt`/`run`. */
  baseRootfs?: string;
  /** The base image's manifest digest, for the layer cache's keys. */
  baseDigest?: string;
  /** The app folder as uploaded: the build context. */
  contextDir: string;
  projectId: string;
  buildId: string;
  log: (line: string) => void;
  signal: AbortSignal;
}

export interface ImageBuildOutput {
  /** An OCI layout folder holding the built image. */
  layoutDir: string;
  /** The built image's manifest digest (`sha256:…`). */
  digest: string;
}

/**
 * A failure of an image build: a coded build failure whose message is `CODE: step: cause`, as the build
 * log and `builds.error` show it.
 */
export class ImageBuildError extends BuildFailedError {
  readonly code: ErrorCode;
  readonly step: string;
  constructor(code: ErrorCode, step: string, cause: string, options?: { cause?: unknown }) {
    super(`${code}: ${step}: ${cause}`, options);
    this.name = 'ImageBuildError';
    this.code = code;
    this.step = step;
  }
}

/** Whether the spec has steps that must be built (apt, run, a Dockerfile), not just a base to pull. */
export function needsImageBuild(spec: ImageSpec): boolean {
  return spec.kind === 'dockerfile' || spec.apt.length > 0 || spec.run.length > 0;
}

/** Builds the image's steps (see the module comment). Not connected yet: refuses with a coded error. */
export async function buildImageSteps(input: ImageBuildInput): Promise<ImageBuildOutput> {
  const step =
    input.spec.kind === 'dockerfile'
      ? `image.dockerfile (${input.spec.dockerfile})`
      : input.spec.apt.length > 0
        ? 'image.apt'
        : 'image.run';
  throw new ImageBuildError('FERRY_IMAGE_UNSUPPORTED', step, 'apt/run/dockerfile steps are not built yet');
}
