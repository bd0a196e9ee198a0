/**
 * Volumes: a project's persistent folders, bounded in size, mounted into the replicas of the apps that
 * list them in ferry.toml (`[[volumes]]`), and read and written through the API.
 *
 * The rows are in the store (`volumes`, migrations 0012 and 0015); what bounds a volume on disk is its
 * backend (`backend.ts`, FERRY_VOLUMES_BACKEND): filesystem images and their mounts (`images.ts`) or
 * folders with the filesystem's own quota (`quota-dirs.ts`); the host-side file operations are
 * `volume-files.ts`.
 *
 * API:
 *   const volumes = await createVolumes({ store, config, sandbox, logger });
 *   volumes.support                          can volumes be used here, and if not why
 *   await volumes.create(projectId, name, sizeMiB) / list / get / remove(projectId, name, force)
 *   await volumes.withRoot(projectId, name, (fd) => ...)   a file operation on the mounted volume
 *   await volumes.checkMounts(projectId, config)           a deploy's [[volumes]] exist (FERRY_BUILD_VOLUME_MISSING)
 *   await volumes.forLaunch(projectId, config)             what a replica binds, and its groups
 *   await volumes.close()                                  unmounts what is mounted on this machine
 */

import { randomInt } from 'node:crypto';
import type fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { type AppConfig, VOLUME_NAME_PATTERN, volumesOf } from '../apps/app-config.js';
import type { ChangeFeed } from '../cluster/change-feed.js';
import type { ServerConfig, VolumesBackendKind } from '../config.js';
import { FerryError } from '../errors.js';
import { nowIso } from '../ids.js';
import { lockBudget } from '../store/budget-lock.js';
import type { Store } from '../store/index.js';
import { imageBackend, peekVolumeUse, type VolumeBackend, type VolumeRef } from './backend.js';
import {
  MIN_VOLUME_MIB,
  probeVolumeSupport,
  VOLUME_GID_COUNT,
  VOLUME_GID_FIRST,
  VolumeMechanismError,
  type VolumeSupport,
} from './images.js';
import { removeNodeMarker, writeNodeMarker } from './markers.js';
import { probeQuotaDirSupport, type QuotaDirSupport, quotaDirBackend } from './quota-dirs.js';

/** The first quota id of `quota-dir` volumes (XFS project id, btrfs qgroup 1/<id>); one per volume. */
export const VOLUME_QUOTA_ID_FIRST = 1_879_113_728;
export const VOLUME_QUOTA_ID_COUNT = 16_777_216;

export interface Volume {
  name: string;
  size_mib: number;
  created_at: string;
}

export interface VolumeWithUse extends Volume {
  used_bytes: number;
  free_bytes: number;
  /** Apps of the project whose active build mounts it. */
  mounted_by: string[];
}

/** What a replica binds: the mount point on the host, where it shows in the sandbox, and how. */
export interface VolumeBind {
  host: string;
  sandbox: string;
  readOnly: boolean;
}

export interface Volumes {
  readonly support: VolumeSupport;
  readonly dir: string;
  /** FERRY_VOLUMES_BACKEND: what bounds the volumes, and how it is described (`ferry doctor`, the log). */
  readonly backend: { kind: VolumesBackendKind; description: string };
  create(projectId: string, name: string, sizeMiB: number): Promise<Volume>;
  list(projectId: string): Promise<Volume[]>;
  get(projectId: string, name: string): Promise<VolumeWithUse>;
  remove(projectId: string, name: string, force: boolean): Promise<void>;
  /**
   * Runs `fn` with the volume's root folder open (closed after); `usage()` reads its use and room as its
   * bound counts them (statfs of an image, the quota of a folder).
   */
  withRoot<T>(
    projectId: string,
    name: string,
    fn: (rootFd: number, usage: () => Promise<{ used_bytes: number; free_bytes: number }>) => Promise<T>,
  ): Promise<T>;
  /** Opens the root for a caller that closes it later (a streamed download). */
  openRoot(projectId: string, name: string): Promise<fs.FileHandle>;
  checkMounts(projectId: string, config: AppConfig): Promise<void>;
  forLaunch(projectId: string, config: AppConfig): Promise<{ binds: VolumeBind[]; groups: number[] }>;
  /** Every volume of every project with its use on this node (`ferry doctor`). */
  usageAll(): Promise<Array<{ project_id: string; name: string; size_mib: number; used_bytes: number | null }>>;
  close(): Promise<void>;
}

const NAME_RE = new RegExp(VOLUME_NAME_PATTERN);

export interface VolumesDeps {
  store: Store;
  config: Pick<ServerConfig, 'volumesDir' | 'volumeMaxMiB' | 'volumesTotalMiB'> &
    Partial<Pick<ServerConfig, 'volumesBackend'>>;
  /** Replicas run under bwrap: volumes are bound into the sandbox. */
  sandboxed: boolean;
  logger: Logger;
  /** Where a forced delete is announced, so every process stops the replicas mounting the volume. */
  changes?: Pick<ChangeFeed, 'publish'>;
  /** Tests: what probeVolumeSupport (or probeQuotaDirSupport) would find. */
  support?: VolumeSupport;
  /** This node's id: its marker in the volumes folder tells `ferry doctor` the folder is shared (markers.ts). */
  nodeId?: string;
}

function unavailable(support: VolumeSupport): FerryError {
  return new FerryError(
    'FERRY_VOLUMES_UNAVAILABLE',
    `Volumes cannot be used on this server: ${support.reasons.join('; ')}`,
  );
}

export async function createVolumes(deps: VolumesDeps): Promise<Volumes> {
  const { store, logger } = deps;
  const dir = deps.config.volumesDir;
  const kind = deps.config.volumesBackend ?? 'image';
  let backend: VolumeBackend;
  if (kind === 'quota-dir') {
    const support =
      (deps.support as QuotaDirSupport | undefined) ?? (await probeQuotaDirSupport(dir, deps.sandboxed, true));
    backend = quotaDirBackend(dir, support);
  } else {
    backend = imageBackend(dir, deps.support ?? (await probeVolumeSupport(deps.sandboxed)));
  }
  const support = backend.support;
  const description =
    kind === 'quota-dir'
      ? ((support as QuotaDirSupport).quota?.description ?? "folders bounded by their filesystem's quota")
      : "ext4 images on loop devices (writes past a volume's size fail with ENOSPC)";
  if (!support.available)
    logger.info(`volumes unavailable (FERRY_VOLUMES_BACKEND=${kind}): ${support.reasons.join('; ')}`);
  else logger.info(`volumes: ${description} in ${dir}`);
  if (deps.nodeId) {
    await writeNodeMarker(dir, deps.nodeId).catch((err: Error) =>
      logger.warn({ err }, `cannot write this node's marker in FERRY_VOLUMES_DIR (${dir})`),
    );
  }

  async function row(projectId: string, name: string) {
    const found = await store
      .selectFrom('volumes')
      .selectAll()
      .where('project_id', '=', projectId)
      .where('name', '=', name)
      .executeTakeFirst();
    if (!found) throw new FerryError('FERRY_VOLUME_NOT_FOUND', `No volume named ${name} in this project`);
    return found;
  }

  /** The row's volume as the backend knows it; refused when another backend made it. */
  function refOf(r: { project_id: string; name: string; backend: string | null; quota_id: number | null }): VolumeRef {
    const madeBy = r.backend ?? 'image';
    if (madeBy !== kind) {
      throw new FerryError(
        'FERRY_VOLUMES_UNAVAILABLE',
        `Volume ${r.name} was made by the ${madeBy} backend, and this server uses FERRY_VOLUMES_BACKEND=${kind}: serve it with FERRY_VOLUMES_BACKEND=${madeBy}`,
      );
    }
    return { projectId: r.project_id, name: r.name, quotaId: r.quota_id === null ? null : Number(r.quota_id) };
  }

  /** Ready here (an image mounted if needed), with its root open. */
  async function mountedRoot(projectId: string, name: string): Promise<fs.FileHandle> {
    return (await openRef(projectId, name)).root;
  }

  async function openRef(projectId: string, name: string): Promise<{ root: fs.FileHandle; ref: VolumeRef }> {
    if (!support.available) throw unavailable(support);
    const ref = refOf(await row(projectId, name));
    try {
      return { root: await backend.openRoot(ref), ref };
    } catch (err) {
      if (err instanceof VolumeMechanismError) {
        throw new FerryError(
          'FERRY_VOLUMES_UNAVAILABLE',
          `Volume ${name} cannot be ${kind === 'image' ? 'mounted' : 'used'} here: ${err.message}`,
          {
            cause: err,
          },
        );
      }
      throw err;
    }
  }

  async function usageOf(ref: VolumeRef, root: fs.FileHandle) {
    return backend.usage(ref, root).catch((err: unknown) => {
      if (!(err instanceof VolumeMechanismError)) throw err;
      throw new FerryError(
        'FERRY_VOLUMES_UNAVAILABLE',
        `The use of volume ${ref.name} cannot be read: ${err.message}`,
        {
          cause: err,
        },
      );
    });
  }

  /** Apps of the project whose active build mounts `name` (each app's config of its active build). */
  async function mountedBy(projectId: string): Promise<Map<string, string[]>> {
    const rows = await store
      .selectFrom('apps')
      .innerJoin('builds', 'builds.id', 'apps.active_build_id')
      .select(['apps.id', 'builds.config_json'])
      .where('apps.project_id', '=', projectId)
      .execute();
    const byVolume = new Map<string, string[]>();
    for (const r of rows) {
      const config = JSON.parse(r.config_json) as AppConfig;
      for (const v of volumesOf(config)) byVolume.set(v.name, [...(byVolume.get(v.name) ?? []), r.id]);
    }
    return byVolume;
  }

  return {
    support,
    dir,
    backend: { kind, description },

    async create(projectId, name, sizeMiB) {
      if (!NAME_RE.test(name)) {
        throw new FerryError(
          'FERRY_VALIDATION',
          `Invalid volume name "${name}": use a-z, 0-9 and "-", start and end with a letter or digit, at most 63 characters`,
        );
      }
      if (!Number.isInteger(sizeMiB) || sizeMiB < MIN_VOLUME_MIB) {
        throw new FerryError('FERRY_VALIDATION', `size_mib must be a whole number of at least ${MIN_VOLUME_MIB}`);
      }
      if (sizeMiB > deps.config.volumeMaxMiB) {
        throw new FerryError(
          'FERRY_VOLUME_TOO_LARGE',
          `size_mib ${sizeMiB} is more than this server allows for one volume (FERRY_VOLUME_MAX_MIB=${deps.config.volumeMaxMiB})`,
        );
      }
      if (!support.available) throw unavailable(support);
      const at = nowIso();
      // The row first, in one transaction with the check of the total, under the total's lock: two creations
      // at the same moment (on PostgreSQL, from two nodes or two connections) check one after the other.
      let gid = 0;
      let quotaId: number | null = null;
      await store.transaction().execute(async (trx) => {
        await lockBudget(trx, 'volumes_total');
        const existing = await trx
          .selectFrom('volumes')
          .select('name')
          .where('project_id', '=', projectId)
          .where('name', '=', name)
          .executeTakeFirst();
        if (existing) throw new FerryError('FERRY_VOLUME_EXISTS', `The project already has a volume named ${name}`);
        const total = await trx
          .selectFrom('volumes')
          .select((eb) => eb.fn.coalesce(eb.fn.sum<number>('size_mib'), eb.lit(0)).as('total'))
          .executeTakeFirstOrThrow();
        if (Number(total.total) + sizeMiB > deps.config.volumesTotalMiB) {
          throw new FerryError(
            'FERRY_VOLUMES_TOTAL_EXCEEDED',
            `The volumes of this server take ${total.total} MiB of FERRY_VOLUMES_TOTAL_MIB=${deps.config.volumesTotalMiB}: ${sizeMiB} MiB more do not fit`,
          );
        }
        for (let attempt = 0; ; attempt++) {
          gid = VOLUME_GID_FIRST + randomInt(VOLUME_GID_COUNT);
          const taken = await trx.selectFrom('volumes').select('gid').where('gid', '=', gid).executeTakeFirst();
          if (!taken) break;
          if (attempt > 100) throw new Error('no free volume gid');
        }
        for (let attempt = 0; kind === 'quota-dir'; attempt++) {
          quotaId = VOLUME_QUOTA_ID_FIRST + randomInt(VOLUME_QUOTA_ID_COUNT);
          const taken = await trx
            .selectFrom('volumes')
            .select('quota_id')
            .where('quota_id', '=', quotaId)
            .executeTakeFirst();
          if (!taken) break;
          if (attempt > 100) throw new Error('no free volume quota id');
        }
        await trx
          .insertInto('volumes')
          .values({
            project_id: projectId,
            name,
            size_mib: sizeMiB,
            gid,
            created_at: at,
            backend: kind === 'image' ? null : kind,
            quota_id: quotaId,
          })
          .execute();
      });
      try {
        await backend.create({ projectId, name, quotaId }, sizeMiB, gid);
      } catch (err) {
        await store.deleteFrom('volumes').where('project_id', '=', projectId).where('name', '=', name).execute();
        if (err instanceof VolumeMechanismError || (err as NodeJS.ErrnoException).code === 'EEXIST') {
          throw new FerryError(
            'FERRY_VOLUMES_UNAVAILABLE',
            `Volume ${name} could not be made: ${(err as Error).message}`,
            {
              cause: err,
            },
          );
        }
        throw err;
      }
      logger.info({ project: projectId, volume: name, sizeMiB }, 'volume created');
      return { name, size_mib: sizeMiB, created_at: at };
    },

    async list(projectId) {
      const rows = await store
        .selectFrom('volumes')
        .select(['name', 'size_mib', 'created_at'])
        .where('project_id', '=', projectId)
        .execute();
      return rows.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
    },

    async get(projectId, name) {
      const r = await row(projectId, name);
      const { root, ref } = await openRef(projectId, name);
      try {
        const use = await usageOf(ref, root);
        return {
          name: r.name,
          size_mib: r.size_mib,
          created_at: r.created_at,
          ...use,
          mounted_by: (await mountedBy(projectId)).get(name) ?? [],
        };
      } finally {
        await root.close();
      }
    },

    async remove(projectId, name, force) {
      const ref = refOf(await row(projectId, name));
      const users = (await mountedBy(projectId)).get(name) ?? [];
      if (users.length > 0 && !force) {
        throw new FerryError(
          'FERRY_VOLUME_IN_USE',
          `Volume ${name} is mounted by the active build of ${users.join(', ')}: redeploy without it, or delete with force=true`,
          { details: { apps: users.join(',') } },
        );
      }
      // Replicas still binding it stop first (here at once, elsewhere as the change arrives): they would go
      // on writing into a filesystem that no longer has a name.
      if (users.length > 0) await deps.changes?.publish({ type: 'volume.deleted', projectId, volume: name });
      await backend.destroy(ref).catch((err: unknown) => {
        if (!(err instanceof VolumeMechanismError)) throw err;
        throw new FerryError('FERRY_VOLUMES_UNAVAILABLE', `Volume ${name} could not be deleted: ${err.message}`, {
          cause: err,
        });
      });
      await store.deleteFrom('volumes').where('project_id', '=', projectId).where('name', '=', name).execute();
      logger.info({ project: projectId, volume: name, force }, 'volume deleted');
    },

    async withRoot(projectId, name, fn) {
      const { root, ref } = await openRef(projectId, name);
      try {
        return await fn(root.fd, () => usageOf(ref, root));
      } finally {
        await root.close();
      }
    },

    openRoot: mountedRoot,

    async checkMounts(projectId, config) {
      const wanted = volumesOf(config);
      if (wanted.length === 0) return;
      if (!support.available) throw unavailable(support);
      const rows = await store.selectFrom('volumes').select('name').where('project_id', '=', projectId).execute();
      const have = new Set(rows.map((v) => v.name));
      const missing = wanted.filter((v) => !have.has(v.name)).map((v) => v.name);
      if (missing.length > 0) {
        throw new FerryError(
          'FERRY_BUILD_VOLUME_MISSING',
          `ferry.toml mounts ${missing.map((m) => `volume "${m}"`).join(', ')}, which the project does not have: create it first (ferry volumes create ${missing[0]} --size 10GiB)`,
          { details: { volume: missing[0]! } },
        );
      }
    },

    async forLaunch(projectId, config) {
      const wanted = volumesOf(config);
      if (wanted.length === 0) return { binds: [], groups: [] };
      if (!support.available) throw unavailable(support);
      const binds: VolumeBind[] = [];
      const groups: number[] = [];
      for (const v of wanted) {
        const r = await row(projectId, v.name);
        const root = await mountedRoot(projectId, v.name);
        await root.close();
        binds.push({ host: backend.bindSource(refOf(r)), sandbox: v.mount, readOnly: v.read_only });
        groups.push(Number(r.gid));
      }
      return { binds, groups };
    },

    async usageAll() {
      const rows = await store
        .selectFrom('volumes')
        .select(['project_id', 'name', 'size_mib', 'backend', 'quota_id'])
        .execute();
      const out = [];
      for (const { backend: _backend, quota_id: _quotaId, ...r } of rows) {
        let used: number | null = null;
        if (support.available && (_backend ?? 'image') === kind) {
          const ref = refOf({ ...r, backend: _backend, quota_id: _quotaId });
          used = (await peekVolumeUse(backend, ref))?.used_bytes ?? null;
        }
        out.push({ ...r, used_bytes: used });
      }
      return out;
    },

    async close() {
      if (deps.nodeId) await removeNodeMarker(dir, deps.nodeId).catch(() => {});
      await backend.close((err) => logger.warn({ err }, 'could not unmount a volume'));
    },
  };
}
