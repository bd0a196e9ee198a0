/**
 * Where uploaded archives and build outputs live, chosen once: the artifacts folder on disk, or with the
 * cluster link the JetStream object store, so any process of the cluster can run any build. Both keep a
 * local copy of the builds this node runs (builds/local-build-cache.ts).
 */
import path from 'node:path';
import type { ObjectStore } from '@nats-io/obj';
import { type ArtifactStore, createDiskArtifactStore } from '../builds/artifact-store.js';
import { type BuildOutput, createBuildOutput } from '../builds/build-output.js';
import { createNatsArtifactStore, lazyArtifactsBucket } from '../builds/nats-artifact-store.js';
import { createNatsBuildOutput } from '../builds/nats-build-output.js';
import { requireNats } from '../cluster/nats.js';
import { prepareArtifactsDir } from '../data-dir.js';
import {
  createFolderImageShelf,
  createNatsImageShelf,
  type ImageShelf,
  openImagesBucket,
} from '../images/image-shelf.js';
import type { BuildViews } from '../sandbox/views.js';
import type { ClusterLink } from './cluster-link.js';
import type { Core } from './core.js';

export interface BuildStorage {
  artifacts: ArtifactStore;
  buildOutput: BuildOutput;
  /** Images by digest for every node (`[image]` apps): the images bucket, or `<artifacts>/images`. */
  imageShelf: ImageShelf;
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
    const images = link.names.imagesBucket;
    let opened: Promise<ObjectStore> | undefined;
    // Opened when first needed (start-up does not wait for NATS); a failure is retried at the next use.
    const imageShelf = createNatsImageShelf(() => {
      if (!opened) {
        const opening = openImagesBucket(requireNats(nats), images);
        opened = opening;
        opening.catch(() => {
          if (opened === opening) opened = undefined;
        });
      }
      return opened;
    });
    return { artifacts, buildOutput, imageShelf };
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
  return { artifacts, buildOutput, imageShelf: createFolderImageShelf(path.join(config.artifactsDir, 'images')) };
}
