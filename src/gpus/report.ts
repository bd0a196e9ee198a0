/**
 * The GPU part of `ferry doctor` (issue 44): the driver's version, each GPU Ferry may give replicas (its
 * model, UUID, bus location and device node, and its memory where `nvidia-smi` answers), the libraries
 * found, and what is wrong with its fix.
 */
import { discoverGpus, type GpuInventory } from './discovery.js';
import { querySmi, type SmiGpu } from './nvidia-smi.js';
import { resolveGpuSettings } from './settings.js';

export interface GpuReport {
  inventory: GpuInventory | null;
  /** nvidia-smi's view by UUID (empty without it). */
  smi: Record<string, SmiGpu>;
  /** Lines for the report, the first beside the label. */
  lines: string[];
  /** Warnings (problems of the inventory, or a malformed setting). */
  warnings: string[];
}

export async function gpuReport(env: NodeJS.ProcessEnv): Promise<GpuReport> {
  let settings: ReturnType<typeof resolveGpuSettings>;
  try {
    settings = resolveGpuSettings(env);
  } catch (err) {
    const message = (err as Error).message;
    return { inventory: null, smi: {}, lines: [`not read: ${message}`], warnings: [message] };
  }
  const inventory = await discoverGpus(settings);
  const smi = inventory.smi ? await querySmi(inventory.smi) : new Map<string, SmiGpu>();
  const lines: string[] = [];
  const under = settings.root === '/' ? '' : ` (under FERRY_NVIDIA_ROOT=${settings.root})`;
  if (inventory.driverVersion === null && inventory.gpus.length === 0 && inventory.ignored.length === 0) {
    lines.push(`none: no NVIDIA driver${under}`);
  } else {
    lines.push(
      `NVIDIA driver ${inventory.driverVersion ?? '(version unknown)'}${under}: ${inventory.gpus.length} GPU(s) for replicas${inventory.ignored.length > 0 ? `, ${inventory.ignored.length} left out by FERRY_GPUS` : ''}`,
    );
    for (const gpu of inventory.gpus) {
      const seen = smi.get(gpu.uuid);
      const memory = seen?.memoryTotalMiB != null ? `, ${seen.memoryTotalMiB} MiB` : '';
      lines.push(
        `${gpu.model ?? `unnamed ("${gpu.driverName}")`} ${gpu.uuid} at ${gpu.busId}, ${gpu.device}${memory}${gpu.usable ? '' : ' (cannot be opened by a sandbox)'}`,
      );
    }
    lines.push(
      `libraries: ${inventory.libraries.length > 0 ? inventory.libraries.map((l) => l.soname).join(', ') : 'none found'}; nvidia-smi: ${inventory.smi ?? 'not found'}`,
    );
  }
  return { inventory, smi: Object.fromEntries(smi), lines, warnings: [...inventory.problems] };
}
