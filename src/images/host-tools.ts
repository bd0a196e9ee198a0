/**
 * What this host has for images, for `ferry doctor` and (later) for `ferry serve`'s start: the tools an
 * image build uses and whether replicas could run on an image's root file system.
 *
 * The design (docs/operations.md, "Images"): Ferry pulls and unpacks images itself (`pull.ts`,
 * `unpack.ts`, no tool needed); a build's `apt`/`run`/`RUN` steps run in Ferry's own bwrap sandbox with
 * the unpacked root as `/`, and Ferry writes each step's changes as a layer itself (image-builder.ts);
 * replicas run in the same sandbox on the image's root. So running and building need bubblewrap; a
 * build's user namespace gets 65,536 ids (what dpkg's chowns need) only when Ferry is root. umoci and
 * skopeo are optional, for operators who make, push or mirror images into a local registry.
 */
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { findTool } from '../sandbox/find-tool.js';

export interface ImageHostReport {
  canRun: boolean;
  canBuild: boolean;
  /** `umoci 0.4.7` or null when missing (optional). */
  umoci: string | null;
  skopeo: string | null;
  /** What is missing, with the package to install, one line each. */
  missing: string[];
}

/** Probes the tools (their versions, so a broken binary counts as missing). `sandbox`: bwrap works here. */
export async function probeImageHost(sandbox: boolean): Promise<ImageHostReport> {
  const umociPath = findTool('umoci', 'umoci', []);
  const skopeoPath = findTool('skopeo', 'skopeo', []);
  const [umoci, skopeo] = await Promise.all([
    umociPath ? version(umociPath, ['--version']) : Promise.resolve(null),
    skopeoPath ? version(skopeoPath, ['--version']) : Promise.resolve(null),
  ]);
  const missing: string[] = [];
  if (!sandbox) missing.push('a working bubblewrap sandbox (images run and build only sandboxed; see Sandbox above)');
  if (sandbox && process.getuid?.() !== 0) {
    missing.push(
      'root, for image builds whose steps change file owners (apt/dpkg): not root, a build step has one id mapped and such chowns fail',
    );
  }
  return { canRun: sandbox, canBuild: sandbox, umoci, skopeo, missing };
}

/** The images folder of a data directory (`createImageStore`'s `dir`: `unpacked/` and `pulls/` in it). */
export function imagesDir(dataDir: string): string {
  return path.join(dataDir, 'images');
}

/** Bytes and count of the unpacked images a data directory holds (their `image.json`), for the doctor. */
export async function readCacheUse(dataDir: string): Promise<{ bytes: number; images: number } | null> {
  const dir = path.join(imagesDir(dataDir), 'unpacked');
  let names: string[];
  try {
    names = await fs.readdir(dir);
  } catch {
    return null;
  }
  let bytes = 0;
  let images = 0;
  for (const name of names) {
    if (!/^[a-f0-9]{64}$/.test(name)) continue;
    try {
      const saved = JSON.parse(await fs.readFile(path.join(dir, name, 'image.json'), 'utf8')) as { bytes?: number };
      bytes += Number(saved.bytes) || 0;
      images += 1;
    } catch {
      // incomplete: not counted (removed at the server's next start)
    }
  }
  return { bytes, images };
}

function version(file: string, args: string[]): Promise<string | null> {
  return new Promise((resolve) => {
    execFile(file, args, { timeout: 5000 }, (err, stdout) => {
      if (err) resolve(null);
      else
        resolve(
          stdout
            .trim()
            .split('\n')[0]
            ?.replace(/^umoci version /, 'umoci ') ?? null,
        );
    });
  });
}
