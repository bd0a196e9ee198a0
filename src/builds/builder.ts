/**
 * The per-runtime builder interface: what turns an extracted app folder into something replicas load.
 * One implementation per runtime, beside the rest of that runtime (`runtimes/<name>/builder.ts`).
 */
import type { AppConfig } from '../apps/app-config.js';
import type { BuildImageRecord } from '../images/build-image.js';
import type { ImplicitStep } from '../images/image-steps.js';
import type { BuildSandbox } from '../sandbox/build-step.js';

export interface BuildContext {
  buildId: string;
  /** The extracted archive. Steps see it read-only; only `node_modules` in it is written (by npm). */
  sourceDir: string;
  /** An empty folder for what the builder produces (for example the bundle). */
  outputDir: string;
  /** The server's cache folder; each build's steps get `<cacheDir>/builds/<buildId>` of their own. */
  cacheDir: string;
  /** Where build steps run: the sandbox, the network provider and the limits (sandbox/build-step.ts). */
  sandbox: BuildSandbox;
  config: AppConfig;
  /** Appends one line to the build's log (no trailing newline needed). */
  log: (line: string) => void;
  /** Aborted when the build is cancelled or the server stops; the builder must stop its child processes. */
  signal: AbortSignal;
  /**
   * With `[image]`: the image replicas will run on, pulled and pinned for the build (images/build-image.ts).
   * `rootfs` is its unpacked root, read-only and shared: look things up with images/rootfs-path.ts.
   */
  image?: { record: BuildImageRecord; rootfs: string };
}

export interface BuildResult {
  /** The runtime that will run this build: `node`, `python` or `custom`. */
  runtime: 'node' | 'python' | 'custom';
  /** What a replica loads, relative to the build folder (the parent of sourceDir and outputDir). */
  entry: string;
  /**
   * Names of the entry's exports, when the builder can tell without running user code. Public functions are
   * the ones not starting with `_`; the run endpoint answers 404 for any other name without starting a replica.
   * Undefined means "unknown": the replica decides.
   */
  functions?: string[];
  /** With an image: what the runtime found in it for its replicas (stored in the build's image record). */
  image?: Pick<BuildImageRecord, 'custom' | 'python'>;
}

export interface Builder {
  readonly name: 'node' | 'python' | 'custom';
  build(ctx: BuildContext): Promise<BuildResult>;
  /**
   * With `[image]`: steps the runtime adds to the app's image, after the app's own (images/image-steps.ts),
   * decided from the app folder before the image is built. Python installs `requirements.txt` this way.
   * Throws BuildFailedError for an app folder it cannot make steps of.
   */
  imageSteps?(input: { sourceDir: string; config: AppConfig }): Promise<ImplicitStep[]>;
}
