/**
 * Builds as the API shows them, and their lookups.
 */
import { FerryError } from '../errors.js';
import type { Store } from '../store/index.js';
import type { Build, BuildState } from '../store/schema.js';

/** The states a build does not leave. */
export const FINAL_BUILD_STATES: readonly BuildState[] = ['ready', 'failed', 'cancelled'];

export interface BuildView {
  id: string;
  project_id: string;
  app_id: string;
  state: Build['state'];
  runtime: string | null;
  archive_bytes: number;
  file_count: number;
  error: string | null;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  duration_ms: number | null;
  /**
   * The entry's public functions as the builder found them; null when unknown (before the build is ready,
   * a custom app, or a Python module whose public names only loading it can tell).
   */
  functions: string[] | null;
  /** With `[image]`: the image replicas run on, pinned by digest; null for the host runtime (or not built yet). */
  image: { reference: string; digest: string } | null;
  /** Only on `GET .../builds/{build_id}`: the `ferry.toml` the build was made with. */
  config_toml?: string;
  /** Whether it is the app's active build. */
  active: boolean;
}

export function viewBuild(build: Build, withConfig = false, activeBuildId?: string | null): BuildView {
  const duration =
    build.started_at && build.finished_at ? Date.parse(build.finished_at) - Date.parse(build.started_at) : null;
  return {
    id: build.id,
    project_id: build.project_id,
    app_id: build.app_id,
    state: build.state,
    runtime: build.runtime,
    archive_bytes: Number(build.archive_bytes),
    file_count: build.file_count,
    error: build.error,
    created_at: build.created_at,
    started_at: build.started_at,
    finished_at: build.finished_at,
    duration_ms: duration,
    functions: parseFunctions(build.functions),
    image: imageOf(build),
    ...(withConfig ? { config_toml: build.config_toml } : {}),
    active: activeBuildId !== undefined && activeBuildId !== null && activeBuildId === build.id,
  };
}

function imageOf(build: Build): BuildView['image'] {
  if (!build.image_digest) return null;
  let reference = build.image_digest;
  try {
    const record = JSON.parse(build.image_json ?? '{}') as { reference?: unknown };
    if (typeof record.reference === 'string') reference = record.reference;
  } catch {
    // the digest alone
  }
  return { reference, digest: build.image_digest };
}

function parseFunctions(text: string | null): string[] | null {
  if (text === null) return null;
  try {
    const value = JSON.parse(text) as unknown;
    return Array.isArray(value) && value.every((v) => typeof v === 'string') ? value : null;
  } catch {
    return null;
  }
}

export async function findBuild(store: Store, projectId: string, appId: string, buildId: string): Promise<Build> {
  const build = await store
    .selectFrom('builds')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('app_id', '=', appId)
    .where('id', '=', buildId)
    .executeTakeFirst();
  if (!build) throw new FerryError('FERRY_BUILD_NOT_FOUND', `No build ${buildId} of app "${appId}"`);
  return build;
}

export async function listBuilds(
  store: Store,
  projectId: string,
  appId: string,
  options: { limit: number; before?: string | undefined },
): Promise<Build[]> {
  let query = store
    .selectFrom('builds')
    .selectAll()
    .where('project_id', '=', projectId)
    .where('app_id', '=', appId)
    .orderBy('id', 'desc')
    .limit(options.limit);
  if (options.before) query = query.where('id', '<', options.before);
  return query.execute();
}
