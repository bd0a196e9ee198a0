/**
 * What `nvidia-smi` says of each GPU (memory, utilisation), for `ferry doctor` and the metrics poll (issue
 * 44). Ferry asks one fixed query and reads its CSV:
 *
 *   nvidia-smi --query-gpu=uuid,name,memory.total,memory.used,utilization.gpu --format=csv,noheader,nounits
 *
 * A field the card does not report is `[N/A]` or `[Not Supported]`: null here.
 */
import { execFile } from 'node:child_process';

export const SMI_QUERY = [
  '--query-gpu=uuid,name,memory.total,memory.used,utilization.gpu',
  '--format=csv,noheader,nounits',
];

export interface SmiGpu {
  uuid: string;
  name: string;
  memoryTotalMiB: number | null;
  memoryUsedMiB: number | null;
  utilizationPercent: number | null;
}

/** The GPUs of SMI_QUERY's output, by UUID; lines that are not five fields with a UUID are skipped. */
export function parseSmiCsv(text: string): Map<string, SmiGpu> {
  const out = new Map<string, SmiGpu>();
  for (const line of text.split('\n')) {
    const fields = line.split(',').map((f) => f.trim());
    if (fields.length !== 5 || !/^GPU-[0-9a-fA-F-]+$/.test(fields[0]!)) continue;
    const [uuid, name, total, used, utilization] = fields as [string, string, string, string, string];
    out.set(uuid, {
      uuid,
      name,
      memoryTotalMiB: numberOrNull(total),
      memoryUsedMiB: numberOrNull(used),
      utilizationPercent: numberOrNull(utilization),
    });
  }
  return out;
}

function numberOrNull(text: string): number | null {
  return /^\d+(\.\d+)?$/.test(text) ? Number(text) : null;
}

/** Runs SMI_QUERY with `smi` (bounded in time); an empty map when it fails. */
export function querySmi(smi: string, timeoutMs = 10_000): Promise<Map<string, SmiGpu>> {
  return new Promise((resolve) => {
    execFile(smi, SMI_QUERY, { timeout: timeoutMs, env: { PATH: '/usr/bin:/bin' } }, (err, stdout) =>
      resolve(err ? new Map() : parseSmiCsv(stdout)),
    );
  });
}
