/**
 * What the build knows of image steps (`[image].apt`, `[image].run`, `[image].dockerfile`): whether a spec
 * has any (`needsImageBuild`; a spec naming only `base` and `env` runs its base as pulled), and the coded
 * failure of an image build (`ImageBuildError`, `CODE: step: cause`). The steps themselves are
 * image-builder.ts's `buildImage`, called by images/build-image.ts.
 */
import { BuildFailedError } from '../builds/builder.js';
import type { ErrorCode } from '../errors.js';
import type { ImageSpec } from './image-spec.js';

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
