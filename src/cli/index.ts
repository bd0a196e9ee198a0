/**
 * The `ferry` command line: parses the arguments with the command tree of `program.ts` and turns a
 * `CliError` into one readable line and an exit code.
 */
import { CliError } from './client.js';
import { createProgram } from './program.js';

try {
  await createProgram().parseAsync(process.argv);
} catch (err) {
  if (err instanceof CliError) {
    process.stderr.write(`ferry: ${err.message}\n`);
    process.exit(err.exitCode);
  }
  const message = err instanceof Error ? err.message : String(err);
  process.stderr.write(`ferry: unexpected error: ${message}\n`);
  if (process.env.FERRY_DEBUG) console.error(err);
  process.exit(1);
}
