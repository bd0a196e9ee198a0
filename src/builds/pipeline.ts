/**
 * The build pipeline: runs builds off the request path, one at a time per app, in upload order.
 *
 * A build goes `pending → building → ready | failed | cancelled`. When a build becomes ready it becomes
 * the app's active build unless a newer one already is (builds/activation.ts decides and writes it, in the
 * transaction that records the build ready, and announces it only when it did); a failed build leaves the
 * active build alone.
 *
 * A build is held by one node (its `owner`): the node that received the upload, from the start. It moves
 * to `building` only while this node still holds it (store/claims.ts), and its final state is written only
 * then too. A build whose node stopped or died is pending and free again (cluster/recovery.ts): `recover`
 * claims free builds and runs them here, from the start.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import type { AppConfig } from '../apps/app-config.js';
import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import { type BuildImage, type BuildImageRecord, prepareBuildImage } from '../images/build-image.js';
import { DEFAULT_IMAGE_BUILD_LIMITS } from '../images/image-builder.js';
import type { ImageStore } from '../images/image-store.js';
import { type Builders, selectBuilder } from '../runtimes/index.js';
import { type BuildLimits, buildCacheDir, DEFAULT_BUILD_LIMITS } from '../sandbox/build-step.js';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import type { SandboxNetwork } from '../sandbox/network.js';
import { ScheduleLimitError } from '../schedules/limits.js';
import { claimFreeBuilds, startBuild } from '../store/claims.js';
import type { Store } from '../store/index.js';
import type { Build, BuildState } from '../store/schema.js';
import type { BuildActivation } from './activation.js';
import { BuildFailedError } from './build-failed.js';
import { buildFolder } from './build-folder.js';
import type { BuildLog } from './build-log.js';
import type { BuildOutput } from './build-output.js';
import { FINAL_BUILD_STATES } from './builds.js';

export interface BuildPipelineDeps {
  store: Store;
  buildLog: BuildLog;
  /** `<data-dir>/builds`: each build gets `<buildsDir>/<build_id>/{source,out}`. */
  buildsDir: string;
  cacheDir: string;
  builders: Builders;
  /** Build steps run in this sandbox (plain processes, loudly logged, when it has no bwrap). */
  sandbox: SandboxCapabilities;
  /** Gives every build step its network (sandbox/network.ts). */
  network: SandboxNetwork;
  /** Memory and processes per step, wall-clock time per build (default DEFAULT_BUILD_LIMITS). */
  limits?: BuildLimits;
  logger: Logger;
  /** Makes a ready build the app's active one (unless a newer one is) and announces it: the one writer. */
  activation: Pick<BuildActivation, 'promoteReady' | 'announce'>;
  /** Told about every build that reaches a final state (metrics). */
  onFinished?: (build: Build) => void;
  /** This node's id (cluster/node.ts). */
  owner: string;
  /** Shares builds through the artifacts folder (build-output.ts): source in when missing, output out when ready. */
  output?: Pick<BuildOutput, 'ensureSource' | 'publish'>;
  /**
   * False on a gateway (`--role gateway`), which builds nothing: builds it receives stay free (no owner)
   * for a process that builds to claim, and `onQueued` tells them. Default true.
   */
  builds?: boolean;
  /** A build was received here but is left for another process to build (builds: false). */
  onQueued?: (build: Build) => void;
  /**
   * The node's images (images/image-store.ts): an app with `[image]` has its base pulled and pinned here.
   * Without it such a build fails (FERRY_IMAGE_NO_SANDBOX).
   */
  images?: ImageStore;
  /** `FERRY_IMAGE_BUILD_TIMEOUT_SECONDS` in milliseconds: the image part's own limit (default 30 min). */
  imageBuildTimeoutMs?: number;
}

export interface BuildPipeline {
  enqueue(build: Build): void;
  /** Cancels a pending or running build; answers FERRY_BUILD_NOT_CANCELLABLE when it has finished. */
  cancel(projectId: string, appId: string, buildId: string): Promise<Build>;
  /** Claims the builds no node holds (their node stopped or died) and queues them here; returns how many. */
  recover(): Promise<number>;
  /** Stops running builds without marking them (they are redone at the next start) and waits for the queues. */
  close(): Promise<void>;
}

/** The abort reason when a build runs past its time limit: a failure of the build, not a cancellation. */
class BuildTimeLimitError extends BuildFailedError {}

export function createBuildPipeline(deps: BuildPipelineDeps): BuildPipeline {
  const { store, buildLog, logger, owner } = deps;
  const limits = deps.limits ?? DEFAULT_BUILD_LIMITS;
  const queues = new Map<string, Promise<void>>();
  const running = new Map<string, AbortController>();
  let closing = false;

  async function runOne(build: Build): Promise<void> {
    if (closing) return;
    // Only while this node still holds it: it may have been cancelled, or taken over after a lost lease.
    if (!(await startBuild(store, owner, build.id, nowIso()))) return;
    const controller = new AbortController();
    running.set(build.id, controller);
    const started = Date.now();
    const timeLimit = setTimeout(() => {
      controller.abort(
        new BuildTimeLimitError(
          `The build took longer than its time limit (${formatDuration(limits.timeoutMs)}) and was stopped`,
        ),
      );
    }, limits.timeoutMs);
    const log = (line: string) => buildLog.append(build.id, line);
    // The build's outcome is written past the log's byte bound too.
    const note = (line: string) => buildLog.append(build.id, line, true);
    const folder = buildFolder(deps.buildsDir, build.id);
    let finalState: BuildState;
    let error: string | null = null;
    let result: { runtime: string; entry: string; functions?: string[] | undefined } | undefined;
    let image: BuildImage | undefined;
    let imageRecord: BuildImageRecord | undefined;
    try {
      log(`Building ${build.app_id} (build ${build.id})`);
      if (deps.sandbox.bwrap === null) {
        log('WARNING: this build is NOT sandboxed: npm, pip and esbuild run as plain processes of the server,');
        log('WARNING: with its user and its view of files and network (bubblewrap is missing or FERRY_SANDBOX=off)');
      }
      await deps.output?.ensureSource(build);
      await fs.rm(folder.out, { recursive: true, force: true });
      await fs.mkdir(folder.out, { recursive: true });
      const config = JSON.parse(build.config_json) as AppConfig;
      const builder = selectBuilder(config, folder.source, deps.builders);
      log(`Runtime: ${config.app.runtime} (${builder.name} builder)`);
      if (config.image) {
        const implicitSteps = (await builder.imageSteps?.({ sourceDir: folder.source, config })) ?? [];
        image = await prepareBuildImage({
          images: deps.images,
          spec: config.image,
          implicitSteps,
          projectId: build.project_id,
          buildId: build.id,
          sourceDir: folder.source,
          timeoutMs: deps.imageBuildTimeoutMs ?? 30 * 60_000,
          sandboxed: deps.sandbox.bwrap !== null,
          log,
          signal: controller.signal,
          steps: {
            sandbox: { caps: deps.sandbox, network: deps.network },
            cacheDir: path.join(deps.cacheDir, 'image-steps'),
            // The data folder, as build steps take it (sandbox/build-step.ts): the cache folder's parent.
            dataDir: path.dirname(path.resolve(deps.cacheDir)),
            limits: {
              memoryMiB: limits.memoryMiB,
              maxProcesses: limits.maxProcesses,
              cpu: DEFAULT_IMAGE_BUILD_LIMITS.cpu,
              diskBytes: DEFAULT_IMAGE_BUILD_LIMITS.diskBytes,
            },
          },
        });
      }
      const built = await builder.build({
        buildId: build.id,
        sourceDir: folder.source,
        outputDir: folder.out,
        cacheDir: deps.cacheDir,
        sandbox: { caps: deps.sandbox, network: deps.network, limits },
        config,
        log,
        signal: controller.signal,
        ...(image ? { image: { record: image.record, rootfs: image.rootfs } } : {}),
      });
      result = built;
      if (image) imageRecord = { ...image.record, ...built.image };
      checkScheduledFunctions(config, result.functions);
      await deps.output?.publish(build.id);
      finalState = 'ready';
      note(`Build ready in ${((Date.now() - started) / 1000).toFixed(1)} s`);
    } catch (err) {
      if (controller.signal.reason instanceof BuildTimeLimitError) {
        finalState = 'failed';
        error = controller.signal.reason.message;
        note(`Build failed: ${error}`);
      } else if (controller.signal.aborted) {
        if (closing) {
          // Not the app's fault and not the user's choice: leave it for recover() at the next start.
          note('Build interrupted by a server stop; it will run again from the start');
          // Free for any node (or this one's next start) to build again.
          await store
            .updateTable('builds')
            .set({ state: 'pending', started_at: null, owner: null })
            .where('id', '=', build.id)
            .where('owner', '=', owner)
            .where('state', '=', 'building')
            .execute();
          await buildLog.flush(build.id);
          return;
        }
        finalState = 'cancelled';
        error = 'cancelled';
        note('Build cancelled');
      } else if (err instanceof BuildFailedError) {
        finalState = 'failed';
        error = err.message;
        note(`Build failed: ${err.message}`);
      } else if (err instanceof FerryError) {
        // A coded failure of a part the build uses (the artifacts store out of reach, say): its code and
        // message are meant for users, so the build says them rather than only "internal error".
        finalState = 'failed';
        error = `${err.code}: ${err.message}`;
        logger.warn({ err, buildId: build.id }, 'build failed on a coded error');
        note(`Build failed: ${error}`);
      } else {
        finalState = 'failed';
        error = 'internal error while building';
        logger.error({ err, buildId: build.id }, 'build crashed');
        note('Build failed: internal error while building (see the server log)');
      }
    } finally {
      clearTimeout(timeLimit);
      // Replicas pin the image again when they start; between the two the cache may evict it (pulled again).
      image?.release();
      running.delete(build.id);
      await fs.rm(buildCacheDir(deps.cacheDir, build.id), { recursive: true, force: true }).catch(() => {});
    }
    await buildLog.flush(build.id);
    let promoted = false;
    const record = () =>
      store.transaction().execute(async (trx) => {
        const changed = await trx
          .updateTable('builds')
          .set({
            state: finalState,
            error,
            finished_at: nowIso(),
            runtime: result?.runtime ?? null,
            entry: result?.entry ?? null,
            functions: result?.functions ? JSON.stringify(result.functions) : null,
            image_digest: finalState === 'ready' && imageRecord ? imageRecord.digest : null,
            image_json: finalState === 'ready' && imageRecord ? JSON.stringify(imageRecord) : null,
          })
          .where('id', '=', build.id)
          .where('owner', '=', owner)
          .where('state', '=', 'building')
          .executeTakeFirst();
        // Another node holds the build now (this one lost its lease): its outcome is that node's to write.
        if (Number(changed.numUpdatedRows) === 0) return false;
        if (finalState === 'ready') promoted = await deps.activation.promoteReady(trx, build);
        return true;
      });
    let recorded: boolean;
    try {
      recorded = await record();
    } catch (err) {
      // The activation refused the ready build (schedules/limits.ts: checked under the project's lock, the
      // limit was passed since the upload's check, by another app's deploy say): the build fails with it.
      if (!(finalState === 'ready' && err instanceof ScheduleLimitError)) throw err;
      finalState = 'failed';
      error = `${err.code}: ${err.message}`;
      note(`Build failed: ${error}`);
      await buildLog.flush(build.id);
      recorded = await record();
    }
    if (!recorded) {
      logger.warn(
        { buildId: build.id, state: finalState },
        'build outcome not written: another node holds the build now',
      );
      return;
    }
    buildLog.ended(build.id);
    if (finalState !== 'ready') await fs.rm(folder.out, { recursive: true, force: true }).catch(() => {});
    logger.info(
      { buildId: build.id, app: build.app_id, state: finalState, ms: Date.now() - started },
      'build finished',
    );
    const finished = await store.selectFrom('builds').selectAll().where('id', '=', build.id).executeTakeFirst();
    if (finished) deps.onFinished?.(finished);
    // Only a build that did become active is announced: one that finished after a newer build became
    // active stays ready but inactive, and every process keeps running the newer one.
    if (promoted) {
      void deps.activation
        .announce(build)
        .catch((err: unknown) => logger.warn({ err, buildId: build.id }, 'announcing the activated build failed'));
    }
  }

  function formatDuration(ms: number): string {
    return ms % 60_000 === 0 ? `${ms / 60_000} min` : `${Math.round(ms / 1000)} s`;
  }

  function enqueue(build: Build): void {
    if (deps.builds === false) {
      deps.onQueued?.(build);
      return;
    }
    const key = `${build.project_id}/${build.app_id}`;
    const previous = queues.get(key) ?? Promise.resolve();
    const next = previous
      .then(() => runOne(build))
      .catch((err: unknown) => logger.error({ err, buildId: build.id }, 'build pipeline error'));
    queues.set(key, next);
    void next.then(() => {
      if (queues.get(key) === next) queues.delete(key);
    });
  }

  return {
    enqueue,
    async cancel(projectId, appId, buildId) {
      const build = await store
        .selectFrom('builds')
        .selectAll()
        .where('project_id', '=', projectId)
        .where('app_id', '=', appId)
        .where('id', '=', buildId)
        .executeTakeFirst();
      if (!build) throw new FerryError('FERRY_BUILD_NOT_FOUND');
      if (FINAL_BUILD_STATES.includes(build.state)) {
        throw new FerryError('FERRY_BUILD_NOT_CANCELLABLE', `The build has already finished (${build.state})`);
      }
      const controller = running.get(buildId);
      if (controller) {
        controller.abort(new Error('cancelled'));
        // runOne records the final state; wait for it so the answer shows it.
        await queues.get(`${projectId}/${appId}`);
      } else {
        const at = nowIso();
        const changed = await store
          .updateTable('builds')
          .set({ state: 'cancelled', error: 'cancelled', finished_at: at })
          .where('id', '=', buildId)
          .where('state', '=', 'pending')
          .executeTakeFirst();
        if (Number(changed.numUpdatedRows) > 0) buildLog.append(buildId, 'Build cancelled before it started');
        await buildLog.flush(buildId);
      }
      const after = await store.selectFrom('builds').selectAll().where('id', '=', buildId).executeTakeFirstOrThrow();
      return after;
    },
    async recover() {
      if (closing || deps.builds === false) return 0;
      const free = await claimFreeBuilds(store, owner, 100);
      for (const build of free) {
        buildLog.append(
          build.id,
          `Picked up by ${owner} (received by a gateway, or left by a server that stopped); building from the start`,
        );
        enqueue(build);
      }
      return free.length;
    },
    async close() {
      closing = true;
      for (const controller of running.values()) controller.abort(new Error('server stopping'));
      await Promise.allSettled([...queues.values()]);
    },
  };
}

/**
 * A cortex app's `[[schedules]]` must each name a public function the build exports (known once it is
 * built): the build fails naming the key otherwise. Custom apps' `function` is a path of their server.
 */
export function checkScheduledFunctions(config: AppConfig, functions: string[] | undefined): void {
  if (config.app.runtime === 'custom' || functions === undefined) return;
  (config.schedules ?? []).forEach((schedule, i) => {
    if (!functions.includes(schedule.function) || schedule.function.startsWith('_')) {
      throw new BuildFailedError(
        `ferry.toml: schedules.${i}.function: "${schedule.function}" is not a public function of the app (it exports ${
          functions.length > 0 ? functions.join(', ') : 'none'
        })`,
      );
    }
  });
}
