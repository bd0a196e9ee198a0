/**
 * Is FERRY_VOLUMES_DIR the same shared folder on every node? Each Ferry server writes a marker named by its
 * node id into `<FERRY_VOLUMES_DIR>/.nodes/` when it starts (and removes it when it stops); `ferry doctor`
 * on any node reads the cluster's live nodes from the server and looks for each one's marker in the
 * folder it has: a marker missing means that node writes volumes somewhere else (a local folder where a
 * shared mount was meant, a mount missing on one machine), which the doctor warns about.
 *
 * The doctor also lists the volumes it finds in the folder: each image's size, the disk it takes (the
 * image is sparse: its allocated blocks are the volume's use) and whether it is mounted on this machine.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { mountedPoints, volumePaths } from './images.js';

const NODES_DIR = '.nodes';

/** Writes this node's marker (best effort: a read-only or missing folder is for the doctor to report). */
export async function writeNodeMarker(volumesDir: string, nodeId: string): Promise<void> {
  const dir = path.join(volumesDir, NODES_DIR);
  await fs.mkdir(dir, { recursive: true, mode: 0o700 });
  const marker = { node: nodeId, hostname: os.hostname(), pid: process.pid, written_at: new Date().toISOString() };
  await fs.writeFile(path.join(dir, nodeId), `${JSON.stringify(marker)}\n`, { mode: 0o600 });
}

export async function removeNodeMarker(volumesDir: string, nodeId: string): Promise<void> {
  await fs.rm(path.join(volumesDir, NODES_DIR, nodeId), { force: true });
}

/** The live nodes whose marker is not in `volumesDir`: they do not share this folder. */
export async function nodesWithoutMarker(volumesDir: string, nodeIds: readonly string[]): Promise<string[]> {
  const present = new Set(await fs.readdir(path.join(volumesDir, NODES_DIR)).catch(() => [] as string[]));
  return nodeIds.filter((id) => !present.has(id));
}

export interface LocalVolume {
  project_id: string;
  name: string;
  size_bytes: number;
  /**
   * Disk the image takes on the host now: its allocated blocks, the filesystem's own metadata and journal
   * included, and blocks of deleted files until they are discarded. Not the volume's use (which its bound
   * counts: backend.ts `peekVolumeUse`).
   */
  allocated_bytes: number;
  mounted_here: boolean;
}

/** The volume images in `volumesDir`, by project and name. */
export async function localVolumes(volumesDir: string): Promise<LocalVolume[]> {
  const mounted = await mountedPoints();
  const out: LocalVolume[] = [];
  const projects = (await fs.readdir(volumesDir).catch(() => [] as string[])).filter((p) => !p.startsWith('.'));
  for (const project of projects.sort()) {
    const files = await fs.readdir(path.join(volumesDir, project)).catch(() => [] as string[]);
    for (const file of files.filter((f) => f.endsWith('.img')).sort()) {
      const name = file.slice(0, -'.img'.length);
      const stat = await fs.stat(path.join(volumesDir, project, file)).catch(() => null);
      if (!stat) continue;
      out.push({
        project_id: project,
        name,
        size_bytes: stat.size,
        allocated_bytes: stat.blocks * 512,
        mounted_here: mounted.has(volumePaths(volumesDir, project, name).mountPoint),
      });
    }
  }
  return out;
}
