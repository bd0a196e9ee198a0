/**
 * Prepares the process of one replica: the build's runtime gives its launch recipe (runtimes/: the root
 * filesystem, the interpreter, the in-sandbox program and its variables), this module adds the environment
 * (the project's secrets, the app's [env], Ferry's protocol variables, and nothing of the server's own
 * environment) and the sandbox around it (sandbox/launch.ts).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { FerryError } from '../errors.js';
import { parseBuildImageRecord } from '../images/build-image.js';
import type { ImageStore, PinnedImage } from '../images/image-store.js';
import { createImageViews } from '../images/image-views.js';
import { runtimeOf } from '../runtimes/index.js';
import type { LaunchImage, LaunchRecipe, Runtime } from '../runtimes/runtime.js';
import { prepareLaunch, type SandboxCapabilities, sandboxPaths } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import type { BuildViews } from '../sandbox/views.js';
import type { Store } from '../store/index.js';
import type { Volumes } from '../volumes/volumes.js';
import type { PoolBuild } from './pool.js';
import type { LaunchPlan } from './replica.js';

export interface LauncherDeps {
  store: Store;
  buildsDir: string;
  /** Where replica socket folders are made (short: Unix socket paths are limited to 107 bytes). */
  runDir: string;
  sandbox: SandboxCapabilities;
  /** Where sandboxed replicas find their build (a path that does not name the data directory; sandbox/views.ts). */
  views?: BuildViews;
  /** Gives each replica a network namespace of its own (acquired before spawn, released in cleanup). */
  network: SandboxNetwork;
  /** Makes `<buildsDir>/<build>` complete here, from the artifacts folder when another process built it. */
  ensureLocal?: (buildId: string) => Promise<void>;
  /** The project's secrets, decrypted, for the replica's environment. */
  secrets(projectId: string): Promise<Record<string, string>>;
  /** The app's `[[volumes]]`, mounted on this machine, as binds and groups (volumes/volumes.ts). */
  volumes?: Pick<Volumes, 'forLaunch'>;
  /**
   * The node's images: a replica of an image build pins its image here (pulled by digest when this node
   * does not have it) for as long as it runs. Absent where replicas are not sandboxed.
   */
  images?: Pick<ImageStore, 'acquire' | 'acquireBuilt' | 'onDiscard'>;
}

/** A recipe's command as the replica sees it (its program where the sandbox copies it). */
export function recipeCommand(recipe: LaunchRecipe, paths: { runtimeFile(host: string): string }): string[] {
  return recipe.command(paths.runtimeFile(recipe.program.host));
}

export function createLauncher(deps: LauncherDeps) {
  const imageViews = createImageViews({ dataDir: deps.buildsDir, othersRead: deps.sandbox.identity !== null });
  // A view is kept between replicas (no view to make at the next cold start) until the cache lets go of
  // the image: its hard links would keep the evicted files on disk.
  deps.images?.onDiscard((digest) => imageViews.drop(digest));
  return async function launch(build: PoolBuild, replicaId: string): Promise<LaunchPlan> {
    const runtime = runtimeOf(build);
    const row = await deps.store
      .selectFrom('builds')
      .select(['entry', 'image_json'])
      .where('id', '=', build.buildId)
      .executeTakeFirst();
    // Deleted since the call resolved it (retention, or its app deleted on another node): the caller may try
    // again and find the app's build as it is now. The answer a worker gives a gateway naming such a build
    // (cluster/worker-builds.ts); it was a 500 FERRY_INTERNAL (test/contract-invoker.test.ts).
    if (!row) {
      throw new FerryError('FERRY_NO_READY_BUILD', 'The build this call was resolved to is not there any more', {
        headers: { 'retry-after': '1' },
      });
    }
    await deps.ensureLocal?.(build.buildId);
    const sandboxed = deps.sandbox.bwrap !== null;
    const buildDir =
      sandboxed && deps.views ? await deps.views.viewOf(build.buildId) : path.join(deps.buildsDir, build.buildId);
    const record = parseBuildImageRecord(row.image_json);
    let pinned: PinnedImage | undefined;
    let view: { dir: string; release: () => Promise<void> } | undefined;
    try {
      if (record) {
        if (!sandboxed || !deps.images) throw new FerryError('FERRY_IMAGE_NO_SANDBOX');
        // Held until the replica's cleanup: the cache never evicts an image a replica runs on.
        // A built image comes from this node's cache or the image shelf; a pulled one also from its registry,
        // with the project's credentials. The build that recorded it proved the project may have it.
        pinned = record.built
          ? await deps.images.acquireBuilt(record.digest, record.reference)
          : await deps.images.acquire(record.reference, { projectId: build.projectId, recorded: true });
        view = await imageViews.acquire(pinned.digest, pinned.image.rootfs);
      }
      const image = record && view ? { record, rootfs: view.dir } : undefined;
      const plan = await launchOn(build, replicaId, runtime, row.entry, buildDir, sandboxed, image);
      const release = async () => {
        await view?.release();
        pinned?.release();
      };
      return { ...plan, cleanup: () => plan.cleanup().finally(release) };
    } catch (err) {
      await view?.release();
      pinned?.release();
      throw err;
    }
  };

  async function launchOn(
    build: PoolBuild,
    replicaId: string,
    runtime: Runtime,
    entry: string | null,
    buildDir: string,
    sandboxed: boolean,
    image: LaunchImage | undefined,
  ): Promise<LaunchPlan> {
    const recipe = await runtime.launchRecipe({
      build,
      entry: entry ?? runtime.defaultEntry,
      resources: build.config.resources,
      sandboxed,
      ...(image ? { image } : {}),
    });
    // Used only without bwrap: a sandboxed replica's socket is in its own private tmpfs.
    const socketDir = path.join(deps.runDir, replicaId);
    const layout = { buildDir, socketDir, runtimeFiles: [recipe.program] };
    const paths = sandboxPaths(layout, sandboxed);
    const env: Record<string, string> = {
      ...replicaEnvironment(build, runtime, recipe, await deps.secrets(build.projectId), paths, entry),
      ...recipe.overrides,
    };
    // Mounted on this machine before the sandbox starts; refused (never unbounded) without the sandbox.
    const volumes = (await deps.volumes?.forLaunch(build.projectId, build.config)) ?? { binds: [], groups: [] };
    const lease = sandboxed ? await deps.network.acquire(replicaId) : null;
    let prepared: Awaited<ReturnType<typeof prepareLaunch>>;
    try {
      prepared = await prepareLaunch(
        {
          ...layout,
          replicaId,
          memoryMiB: build.config.resources.memory,
          maxProcesses: build.config.resources.max_processes,
          cpu: build.config.resources.cpu,
          command: recipeCommand(recipe, paths),
          env,
          ...(volumes.binds.length > 0 ? { volumes: volumes.binds, groups: volumes.groups } : {}),
          ...(lease ? { network: lease } : {}),
          ...(recipe.cwd !== undefined ? { cwd: recipe.cwd } : {}),
          ...(recipe.rootfs.kind === 'image'
            ? {
                image: {
                  rootfs: recipe.rootfs.dir,
                  files: recipe.rootfs.files,
                  ...(recipe.rootfs.workingDir !== undefined ? { workingDir: recipe.rootfs.workingDir } : {}),
                },
              }
            : {}),
        },
        deps.sandbox,
      );
    } catch (err) {
      await lease?.release();
      throw err;
    }
    return {
      spawn: () => prepared.spawn(['ignore', 'pipe', 'pipe']),
      sandboxed: prepared.sandboxed,
      wasOomKilled: () => prepared.wasOomKilled(),
      async cleanup() {
        await prepared.cleanup();
        await lease?.release();
        await fs.rm(socketDir, { recursive: true, force: true });
      },
    };
  }
}

/** Ferry's own variables of every replica: the base of a warm sandbox's environment too (warm-pool.ts). */
export function baseEnvironment(recipe: LaunchRecipe, socketPath: string): Record<string, string> {
  return {
    PATH: recipe.rootfs.searchPath.join(':'),
    HOME: '/tmp',
    ...recipe.env,
    FERRY_PROTOCOL: '1',
    FERRY_SOCKET: socketPath,
  };
}

/**
 * A replica's environment: the project's secrets, the app's [env], then Ferry's variables (which win). A
 * warm sandbox is given the same at load (warm-pool.ts), so an app cannot tell how its replica started.
 */
export function replicaEnvironment(
  build: PoolBuild,
  runtime: Pick<Runtime, 'defaultEntry'>,
  recipe: LaunchRecipe,
  secrets: Record<string, string>,
  paths: { socketPath: string; appDir: string },
  entry: string | null,
): Record<string, string> {
  const base = baseEnvironment(recipe, paths.socketPath);
  return {
    // An image's ENV (with [image].env) is the bottom layer: the project's and the app's settings win.
    ...(recipe.rootfs.kind === 'image' ? recipe.rootfs.env : {}),
    ...secrets,
    ...build.config.env,
    PATH: base.PATH!,
    HOME: base.HOME!,
    ...recipe.env,
    APP_NAME: build.appId,
    PROJECT_ID: build.projectId,
    BUILD_ID: build.buildId,
    FERRY_PROTOCOL: '1',
    FERRY_SOCKET: paths.socketPath,
    FERRY_ENTRY: `${paths.appDir}/${entry ?? runtime.defaultEntry}`,
  };
}
