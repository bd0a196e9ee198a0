/**
 * The `ferry` command line: parses the arguments with the command tree of `program.ts` and turns a
 * `CliError` (or a store that cannot be reached) into one readable line and an exit code.
 */
import { StoreUnavailableError } from '../store/outage.js';
import { CliError } from './client.js';
import { createProgram } from './program.js';
import { safeText } from './terminal.js';

try {
  await createProgram().parseAsync(process.argv);
} catch (err) {
  // Messages may quote the server, and through it a function (a failed run's error): controls made visible.
  if (err instanceof CliError) {
    process.stderr.write(`ferry: ${safeText(err.message)}\n`);
    process.exit(err.exitCode);
  }
  // The database of --database-url cannot be reached: the message names it and the reason.
  if (err instanceof StoreUnavailableError) {
    process.stderr.write(`ferry: ${safeText(err.message)}\n`);
    process.exit(1);
  }
  const message = err instanceof Error ? err.message : String(err);
  process.stderr.write(`ferry: unexpected error: ${safeText(message)}\n`);
  if (process.env.FERRY_DEBUG) console.error(err);
  process.exit(1);
}
