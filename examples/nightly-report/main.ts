/**
 * A scheduled report: each tick calls `report` with the schedule's `args` as an async run (its result is
 * on the run record, `ferry runs list nightly-report`). Throwing fails the attempt; `[retries]` tries it
 * again after its delay, and the run ends `dead` after the last attempt.
 */
export async function report({ days }: { days: number }): Promise<{ period: string; generatedAt: string }> {
  const end = new Date();
  const start = new Date(end.getTime() - days * 86_400_000);
  // Your work here: query a database, call an API, write a file to a volume...
  return { period: `${start.toISOString()} to ${end.toISOString()}`, generatedAt: end.toISOString() };
}

export function heartbeat(): { ok: true } {
  return { ok: true };
}
