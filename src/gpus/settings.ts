/**
 * The operator's GPU settings (issue 44), read from the environment: FERRY_NVIDIA_ROOT (where the driver's
 * files and device nodes are read, default `/`; tests point it at a fake tree), FERRY_GPUS (`all`, `none`,
 * or a comma list of device minors or UUIDs), FERRY_GPU_MODEL_ALIASES (`driver name=model,...`).
 */
import path from 'node:path';
import { type GpuModel, parseModelAliases } from './models.js';

export interface GpuSettings {
  root: string;
  select: string;
  aliases: Record<string, GpuModel>;
}

/** Throws an Error naming the setting when one is malformed. */
export function resolveGpuSettings(env: NodeJS.ProcessEnv): GpuSettings {
  const select = (env.FERRY_GPUS ?? 'all').trim();
  if (select === '') throw new Error('FERRY_GPUS is empty: all, none, or a comma list of device minors or GPU UUIDs');
  return {
    root: path.resolve(env.FERRY_NVIDIA_ROOT || '/'),
    select,
    aliases: parseModelAliases(env.FERRY_GPU_MODEL_ALIASES),
  };
}
