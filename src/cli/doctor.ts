/**
 * `ferry doctor`: what this machine gives replicas (sandbox, user namespaces, memory limits, runtimes),
 * the data folder (its free space against FERRY_MIN_FREE_MIB, the staging folder sandboxes' folders come
 * from) and what to install for the rest, and the cluster as the configured server sees it (when it can reach
 * one). It always exits 0: a missing sandbox is a warning, not a failure, because Ferry still runs (as
 * plain processes) without one; a server it cannot reach is a line of the report.
 */

import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { resolveServerConfig } from '../config.js';
import { spaceOf } from '../disk-space.js';
import { gpuReport } from '../gpus/report.js';
import { type ImageHostReport, probeImageHost, readCacheUse } from '../images/host-tools.js';
import { findPython } from '../runtimes/python/interpreter.js';
import { type NetworkPlan, planSandboxNetwork } from '../sandbox/choose-network.js';
import { probeSandbox, type SandboxCapabilities } from '../sandbox/launch.js';
import { stagingPlace } from '../sandbox/views.js';
import { imageBackend, peekVolumeUse } from '../volumes/backend.js';
import { probeVolumeSupport } from '../volumes/images.js';
import { localVolumes, nodesWithoutMarker } from '../volumes/markers.js';
import { localQuotaDirs, probeQuotaDirSupport, quotaDirBackend } from '../volumes/quota-dirs.js';
import { clusterLines, readCluster } from './cluster.js';

export interface DoctorOptions {
  json?: boolean;
}

/**
 * Prints the report; with `json`, the capabilities object, with `cluster` (`GET /v2/cluster` of the
 * configured server, or null) and `cluster_problem` (why there is none, or null).
 */
export async function doctorCommand(options: DoctorOptions): Promise<void> {
  // Probed afresh: the doctor is run to check a fix, so a cached answer would defeat it.
  // The interpreter Python replicas and builds use (Debian's /usr/bin/python3 when present), not PATH's.
  const pythonPath = await findPython();
  const [caps, pythonVersion, cluster, gpus] = await Promise.all([
    probeSandbox(),
    pythonPath ? commandVersion(pythonPath, ['--version']) : Promise.resolve(undefined),
    readCluster(),
    gpuReport(process.env),
  ]);
  const python = pythonPath && pythonVersion ? pythonVersion : undefined;
  const network = networkPlan(caps);
  const images = await imagesReport(caps);
  const volumes = await volumesReport(
    caps,
    cluster.view?.nodes.map((n) => n.id),
  );
  const staging = await stagingReport();
  const storage = await storageReport();
  if (options.json) {
    const { tools: _tools, userTools: _userTools, ...plan } = network;
    const report = {
      ...caps,
      network: plan,
      images,
      volumes,
      gpus: { inventory: gpus.inventory, smi: gpus.smi, warnings: gpus.warnings },
      staging,
      storage,
      cluster: cluster.view ?? null,
      cluster_problem: cluster.problem ?? null,
    };
    process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
    return;
  }
  const row = (label: string, value: string) => `  ${label.padEnd(17)}${value}`;
  const lines = ['Ferry doctor', '', row('Node.js', `${process.version} (${process.execPath})`)];

  if (caps.bwrap) {
    lines.push(
      row(
        'Sandbox',
        `bubblewrap ${caps.bwrapVersion ?? '(unknown version)'} at ${caps.bwrap}: works (replicas and builds run isolated, as uid 65534)`,
      ),
    );
  } else {
    lines.push(row('Sandbox', 'NOT AVAILABLE: replicas and builds run as plain processes WITHOUT isolation'));
  }
  lines.push(row('User namespaces', caps.userNamespaces ? 'available' : 'not available'));
  lines.push(row('Sandbox identity', describeIdentity(caps)));
  lines.push(row('Memory limits', describeMemory(caps)));
  lines.push(row('Process limits', describeController(caps, 'pids', 'max_processes')));
  lines.push(row('CPU limits', describeController(caps, 'cpu', 'cpu')));
  lines.push(row('Network', network.description));
  lines.push(row('Python', python ?? 'no usable python3 (3.9+) found: Python apps cannot build or run'));
  lines.push(...imageLines(images).map((line, i) => row(i === 0 ? 'Images' : '', line)));
  lines.push(row('Data folder', describeStorage(storage)));
  lines.push(row('Staging folder', describeStaging(staging)));

  lines.push(
    row(
      'Volumes',
      volumes.available
        ? `available: ${volumes.mechanism} in ${volumes.dir}`
        : `NOT AVAILABLE (FERRY_VOLUMES_BACKEND=${volumes.backend}; volumes are refused, never unbounded): ${volumes.reasons.join('; ')}`,
    ),
  );
  for (const v of volumes.volumes) {
    const size = v.size_bytes === null ? '' : ` of ${formatMiB(v.size_bytes)}`;
    const use =
      v.used_bytes !== null
        ? `${formatMiB(v.used_bytes)} used${size}`
        : volumes.backend === 'quota-dir'
          ? 'use unknown (its quota cannot be read)'
          : `use unknown here (not mounted on this machine; \`ferry volumes list\` asks the server)${v.size_bytes === null ? '' : `, size ${formatMiB(v.size_bytes)}`}`;
    const disk = v.allocated_bytes === null ? '' : ` (the image takes ${formatMiB(v.allocated_bytes)} on disk)`;
    lines.push(row('', `${v.project_id}/${v.name}: ${use}${disk}${v.mounted_here ? ', mounted here' : ''}`));
  }
  lines.push(...gpus.lines.map((line, i) => row(i === 0 ? 'GPUs' : '', line)));
  const warnings = sandboxWarnings(caps);
  warnings.push(...gpus.warnings);
  if (network.warning) warnings.push(network.warning);
  if (volumes.not_shared_with.length > 0) {
    warnings.push(
      `FERRY_VOLUMES_DIR (${volumes.dir}) is not the folder node(s) ${volumes.not_shared_with.join(', ')} use: their markers are not in it. Mount the same shared filesystem at the same path on every node (docs/scaling-out.md, "Volumes")`,
    );
  }
  if (warnings.length > 0) {
    lines.push('', 'Warnings:', ...warnings.map((warning) => `  ! ${warning}`));
  }
  const notes = caps.reasons.filter((reason) => !warnings.some((warning) => warning.includes(reason)));
  if (notes.length > 0) lines.push('', 'Details:', ...notes.map((note) => `  - ${note}`));
  const fixes = suggestedFixes(caps);
  if (fixes.length > 0) lines.push('', 'To fix:', ...fixes.map((fix) => `  ${fix}`));
  lines.push('', `Cluster (as ${cluster.url} sees it):`);
  if (cluster.view) lines.push(...clusterLines(cluster.view).map((line) => `  ${line}`));
  else lines.push(`  not shown: ${cluster.problem ?? 'unknown'}`);
  process.stdout.write(`${lines.join('\n')}\n`);
}

type ImagesReport = ImageHostReport & {
  cache: { dir: string; bytes: number; images: number; max_bytes: number } | null;
  settings_problem: string | null;
};

/** Whether images (`[image]` in ferry.toml) can be built and run here, and the cache's use. */
async function imagesReport(caps: SandboxCapabilities): Promise<ImagesReport> {
  const host = await probeImageHost(caps.bwrap !== null);
  try {
    const config = resolveServerConfig({}, process.env);
    const use = await readCacheUse(config.dataDir);
    return {
      ...host,
      cache: use && { dir: config.dataDir, ...use, max_bytes: config.images.cacheBytes },
      settings_problem: null,
    };
  } catch (err) {
    return { ...host, cache: null, settings_problem: (err as Error).message };
  }
}

function imageLines(images: ImagesReport): string[] {
  const mib = (bytes: number) => `${Math.round(bytes / 1024 / 1024)} MiB`;
  const lines = [
    `can run: ${images.canRun ? 'yes' : 'no'}; can build: ${images.canBuild ? 'yes' : 'no'}` +
      ' ([image] base images, apt and run steps and Dockerfiles, built at deploy)',
  ];
  if (images.missing.length > 0) lines.push(`missing: ${images.missing.join('; ')}`);
  if (images.cache) {
    lines.push(`cache: ${images.cache.images} unpacked, ${mib(images.cache.bytes)} of ${mib(images.cache.max_bytes)}`);
  }
  if (images.settings_problem) lines.push(`settings: ${images.settings_problem}`);
  return lines;
}

/**
 * What `ferry serve` should log at start (at warn level), one line each; empty when replicas are
 * sandboxed and limited by a cgroup (memory, processes, CPU).
 */
export function sandboxWarnings(caps: SandboxCapabilities): string[] {
  const warnings: string[] = [];
  if (!caps.bwrap) {
    const why = caps.reasons.filter((reason) => /bwrap|bubblewrap|FERRY_SANDBOX|namespace/i.test(reason));
    const fix = why.some((reason) => reason.startsWith('FERRY_SANDBOX=off'))
      ? 'Unset FERRY_SANDBOX to sandbox them.'
      : caps.bwrapVersion === null
        ? 'Install bubblewrap (apt-get install bubblewrap); `ferry doctor` checks the result.'
        : 'Run `ferry doctor` for what is missing.';
    warnings.push(
      `NO SANDBOX: replicas and builds (npm, pip, esbuild) run as plain processes WITHOUT isolation${isRoot() ? ', as root,' : ''} and can read Ferry's data directory (signing keys included) and other apps' files. ${why.join('; ')}. ${fix}`,
    );
  }
  const unlimited = (['pids', 'cpu'] as const).filter((c) => !caps.cgroup?.controllers[c]);
  if (unlimited.length > 0) {
    warnings.push(
      `NO ${unlimited.map((c) => (c === 'pids' ? 'PROCESS' : 'CPU')).join(' AND NO ')} LIMIT: no writable ${unlimited.join('/')} cgroup, so ${unlimited.map((c) => (c === 'pids' ? '[resources].max_processes' : '[resources].cpu')).join(' and ')} ${unlimited.length > 1 ? 'are' : 'is'} not enforced (a fork bomb or a busy loop in one app takes the machine). Run \`ferry doctor\` for why.`,
    );
  }
  if (!caps.cgroup?.controllers.memory) {
    warnings.push(
      caps.prlimit
        ? 'No writable memory cgroup: replica memory is limited with RLIMIT_DATA only (allocation failures instead of OOM kills, which are not reported). Run `ferry doctor` for why.'
        : 'Replicas run WITHOUT a memory limit: no writable memory cgroup and no prlimit (util-linux). Run `ferry doctor` for why.',
    );
  }
  return warnings;
}

function describeController(caps: SandboxCapabilities, controller: 'pids' | 'cpu', key: string): string {
  const dir = caps.cgroup?.controllers[controller];
  if (dir) return `cgroup v${caps.cgroup!.version} ${controller} at ${dir} ([resources].${key})`;
  return `NONE: [resources].${key} is not enforced`;
}

/** Which host uid a sandbox's uid 65534 maps to: never root (sandbox/identity.ts). */
function describeIdentity(caps: SandboxCapabilities): string {
  const id = caps.identity;
  if (id) {
    return `each sandbox runs as a host uid of its own in ${id.first}-${id.first + id.count - 1} (from ${id.source}), never root`;
  }
  if (typeof process.getuid === 'function' && process.getuid() === 0) {
    return 'Ferry is root and cannot drop sandboxes to another uid (setpriv missing): sandboxing is off';
  }
  return "sandboxes map to this server's own uid (Ferry is not root)";
}

/** What `ferry serve` would give sandboxes with the environment's settings (FERRY_EGRESS and friends). */
function networkPlan(caps: SandboxCapabilities): NetworkPlan {
  try {
    return planSandboxNetwork(resolveServerConfig({}, process.env).egress, caps);
  } catch (err) {
    const message = `the server settings are invalid: ${(err as Error).message}`;
    return { mode: 'none', description: message, warning: message, tools: null };
  }
}

function describeMemory(caps: SandboxCapabilities): string {
  const dir = caps.cgroup?.controllers.memory;
  if (caps.cgroup && dir) return `cgroup v${caps.cgroup.version} at ${dir} (tmpfs in the sandbox counts too)`;
  if (caps.prlimit) return `RLIMIT_DATA via ${caps.prlimit} (no writable memory cgroup; OOM kills are not reported)`;
  return 'NONE: replicas can use all the memory of the machine';
}

function suggestedFixes(caps: SandboxCapabilities): string[] {
  const fixes: string[] = [];
  if (!caps.bwrap && caps.bwrapVersion === null)
    fixes.push('apt-get install bubblewrap   (Fedora: dnf install bubblewrap)');
  if (!caps.bwrap && caps.bwrapVersion !== null && !caps.userNamespaces) {
    fixes.push(
      'enable user namespaces: sysctl -w kernel.unprivileged_userns_clone=1 (or user.max_user_namespaces > 0)',
    );
  }
  const missing = (['memory', 'pids', 'cpu'] as const).filter((c) => !caps.cgroup?.controllers[c]);
  if (missing.includes('memory') && !caps.prlimit) fixes.push('apt-get install util-linux   (for prlimit)');
  if (missing.length > 0) {
    fixes.push(
      `for cgroup ${missing.join(', ')} limits, run Ferry where its cgroup is writable (root, or a systemd unit with Delegate=yes)`,
    );
  }
  return fixes;
}

function isRoot(): boolean {
  return typeof process.getuid === 'function' && process.getuid() === 0;
}

function commandVersion(command: string, args: string[]): Promise<string | null> {
  return new Promise((resolve) => {
    execFile(command, args, { timeout: 5_000 }, (err, stdout, stderr) => {
      if (err) resolve(null);
      else resolve(`${(stdout || stderr).trim()} (${command})`);
    });
  });
}

/** A volume as the doctor reports it. */
interface VolumeLine {
  project_id: string;
  name: string;
  size_bytes: number | null;
  /** Its use, read as the server reads it (volumes/backend.ts `peekVolumeUse`); null when not readable here. */
  used_bytes: number | null;
  /** An image's allocated blocks on the host's disk; null for a quota-dir volume. */
  allocated_bytes: number | null;
  mounted_here: boolean;
}

/**
 * Volumes on this node: the mechanism, the volumes in FERRY_VOLUMES_DIR with their use (the figure
 * `ferry volumes list` shows, by the same function), and whether every live node shares the folder.
 */
async function volumesReport(caps: SandboxCapabilities, liveNodes: string[] | undefined) {
  const { volumesDir: dir, volumesBackend: backend } = resolveServerConfig({}, process.env);
  const ref = (v: { project_id: string; name: string }) => ({ projectId: v.project_id, name: v.name, quotaId: null });
  if (backend === 'quota-dir') {
    const support = await probeQuotaDirSupport(dir, caps.bwrap !== null, false);
    const quotaDirs = quotaDirBackend(dir, support);
    const volumes: VolumeLine[] = [];
    for (const v of await localQuotaDirs(dir, support.quota)) {
      volumes.push({
        project_id: v.project_id,
        name: v.name,
        size_bytes: v.size_bytes,
        used_bytes: (await peekVolumeUse(quotaDirs, ref(v)))?.used_bytes ?? null,
        allocated_bytes: null,
        mounted_here: false,
      });
    }
    return {
      available: support.available,
      reasons: support.reasons,
      backend,
      mechanism: support.quota?.description ?? null,
      dir,
      volumes,
      not_shared_with: liveNodes ? await nodesWithoutMarker(dir, liveNodes) : [],
    };
  }
  const support = await probeVolumeSupport(caps.bwrap !== null);
  const images = imageBackend(dir, support);
  const volumes: VolumeLine[] = [];
  for (const v of await localVolumes(dir)) {
    // Read only where it is mounted already: the doctor mounts nothing.
    const used = v.mounted_here ? ((await peekVolumeUse(images, ref(v)))?.used_bytes ?? null) : null;
    volumes.push({ ...v, used_bytes: used });
  }
  return {
    available: support.available,
    reasons: support.reasons,
    backend,
    mechanism: "ext4 images on loop devices (writes past a volume's size fail with ENOSPC)",
    dir,
    volumes,
    /** Live nodes (as the server lists them) whose marker is missing here; [] when none or unknown. */
    not_shared_with: liveNodes ? await nodesWithoutMarker(dir, liveNodes) : [],
  };
}

type StorageReport =
  | { dir: string; free_bytes: number; total_bytes: number; min_free_bytes: number; low: boolean }
  | { dir: string | null; problem: string };

/** The data folder's free space, against FERRY_MIN_FREE_MIB (disk-space.ts: what `ferry serve` watches). */
async function storageReport(): Promise<StorageReport> {
  let config: ReturnType<typeof resolveServerConfig>;
  try {
    config = resolveServerConfig({}, process.env);
  } catch (err) {
    return { dir: null, problem: `the server settings are invalid: ${(err as Error).message}` };
  }
  const dir = path.resolve(config.dataDir);
  try {
    const { freeBytes, totalBytes } = spaceOf(await fs.statfs(dir));
    const minFree = config.minFreeMib * 1024 * 1024;
    return { dir, free_bytes: freeBytes, total_bytes: totalBytes, min_free_bytes: minFree, low: freeBytes < minFree };
  } catch (err) {
    return { dir, problem: `cannot be read: ${(err as Error).message}` };
  }
}

function describeStorage(storage: StorageReport): string {
  if ('problem' in storage) return `${storage.dir ?? 'unknown'}: ${storage.problem}`;
  const gib = (bytes: number) => `${(bytes / 1024 ** 3).toFixed(1)} GiB`;
  const threshold =
    storage.min_free_bytes === 0
      ? 'FERRY_MIN_FREE_MIB is 0: intake never stops for space'
      : storage.low
        ? `UNDER FERRY_MIN_FREE_MIB (${formatMiB(storage.min_free_bytes)}): new runs and uploads are refused (507)`
        : `new runs and uploads stop under ${formatMiB(storage.min_free_bytes)} (FERRY_MIN_FREE_MIB)`;
  return `${storage.dir}: ${formatMiB(storage.free_bytes)} free of ${gib(storage.total_bytes)}; ${threshold}`;
}

type StagingReport = { dir: string; inside_data_folder: boolean } | { problem: string };

/**
 * Where sandboxes' folders (build views, build steps' stages, image unpacking) are staged for the data
 * folder (sandbox/views.ts `stagingPlace`): nothing is made to find out.
 */
async function stagingReport(): Promise<StagingReport> {
  let dataDir: string;
  try {
    dataDir = resolveServerConfig({}, process.env).dataDir;
  } catch (err) {
    return { problem: `the server settings are invalid: ${(err as Error).message}` };
  }
  try {
    const place = await stagingPlace(dataDir);
    return { dir: place.dir, inside_data_folder: place.inside };
  } catch (err) {
    return { problem: `the data folder ${path.resolve(dataDir)} cannot be read: ${(err as Error).message}` };
  }
}

function describeStaging(staging: StagingReport): string {
  if ('problem' in staging) return `unknown: ${staging.problem}`;
  if (!staging.inside_data_folder) return `${staging.dir} (outside the data folder, on its filesystem)`;
  return `${staging.dir} (inside the data folder: no folder outside it is on its filesystem; sandboxes' mountinfo shows paths from that filesystem's root)`;
}

function formatMiB(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}
