/**
 * What the build knows of image steps (`[image].apt`, `[image].run`, `[image].dockerfile`, and the steps a
 * runtime adds, `ImplicitStep`): whether a build has any (`needsImageBuild`; a spec naming only `base` and
 * `env`, with no runtime step, runs its base as pulled), and the coded failure of an image build
 * (`ImageBuildError`, `CODE: step: cause`). The steps themselves are image-builder.ts's `buildImage`,
 * called by images/build-image.ts.
 */
import { CodedBuildError } from '../builds/build-failed.js';
import type { ErrorCode } from '../errors.js';
import type { ImageSpec } from './image-spec.js';

/**
 * A failure of an image build: a coded build failure whose message is `CODE: step: cause`, as the build
 * log and `builds.error` show it.
 */
export class ImageBuildError extends CodedBuildError {
  readonly step: string;
  constructor(code: ErrorCode, step: string, cause: string, options?: { cause?: unknown }) {
    super(code, `${step}: ${cause}`, options);
    this.name = 'ImageBuildError';
    this.step = step;
  }
}

/**
 * A step a runtime adds to an app's image on its own account, after the `[image]` steps (or the
 * Dockerfile's): the Python runtime's install of `requirements.txt` (runtimes/python/builder.ts) is a
 * `copy` of the file, and of what it names, and a `run` of pip. They are built and cached like the app's own
 * steps (the key of a `copy` holds the digest of the files it copies), run as the image's root user in the
 * build sandbox, and leave the image's config (ENV, WORKDIR, USER, CMD) as the app's steps made it.
 */
export type ImplicitStep =
  | {
      kind: 'copy';
      /** A path of the app folder (`.` for all of it), copied as COPY would (no link followed). */
      source: string;
      /** Absolute in the image; a trailing `/` means "into this folder". */
      dest: string;
    }
  | {
      kind: 'run';
      /** What the build log shows for the step. */
      label: string;
      /** A shell command, run with `/bin/sh -c` in the image. */
      command: string;
      /** Absolute in the image. */
      cwd: string;
      /** Variables for this step only (not baked into the image). */
      env: Record<string, string>;
    };

/** Whether the build has steps to build (apt, run, a Dockerfile, a runtime's), not just a base to pull. */
export function needsImageBuild(spec: ImageSpec, implicit: readonly ImplicitStep[] = []): boolean {
  return spec.kind === 'dockerfile' || spec.apt.length > 0 || spec.run.length > 0 || implicit.length > 0;
}
