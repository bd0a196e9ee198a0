/**
 * The build service: what the builds routes ask of builds, behind one object. A deploy (the upload checked
 * and stored, then queued for the pipeline), the reads (list, get, the log, the archive's listing),
 * delete, cancel, and activation (a rollback), which goes through the one writer of the active build
 * (builds/activation.ts) that the pipeline uses too.
 */
import type { Readable } from 'node:stream';
import { findApp } from '../apps/apps.js';
import type { Housekeeping } from '../apps/housekeeping.js';
import type { DiskSpace } from '../disk-space.js';
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { Build, BuildState } from '../store/schema.js';
import type { BuildActivation } from './activation.js';
import type { ArtifactStore } from './artifact-store.js';
import type { BuildLog, LogLine } from './build-log.js';
import { type BuildView, findBuild, listBuilds, viewBuild } from './builds.js';
import { type ReceiveBuildDeps, receiveBuild } from './upload.js';
import { listZip, type ZipFileEntry } from './zip-archive.js';

export interface BuildServiceDeps {
  store: Store;
  activation: Pick<BuildActivation, 'activate'>;
  pipeline: {
    enqueue(build: Build): void;
    cancel(projectId: string, appId: string, buildId: string): Promise<Build>;
  };
  artifacts: ArtifactStore;
  buildLog: Pick<BuildLog, 'read' | 'waitForLines'>;
  housekeeping: Pick<Housekeeping, 'deleteBuild'>;
  /** Where and how uploads are received (builds/upload.ts); `owner` unset on a gateway, which builds nothing. */
  upload: Omit<ReceiveBuildDeps, 'store' | 'artifacts'>;
  /** The data folder's free space: while `low`, uploads are refused (507) before a byte is written (disk-space.ts). */
  space?: Pick<DiskSpace, 'low' | 'intakeRefused'>;
}

export interface BuildService {
  /**
   * Receives an upload (the ZIP checked before anything is extracted) and queues the new pending build;
   * 507 FERRY_STORAGE_FULL while the data folder is low on space.
   */
  deploy(projectId: string, appId: string, body: Readable): Promise<{ build: Build; view: BuildView }>;
  list(projectId: string, appId: string, page: { limit: number; before?: string | undefined }): Promise<BuildView[]>;
  /** One build, with the ferry.toml it was made with. */
  get(projectId: string, appId: string, buildId: string): Promise<BuildView>;
  /** Deletes a build and its files (not the active build, nor one being made). */
  delete(projectId: string, appId: string, buildId: string): Promise<void>;
  /** Makes an earlier ready build the active one (rollback); this process has switched when it resolves. */
  activate(projectId: string, appId: string, buildId: string): Promise<BuildView>;
  cancel(projectId: string, appId: string, buildId: string): Promise<BuildView>;
  /** The build's state now (undefined once it is gone); throws FERRY_BUILD_NOT_FOUND for another app's. */
  find(projectId: string, appId: string, buildId: string): Promise<Build>;
  /** The build's state by id alone (a log follower's poll), undefined once it is gone. */
  state(buildId: string): Promise<BuildState | undefined>;
  readLog(buildId: string, after: number): Promise<LogLine[]>;
  /** Resolves when the build logs more, after `ms`, or when `signal` aborts. */
  waitForLog(buildId: string, ms: number, signal: AbortSignal): Promise<void>;
  /** The files of the build's uploaded archive, in archive order. */
  archive(projectId: string, appId: string, buildId: string): Promise<ZipFileEntry[]>;
}

export function createBuildService(deps: BuildServiceDeps): BuildService {
  const { store } = deps;
  return {
    async deploy(projectId, appId, body) {
      if (deps.space?.low) throw deps.space.intakeRefused();
      const build = await receiveBuild({ store, artifacts: deps.artifacts, ...deps.upload }, projectId, appId, body);
      deps.pipeline.enqueue(build);
      return { build, view: viewBuild(build, false, null) };
    },

    async list(projectId, appId, page) {
      const found = await findApp(store, projectId, appId);
      const builds = await listBuilds(store, projectId, appId, page);
      return builds.map((b) => viewBuild(b, false, found.active_build_id));
    },

    async get(projectId, appId, buildId) {
      const found = await findApp(store, projectId, appId);
      return viewBuild(await findBuild(store, projectId, appId, buildId), true, found.active_build_id);
    },

    delete: (projectId, appId, buildId) => deps.housekeeping.deleteBuild(projectId, appId, buildId),

    async activate(projectId, appId, buildId) {
      await findApp(store, projectId, appId);
      const build = await deps.activation.activate(projectId, appId, buildId);
      return viewBuild(build, false, build.id);
    },

    async cancel(projectId, appId, buildId) {
      return viewBuild(await deps.pipeline.cancel(projectId, appId, buildId), false, null);
    },

    find: (projectId, appId, buildId) => findBuild(store, projectId, appId, buildId),

    async state(buildId) {
      return (await store.selectFrom('builds').select('state').where('id', '=', buildId).executeTakeFirst())?.state;
    },

    readLog: (buildId, after) => deps.buildLog.read(buildId, after),
    waitForLog: (buildId, ms, signal) => deps.buildLog.waitForLines(buildId, ms, signal),

    async archive(projectId, appId, buildId) {
      await findBuild(store, projectId, appId, buildId);
      const file = await deps.artifacts.localPath(buildId);
      if (!file) throw new FerryError('FERRY_BUILD_NOT_FOUND', `The archive of build ${buildId} is no longer stored`);
      return listZip(file);
    },
  };
}
