/**
 * The error of a build that failed through the app's fault, and the one every cortex builder shares. Apart
 * from builder.ts (the builder interface), which imports the image modules' types, so that the image
 * modules can throw it without an import cycle (`madge --circular`).
 */

/** Thrown by a builder for a failure that is the app's fault (bad syntax, failed install); the message goes to the build log. */
export class BuildFailedError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'BuildFailedError';
  }
}

/** A cortex app with no entry file: either runtime's entry would do, so the message names both. */
export function noEntryError(): BuildFailedError {
  return new BuildFailedError(
    'No entry file: expected main.ts, main.js or main.mjs (TypeScript/JavaScript) or main.py (Python) at the archive root',
  );
}
