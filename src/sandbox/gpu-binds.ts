/**
 * What a GPU replica's sandbox adds to a CPU replica's (issue 44), and nothing else: the same uid,
 * namespaces, read-only root and limits. Measured on an H200 (driver 580, open kernel module): binding the
 * control nodes and the GPU's own node is enough for CUDA at full speed; `/sys` is not needed.
 *
 * After bwrap's `--proc /proc` and `--dev /dev`:
 * - `--dev-bind` of `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` (those the host has) and of
 *   each of the replica's own GPUs, `/dev/nvidia<minor>`, at their usual paths; no other GPU's node exists
 *   inside, and the sandbox cannot make one (no CAP_MKNOD, and /dev is bwrap's own tmpfs).
 * - `/proc/driver` as a tmpfs holding only the driver's `version` and its GPUs' `gpus/<bus>` folders, read
 *   only: procfs cannot be given folders, but a tmpfs over `/proc/driver` with binds under it works, also
 *   where the host has no driver (CI's fake trees).
 * - The driver's libraries (of the running version) read-only in GPU_LIB_DIR, each under its versioned name
 *   with its soname as a link, and `nvidia-smi` in GPU_BIN_DIR: one fixed place for host-root and image apps
 *   alike (an image has no driver; the host's /usr is bound read-only, so nothing can be made under it).
 * - The variables: NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES the GPUs' UUIDs, CUDA_DEVICE_ORDER
 *   PCI_BUS_ID, and GPU_LIB_DIR and GPU_BIN_DIR to put on LD_LIBRARY_PATH and PATH.
 */
import path from 'node:path';
import type { GpuDevice, GpuInventory } from '../gpus/discovery.js';

/** Where the driver's libraries are inside a GPU replica. */
export const GPU_LIB_DIR = '/ferry/nvidia/lib64';
/** Where `nvidia-smi` is inside a GPU replica. */
export const GPU_BIN_DIR = '/ferry/nvidia/bin';

export interface GpuSandbox {
  /** bwrap options, to come after `--proc /proc` and `--dev /dev`. */
  args: string[];
  /** Variables the replica gets (LD_LIBRARY_PATH and PATH: the caller prepends/appends to its own). */
  env: { NVIDIA_VISIBLE_DEVICES: string; CUDA_VISIBLE_DEVICES: string; CUDA_DEVICE_ORDER: string };
  /** Host paths bwrap binds (for the reachability check of a sandbox that drops to another uid). */
  bound: string[];
}

/** The sandbox of a replica holding `gpus` (each one of `inventory.gpus`). */
export function gpuSandbox(inventory: GpuInventory, gpus: readonly GpuDevice[]): GpuSandbox {
  const args: string[] = [];
  const bound: string[] = [];
  const bind = (flag: string, host: string, inside: string) => {
    args.push(flag, host, inside);
    bound.push(host);
  };
  for (const control of inventory.controlDevices) bind('--dev-bind', control.device, `/dev/${control.name}`);
  for (const gpu of gpus) bind('--dev-bind', gpu.device, `/dev/nvidia${gpu.minor}`);

  const driver = path.join(inventory.root, 'proc', 'driver', 'nvidia');
  args.push('--tmpfs', '/proc/driver');
  if (inventory.driverVersion !== null) bind('--ro-bind', path.join(driver, 'version'), '/proc/driver/nvidia/version');
  for (const gpu of gpus) {
    bind('--ro-bind', path.join(driver, 'gpus', gpu.procName), `/proc/driver/nvidia/gpus/${gpu.procName}`);
  }
  args.push('--remount-ro', '/proc/driver');

  for (const lib of inventory.libraries) {
    const name = path.basename(lib.file);
    bind('--ro-bind', lib.file, `${GPU_LIB_DIR}/${name}`);
    if (lib.soname !== name) args.push('--symlink', name, `${GPU_LIB_DIR}/${lib.soname}`);
  }
  if (inventory.smi) bind('--ro-bind', inventory.smi, `${GPU_BIN_DIR}/nvidia-smi`);

  const uuids = gpus.map((g) => g.uuid).join(',');
  return {
    args,
    env: { NVIDIA_VISIBLE_DEVICES: uuids, CUDA_VISIBLE_DEVICES: uuids, CUDA_DEVICE_ORDER: 'PCI_BUS_ID' },
    bound,
  };
}
