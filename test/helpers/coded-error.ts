/** Asserting coded errors (FerryError, src/errors.ts) from promises. */
import assert from 'node:assert/strict';
import { FerryError } from '../../src/errors.js';

/** Asserts `promise` rejects with a FerryError of `code`, and returns it (for its message). */
export async function rejectsWithCode(promise: Promise<unknown>, code: string): Promise<FerryError> {
  let caught: unknown;
  await promise.then(
    (value) => assert.fail(`resolved with ${JSON.stringify(value) ?? String(value)}, expected ${code}`),
    (err: unknown) => {
      caught = err;
    },
  );
  assert.ok(
    caught instanceof FerryError,
    `expected a FerryError ${code}, got ${String((caught as Error)?.stack ?? caught)}`,
  );
  assert.equal(caught.code, code, caught.message);
  return caught;
}
