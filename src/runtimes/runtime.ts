/**
 * The `Runtime` interface: everything Ferry knows about one runtime, in one object per runtime
 * (`runtimes/<name>/index.ts`), chosen once from the build's runtime (`runtimeOf`, ./index.ts) and asked
 * wherever the runtimes differ, so no other module branches on a runtime's name:
 *
 * - its builder (what turns an upload into something replicas load), in `runtimes/<name>/builder.ts`;
 * - its launch recipe: which root filesystem the replica's sandbox shows as `/`, which interpreter runs
 *   which in-sandbox program (the Node or Python bootstrap, the custom supervisor, in the same folder),
 *   and the runtime's variables. The sandbox (sandbox/launch.ts) only executes a recipe;
 * - its capabilities: how calls reach a replica (the frame protocol, or proxied HTTP to the app's own
 *   server), whether the warm pool keeps sandboxes of it, how long a replica may take to start.
 *
 * The in-sandbox programs are copied alone into the sandbox: they import nothing of Ferry (not this file).
 */
import fs from 'node:fs/promises';
import type { AppConfig } from '../apps/app-config.js';
import type { Builder } from '../builds/builder.js';
import type { BuildImageRecord } from '../images/build-image.js';
import { resolveInRoot } from '../images/rootfs-path.js';
import type { PoolBuild } from '../replicas/pool.js';
import { HOST_SYSTEM_ROOTS } from '../sandbox/launch.js';
import { ferryNodeBinding } from '../sandbox/node-binding.js';

/** The runtimes a build can have (`builds.runtime`, written by the builder). */
export type RuntimeName = 'node' | 'python' | 'custom';

/**
 * The root filesystem a replica sees as `/`. `host`: the host's system folders, read-only (/usr, /etc,
 * /bin, /lib…, sandbox/launch.ts), with the programs Ferry runs from the host (Node, the system's
 * python3). `image`: an image's unpacked root (`[image]` in ferry.toml), with Ferry's Node bound in.
 */
export interface HostRootfs {
  kind: 'host';
  /** The search path a replica gets (PATH): what the custom builder looks up an entrypoint's command on. */
  searchPath: readonly string[];
  /** The host's folders a sandboxed replica sees at their own path (the custom builder's checks). */
  systemRoots: readonly string[];
  /** The command that runs Ferry's Node (its options and script follow). */
  node: readonly string[];
}

/**
 * An image's unpacked root filesystem as `/`, read-only (sandbox/launch.ts `ImageRoot`): one copy per
 * digest on the node, pinned in the node's image cache while the replica runs. The image's ENV is the
 * base of the replica's environment, and its WORKDIR its working folder where the image's program runs.
 */
export interface ImageRootfs {
  kind: 'image';
  /** The unpacked root on the host. */
  dir: string;
  digest: string;
  /** The image's PATH. */
  searchPath: readonly string[];
  /** The image's ENV with `[image].env` over it: under the project's secrets and the app's `[env]`. */
  env: Record<string, string>;
  /** Ferry's Node inside (sandbox/node-binding.ts): its command prefix, and the host files it needs bound. */
  node: readonly string[];
  files: ReadonlyArray<{ host: string; sandbox: string }>;
  /** Where the replica starts, absolute in the image; undefined: the app folder. */
  workingDir?: string;
}

export type Rootfs = HostRootfs | ImageRootfs;

/** The host's root filesystem, as every runtime launches without an image. */
export const HOST_ROOTFS: HostRootfs = {
  kind: 'host',
  searchPath: ['/usr/local/bin', '/usr/bin', '/bin'],
  systemRoots: HOST_SYSTEM_ROOTS,
  node: [process.execPath],
};

/** The image of an image build's replica: its record (builds.image_json) and its pinned unpacked root. */
export interface LaunchImage {
  record: BuildImageRecord;
  rootfs: string;
}

/**
 * The root filesystem of a replica on `image`; it starts in `workingDir` (absolute in the image) when
 * given and a folder there, else in the app folder.
 */
export async function imageRootfs(image: LaunchImage, workingDir?: string): Promise<ImageRootfs> {
  const node = await ferryNodeBinding();
  let start: string | undefined;
  if (workingDir !== undefined && workingDir !== '/') {
    const host = await resolveInRoot(image.rootfs, workingDir);
    if (host && (await fs.stat(host).catch(() => undefined))?.isDirectory()) start = workingDir;
  }
  return {
    kind: 'image',
    dir: image.rootfs,
    digest: image.record.digest,
    searchPath: image.record.searchPath,
    env: image.record.env,
    node: node.argv,
    files: node.files,
    ...(start !== undefined ? { workingDir: start } : {}),
  };
}

/** What a replica of a runtime runs: decided by the runtime, executed by the sandbox. */
export interface LaunchRecipe {
  /** What the sandbox shows as `/`, and so where the interpreter below comes from. */
  rootfs: Rootfs;
  /** The in-sandbox program (bootstrap or supervisor): the host file, copied read-only to `sandbox`. */
  program: { host: string; sandbox: string };
  /** The command, given the path at which the replica sees the program (the interpreter is chosen here). */
  command(programPath: string): string[];
  /** The runtime's variables, under Ferry's own (launcher.ts `replicaEnvironment`). */
  env: Record<string, string>;
  /** Variables of this replica over every other (the custom supervisor's settings and PORT). */
  overrides: Record<string, string>;
  /** The working folder, relative to the app folder; undefined: the app folder. */
  cwd?: string;
}

/** What a recipe is made for. */
export interface LaunchTarget {
  /** The build, or undefined for a warm sandbox that knows no app yet (warm-pool.ts). */
  build?: PoolBuild;
  /** What the replica loads, relative to the build folder (the build's entry, or the runtime's default). */
  entry: string;
  resources: AppConfig['resources'];
  /** Whether the replica gets a sandbox (and so a network namespace of its own). */
  sandboxed: boolean;
  /** With `[image]`: the image the replica runs on (the warm pool never has one). */
  image?: LaunchImage;
}

export interface Runtime {
  readonly name: RuntimeName;
  /**
   * How calls reach a replica: `frames`, the replica protocol (docs/replica-protocol.md) spoken by a
   * bootstrap calling the app's functions; `http`, requests proxied to the app's own server (and
   * WebSockets tunnelled to it) through the supervisor.
   */
  readonly calls: 'frames' | 'http';
  /**
   * The warm pool (replicas/warm-pool.ts) keeps started sandboxes of this runtime, or null when it does
   * not. `startupVariables`: variables the runtime reads only as it starts; an app setting one gets a
   * replica started for it.
   */
  readonly warm: { startupVariables: RegExp } | null;
  /** What a replica loads when the build named no entry, relative to the build folder. */
  readonly defaultEntry: string;
  /** Whether this server can run (and build) it: Python needs an interpreter. */
  available(): Promise<boolean>;
  createBuilder(): Builder;
  launchRecipe(target: LaunchTarget): Promise<LaunchRecipe>;
  /** How long a replica of `config` may take to become ready, given the server's own start timeout. */
  startTimeoutMs(config: AppConfig, serverMs: number): number;
}
