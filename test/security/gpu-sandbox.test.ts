/**
 * A GPU replica's sandbox (src/sandbox/gpu-binds.ts, issue 44) on a fake NVIDIA tree (CI has no GPU): the
 * real replica arguments (sandbox/launch.ts baseBwrapArgs) plus the GPU binds, under bwrap. The replica sees
 * its own GPU's node and the control nodes, its GPU's /proc/driver/nvidia/gpus entry only, the driver's
 * libraries and nvidia-smi at the fixed place, and the variables; it cannot open another GPU's node, cannot
 * change what /proc/driver shows, and a CPU replica sees no /dev/nvidia* at all.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { discoverGpus, type GpuInventory } from '../../src/gpus/discovery.js';
import { GPU_BIN_DIR, GPU_LIB_DIR, gpuSandbox } from '../../src/sandbox/gpu-binds.js';
import { baseBwrapArgs, detectSandbox, type SandboxCapabilities } from '../../src/sandbox/launch.js';
import { FAKE_DRIVER_VERSION, FAKE_GPUS, makeFakeNvidia } from '../helpers/fake-nvidia.js';
import { tempDir } from '../helpers/ferry.js';

const SCRIPT = `
echo "devices: $(ls /dev | grep nvidia | tr '\\n' ' ')"
echo "gpus: $(ls /proc/driver/nvidia/gpus 2>/dev/null | tr '\\n' ' ')"
echo "version: $(head -c 60 /proc/driver/nvidia/version 2>/dev/null)"
echo "visible: $NVIDIA_VISIBLE_DEVICES|$CUDA_VISIBLE_DEVICES|$CUDA_DEVICE_ORDER"
echo "libs: $(ls ${GPU_LIB_DIR} 2>/dev/null | tr '\\n' ' ')"
echo "libcuda: $(readlink ${GPU_LIB_DIR}/libcuda.so.1)"
echo "smi: $(${GPU_BIN_DIR}/nvidia-smi 2>/dev/null | cut -d, -f1 | tr '\\n' ' ')"
if [ -c /dev/nvidia0 ] && : > /dev/nvidia0 2>/dev/null; then echo "other-gpu: opened"; else echo "other-gpu: refused"; fi
if mknod /dev/nvidia0 c 195 0 2>/dev/null; then echo "mknod: made"; else echo "mknod: refused"; fi
if echo x > /proc/driver/nvidia/version 2>/dev/null; then echo "proc-write: done"; else echo "proc-write: refused"; fi
if mkdir /proc/driver/nvidia/gpus/0000:3b:00.0 2>/dev/null; then echo "proc-mkdir: done"; else echo "proc-mkdir: refused"; fi
if [ -c /dev/nvidia2 ] && : > /dev/nvidia2 2>/dev/null; then echo "own-gpu: opened"; else echo "own-gpu: refused"; fi
`;

/** Runs SCRIPT in bwrap with the replica's base arguments and `extra`; the lines it printed, by key. */
async function inSandbox(
  caps: SandboxCapabilities,
  extra: string[],
  env: Record<string, string>,
): Promise<Record<string, string>> {
  const args = [
    ...(await baseBwrapArgs(caps.bwrapFeatures, 'isolated', caps.identity !== null)),
    ...extra,
    '--clearenv',
    '--setenv',
    'PATH',
    '/usr/bin:/bin',
    ...Object.entries(env).flatMap(([k, v]) => ['--setenv', k, v]),
    '--',
    '/bin/sh',
    '-c',
    SCRIPT,
  ];
  const out = await new Promise<string>((resolve, reject) => {
    const child = spawn(caps.bwrap!, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d));
    child.stderr.on('data', (d: Buffer) => (stderr += d));
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve(stdout) : reject(new Error(`bwrap exited ${code}: ${stderr}`))));
  });
  return Object.fromEntries(
    out
      .trim()
      .split('\n')
      .map((line) => [line.slice(0, line.indexOf(':')), line.slice(line.indexOf(':') + 1).trim()]),
  );
}

describe('security: a GPU replica sees its own GPUs only (fake NVIDIA tree)', () => {
  let work: string;
  let caps: SandboxCapabilities;
  let inventory: GpuInventory;
  before(async () => {
    caps = await detectSandbox();
    assert.ok(caps.bwrap, 'this test needs bubblewrap (bash scripts/setup-system.sh installs it)');
    work = await tempDir('ferry-gpu-sandbox-');
    inventory = await discoverGpus({ root: await makeFakeNvidia(path.join(work, 'nv')) });
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it('binds its GPU node, the control nodes, its /proc entry, the libraries and nvidia-smi, and sets the variables', async () => {
    const mine = inventory.gpus.find((g) => g.minor === 2)!;
    const gpu = gpuSandbox(inventory, [mine]);
    const seen = await inSandbox(caps, gpu.args, gpu.env);
    assert.equal(seen.devices, 'nvidia-uvm nvidia-uvm-tools nvidia2 nvidiactl');
    assert.equal(seen.gpus, mine.procName, "only its own GPU's folder");
    assert.match(seen.version!, /NVRM version: NVIDIA UNIX Open Kernel Module/);
    assert.equal(seen.visible, `${mine.uuid}|${mine.uuid}|PCI_BUS_ID`);
    assert.match(seen.libs!, new RegExp(`libcuda\\.so\\.${FAKE_DRIVER_VERSION.replace(/\./g, '\\.')}`));
    assert.doesNotMatch(seen.libs!, /470/, "an older driver's library is not given");
    assert.equal(seen.libcuda, `libcuda.so.${FAKE_DRIVER_VERSION}`);
    assert.equal(seen.smi, FAKE_GPUS.map((g) => g.uuid).join(' '), 'nvidia-smi runs (the fake prints every UUID)');
    assert.equal(seen['own-gpu'], 'opened');
    assert.equal(
      seen['other-gpu'],
      'refused',
      "another GPU's node is not there to open (a file of that name is no device)",
    );
    assert.equal(seen.mknod, 'refused', 'nor made');
    assert.equal(seen['proc-write'], 'refused');
    assert.equal(seen['proc-mkdir'], 'refused', '/proc/driver is read-only');
  });

  it('two GPUs for one replica: both nodes, both UUIDs in bus order', async () => {
    const two = inventory.gpus.filter((g) => g.minor !== 2);
    const gpu = gpuSandbox(inventory, two);
    const seen = await inSandbox(caps, gpu.args, gpu.env);
    assert.equal(seen.devices, 'nvidia-uvm nvidia-uvm-tools nvidia0 nvidia3 nvidiactl');
    assert.equal(seen.gpus, two.map((g) => g.procName).join(' '));
    assert.equal(seen.visible, `${two.map((g) => g.uuid).join(',')}|${two.map((g) => g.uuid).join(',')}|PCI_BUS_ID`);
  });

  it('a CPU replica sees no NVIDIA node, no driver folder and no libraries', async () => {
    const seen = await inSandbox(caps, [], {});
    assert.equal(seen.devices, '');
    assert.equal(seen.gpus, '');
    assert.equal(seen.libs, '');
    assert.equal(seen['other-gpu'], 'refused');
    assert.equal(seen['own-gpu'], 'refused');
  });
});
