/**
 * The image part of a build of an app with `[image]`: the base is pulled (or found in the node's cache)
 * and pinned for the build's time, the steps that need building (the app's, then its runtime's own, such
 * as Python's install of requirements.txt) go through the seam (image-steps.ts),
 * and what replicas need of the image is written down once, as the build's `BuildImageRecord`
 * (`builds.image_json`, with the digest in `builds.image_digest`).
 *
 * Each failure is a coded build failure, `FERRY_IMAGE_*: step: cause`, never a stack trace or a host path;
 * the image part has its own time limit, `FERRY_IMAGE_BUILD_TIMEOUT_SECONDS`, inside the build's.
 */

import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import { buildImage, readDockerfileBase } from './image-builder.js';
import type { ImageRunConfig } from './image-config.js';
import type { ImageSpec } from './image-spec.js';
import { ImageBuildError, type ImplicitStep, needsImageBuild } from './image-steps.js';
import type { ImageStore, PinnedImage } from './image-store.js';
import { formatImageReference, parseImageReference } from './reference.js';
import type { StepLimits } from './step-sandbox.js';

/** What a replica of an image build needs of its image: stored with the build, read at every launch. */
export interface BuildImageRecord {
  /** The image pinned by its digest (`registry/repo@sha256:…`): a node without it pulls exactly this. */
  reference: string;
  /** The manifest digest: the key of the node's image cache. */
  digest: string;
  /**
   * Built by this cluster (`apt`, `run` or a Dockerfile): no registry has it, so a node without it fetches it
   * from the image shelf only; `reference` then only says what it was built from.
   */
  built?: boolean;
  /** The image's run config as its config blob says it. */
  config: ImageRunConfig;
  /** The replica's base environment: the image's `ENV`, then `[image].env` over it. */
  env: Record<string, string>;
  /** PATH of the image (its `ENV PATH`, else the usual one), split: where commands are looked up. */
  searchPath: string[];
  /** Custom runtime: the command the supervisor starts, its port, and whether the image gave the command. */
  custom?: { entrypoint: string | string[]; port: number; fromImage: boolean };
  /** Cortex Python: the image's interpreter, as the image names it (`/usr/local/bin/python3`). */
  python?: string;
}

/** The image a build runs its checks against, pinned until `release`. */
export interface BuildImage {
  record: BuildImageRecord;
  /** The unpacked root, read-only to everyone (shared by every build and replica of the digest on the node). */
  rootfs: string;
  release: () => void;
}

/** The PATH of an image that sets none (Docker's default). */
export const DEFAULT_IMAGE_PATH = ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin'];

export interface PrepareBuildImageOptions {
  /** The node's images; absent where replicas are not sandboxed (images need the sandbox). */
  images: ImageStore | undefined;
  spec: ImageSpec;
  /** The runtime's own steps after the spec's (builds/builder.ts `imageSteps`): Python's requirements.txt. */
  implicitSteps?: readonly ImplicitStep[];
  projectId: string;
  buildId: string;
  /** The app folder as uploaded (a Dockerfile's context). */
  sourceDir: string;
  /** `FERRY_IMAGE_BUILD_TIMEOUT_SECONDS`, in milliseconds. */
  timeoutMs: number;
  /** Whether replicas and build steps run in bwrap here: images need it. */
  sandboxed: boolean;
  log: (line: string) => void;
  /** The build's own signal (cancel, server stop, the build's time limit). */
  signal: AbortSignal;
  /** What image steps (`apt`, `run`, a Dockerfile) run with: the node's sandbox, the build cache, limits. */
  steps: {
    sandbox: { caps: SandboxCapabilities; network: SandboxNetwork };
    /** The node's image build cache (a folder per project inside). */
    cacheDir: string;
    /** The data folder, whose staging root image builds' scratch roots are made in (image-builder.ts). */
    dataDir?: string;
    limits: StepLimits;
  };
}

/** Pulls and pins the image of a build; throws ImageBuildError for every failure that is the app's. */
export async function prepareBuildImage(options: PrepareBuildImageOptions): Promise<BuildImage> {
  const { spec, log, images } = options;
  if (!options.sandboxed || !images) {
    throw new ImageBuildError(
      'FERRY_IMAGE_NO_SANDBOX',
      'image',
      'apps with [image] run only in the sandbox, and this server has none (bubblewrap is missing or FERRY_SANDBOX=off; see ferry doctor)',
    );
  }
  const timer = new AbortController();
  const timeout = setTimeout(() => timer.abort(), options.timeoutMs);
  const signal = AbortSignal.any([options.signal, timer.signal]);
  try {
    let baseText: string;
    if (spec.kind === 'dockerfile') {
      baseText = await imageStep(`reading ${spec.dockerfile}`, () =>
        readDockerfileBase(options.sourceDir, spec.dockerfile),
      );
    } else {
      baseText = spec.baseText;
    }
    log(`Image: base ${baseText}`);
    const step = `pulling the base image ${baseText}`;
    let pinned: PinnedImage;
    try {
      // For this project only: its own credentials, and nothing another project's pull left on the node
      // unless this project proves it can pull it too (image-store.ts).
      pinned = await images.acquire(baseText, {
        projectId: options.projectId,
        signal,
        onProgress: (line) => log(`  ${line}`),
      });
    } catch (err) {
      if (timer.signal.aborted && !options.signal.aborted) throw timedOut(step, options.timeoutMs, err);
      if (options.signal.aborted) throw err;
      if (err instanceof FerryError && err.code.startsWith('FERRY_IMAGE_')) {
        throw new ImageBuildError(err.code, step, err.message, { cause: err });
      }
      throw err;
    }
    let final = pinned;
    try {
      const implicitSteps = options.implicitSteps ?? [];
      if (needsImageBuild(spec, implicitSteps)) {
        const reference = `built from ${pinned.reference}`;
        let adopted: PinnedImage | undefined;
        // Twice at most: an image the node had when the build looked, evicted before it was pinned, is
        // written out after all.
        for (const known of [(digest: string) => images.cache.peek(digest) !== undefined, undefined]) {
          const out = await images.scratch();
          let wrote = true;
          try {
            const built = await imageStep('building the image', () =>
              buildImage({
                spec,
                implicitSteps,
                baseLayoutDir: pinned.layout,
                baseDigest: pinned.digest,
                contextDir: options.sourceDir,
                projectId: options.projectId,
                cacheDir: options.steps.cacheDir,
                ...(options.steps.dataDir ? { dataDir: options.steps.dataDir } : {}),
                outDir: path.join(out, 'layout'),
                sandbox: options.steps.sandbox,
                limits: { ...options.steps.limits, timeoutMs: options.timeoutMs },
                log,
                signal,
                ...(known ? { known } : {}),
              }),
            );
            if (built.known) {
              wrote = false; // nothing was written to `out`
              adopted = await images.pinCached(built.digest, reference);
              if (!adopted) continue;
            } else {
              adopted = await images.adopt(built.layoutDir, built.digest, reference);
            }
            log(`Image: built ${built.digest} (${built.ran} steps ran, ${built.cached} cached)`);
            break;
          } finally {
            if (wrote) await fs.rm(out, { recursive: true, force: true });
          }
        }
        if (!adopted) throw new Error('unreachable: the second build writes the image');
        final = adopted;
        pinned.release();
        // The cluster's other nodes have no registry to pull it from: the shelf must have it.
        await imageStep('putting the image on the image shelf', () => images.publish(final));
      } else {
        await images.publish(pinned).catch((err: unknown) => {
          // Other nodes can still pull it from its registry by digest.
          log(`  (not put on the image shelf: ${(err as Error).message}; other nodes pull it from the registry)`);
        });
      }
      const record = recordOf(final, spec.env, final !== pinned);
      log(`Image: ${record.reference}${record.built ? ` ${record.digest}` : ''}`);
      describe(record, log);
      return { record, rootfs: final.image.rootfs, release: final.release };
    } catch (err) {
      final.release();
      if (final !== pinned) pinned.release();
      if (timer.signal.aborted && !options.signal.aborted && !(err instanceof ImageBuildError)) {
        throw timedOut('building the image', options.timeoutMs, err);
      }
      throw err;
    }
  } finally {
    clearTimeout(timeout);
  }
}

/**
 * Runs one part of the image build, turning its coded failures (FERRY_IMAGE_*, and the shelf's
 * FERRY_ARTIFACTS_UNAVAILABLE) into build failures that name `step`.
 */
async function imageStep<T>(step: string, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    if (err instanceof ImageBuildError) throw err;
    if (
      err instanceof FerryError &&
      (err.code.startsWith('FERRY_IMAGE_') || err.code === 'FERRY_ARTIFACTS_UNAVAILABLE')
    ) {
      throw new ImageBuildError(err.code, step, err.message, { cause: err });
    }
    if (err instanceof Error && !(err instanceof FerryError) && step.startsWith('putting')) {
      throw new ImageBuildError('FERRY_ARTIFACTS_UNAVAILABLE', step, 'the image shelf cannot be reached', {
        cause: err,
      });
    }
    throw err;
  }
}

function timedOut(step: string, ms: number, cause: unknown): ImageBuildError {
  return new ImageBuildError(
    'FERRY_IMAGE_BUILD_TIMEOUT',
    step,
    `the image part of the build took longer than FERRY_IMAGE_BUILD_TIMEOUT_SECONDS (${Math.round(ms / 1000)} s)`,
    { cause },
  );
}

/** The record of an image (pulled, or `built` here), `[image].env` over its ENV. */
export function recordOf(
  pinned: Pick<PinnedImage, 'reference' | 'digest' | 'config'>,
  env: Record<string, string>,
  built = false,
) {
  const merged: Record<string, string> = {};
  for (const [name, value] of pinned.config.env) merged[name] = value;
  Object.assign(merged, env);
  const searchPath = (merged.PATH ?? '')
    .split(':')
    .filter((dir) => dir.startsWith('/') && !dir.split('/').includes('..'));
  const record: BuildImageRecord = {
    reference: built
      ? pinned.reference
      : formatImageReference({ ...parseImageReference(pinned.reference), tag: undefined, digest: pinned.digest }),
    digest: pinned.digest,
    ...(built ? { built: true } : {}),
    config: pinned.config,
    env: merged,
    searchPath: searchPath.length > 0 ? searchPath : DEFAULT_IMAGE_PATH,
  };
  return record;
}

function describe(record: BuildImageRecord, log: (line: string) => void): void {
  const { config } = record;
  const names = Object.keys(record.env);
  log(`  ENV: ${names.length > 0 ? names.join(', ') : '(none)'}`);
  log(`  WORKDIR: ${config.workingDir}`);
  if (config.user !== undefined && config.user !== '') {
    log(`  USER: ${config.user} (runs as the sandbox's unprivileged user, never root)`);
  }
  if (config.architecture !== undefined) log(`  platform: ${config.os ?? 'linux'}/${config.architecture}`);
}

/** The record stored on a build (`builds.image_json`), or undefined for a host-runtime build. */
export function parseBuildImageRecord(text: string | null | undefined): BuildImageRecord | undefined {
  if (!text) return undefined;
  return JSON.parse(text) as BuildImageRecord;
}
