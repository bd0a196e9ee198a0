/**
 * The error of a build that failed through the app's fault, and the one every cortex builder shares. Apart
 * from builder.ts (the builder interface), which imports the image modules' types, so that the image
 * modules can throw it without an import cycle (`madge --circular`).
 */
import type { ErrorCode } from '../errors.js';

/** Thrown by a builder for a failure that is the app's fault (bad syntax, failed install); the message goes to the build log. */
export class BuildFailedError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'BuildFailedError';
  }
}

/**
 * A build failure with a stable code of src/errors.ts (documented in docs/errors.md): its message is
 * `CODE: what`, as the build log and `builds.error` show it, so a user (or a script) can tell it apart.
 */
export class CodedBuildError extends BuildFailedError {
  readonly code: ErrorCode;
  constructor(code: ErrorCode, message: string, options?: { cause?: unknown }) {
    super(`${code}: ${message}`, options);
    this.name = 'CodedBuildError';
    this.code = code;
  }
}

/** A cortex app with no entry file: either runtime's entry would do, so the message names both. */
export function noEntryError(): BuildFailedError {
  return new BuildFailedError(
    'No entry file: expected main.ts, main.js or main.mjs (TypeScript/JavaScript) or main.py (Python) at the archive root',
  );
}
