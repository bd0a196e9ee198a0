/**
 * Builds an app's image: `[image]`'s `apt`, `run` and `env` on top of a pulled base, or a Dockerfile,
 * rootless and daemonless. Nothing here pulls: the caller gives the base as a verified OCI layout
 * (pull.ts), and for a Dockerfile learns which base to pull with `readDockerfileBase`.
 *
 * How a step becomes a layer, and why this and not buildah: buildah needs newuidmap (setuid) and cannot
 * run in Ferry's sandbox; umoci could repack, but only a tree it unpacked itself, as root, following its
 * own rules for untrusted layers. So Ferry does the three parts itself, each small: it unpacks the parent
 * layers with its own unpacker for untrusted layers (unpack.ts) into a scratch root outside the data
 * directory, owned by the build's id range; runs the step in its bwrap sandbox with that root as `/`
 * (step-sandbox.ts: user namespace with 65,536 ids, egress policy, cgroup, time and disk bounds); and
 * writes what the step changed as a gzip tar (rootfs-diff.ts, layer-writer.ts). `COPY`/`ADD` layers are
 * written straight from the build context by code that never follows a link out of it
 * (context-files.ts); `WORKDIR` makes a one-folder layer. The base's layers are kept as they are; the new
 * image is the base's layers plus one per step, a new config, and a new manifest, in `outDir`.
 *
 * After the app's steps come its runtime's (`implicitSteps`, image-steps.ts: Python's COPY of
 * requirements.txt and pip install), built and cached the same way, as the image's root user; they leave
 * the image's config (ENV, WORKDIR, USER, CMD) as the app's steps made it.
 *
 * Layer cache, per project: each step's key is the SHA-256 of the project, the parent (the base
 * manifest digest, then the previous step's key), the step's text and the state it runs with (env,
 * workdir, user, build args; for COPY the digest of the files it copies). The layers and keys of a
 * project live in a folder named by the project's hash: a second build with the same steps finds every
 * key and runs nothing (the log says `cached`), and one project's build never looks in another's folder.
 * The scratch root is made only when a step must run, from the layers before it.
 *
 * Failures are FerryErrors: FERRY_IMAGE_STEP_FAILED (naming the step, its command, the exit code and the
 * tail of its output), FERRY_IMAGE_BUILD_TIMEOUT, FERRY_IMAGE_DOCKERFILE_NOT_FOUND/INVALID,
 * FERRY_IMAGE_ADD_URL_REFUSED, FERRY_IMAGE_CONTEXT_ESCAPE. Messages never name a host path.
 */
import { createHash, randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import { stagingRoot } from '../sandbox/views.js';
import { acquireIds, releaseIds } from './build-ids.js';
import { hashCopySources, writeCopyLayer } from './context-files.js';
import { type BuildState, dockerfileBase, initialState, type PlanStep, planDockerfile } from './dockerfile.js';
import { type ImageRunConfig, parseImageConfig } from './image-config.js';
import type { ImageSpec } from './image-spec.js';
import type { ImplicitStep } from './image-steps.js';
import { diffInSandbox, unpackInSandbox } from './layer-sandbox.js';
import { LayerWriter, type WrittenLayer } from './layer-writer.js';
import {
  blobPath,
  type Descriptor,
  hasBlob,
  initLayout,
  MEDIA,
  parseManifest,
  readJsonBlob,
  sha256,
  writeBlob,
  writeIndex,
} from './oci-layout.js';
import { snapshotTree } from './rootfs-diff.js';
import { makeWorkdir, readFileNoFollow, resolveUser } from './scratch-root.js';
import {
  cleanMountPoints,
  type IdRange,
  madePaths,
  prepareMountPoints,
  runImageStep,
  type StepLimits,
} from './step-sandbox.js';

export interface ImageBuildLimits extends StepLimits {
  /** Wall-clock time of the whole image build (FERRY_IMAGE_BUILD_TIMEOUT_SECONDS). */
  timeoutMs: number;
}

export const DEFAULT_IMAGE_BUILD_LIMITS: ImageBuildLimits = {
  timeoutMs: 30 * 60_000,
  memoryMiB: 2048,
  maxProcesses: 1024,
  cpu: 1,
  diskBytes: 8 * 1024 ** 3,
};

export interface BuildImageOptions {
  spec: ImageSpec;
  /** The runtime's own steps (image-steps.ts), after the spec's: Python's install of requirements.txt. */
  implicitSteps?: readonly ImplicitStep[];
  /** An OCI layout holding the pulled base (verified by the pull). */
  baseLayoutDir: string;
  /** The base's manifest digest in that layout. */
  baseDigest: string;
  /** The app folder (untrusted): the Dockerfile and COPY sources are read from it. */
  contextDir: string;
  projectId: string;
  /** The node's image build cache (`<data>/images/build-cache`): a folder per project inside. */
  cacheDir: string;
  /** The data folder, whose staging root (sandbox/views.ts) holds scratch roots; unset (tests): `cacheDir`'s. */
  dataDir?: string;
  /** Where the built image's OCI layout is written (made; tag `image`). */
  outDir: string;
  sandbox: { caps: SandboxCapabilities; network: SandboxNetwork };
  limits: ImageBuildLimits;
  log: (line: string) => void;
  signal: AbortSignal;
  /**
   * Whether the node already has the image of this manifest digest (its image cache). When every step was
   * cached, the image's digest is known before anything is written: one the node has is not written again
   * (`BuiltImage.known`), and the caller pins the node's copy.
   */
  known?: (digest: string) => boolean;
}

export interface BuiltImage {
  /**
   * = outDir: an OCI layout with the image tagged `image`; nothing (and outDir not made) when `known`.
   */
  layoutDir: string;
  /** The node already had this image (`BuildImageOptions.known`): no layout was written. */
  known?: boolean;
  /** The manifest digest. */
  digest: string;
  config: ImageRunConfig;
  /** Steps that ran, and steps found in the cache. */
  ran: number;
  cached: number;
}

/** The tag of the built image in its layout. */
export const BUILT_IMAGE_TAG = 'image';

const CACHE_VERSION = 'ferry-image-step-v1';
const TAIL_LINES = 15;
const MAX_LOG_LINE = 4000;
const MAX_ENTRIES = 2_000_000;

/**
 * Reads the Dockerfile of `spec` (kind `dockerfile`) from the context, safely, and returns its base
 * reference: what the caller pulls before calling buildImage.
 */
export async function readDockerfileBase(contextDir: string, dockerfile: string): Promise<string> {
  return dockerfileBase(await readDockerfile(contextDir, dockerfile)).from;
}

/** Builds the image; see the module comment. */
export async function buildImage(options: BuildImageOptions): Promise<BuiltImage> {
  const { limits } = options;
  const timeout = new AbortController();
  const timer = setTimeout(() => timeout.abort(new Error('timeout')), limits.timeoutMs);
  const signal = AbortSignal.any([options.signal, timeout.signal]);
  const builder = new ImageBuild(options, signal);
  try {
    return await builder.run();
  } catch (err) {
    if (timeout.signal.aborted && !options.signal.aborted) {
      throw new FerryError(
        'FERRY_IMAGE_BUILD_TIMEOUT',
        `the image build took longer than ${Math.round(limits.timeoutMs / 1000)} s${builder.current ? ` (during ${builder.current})` : ''}; everything it started was stopped`,
      );
    }
    throw err;
  } finally {
    clearTimeout(timer);
    await builder.close();
  }
}

/**
 * Manifests and configs of bases read lately, by digest: content-addressed (and checked against the digest
 * when read), so a copy is never stale; a few KiB each, the newest 64 kept.
 */
const jsonBlobs = new Map<string, Buffer>();

async function readJsonBlobOnce(layout: string, digest: string): Promise<Buffer> {
  const known = jsonBlobs.get(digest);
  if (known) {
    jsonBlobs.delete(digest);
    jsonBlobs.set(digest, known);
    return known;
  }
  const bytes = await readJsonBlob(layout, digest);
  jsonBlobs.set(digest, bytes);
  if (jsonBlobs.size > 64) jsonBlobs.delete(jsonBlobs.keys().next().value!);
  return bytes;
}

interface CachedStep {
  layer: Descriptor;
  diffId: string;
}

class ImageBuild {
  /** The step running, for the timeout's message. */
  current: string | null = null;
  private readonly projectDir: string;
  private readonly projectLayout: string;
  private scratch: string | null = null;
  private rootfs: string | null = null;
  /** How many of `layers` the scratch root holds. */
  private applied = 0;
  private readonly layers: Array<{ descriptor: Descriptor; diffId: string; layout: string }> = [];
  private idSlot: number | null = null;
  private ids: IdRange | null = null;
  private mapRange = false;

  constructor(
    private readonly o: BuildImageOptions,
    private readonly signal: AbortSignal,
  ) {
    const projectHash = createHash('sha256').update(`ferry-project\0${o.projectId}`).digest('hex').slice(0, 32);
    this.projectDir = path.join(o.cacheDir, 'projects', projectHash);
    this.projectLayout = path.join(this.projectDir, 'layout');
  }

  async run(): Promise<BuiltImage> {
    const o = this.o;
    const manifest = parseManifest(await readJsonBlobOnce(o.baseLayoutDir, o.baseDigest));
    const baseConfigBytes = await readJsonBlobOnce(o.baseLayoutDir, manifest.config.digest);
    const baseConfig = parseImageConfig(baseConfigBytes);
    const baseJson = JSON.parse(baseConfigBytes.toString('utf8')) as Record<string, unknown>;
    const baseDiffIds = ((baseJson.rootfs as { diff_ids?: unknown } | undefined)?.diff_ids ?? []) as unknown[];
    if (!Array.isArray(baseDiffIds) || baseDiffIds.length !== manifest.layers.length) {
      throw new FerryError('FERRY_IMAGE_UNSUPPORTED', "the base image's config does not list one diff id per layer");
    }
    for (const [i, layer] of manifest.layers.entries()) {
      this.layers.push({ descriptor: layer, diffId: String(baseDiffIds[i]), layout: o.baseLayoutDir });
    }

    const { steps, finalEnv, appSteps } = await this.plan(baseConfig);

    let parent = createHash('sha256').update(`${CACHE_VERSION}\0${o.projectId}\0${o.baseDigest}`).digest('hex');
    let state = initialState(baseConfig);
    let ran = 0;
    let cached = 0;
    const history: Array<Record<string, unknown>> = [];
    for (const [i, step] of steps.entries()) {
      const label = `step ${i + 1}/${steps.length}: ${step.label}`;
      this.current = `step ${i + 1}/${steps.length} (${step.label.slice(0, 200)})`;
      // A runtime's steps leave the image's config as the app's steps made it.
      if (i < appSteps) state = step.state;
      if (step.kind === 'config') {
        o.log(step.note ? `${label} (${step.note})` : label);
        history.push({ created_by: step.label, empty_layer: true });
        continue;
      }
      if (this.signal.aborted) throw this.signal.reason;
      const key = await this.keyOf(parent, step);
      parent = key;
      const hit = await this.lookup(key);
      if (hit) {
        o.log(`${label}: cached`);
        this.layers.push({ descriptor: hit.layer, diffId: hit.diffId, layout: this.projectLayout });
        cached += 1;
      } else {
        o.log(label);
        // Made when a step first runs (a build whose steps are all cached writes nothing here).
        await initLayout(this.projectLayout);
        await fs.mkdir(path.join(this.projectDir, 'steps'), { recursive: true });
        const written = await this.execute(step, i, steps.length);
        await this.remember(key, { layer: written.descriptor, diffId: written.diffId });
        this.layers.push({ descriptor: written.descriptor, diffId: written.diffId, layout: this.projectLayout });
        if (step.kind === 'run') this.applied = this.layers.length; // the scratch has it already
        ran += 1;
      }
      history.push({ created_by: step.label });
    }
    this.current = null;
    return this.writeImage(baseJson, state, finalEnv, history, ran, cached);
  }

  /** The steps in order: the app's (`appSteps` of them), then the runtime's (implicitSteps). */
  private async plan(
    base: ImageRunConfig,
  ): Promise<{ steps: PlanStep[]; finalEnv: Record<string, string>; appSteps: number }> {
    const { spec } = this.o;
    let steps: PlanStep[];
    let finalEnv: Record<string, string>;
    let last: BuildState;
    if (spec.kind === 'dockerfile') {
      const text = await readDockerfile(this.o.contextDir, spec.dockerfile);
      steps = planDockerfile(text, base).steps;
      finalEnv = spec.env;
      last = steps.at(-1)?.state ?? initialState(base);
    } else {
      const state = initialState(base);
      for (const [k, v] of Object.entries(spec.env)) {
        const at = state.env.findIndex(([name]) => name === k);
        if (at >= 0) state.env[at] = [k, v];
        else state.env.push([k, v]);
      }
      steps = [];
      if (spec.apt.length > 0) steps.push(aptStep(spec.apt, state));
      for (const command of spec.run) {
        steps.push({ kind: 'run', label: command, argv: ['/bin/sh', '-c', command], state, buildArgs: [] });
      }
      finalEnv = {};
      last = state;
    }
    const appSteps = steps.length;
    for (const step of this.o.implicitSteps ?? []) steps.push(implicitPlanStep(step, last, finalEnv));
    return { steps, finalEnv, appSteps };
  }

  private async keyOf(parent: string, step: Exclude<PlanStep, { kind: 'config' }>): Promise<string> {
    const hash = createHash('sha256').update(`${CACHE_VERSION}\0${this.o.projectId}\0${parent}\0`);
    const s = step.state;
    const common = { env: s.env, workdir: s.workdir, user: s.user ?? null };
    if (step.kind === 'run') hash.update(JSON.stringify({ run: step.argv, buildArgs: step.buildArgs, ...common }));
    else if (step.kind === 'mkdir') hash.update(JSON.stringify({ mkdir: step.path }));
    else {
      const files = await hashCopySources(this.o.contextDir, copySpec(step));
      hash.update(JSON.stringify({ copy: step.sources, dest: step.dest, uid: step.uid, gid: step.gid, files }));
    }
    return hash.digest('hex');
  }

  private async lookup(key: string): Promise<CachedStep | null> {
    try {
      const saved = JSON.parse(
        await fs.readFile(path.join(this.projectDir, 'steps', `${key}.json`), 'utf8'),
      ) as CachedStep;
      if (!(await hasBlob(this.projectLayout, saved.layer.digest))) return null;
      return saved;
    } catch {
      return null;
    }
  }

  private async remember(key: string, entry: CachedStep): Promise<void> {
    const file = path.join(this.projectDir, 'steps', `${key}.json`);
    const temp = `${file}.${randomBytes(6).toString('hex')}`;
    await fs.writeFile(temp, JSON.stringify(entry));
    await fs.rename(temp, file);
  }

  private async execute(
    step: Exclude<PlanStep, { kind: 'config' }>,
    index: number,
    total: number,
  ): Promise<WrittenLayer> {
    const writer = LayerWriter.open(this.projectLayout);
    try {
      if (step.kind === 'copy') {
        await writeCopyLayer(this.o.contextDir, copySpec(step), writer);
      } else if (step.kind === 'mkdir') {
        const name = step.path.replace(/^\/+/, '');
        if (name !== '') await writer.add({ name, type: 'directory', mode: 0o755, uid: 0, gid: 0, mtime: new Date(0) });
      } else {
        await this.runStep(step, index, total, writer);
      }
      return await writer.finish(this.projectLayout);
    } catch (err) {
      await writer.abort();
      throw err;
    }
  }

  private async runStep(
    step: Extract<PlanStep, { kind: 'run' }>,
    index: number,
    total: number,
    writer: LayerWriter,
  ): Promise<void> {
    const o = this.o;
    const what = `step ${index + 1}/${total} (${step.label.slice(0, 200)})`;
    if (!o.sandbox.caps.bwrap) {
      throw new FerryError(
        'FERRY_IMAGE_STEP_FAILED',
        `${what}: this server cannot run image build steps (they run only in the bubblewrap sandbox, which it does not have; see ferry doctor)`,
      );
    }
    const rootfs = await this.materialize();
    const ids = this.ids!;
    const user = await resolveUser(rootfs, step.state.user, what);
    const env: Record<string, string> = {
      PATH: '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
      HOME: user.uid === 0 ? '/root' : '/',
    };
    for (const [k, v] of step.buildArgs) env[k] = v;
    for (const [k, v] of step.state.env) env[k] = v;
    const made = await prepareMountPoints({ rootfs, ids });
    const before = await snapshotTree(rootfs);
    // After the snapshot, so a folder made for WORKDIR is part of the step's layer (as Docker does).
    await makeWorkdir(rootfs, step.state.workdir, ids);
    const tail: string[] = [];
    let result: Awaited<ReturnType<typeof runImageStep>>;
    try {
      result = await runImageStep({
        rootfs,
        made,
        command: step.argv,
        env,
        cwd: step.state.workdir,
        uid: user.uid,
        gid: user.gid,
        ids,
        mapRange: this.mapRange,
        caps: o.sandbox.caps,
        network: o.sandbox.network,
        limits: o.limits,
        id: `img-${randomBytes(6).toString('hex')}`,
        signal: this.signal,
        onLine: (line) => {
          const clipped = line.length > MAX_LOG_LINE ? `${line.slice(0, MAX_LOG_LINE)}…` : line;
          o.log(clipped);
          tail.push(clipped);
          if (tail.length > TAIL_LINES) tail.shift();
        },
      });
    } catch (err) {
      this.applied = -1; // the scratch holds a half-run step: made again if another step runs
      if (this.signal.aborted) throw err;
      throw new FerryError('FERRY_IMAGE_STEP_FAILED', `${what}: ${(err as Error).message}`);
    } finally {
      await cleanMountPoints(rootfs, made);
    }
    if (result.code !== 0) {
      this.applied = -1;
      const how = result.diskExceeded
        ? `was killed: it passed the build's disk bound (${Math.round(o.limits.diskBytes / 2 ** 20)} MiB)`
        : result.oomKilled
          ? `was killed: it ran out of memory (the limit is ${o.limits.memoryMiB} MiB)`
          : result.code === null
            ? `was killed by ${result.signal ?? 'a signal'}`
            : `failed with exit code ${result.code}`;
      throw new FerryError(
        'FERRY_IMAGE_STEP_FAILED',
        `${what} ${how}${tail.length > 0 ? `; its last output:\n${tail.join('\n')}` : ''}`,
      );
    }
    // Read back in a sandbox of its own, by the build's ids: the root is a stranger's (layer-sandbox.ts).
    await diffInSandbox({
      caps: o.sandbox.caps,
      root: rootfs,
      before,
      writer,
      ids,
      mapRange: this.mapRange,
      ignore: madePaths(made),
      scratch: this.scratch!,
      maxBytes: o.limits.diskBytes,
      signal: this.signal,
    });
  }

  /** The scratch root holding every layer so far (made, or brought up to date, here). */
  private async materialize(): Promise<string> {
    if (this.rootfs && this.applied >= 0) {
      await this.apply(this.layers.slice(this.applied));
      this.applied = this.layers.length;
      return this.rootfs;
    }
    await this.dropScratch();
    const { ids, mapRange, slot } = this.ids
      ? { ids: this.ids, mapRange: this.mapRange, slot: this.idSlot }
      : acquireIds(this.o.sandbox.caps);
    this.ids = ids;
    this.mapRange = mapRange;
    this.idSlot = slot;
    const { dataDir, cacheDir } = this.o;
    const root = (await stagingRoot(dataDir ?? cacheDir, mapRange, !!dataDir)) ?? path.join(cacheDir, 'scratch');
    await fs.mkdir(root, { recursive: true });
    this.scratch = await fs.mkdtemp(path.join(root, 'imagebuild-'));
    await fs.chmod(this.scratch, mapRange ? 0o711 : 0o700);
    this.rootfs = path.join(this.scratch, 'rootfs');
    await fs.mkdir(this.rootfs, { mode: 0o755 });
    await this.apply(this.layers);
    this.applied = this.layers.length;
    return this.rootfs;
  }

  private async apply(layers: Array<{ descriptor: Descriptor; layout: string }>): Promise<void> {
    if (layers.length === 0) return;
    try {
      await unpackInSandbox({
        caps: this.o.sandbox.caps,
        root: this.rootfs!,
        layers: layers.map((l) => ({ layout: l.layout, digest: l.descriptor.digest })),
        limits: { maxBytes: this.o.limits.diskBytes, maxEntries: MAX_ENTRIES },
        ids: this.ids!,
        mapRange: this.mapRange,
        signal: this.signal,
      });
    } catch (err) {
      this.applied = -1;
      throw err;
    }
  }

  private async writeImage(
    baseJson: Record<string, unknown>,
    state: BuildState,
    finalEnv: Record<string, string>,
    history: Array<Record<string, unknown>>,
    ran: number,
    cached: number,
  ): Promise<BuiltImage> {
    const o = this.o;
    const env = state.env.map(([k, v]) => [k, v] as [string, string]);
    for (const [k, v] of Object.entries(finalEnv)) {
      const at = env.findIndex(([name]) => name === k);
      if (at >= 0) env[at] = [k, v];
      else env.push([k, v]);
    }
    const baseInner = (baseJson.config ?? {}) as Record<string, unknown>;
    const inner: Record<string, unknown> = {
      ...baseInner,
      Env: env.map(([k, v]) => `${k}=${v}`),
      WorkingDir: state.workdir,
      ...(state.user !== undefined ? { User: state.user } : {}),
      ExposedPorts: Object.fromEntries(state.exposed.map((p) => [p, {}])),
      Labels: { ...((baseInner.Labels as Record<string, string> | undefined) ?? {}), ...state.labels },
    };
    if (state.entrypoint !== undefined) inner.Entrypoint = state.entrypoint;
    else delete inner.Entrypoint;
    if (state.cmd !== undefined) inner.Cmd = state.cmd;
    else delete inner.Cmd;
    const baseHistory = Array.isArray(baseJson.history) ? (baseJson.history as unknown[]) : [];
    const configJson = {
      ...baseJson,
      config: inner,
      rootfs: { type: 'layers', diff_ids: this.layers.map((l) => l.diffId) },
      history: [...baseHistory, ...history],
    };
    const configBytes = Buffer.from(JSON.stringify(configJson));
    const configDesc: Descriptor = {
      mediaType: MEDIA.ociConfig,
      digest: sha256(configBytes),
      size: configBytes.length,
    };
    const manifest = {
      schemaVersion: 2,
      mediaType: MEDIA.ociManifest,
      config: configDesc,
      layers: this.layers.map((l) => ({
        mediaType: l.descriptor.mediaType,
        digest: l.descriptor.digest,
        size: l.descriptor.size,
      })),
    };
    const manifestBytes = Buffer.from(JSON.stringify(manifest));
    const manifestDesc: Descriptor = {
      mediaType: MEDIA.ociManifest,
      digest: sha256(manifestBytes),
      size: manifestBytes.length,
    };
    const config = parseImageConfig(configBytes);
    // Nothing ran and the node has the result (a second deploy that changed only the source): the same
    // layers and config make the same digest, so the node's copy is this image.
    if (ran === 0 && o.known?.(manifestDesc.digest)) {
      o.log(
        `image ${manifestDesc.digest}: ${this.layers.length} layers (0 steps ran, ${cached} cached; already on this node)`,
      );
      return { layoutDir: o.outDir, known: true, digest: manifestDesc.digest, config, ran, cached };
    }
    await fs.mkdir(o.outDir, { recursive: true });
    await initLayout(o.outDir);
    for (const layer of this.layers) await linkBlob(layer.layout, o.outDir, layer.descriptor.digest);
    await writeBlob(o.outDir, configDesc, [configBytes], configBytes.length);
    if (!(await hasBlob(o.outDir, manifestDesc.digest))) {
      await writeBlob(o.outDir, manifestDesc, [manifestBytes], manifestBytes.length);
    }
    await writeIndex(o.outDir, manifestDesc, BUILT_IMAGE_TAG);
    o.log(`image ${manifestDesc.digest}: ${this.layers.length} layers (${ran} steps ran, ${cached} cached)`);
    return { layoutDir: o.outDir, digest: manifestDesc.digest, config, ran, cached };
  }

  private async dropScratch(): Promise<void> {
    if (this.scratch) await removeTree(this.scratch);
    this.scratch = null;
    this.rootfs = null;
    this.applied = 0;
  }

  async close(): Promise<void> {
    await this.dropScratch().catch(() => {});
    releaseIds(this.idSlot);
    this.idSlot = null;
  }
}

/**
 * A runtime's step as the plan runs it: with the app's final ENV (and `[image].env`), as the image's root
 * user (what installs into the image need, whatever USER the app's steps left), in its own folder.
 */
function implicitPlanStep(step: ImplicitStep, last: BuildState, finalEnv: Record<string, string>): PlanStep {
  const env = last.env.map(([k, v]) => [k, v] as [string, string]);
  for (const [k, v] of Object.entries(finalEnv)) {
    const at = env.findIndex(([name]) => name === k);
    if (at >= 0) env[at] = [k, v];
    else env.push([k, v]);
  }
  if (step.kind === 'copy') {
    const state: BuildState = { ...last, env, user: undefined };
    return {
      kind: 'copy',
      label: `COPY ${step.source} ${step.dest}`,
      sources: [step.source],
      dest: step.dest,
      uid: 0,
      gid: 0,
      state,
    };
  }
  return {
    kind: 'run',
    label: step.label,
    argv: ['/bin/sh', '-c', step.command],
    state: { ...last, env, user: undefined, workdir: step.cwd },
    buildArgs: Object.entries(step.env),
  };
}

/**
 * `apt` as one step. `apt-get clean` drops the downloaded .debs and apt's package caches from the layer
 * (Debian's own images do it with a hook, /etc/apt/apt.conf.d/docker-clean; other images have none), and
 * the package lists go too: the next build's step fetches fresh ones. `apt-get update` keeps apt's own
 * rule (a source that cannot be fetched is a warning, as in a Dockerfile), so the step fails at the
 * install, whose output tail (in the error) names both. apt drops to `_apt` for downloads when the image
 * has that user (inside the build's user namespace); without it apt warns and fetches as root.
 */
function aptStep(packages: string[], state: BuildState): PlanStep {
  const list = packages.join(' ');
  const command = `apt-get update && apt-get install -y --no-install-recommends ${list} && apt-get clean && rm -rf /var/lib/apt/lists/*`;
  return {
    kind: 'run',
    label: `apt-get install ${list}`,
    argv: ['/bin/sh', '-c', command],
    state,
    buildArgs: [['DEBIAN_FRONTEND', 'noninteractive']],
  };
}

/** The shell command the `apt` list becomes (for tests and docs). */
export function aptCommand(packages: string[]): string[] {
  const step = aptStep(
    packages,
    initialState({
      env: [],
      workingDir: '/',
      user: undefined,
      entrypoint: undefined,
      cmd: undefined,
      exposedPorts: [],
      architecture: undefined,
      os: undefined,
    }),
  );
  return step.kind === 'run' ? step.argv : [];
}

function copySpec(step: Extract<PlanStep, { kind: 'copy' }>) {
  return { sources: step.sources, dest: step.dest, uid: step.uid, gid: step.gid, label: step.label };
}

/** Hard-links (else copies) a verified blob into another layout. */
async function linkBlob(fromLayout: string, toLayout: string, digest: string): Promise<void> {
  const to = blobPath(toLayout, digest);
  if (await hasBlob(toLayout, digest)) return;
  const from = blobPath(fromLayout, digest);
  try {
    await fs.link(from, to);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'EEXIST') return;
    const temp = `${to}.${randomBytes(6).toString('hex')}.part`;
    await fs.copyFile(from, temp);
    await fs.rename(temp, to);
  }
}

/** Reads the Dockerfile from the context without following a link. */
async function readDockerfile(contextDir: string, relative: string): Promise<string> {
  const parts = relative.split('/').filter((p) => p !== '' && p !== '.');
  const notFound = () =>
    new FerryError(
      'FERRY_IMAGE_DOCKERFILE_NOT_FOUND',
      `image.dockerfile: the app folder has no file ${JSON.stringify(relative.slice(0, 200))} (a symbolic link is not followed)`,
    );
  if (parts.length === 0 || parts.includes('..')) throw notFound();
  const text = await readFileNoFollow(contextDir, parts, 1024 * 1024).catch((err: unknown) => {
    if (err instanceof FerryError) throw err;
    throw notFound();
  });
  if (text === null) throw notFound();
  return text;
}

/** Removes a scratch tree whose folders a step may have made read-only. */
async function removeTree(dir: string): Promise<void> {
  if (process.getuid?.() !== 0) {
    const walk = async (folder: string): Promise<void> => {
      await fs.chmod(folder, 0o700).catch(() => {});
      for (const child of await fs.readdir(folder, { withFileTypes: true }).catch(() => [])) {
        if (child.isDirectory()) await walk(path.join(folder, child.name));
      }
    };
    await walk(dir);
  }
  await fs.rm(dir, { recursive: true, force: true });
}
