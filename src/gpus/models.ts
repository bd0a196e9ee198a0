/**
 * GPU models as apps name them and as drivers name them (issue 44): the one table both sides go through.
 *
 * An app asks for a model by Ferry's canonical name (`H100`, `A100-80GB`, …), case-insensitive, by one of
 * Cerebrium's names (`HOPPER_H100`), by `A100` (either size), or by `any`. A node names each GPU it finds by
 * the driver's own name (`NVIDIA H100 80GB HBM3`, from /proc/driver/nvidia/gpus/<bus>/information) mapped
 * through DRIVER_NAMES; an operator names a card the table lacks with FERRY_GPU_MODEL_ALIASES
 * (`driver name=model,...`). A GPU whose driver name maps to nothing has no model, and no app's request
 * matches it except `any`.
 */

/** Ferry's canonical model names, in the order docs list them. */
export const GPU_MODELS = [
  'T4',
  'L4',
  'A10',
  'A10G',
  'L40S',
  'A100-40GB',
  'A100-80GB',
  'H100',
  'H200',
  'B200',
] as const;
export type GpuModel = (typeof GPU_MODELS)[number];

/** Names an app may use for a model (upper-cased) beside the canonical ones: Cerebrium's. */
const REQUEST_ALIASES: Record<string, GpuModel[]> = {
  A100: ['A100-40GB', 'A100-80GB'],
  TURING_T4: ['T4'],
  ADA_L4: ['L4'],
  AMPERE_A10: ['A10'],
  ADA_L40: ['L40S'],
  AMPERE_A100: ['A100-40GB'],
  AMPERE_A100_80GB: ['A100-80GB'],
  HOPPER_H100: ['H100'],
  HOPPER_H200: ['H200'],
  BLACKWELL_B200: ['B200'],
};

/** The driver's names (the `Model:` line of a GPU's information file) → the model. */
export const DRIVER_NAMES: Record<string, GpuModel> = {
  'NVIDIA H200': 'H200',
  'NVIDIA H100 80GB HBM3': 'H100',
  'NVIDIA H100 PCIe': 'H100',
  'NVIDIA H100 NVL': 'H100',
  'NVIDIA A100-SXM4-80GB': 'A100-80GB',
  'NVIDIA A100 80GB PCIe': 'A100-80GB',
  'NVIDIA A100-SXM4-40GB': 'A100-40GB',
  'NVIDIA A100-PCIE-40GB': 'A100-40GB',
  'NVIDIA L40S': 'L40S',
  'NVIDIA L4': 'L4',
  'NVIDIA A10': 'A10',
  'NVIDIA A10G': 'A10G',
  'Tesla T4': 'T4',
  'NVIDIA B200': 'B200',
};

/** Every name `parseGpuNames` takes, for error messages. */
export function knownGpuNames(): string[] {
  return [...GPU_MODELS, ...Object.keys(REQUEST_ALIASES), 'any'];
}

/**
 * An app's `[resources] gpu`, resolved: the models it takes, in order of preference (duplicates dropped),
 * then, with `any`, whatever other GPU is free.
 */
export interface GpuChoice {
  models: GpuModel[];
  any: boolean;
}

/**
 * Resolves `gpu` (one name or a list, in order of preference). Returns the names it does not know as
 * `unknown` (the caller words the config error), never throws.
 */
export function parseGpuNames(value: string | string[]): { choice: GpuChoice; unknown: string[] } {
  const names = Array.isArray(value) ? value : [value];
  const choice: GpuChoice = { models: [], any: false };
  const unknown: string[] = [];
  for (const raw of names) {
    const name = raw.trim().toUpperCase();
    if (name === 'ANY') {
      choice.any = true;
      continue;
    }
    const canonical = GPU_MODELS.find((m) => m === name);
    const found = canonical ? [canonical] : REQUEST_ALIASES[name];
    if (!found) unknown.push(raw);
    else for (const model of found) if (!choice.models.includes(model)) choice.models.push(model);
  }
  return { choice, unknown };
}

/** Whether a GPU of `model` (null: one the tables do not name) meets `choice`. */
export function gpuMatches(choice: GpuChoice, model: GpuModel | null): boolean {
  return choice.any || (model !== null && choice.models.includes(model));
}

/**
 * FERRY_GPU_MODEL_ALIASES (`driver name=model,...`): the operator's names for cards DRIVER_NAMES lacks.
 * Throws an Error naming the bad part (the server refuses to start with it).
 */
export function parseModelAliases(text: string | undefined): Record<string, GpuModel> {
  const out: Record<string, GpuModel> = {};
  if (!text || text.trim() === '') return out;
  for (const part of text.split(',')) {
    const eq = part.lastIndexOf('=');
    const driver = part.slice(0, eq).trim();
    const model = part
      .slice(eq + 1)
      .trim()
      .toUpperCase();
    const canonical = GPU_MODELS.find((m) => m === model);
    if (eq <= 0 || driver === '' || !canonical) {
      throw new Error(
        `FERRY_GPU_MODEL_ALIASES: ${JSON.stringify(part.trim())} is not "driver name=model" with a model of ${GPU_MODELS.join(', ')}`,
      );
    }
    out[driver] = canonical;
  }
  return out;
}

/** The model of a GPU the driver names `driverName`, or null when neither table knows it. */
export function modelOf(driverName: string, aliases: Record<string, GpuModel> = {}): GpuModel | null {
  return aliases[driverName] ?? DRIVER_NAMES[driverName] ?? null;
}
