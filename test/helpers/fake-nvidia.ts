/**
 * A fake NVIDIA host under a temporary folder, for FERRY_NVIDIA_ROOT (CI has no GPU): the driver's files in
 * `proc/driver/nvidia` (its version, one `information` file per GPU), `dev/nvidia*` made with mknod as
 * character devices that open (the numbers of /dev/null), the driver's libraries (empty files under their
 * versioned names, with the soname links ldconfig would make) and an `nvidia-smi` script. Needs root (mknod).
 */
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);

export interface FakeGpu {
  /** The driver's name (`NVIDIA H200`). */
  name: string;
  uuid: string;
  bus: string;
  minor: number;
  excluded?: boolean;
}

export const FAKE_DRIVER_VERSION = '580.159.04';

export const FAKE_GPUS: FakeGpu[] = [
  { name: 'NVIDIA H200', uuid: 'GPU-11111111-2222-3333-4444-555555555555', bus: '0000:3b:00.0', minor: 0 },
  { name: 'NVIDIA A100-SXM4-80GB', uuid: 'GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee', bus: '0000:5e:00.0', minor: 2 },
  { name: 'NVIDIA H100 80GB HBM3', uuid: 'GPU-12345678-90ab-cdef-1234-567890abcdef', bus: '0000:86:00.0', minor: 3 },
];

export function informationFile(gpu: FakeGpu): string {
  return [
    `Model: \t\t ${gpu.name}`,
    'IRQ:   \t\t 123',
    `GPU UUID: \t ${gpu.uuid}`,
    'Video BIOS: \t 96.00.a5.00.01',
    'Bus Type: \t PCIe',
    'DMA Size: \t 52 bits',
    'DMA Mask: \t 0xfffffffffffff',
    `Bus Location: \t ${gpu.bus}`,
    `Device Minor: \t ${gpu.minor}`,
    `GPU Excluded:\t ${gpu.excluded ? 'Yes' : 'No'}`,
    '',
  ].join('\n');
}

/** Makes the tree at `root`; returns `root`. */
export async function makeFakeNvidia(
  root: string,
  options: { gpus?: FakeGpu[]; version?: string; libraries?: boolean; smi?: boolean; deviceMode?: number } = {},
): Promise<string> {
  const gpus = options.gpus ?? FAKE_GPUS;
  const version = options.version ?? FAKE_DRIVER_VERSION;
  const driver = path.join(root, 'proc', 'driver', 'nvidia');
  await fs.mkdir(path.join(driver, 'gpus'), { recursive: true });
  await fs.writeFile(
    path.join(driver, 'version'),
    `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  ${version}  Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Oct  2 00:00:00 UTC 2025\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n`,
  );
  for (const gpu of gpus) {
    await fs.mkdir(path.join(driver, 'gpus', gpu.bus), { recursive: true });
    await fs.writeFile(path.join(driver, 'gpus', gpu.bus, 'information'), informationFile(gpu));
  }
  await fs.mkdir(path.join(root, 'dev'), { recursive: true });
  for (const name of ['nvidiactl', 'nvidia-uvm', 'nvidia-uvm-tools', ...gpus.map((g) => `nvidia${g.minor}`)]) {
    const device = path.join(root, 'dev', name);
    await fs.rm(device, { force: true });
    await run('mknod', [device, 'c', '1', '3']);
    await fs.chmod(device, options.deviceMode ?? 0o666);
  }
  if (options.libraries !== false) {
    const lib = path.join(root, 'usr', 'lib', 'x86_64-linux-gnu');
    await fs.mkdir(lib, { recursive: true });
    for (const [name, soname] of [
      ['libcuda', 'libcuda.so.1'],
      ['libnvidia-ml', 'libnvidia-ml.so.1'],
      ['libnvidia-ptxjitcompiler', 'libnvidia-ptxjitcompiler.so.1'],
      ['libnvidia-nvvm', 'libnvidia-nvvm.so.4'],
    ] as const) {
      await fs.writeFile(path.join(lib, `${name}.so.${version}`), '');
      await fs.symlink(`${name}.so.${version}`, path.join(lib, soname)).catch(() => {});
    }
    // One whose soname is its versioned name (no link), as libnvidia-gpucomp's is.
    await fs.writeFile(path.join(lib, `libnvidia-gpucomp.so.${version}`), '');
    // A library an older driver left behind: never given to a replica.
    await fs.writeFile(path.join(lib, 'libnvidia-cfg.so.470.256.02'), '');
    await fs.symlink('libnvidia-cfg.so.470.256.02', path.join(lib, 'libnvidia-cfg.so.1')).catch(() => {});
  }
  if (options.smi !== false) {
    await fs.mkdir(path.join(root, 'usr', 'bin'), { recursive: true });
    const rows = gpus.map((g) => `${g.uuid}, ${g.name}, 81559, 0, 0`).join('\n');
    await fs.writeFile(path.join(root, 'usr', 'bin', 'nvidia-smi'), `#!/bin/sh\nprintf '%s\\n' '${rows}'\n`, {
      mode: 0o755,
    });
  }
  return root;
}
