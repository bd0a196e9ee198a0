/**
 * What NVIDIA GPUs a node has, read from the driver's own files (issue 44), at start and by `ferry doctor`:
 *
 * - each GPU from `<root>/proc/driver/nvidia/gpus/<bus>/information` (its model as the driver names it, UUID,
 *   bus location, device minor: its node is `/dev/nvidia<minor>`, from the minor, never from an index);
 * - the driver's version from `<root>/proc/driver/nvidia/version`;
 * - the control nodes every GPU process opens (`nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`) and each GPU's
 *   node, with whether a sandbox's unprivileged uid can open them (mode 0666, as the driver makes them by
 *   default; `/dev/nvidia-caps/*`, for MIG, are root-only and not used);
 * - the driver's user-space libraries of the compute and utility set, only files of the running driver's
 *   version: through `ldconfig -p` when the root is `/`, else in `<root>/usr/lib/x86_64-linux-gnu`,
 *   `<root>/usr/lib64` and `<root>/usr/local/nvidia/lib64`; and `nvidia-smi`.
 *
 * `root` is FERRY_NVIDIA_ROOT (default `/`): tests point it at a fake tree. FERRY_GPUS (`all`, `none`, or a
 * comma list of device minors or UUIDs) gives Ferry only some of the GPUs. Nothing here throws for what a
 * host lacks: a node without the driver has no GPUs, and what is wrong goes to `problems`.
 */
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { type GpuModel, modelOf } from './models.js';

export interface GpuDevice {
  /** The driver's name (`NVIDIA H200`). */
  driverName: string;
  /** Ferry's model, null when no table names the card (FERRY_GPU_MODEL_ALIASES can). */
  model: GpuModel | null;
  uuid: string;
  /** PCI bus location (`0000:3b:00.0`). */
  busId: string;
  /** Its folder in the driver's `gpus/` (named by its bus location). */
  procName: string;
  /** The device minor: the GPU's node is `/dev/nvidia<minor>`. */
  minor: number;
  /** The node on the host (under the root). */
  device: string;
  /** Whether a sandbox's uid can open the node (mode 0666 character device). */
  usable: boolean;
}

export interface DriverLibrary {
  /** The name programs load (`libcuda.so.1`). */
  soname: string;
  /** The host file, of the running driver's version (`.../libcuda.so.580.159.04`). */
  file: string;
}

export interface GpuInventory {
  /** FERRY_NVIDIA_ROOT. */
  root: string;
  /** The running driver's version; null without a driver. */
  driverVersion: string | null;
  /** The GPUs Ferry may give replicas (FERRY_GPUS applied), by bus location. */
  gpus: GpuDevice[];
  /** GPUs FERRY_GPUS leaves out. */
  ignored: GpuDevice[];
  /** Control nodes present on the host (under the root): `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`. */
  controlDevices: Array<{ name: string; device: string; usable: boolean }>;
  libraries: DriverLibrary[];
  /** `nvidia-smi` on the host, or null. */
  smi: string | null;
  /** What is wrong, each with its fix (ferry doctor prints them; GPU apps are refused while any holds). */
  problems: string[];
}

/** The compute and utility libraries of the driver (what the NVIDIA container toolkit gives to those capabilities). */
export const DRIVER_LIBRARY_NAMES = [
  'libcuda',
  'libcudadebugger',
  'libnvidia-ml',
  'libnvidia-cfg',
  'libnvidia-ptxjitcompiler',
  'libnvidia-nvvm',
  'libnvidia-opencl',
  'libnvidia-gpucomp',
  'libnvidia-allocator',
  'libnvidia-pkcs11',
  'libnvidia-pkcs11-openssl3',
] as const;

/** Where the libraries are looked for under a root other than `/`. */
const LIBRARY_DIRS = ['usr/lib/x86_64-linux-gnu', 'usr/lib64', 'usr/local/nvidia/lib64'];
const CONTROL_DEVICES = ['nvidiactl', 'nvidia-uvm', 'nvidia-uvm-tools'];
/** The control nodes a GPU process cannot work without. */
const REQUIRED_CONTROL = ['nvidiactl', 'nvidia-uvm'];

export interface DiscoveryOptions {
  /** FERRY_NVIDIA_ROOT (default `/`). */
  root?: string;
  /** FERRY_GPUS (default `all`). */
  select?: string;
  /** FERRY_GPU_MODEL_ALIASES, parsed (models.ts parseModelAliases). */
  aliases?: Record<string, GpuModel>;
  /** `ldconfig -p`'s output (tests); by default run when the root is `/`. */
  ldconfig?: () => Promise<string>;
}

/** Reads the node's GPUs (see the module comment). */
export async function discoverGpus(options: DiscoveryOptions = {}): Promise<GpuInventory> {
  const root = path.resolve(options.root ?? '/');
  const problems: string[] = [];
  const inventory: GpuInventory = {
    root,
    driverVersion: null,
    gpus: [],
    ignored: [],
    controlDevices: [],
    libraries: [],
    smi: null,
    problems,
  };
  const driver = path.join(root, 'proc', 'driver', 'nvidia');
  const version = await fs.readFile(path.join(driver, 'version'), 'utf8').catch(() => null);
  const buses = await fs.readdir(path.join(driver, 'gpus')).catch(() => [] as string[]);
  if (version === null && buses.length === 0) return inventory; // no NVIDIA driver: no GPUs, nothing wrong
  inventory.driverVersion = version === null ? null : parseDriverVersion(version);
  if (inventory.driverVersion === null)
    problems.push(`cannot read the driver's version from ${path.join(driver, 'version')}`);

  const found: GpuDevice[] = [];
  for (const bus of buses.sort()) {
    const text = await fs.readFile(path.join(driver, 'gpus', bus, 'information'), 'utf8').catch(() => null);
    const info = text === null ? null : parseInformation(text);
    if (!info) {
      problems.push(`cannot read the GPU at ${bus} (${path.join(driver, 'gpus', bus, 'information')})`);
      continue;
    }
    if (info.excluded) continue; // the driver itself keeps it from every process
    const device = path.join(root, 'dev', `nvidia${info.minor}`);
    const usable = await openableByOthers(device);
    found.push({
      driverName: info.model,
      model: modelOf(info.model, options.aliases),
      uuid: info.uuid,
      busId: info.busId,
      procName: bus,
      minor: info.minor,
      device,
      usable,
    });
  }
  const { chosen, ignored, unknown } = selectGpus(found, options.select ?? 'all');
  inventory.gpus = chosen;
  inventory.ignored = ignored;
  for (const name of unknown) problems.push(`FERRY_GPUS names ${name}, which is not a GPU of this node`);
  for (const gpu of chosen) {
    if (gpu.model === null) {
      problems.push(
        `the GPU ${gpu.uuid} is a "${gpu.driverName}", which Ferry's table does not name: FERRY_GPU_MODEL_ALIASES="${gpu.driverName}=<model>" names it (until then only apps asking for "any" get it)`,
      );
    }
  }

  for (const name of CONTROL_DEVICES) {
    const device = path.join(root, 'dev', name);
    const st = await fs.stat(device).catch(() => null);
    if (!st) {
      if (REQUIRED_CONTROL.includes(name) && chosen.length > 0) {
        problems.push(
          `${device} is missing: load the driver's modules (nvidia, nvidia-uvm) or run nvidia-modprobe -u -c=0`,
        );
      }
      continue;
    }
    inventory.controlDevices.push({ name, device, usable: await openableByOthers(device) });
  }
  const unusable = [
    ...chosen.filter((g) => !g.usable).map((g) => g.device),
    ...inventory.controlDevices.filter((d) => !d.usable).map((d) => d.device),
  ];
  if (unusable.length > 0) {
    problems.push(
      `${unusable.join(', ')}: not character devices of mode 0666, so a sandbox's unprivileged uid cannot open them: chmod 0666 them, or set the driver's NVreg_DeviceFileMode=0666 (GPU apps are refused until then)`,
    );
  }

  if (inventory.driverVersion !== null) {
    inventory.libraries = await driverLibrariesFor(root, inventory.driverVersion, options.ldconfig);
    if (inventory.libraries.length === 0 && chosen.length > 0) {
      problems.push(
        `none of the driver's libraries (libcuda.so.${inventory.driverVersion}, …) was found ${root === '/' ? 'by ldconfig -p' : `under ${LIBRARY_DIRS.map((d) => path.join(root, d)).join(', ')}`}: GPU replicas get their device nodes but CUDA cannot load`,
      );
    }
  }
  inventory.smi = await findSmi(root);
  return inventory;
}

/** The version in the driver's version file (`NVRM version: NVIDIA UNIX ... Kernel Module for x86_64  580.159.04 ...`). */
export function parseDriverVersion(text: string): string | null {
  const match =
    /Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)/.exec(text) ?? /\s(\d{3}\.\d+(?:\.\d+)?)\s/.exec(text);
  return match ? match[1]! : null;
}

/** The fields of a GPU's information file that Ferry uses; null when one is missing. */
export function parseInformation(
  text: string,
): { model: string; uuid: string; busId: string; minor: number; excluded: boolean } | null {
  const fields = new Map<string, string>();
  for (const line of text.split('\n')) {
    const colon = line.indexOf(':');
    if (colon > 0) fields.set(line.slice(0, colon).trim(), line.slice(colon + 1).trim());
  }
  const model = fields.get('Model');
  const uuid = fields.get('GPU UUID');
  const busId = fields.get('Bus Location');
  const minorText = fields.get('Device Minor');
  if (!model || !uuid || !busId || minorText === undefined || !/^\d{1,3}$/.test(minorText)) return null;
  return { model, uuid, busId, minor: Number(minorText), excluded: /^yes$/i.test(fields.get('GPU Excluded') ?? '') };
}

/** FERRY_GPUS applied: `all`, `none`, or a comma list of device minors and UUIDs. */
export function selectGpus(
  gpus: GpuDevice[],
  select: string,
): { chosen: GpuDevice[]; ignored: GpuDevice[]; unknown: string[] } {
  const text = select.trim().toLowerCase();
  if (text === '' || text === 'all') return { chosen: gpus, ignored: [], unknown: [] };
  if (text === 'none') return { chosen: [], ignored: gpus, unknown: [] };
  const wanted = select
    .split(',')
    .map((s) => s.trim())
    .filter((s) => s !== '');
  const matches = (gpu: GpuDevice, w: string) =>
    (/^\d+$/.test(w) && Number(w) === gpu.minor) || w.toLowerCase() === gpu.uuid.toLowerCase();
  const chosen = gpus.filter((gpu) => wanted.some((w) => matches(gpu, w)));
  return {
    chosen,
    ignored: gpus.filter((gpu) => !chosen.includes(gpu)),
    unknown: wanted.filter((w) => !gpus.some((gpu) => matches(gpu, w))),
  };
}

/** A character device a stranger uid may read and write (mode o+rw). */
async function openableByOthers(device: string): Promise<boolean> {
  const st = await fs.stat(device).catch(() => null);
  return st?.isCharacterDevice() === true && (st.mode & 0o006) === 0o006;
}

const LIBRARY_PATTERN = new RegExp(
  `^(${DRIVER_LIBRARY_NAMES.map((n) => n.replace(/[-.]/g, '\\$&')).join('|')})\\.so(\\.[0-9.]+)?$`,
);

/** The driver's libraries of `version`: each name programs load, with its versioned file. */
export async function driverLibrariesFor(
  root: string,
  version: string,
  ldconfig?: () => Promise<string>,
): Promise<DriverLibrary[]> {
  const candidates: string[] = [];
  if (root === '/') {
    const output = await (ldconfig ?? runLdconfig)().catch(() => '');
    for (const line of output.split('\n')) {
      const match = /^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\/\S+)$/.exec(line);
      if (match && LIBRARY_PATTERN.test(match[1]!) && /x86-64/.test(match[2]!)) candidates.push(match[3]!);
    }
  } else {
    for (const dir of LIBRARY_DIRS) {
      for (const name of await fs.readdir(path.join(root, dir)).catch(() => [] as string[])) {
        if (LIBRARY_PATTERN.test(name)) candidates.push(path.join(root, dir, name));
      }
    }
  }
  const out: DriverLibrary[] = [];
  const seen = new Set<string>();
  const covered = new Set<string>();
  const files: string[] = [];
  for (const candidate of candidates) {
    const file = await fs.realpath(candidate).catch(() => null);
    // Only the running driver's files: a library left by an older driver would not talk to this module.
    if (!file || !path.basename(file).endsWith(`.so.${version}`)) continue;
    if (file === candidate) {
      files.push(file); // the versioned file itself: its own name unless a soname link points at it
      continue;
    }
    const soname = path.basename(candidate);
    covered.add(file);
    if (seen.has(soname)) continue;
    seen.add(soname);
    out.push({ soname, file });
  }
  for (const file of files) {
    if (covered.has(file) || seen.has(path.basename(file))) continue;
    seen.add(path.basename(file));
    out.push({ soname: path.basename(file), file });
  }
  return out.sort((a, b) => a.soname.localeCompare(b.soname));
}

/** `ldconfig -p` (Debian keeps it in /sbin, others in /usr/sbin). */
async function runLdconfig(): Promise<string> {
  for (const ldconfig of ['/sbin/ldconfig', '/usr/sbin/ldconfig']) {
    const output = await new Promise<string | null>((resolve) => {
      execFile(ldconfig, ['-p'], { timeout: 10_000, env: { PATH: '/usr/sbin:/usr/bin:/sbin:/bin' } }, (err, stdout) =>
        resolve(err ? null : stdout),
      );
    });
    if (output !== null) return output;
  }
  return '';
}

async function findSmi(root: string): Promise<string | null> {
  for (const dir of ['usr/bin', 'usr/local/nvidia/bin', 'usr/local/bin']) {
    const file = path.join(root, dir, 'nvidia-smi');
    const st = await fs.stat(file).catch(() => null);
    if (st?.isFile() && (st.mode & 0o111) !== 0) return file;
  }
  return null;
}
