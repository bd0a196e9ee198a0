/**
 * GPUs as apps name them and as a node finds them (issue 44): the model table (src/gpus/models.ts), the
 * driver's files read under FERRY_NVIDIA_ROOT (src/gpus/discovery.ts) from a fake NVIDIA tree
 * (test/helpers/fake-nvidia.ts: CI has no GPU), FERRY_GPUS, the device modes a sandbox needs, the driver's
 * libraries of the running version only, and nvidia-smi's CSV (src/gpus/nvidia-smi.ts) from recorded output.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { discoverGpus, driverLibrariesFor, parseDriverVersion, parseInformation } from '../src/gpus/discovery.js';
import { gpuMatches, knownGpuNames, modelOf, parseGpuNames, parseModelAliases } from '../src/gpus/models.js';
import { parseSmiCsv, querySmi } from '../src/gpus/nvidia-smi.js';
import { FAKE_DRIVER_VERSION, FAKE_GPUS, informationFile, makeFakeNvidia } from './helpers/fake-nvidia.js';
import { runCli, tempDir } from './helpers/ferry.js';

describe('GPU models: what apps ask for and what drivers say', () => {
  it('takes canonical names in any case, Cerebrium names, A100 as either size, lists in order, and any', () => {
    assert.deepEqual(parseGpuNames('h100'), { choice: { models: ['H100'], any: false }, unknown: [] });
    assert.deepEqual(parseGpuNames('HOPPER_H200').choice.models, ['H200']);
    assert.deepEqual(parseGpuNames('AMPERE_A100').choice.models, ['A100-40GB']);
    assert.deepEqual(parseGpuNames('ampere_a100_80gb').choice.models, ['A100-80GB']);
    assert.deepEqual(parseGpuNames('ADA_L40').choice.models, ['L40S']);
    assert.deepEqual(parseGpuNames('A100').choice.models, ['A100-40GB', 'A100-80GB']);
    assert.deepEqual(parseGpuNames(['H100', 'a100-80gb', 'H100']).choice.models, ['H100', 'A100-80GB']);
    assert.deepEqual(parseGpuNames('any').choice, { models: [], any: true });
    assert.deepEqual(parseGpuNames(['L4', 'any']).choice, { models: ['L4'], any: true });
    assert.deepEqual(parseGpuNames(['H100', 'V100', 'GTX']).unknown, ['V100', 'GTX']);
    for (const name of ['T4', 'L4', 'A10', 'A10G', 'L40S', 'A100-40GB', 'A100-80GB', 'H100', 'H200', 'B200']) {
      assert.deepEqual(parseGpuNames(name).unknown, [], name);
      assert.ok(knownGpuNames().includes(name));
    }
  });

  it('names cards by the driver table, and by FERRY_GPU_MODEL_ALIASES for the rest', () => {
    const table: Array<[string, string]> = [
      ['NVIDIA H200', 'H200'],
      ['NVIDIA H100 80GB HBM3', 'H100'],
      ['NVIDIA H100 PCIe', 'H100'],
      ['NVIDIA A100-SXM4-80GB', 'A100-80GB'],
      ['NVIDIA A100 80GB PCIe', 'A100-80GB'],
      ['NVIDIA A100-SXM4-40GB', 'A100-40GB'],
      ['NVIDIA A100-PCIE-40GB', 'A100-40GB'],
      ['NVIDIA L40S', 'L40S'],
      ['NVIDIA L4', 'L4'],
      ['NVIDIA A10', 'A10'],
      ['NVIDIA A10G', 'A10G'],
      ['Tesla T4', 'T4'],
      ['NVIDIA B200', 'B200'],
    ];
    for (const [driver, model] of table) assert.equal(modelOf(driver), model, driver);
    assert.equal(modelOf('NVIDIA RTX 6000 Ada Generation'), null);
    const aliases = parseModelAliases('NVIDIA RTX 6000 Ada Generation=l40s, NVIDIA H100 NVL=H100');
    assert.equal(modelOf('NVIDIA RTX 6000 Ada Generation', aliases), 'L40S');
    assert.throws(() => parseModelAliases('NVIDIA Foo=V100'), /FERRY_GPU_MODEL_ALIASES: "NVIDIA Foo=V100"/);
    assert.throws(() => parseModelAliases('just a name'), /FERRY_GPU_MODEL_ALIASES/);
    assert.deepEqual(parseModelAliases(''), {});
    assert.equal(gpuMatches({ models: ['H100'], any: false }, 'H100'), true);
    assert.equal(gpuMatches({ models: ['H100'], any: false }, 'H200'), false);
    assert.equal(gpuMatches({ models: ['H100'], any: false }, null), false);
    assert.equal(gpuMatches({ models: [], any: true }, null), true);
  });
});

describe('GPU discovery under FERRY_NVIDIA_ROOT (a fake NVIDIA tree)', () => {
  let work: string;
  before(async () => {
    work = await tempDir('ferry-gpus-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it("reads each GPU's model, UUID, bus and minor, the driver's version, its nodes, libraries and nvidia-smi", async () => {
    const root = await makeFakeNvidia(path.join(work, 'three'));
    const inv = await discoverGpus({ root });
    assert.equal(inv.driverVersion, FAKE_DRIVER_VERSION);
    assert.deepEqual(
      inv.gpus.map((g) => [g.model, g.uuid, g.busId, g.minor, path.relative(root, g.device), g.usable]),
      FAKE_GPUS.map((g) => [modelOf(g.name), g.uuid, g.bus, g.minor, `dev/nvidia${g.minor}`, true]),
    );
    assert.deepEqual(
      inv.controlDevices.map((d) => [d.name, d.usable]),
      [
        ['nvidiactl', true],
        ['nvidia-uvm', true],
        ['nvidia-uvm-tools', true],
      ],
    );
    assert.deepEqual(
      inv.libraries.map((l) => [l.soname, path.basename(l.file)]),
      [
        ['libcuda.so.1', `libcuda.so.${FAKE_DRIVER_VERSION}`],
        [`libnvidia-gpucomp.so.${FAKE_DRIVER_VERSION}`, `libnvidia-gpucomp.so.${FAKE_DRIVER_VERSION}`],
        ['libnvidia-ml.so.1', `libnvidia-ml.so.${FAKE_DRIVER_VERSION}`],
        ['libnvidia-nvvm.so.4', `libnvidia-nvvm.so.${FAKE_DRIVER_VERSION}`],
        ['libnvidia-ptxjitcompiler.so.1', `libnvidia-ptxjitcompiler.so.${FAKE_DRIVER_VERSION}`],
      ],
      "only the running driver's files (not the 470 driver's libnvidia-cfg)",
    );
    assert.equal(inv.smi, path.join(root, 'usr', 'bin', 'nvidia-smi'));
    assert.deepEqual(inv.problems, []);
    const smi = await querySmi(inv.smi!);
    assert.deepEqual(
      [...smi.keys()],
      FAKE_GPUS.map((g) => g.uuid),
    );
  });

  it('FERRY_GPUS gives Ferry some GPUs by minor or UUID, or none; a name it lacks is a problem', async () => {
    const root = await makeFakeNvidia(path.join(work, 'select'));
    const some = await discoverGpus({ root, select: `3, ${FAKE_GPUS[0]!.uuid.toUpperCase()}` });
    assert.deepEqual(
      some.gpus.map((g) => g.minor),
      [0, 3],
    );
    assert.deepEqual(
      some.ignored.map((g) => g.minor),
      [2],
    );
    assert.equal((await discoverGpus({ root, select: 'none' })).gpus.length, 0);
    const wrong = await discoverGpus({ root, select: '1,GPU-nope' });
    assert.deepEqual(wrong.gpus, []);
    assert.equal(wrong.problems.filter((p) => /FERRY_GPUS names/.test(p)).length, 2);
  });

  it('reports nodes a sandbox uid cannot open, a missing nvidiactl, an unnamed card, and skips excluded GPUs', async () => {
    const root = await makeFakeNvidia(path.join(work, 'modes'), {
      gpus: [
        {
          name: 'NVIDIA RTX 6000 Ada Generation',
          uuid: 'GPU-0000aaaa-0000-0000-0000-000000000000',
          bus: '0000:01:00.0',
          minor: 0,
        },
        {
          name: 'NVIDIA L4',
          uuid: 'GPU-0000bbbb-0000-0000-0000-000000000000',
          bus: '0000:02:00.0',
          minor: 1,
          excluded: true,
        },
      ],
      deviceMode: 0o660,
    });
    await fs.rm(path.join(root, 'dev', 'nvidiactl'));
    const inv = await discoverGpus({ root });
    assert.deepEqual(
      inv.gpus.map((g) => [g.minor, g.model, g.usable]),
      [[0, null, false]],
      'the excluded L4 is not offered',
    );
    const text = inv.problems.join('\n');
    assert.match(text, /dev\/nvidiactl is missing/);
    assert.match(text, /not character devices of mode 0666.*NVreg_DeviceFileMode=0666/);
    assert.match(text, /FERRY_GPU_MODEL_ALIASES="NVIDIA RTX 6000 Ada Generation=<model>"/);
    const named = await discoverGpus({ root, aliases: parseModelAliases('NVIDIA RTX 6000 Ada Generation=L40S') });
    assert.equal(named.gpus[0]!.model, 'L40S');
  });

  it('a node without the driver has no GPUs and nothing wrong; a driver without libraries is a problem', async () => {
    const empty = await discoverGpus({ root: path.join(work, 'nothing-here') });
    assert.deepEqual([empty.driverVersion, empty.gpus, empty.problems, empty.smi], [null, [], [], null]);
    const root = await makeFakeNvidia(path.join(work, 'nolibs'), { libraries: false, smi: false });
    const inv = await discoverGpus({ root });
    assert.equal(inv.gpus.length, 3);
    assert.deepEqual(inv.libraries, []);
    assert.equal(inv.smi, null);
    assert.match(inv.problems.join('\n'), /none of the driver's libraries .* was found under/);
  });

  it("with the root at /, the libraries come from ldconfig -p's answer, of the running version and x86-64 only", async () => {
    const lib = path.join(work, 'ldlib');
    await fs.mkdir(lib, { recursive: true });
    await fs.writeFile(path.join(lib, `libcuda.so.${FAKE_DRIVER_VERSION}`), '');
    await fs.symlink(`libcuda.so.${FAKE_DRIVER_VERSION}`, path.join(lib, 'libcuda.so.1'));
    await fs.writeFile(path.join(lib, 'libnvidia-ml.so.470.1'), '');
    await fs.symlink('libnvidia-ml.so.470.1', path.join(lib, 'libnvidia-ml.so.1'));
    const ldconfig = [
      "1234 libs found in cache `/etc/ld.so.cache'",
      `\tlibcuda.so.1 (libc6,x86-64) => ${lib}/libcuda.so.1`,
      `\tlibcuda.so.1 (libc6) => ${lib}/libcuda.so.1`,
      `\tlibnvidia-ml.so.1 (libc6,x86-64) => ${lib}/libnvidia-ml.so.1`,
      `\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6`,
    ].join('\n');
    // The real / has no NVIDIA driver here, so the version comes from a parse of the driver's line.
    assert.equal(
      parseDriverVersion(`NVRM version: NVIDIA UNIX x86_64 Kernel Module  ${FAKE_DRIVER_VERSION}  Release Build`),
      FAKE_DRIVER_VERSION,
    );
    const libs = await driverLibrariesFor('/', FAKE_DRIVER_VERSION, async () => ldconfig);
    assert.deepEqual(
      libs.map((l) => [l.soname, l.file]),
      [['libcuda.so.1', path.join(lib, `libcuda.so.${FAKE_DRIVER_VERSION}`)]],
    );
  });

  it('parses the information file and refuses one missing a field', () => {
    const info = parseInformation(informationFile(FAKE_GPUS[1]!));
    assert.deepEqual(info, {
      model: 'NVIDIA A100-SXM4-80GB',
      uuid: FAKE_GPUS[1]!.uuid,
      busId: '0000:5e:00.0',
      minor: 2,
      excluded: false,
    });
    assert.equal(parseInformation('Model: NVIDIA H200\nGPU UUID: GPU-1\n'), null);
  });
});

describe('ferry doctor: the GPU line', () => {
  it("shows the driver, each GPU with its model, UUID, node and nvidia-smi's memory, and what is wrong", async () => {
    const work = await tempDir('ferry-gpu-doctor-');
    try {
      const root = await makeFakeNvidia(path.join(work, 'nv'));
      const env = {
        FERRY_NVIDIA_ROOT: root,
        FERRY_GPUS: '0,2',
        FERRY_DATA_DIR: path.join(work, 'data'),
        FERRY_URL: 'http://127.0.0.1:1',
      };
      const text = await runCli(['doctor'], env);
      assert.equal(text.code, 0, text.stderr);
      assert.match(
        text.stdout,
        new RegExp(
          `GPUs +NVIDIA driver ${FAKE_DRIVER_VERSION.replace(/\./g, '\\.')} \\(under FERRY_NVIDIA_ROOT=.*\\): 2 GPU\\(s\\) for replicas, 1 left out by FERRY_GPUS`,
        ),
      );
      assert.match(
        text.stdout,
        /H200 GPU-11111111-2222-3333-4444-555555555555 at 0000:3b:00\.0, .*dev\/nvidia0, 81559 MiB/,
      );
      assert.match(text.stdout, /A100-80GB GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee at 0000:5e:00\.0, .*dev\/nvidia2/);
      assert.doesNotMatch(text.stdout, /GPU-12345678/, 'the GPU FERRY_GPUS leaves out is not listed');
      assert.match(text.stdout, /libraries: libcuda\.so\.1, /);
      const json = await runCli(['doctor', '--json'], env);
      const report = JSON.parse(json.stdout);
      assert.deepEqual(
        report.gpus.inventory.gpus.map((g: { minor: number }) => g.minor),
        [0, 2],
      );
      assert.equal(report.gpus.smi['GPU-11111111-2222-3333-4444-555555555555'].memoryTotalMiB, 81559);
      await fs.chmod(path.join(root, 'dev', 'nvidia0'), 0o600);
      const bad = await runCli(['doctor'], { ...env, FERRY_GPU_MODEL_ALIASES: 'NVIDIA Foo=V100' });
      assert.match(bad.stdout, /! FERRY_GPU_MODEL_ALIASES: "NVIDIA Foo=V100"/);
      const unusable = await runCli(['doctor'], env);
      assert.match(unusable.stdout, /! .*dev\/nvidia0: not character devices of mode 0666/);
      const none = await runCli(['doctor'], { ...env, FERRY_NVIDIA_ROOT: path.join(work, 'empty') });
      assert.match(none.stdout, /GPUs +none: no NVIDIA driver/);
    } finally {
      await fs.rm(work, { recursive: true, force: true });
    }
  });
});

describe("nvidia-smi's CSV", () => {
  it('reads each GPU by UUID, with fields the card does not report as null', () => {
    const recorded = [
      'GPU-11111111-2222-3333-4444-555555555555, NVIDIA H200, 143771, 1024, 37',
      'GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee, NVIDIA A100-SXM4-80GB, 81920, [N/A], [Not Supported]',
      'No devices were found',
      '',
    ].join('\n');
    const gpus = parseSmiCsv(recorded);
    assert.deepEqual(
      [...gpus.values()],
      [
        {
          uuid: 'GPU-11111111-2222-3333-4444-555555555555',
          name: 'NVIDIA H200',
          memoryTotalMiB: 143771,
          memoryUsedMiB: 1024,
          utilizationPercent: 37,
        },
        {
          uuid: 'GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee',
          name: 'NVIDIA A100-SXM4-80GB',
          memoryTotalMiB: 81920,
          memoryUsedMiB: null,
          utilizationPercent: null,
        },
      ],
    );
  });
});
