/**
 * Where uploaded archives and build outputs live, chosen once: the artifacts folder on disk, or with the
 * cluster link the JetStream object store, so any process of the cluster can run any build. Both keep a
 * local copy of the builds this node runs (builds/local-build-cache.ts).
 */
import path from 'node:path';
import { type ArtifactStore, createDiskArtifactStore } from '../builds/artifact-store.js';
import { type BuildOutput, createBuildOutput } from '../builds/build-output.js';
import { createNatsArtifactStore, lazyArtifactsBucket } from '../builds/nats-artifact-store.js';
import { createNatsBuildOutput } from '../builds/nats-build-output.js';
import { requireNats } from '../cluster/nats.js';
import { prepareArtifactsDir } from '../data-dir.js';
import type { BuildViews } from '../sandbox/views.js';
import type { ClusterLink } from './cluster-link.js';
import type { Core } from './core.js';

export interface BuildStorage {
  artifacts: ArtifactStore;
  buildOutput: BuildOutput;
}

/** `views`: the sandboxed replicas' views of builds, removed with a build's local folder (when present). */
export async function createBuildStorage(
  core: Core,
  link: ClusterLink | undefined,
  views: BuildViews | undefined,
): Promise<BuildStorage> {
  const { config, dataDir } = core;
  const logger = core.logger.child({ component: 'builds' });
  if (link) {
    const { nats } = link;
    const bucket = link.names.artifactsBucket;
    const artifacts = await createNatsArtifactStore({
      nc: () => requireNats(nats),
      bucket,
      cacheDir: path.join(dataDir.root, 'archive-cache'),
      logger,
    });
    const buildOutput = await createNatsBuildOutput({
      buildsDir: dataDir.builds,
      bucket: lazyArtifactsBucket(() => requireNats(nats), bucket),
      artifacts,
      zipLimits: config.zipLimits,
      views,
      logger,
    });
    return { artifacts, buildOutput };
  }
  const artifacts = createDiskArtifactStore(prepareArtifactsDir(config.artifactsDir));
  const buildOutput = await createBuildOutput({
    buildsDir: dataDir.builds,
    artifactsDir: config.artifactsDir,
    artifacts,
    zipLimits: config.zipLimits,
    views,
    logger,
  });
  return { artifacts, buildOutput };
}
