/**
 * Where uploaded archives are kept, as uploaded, so their listing can be served and a build can be
 * redone. The disk implementation is the embedded default; a JetStream object-store implementation
 * of the same interface serves scaled-out clusters.
 */
import fs from 'node:fs/promises';
import path from 'node:path';

export interface ArtifactStore {
  /** Takes ownership of `file` (moved, not copied, when it can be) as the archive of `buildId`. */
  put(buildId: string, file: string): Promise<void>;
  /** A local path to read the archive of `buildId`, or undefined when there is none. */
  localPath(buildId: string): Promise<string | undefined>;
  delete(buildId: string): Promise<void>;
}

export function createDiskArtifactStore(folder: string): ArtifactStore {
  const fileOf = (buildId: string) => path.join(folder, `${buildId}.zip`);
  return {
    async put(buildId, file) {
      await fs.rename(file, fileOf(buildId));
      await fs.chmod(fileOf(buildId), 0o600);
    },
    async localPath(buildId) {
      try {
        await fs.access(fileOf(buildId));
        return fileOf(buildId);
      } catch {
        return undefined;
      }
    },
    async delete(buildId) {
      await fs.rm(fileOf(buildId), { force: true });
    },
  };
}
