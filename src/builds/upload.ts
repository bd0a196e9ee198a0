/**
 * Receiving a deploy: the ZIP request body is streamed to a temporary file (never held in memory), checked
 * entry by entry before anything is extracted, extracted into the new build's own folder, its `ferry.toml`
 * validated, and only then recorded as a pending build. Any refusal leaves nothing behind.
 */
import { randomUUID } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Readable } from 'node:stream';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { AppConfigError, parseAppConfig } from '../apps/app-config.js';
import { bodyTooLarge, FerryError } from '../errors.js';
import { nowIso, uuidv7 } from '../ids.js';
import type { Store } from '../store/index.js';
import type { Build } from '../store/schema.js';
import type { ArtifactStore } from './artifact-store.js';
import { buildFolder } from './build-folder.js';
import { extractZip, type ZipLimits } from './zip-archive.js';

export interface ReceiveBuildDeps {
  store: Store;
  artifacts: ArtifactStore;
  tmpDir: string;
  buildsDir: string;
  maxUploadBytes: number;
  zipLimits: ZipLimits;
  /** This node (cluster/node.ts): it holds the new build and builds it, unless it dies first. */
  owner?: string;
  /** Refuses a config whose `[[volumes]]` the project lacks (FERRY_BUILD_VOLUME_MISSING; volumes/volumes.ts). */
  checkVolumes?: (projectId: string, config: ReturnType<typeof parseAppConfig>) => Promise<void>;
  /**
   * Refuses a config with more `[[schedules]]` than the server lets the app or its project have
   * (FERRY_CONFIG_INVALID, FERRY_PROJECT_SCHEDULES_FULL; schedules/limits.ts).
   */
  checkSchedules?: (projectId: string, appId: string, config: ReturnType<typeof parseAppConfig>) => Promise<void>;
}

/** Streams `body` to a file, refusing with FERRY_BODY_TOO_LARGE once it passes `maxBytes`. */
async function receiveToFile(body: Readable, file: string, maxBytes: number): Promise<number> {
  let bytes = 0;
  const counter = new Transform({
    transform(chunk: Buffer, _encoding, callback) {
      bytes += chunk.length;
      if (bytes > maxBytes) {
        callback(bodyTooLarge(maxBytes, 'The archive'));
        return;
      }
      callback(null, chunk);
    },
  });
  await pipeline(body, counter, createWriteStream(file, { mode: 0o600 }));
  return bytes;
}

/** Handles one upload for `appId` in `projectId` and returns the new pending build. */
export async function receiveBuild(
  deps: ReceiveBuildDeps,
  projectId: string,
  appId: string,
  body: Readable,
): Promise<Build> {
  const buildId = uuidv7();
  const tmpFile = path.join(deps.tmpDir, `${randomUUID()}.zip`);
  const folder = buildFolder(deps.buildsDir, buildId);
  let recorded = false;
  try {
    const bytes = await receiveToFile(body, tmpFile, deps.maxUploadBytes);
    if (bytes === 0)
      throw new FerryError('FERRY_ZIP_CORRUPT', 'The request body is empty; send the ZIP archive as the body');
    await fs.mkdir(folder.source, { recursive: true, mode: 0o755 });
    const { files } = await extractZip(tmpFile, folder.source, { limits: deps.zipLimits });

    let toml: string;
    try {
      toml = await fs.readFile(path.join(folder.source, 'ferry.toml'), 'utf8');
    } catch {
      throw new FerryError('FERRY_CONFIG_MISSING');
    }
    let config: ReturnType<typeof parseAppConfig>;
    try {
      config = parseAppConfig(toml);
    } catch (err) {
      if (err instanceof AppConfigError) throw new FerryError(err.code, err.message);
      throw err;
    }
    if (config.app.name !== appId) {
      throw new FerryError(
        'FERRY_APP_NAME_MISMATCH',
        `ferry.toml names the app "${config.app.name}" but the upload is for app "${appId}"`,
      );
    }

    await deps.checkVolumes?.(projectId, config);
    await deps.checkSchedules?.(projectId, appId, config);

    const now = nowIso();
    const build: Build = {
      id: buildId,
      project_id: projectId,
      app_id: appId,
      state: 'pending',
      config_toml: toml,
      config_json: JSON.stringify(config),
      runtime: null,
      entry: null,
      archive_bytes: bytes,
      file_count: files.length,
      functions: null,
      error: null,
      owner: deps.owner ?? null,
      created_at: now,
      started_at: null,
      finished_at: null,
      image_digest: null,
      image_json: null,
    };
    await deps.artifacts.put(buildId, tmpFile);
    await deps.store.transaction().execute(async (trx) => {
      // The app is created by its first deploy; its id is its name.
      const existing = await trx
        .selectFrom('apps')
        .select('id')
        .where('project_id', '=', projectId)
        .where('id', '=', appId)
        .executeTakeFirst();
      if (!existing) {
        await trx
          .insertInto('apps')
          .values({
            project_id: projectId,
            id: appId,
            name: appId,
            active_build_id: null,
            created_at: now,
            updated_at: now,
          })
          .execute();
      }
      await trx.insertInto('builds').values(build).execute();
    });
    recorded = true;
    return build;
  } finally {
    await fs.rm(tmpFile, { force: true });
    if (!recorded) {
      await fs.rm(folder.root, { recursive: true, force: true });
      await deps.artifacts.delete(buildId).catch(() => {});
    }
  }
}
