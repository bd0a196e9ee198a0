/**
 * The tables of Ferry's store, as Kysely types.
 *
 * Portable on purpose: timestamps are ISO-8601 UTC text (they sort as text), booleans are 0/1 integers,
 * JSON is text. The same queries run on SQLite (embedded default) and PostgreSQL (scaled out).
 */
import type { ColumnType, Generated, Selectable } from 'kysely';

/** A nullable column that inserts may leave out (it starts NULL). */
type Optional<T> = ColumnType<T | null, T | null | undefined, T | null>;

export interface ProjectsTable {
  id: string;
  name: string;
  created_at: string;
}

export interface ServiceAccountsTable {
  id: string;
  project_id: string;
  name: string;
  /** Space-separated scopes: `manage`, `run`. */
  scopes: string;
  /** The token's `jti`; the token itself is never stored. */
  token_id: string;
  /** SHA-256 of the token, hex. */
  token_hash: string;
  created_at: string;
  expires_at: string;
  revoked_at: string | null;
  last_used_at: string | null;
}

export type BuildState = 'pending' | 'building' | 'ready' | 'failed' | 'cancelled';

export interface AppsTable {
  /** The app's id is its name (unique inside a project). */
  id: string;
  project_id: string;
  name: string;
  active_build_id: string | null;
  /** Scaling set through the API (`PATCH .../apps/{app}`): keys of [scaling] over the build's; JSON or null. */
  scaling_json: string | null;
  created_at: string;
  updated_at: string;
}

export interface BuildsTable {
  id: string;
  project_id: string;
  app_id: string;
  state: BuildState;
  /** The `ferry.toml` text the build was made with. */
  config_toml: string;
  /** The validated config, JSON. */
  config_json: string;
  runtime: string | null;
  /** What a replica loads, relative to the build folder. */
  entry: string | null;
  archive_bytes: number;
  file_count: number;
  /** JSON array of exported names found at build time (null: unknown until a replica loads it). */
  functions: string | null;
  error: string | null;
  /** The node that will build it or is building it (null: any node may claim it). */
  owner: Optional<string>;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  /** With `[image]`: the manifest digest of the image replicas run on (null: the host runtime). */
  image_digest: Optional<string>;
  /** With `[image]`: what replicas need of the image, JSON (images/build-image.ts `BuildImageRecord`). */
  image_json: Optional<string>;
}

export interface BuildLogLinesTable {
  build_id: string;
  seq: number;
  at: string;
  line: string;
}

export type RunMode = 'sync' | 'async' | 'stream';
export type RunState = 'queued' | 'running' | 'success' | 'failure' | 'timeout' | 'cancelled';

export interface RunsTable {
  id: string;
  project_id: string;
  app_id: string;
  build_id: string | null;
  function_name: string;
  mode: RunMode;
  state: RunState;
  status_code: number | null;
  input: string | null;
  result: string | null;
  error_code: string | null;
  error_message: string | null;
  reason: string | null;
  cold_start: number;
  webhook_endpoint: string | null;
  webhook_secret: string | null;
  idempotency_key: string | null;
  /** Custom runtime: the HTTP request of an async run, as JSON ({method, path, headers, body_base64}). */
  http_request: string | null;
  /** The node (Ferry process) holding the run: running it, or having claimed it to run. Null: nobody. */
  owner: Optional<string>;
  /** How many times the run was started. */
  attempts: Generated<number>;
  /** With --nats-url: when a message of this queued run was last known to be in the runs stream. */
  published_at: Optional<string>;
  /** With --nats-url: how many times the relay published the run (names its message). */
  publishes: Generated<number>;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  run_time_ms: number | null;
  /** Null: a call; 'schedule': a schedule's tick; 'retry': `runs retry` of an earlier run (migration 0013). */
  trigger: Optional<string>;
  /** The schedule of a tick's run. */
  schedule_name: Optional<string>;
  /** The tick's time of a schedule's run. */
  scheduled_for: Optional<string>;
  /** The run a `runs retry` repeats. */
  retry_of: Optional<string>;
  /** A queued run waiting for its next attempt: not claimed or published before this time. */
  not_before: Optional<string>;
  /** 1: the run ended after exhausting its retry attempts. */
  dead: Optional<number>;
  /** The ended attempts of a run under a retry policy, JSON (runs/lifecycle.ts AttemptRecord[]). */
  attempt_log: Optional<string>;
}

export interface RunLogLinesTable {
  run_id: string;
  seq: number;
  at: string;
  stream: string;
  line: string;
}

/** Per run with log lines (migration 0011): stored line bytes and what was dropped. */
export interface RunLogStatsTable {
  run_id: string;
  /** UTF-8 bytes of the run's stored lines; 0 once the project's log budget removed them. */
  bytes: number;
  dropped_lines: number;
  dropped_bytes: number;
}

export interface WebhookDeliveriesTable {
  run_id: string;
  url: string;
  payload: string;
  state: string;
  attempts: number;
  next_attempt_at: string | null;
  /** The node sending the current attempt (state `sending`). */
  owner: Optional<string>;
  created_at: string;
  updated_at: string;
}

export interface WebhookAttemptsTable {
  run_id: string;
  attempt: number;
  at: string;
  status_code: number | null;
  error: string | null;
  duration_ms: number;
}

/** A Ferry process sharing the store, alive while `lease_until` is in the future. */
export interface NodesTable {
  id: string;
  started_at: string;
  /** ISO time; the node renews it. Past it, the node is taken for dead and its work is taken over. */
  lease_until: string;
  /** JSON: {hostname, pid, version, data_dir}. */
  info: string;
}

export interface SecretsTable {
  project_id: string;
  name: string;
  /** AES-256-GCM ciphertext, base64 (iv.tag.data). */
  value: string;
  created_at: string;
  updated_at: string;
}

/**
 * A project's login for one registry (migration 0017, images/registry-logins.ts): what its pulls send there.
 * Kept apart from `secrets`: never a replica's environment, never in a secrets list.
 */
export interface RegistryLoginsTable {
  project_id: string;
  /** As an image reference names it (`ghcr.io`, `127.0.0.1:5000`, `docker.io`), lower-cased. */
  registry: string;
  username: string;
  /** AES-256-GCM ciphertext of the password (v1.iv.tag.data), bound to `<project>/registry:<registry>`. */
  password: string;
  created_at: string;
  updated_at: string;
}

/** One `[[schedules]]` entry of an app's active build, with its state (migration 0013). */
export interface SchedulesTable {
  app_id: string;
  name: string;
  project_id: string;
  /** The build whose ferry.toml defines it (the active build when it was written). */
  build_id: string;
  cron: string;
  timezone: string;
  function_name: string;
  /** The run's JSON body. */
  args: string;
  webhook_endpoint: string | null;
  overlap: string;
  paused: Generated<number>;
  /** The next tick due (ISO time); advanced by compare-and-set when a tick's run is in. */
  next_tick_at: string;
  last_tick_at: string | null;
  last_run_id: string | null;
  /** Due ticks passed over (downtime, overlap skip), in all. */
  ticks_skipped: Generated<number>;
  created_at: string;
  updated_at: string;
}

/** A project's volume (migration 0012, src/volumes/). */
export interface VolumesTable {
  project_id: string;
  /** Same rule as app names. */
  name: string;
  /** Its size, MiB: writes past it fail inside the function (ENOSPC or EDQUOT). */
  size_mib: number;
  /** The host group owning the volume's files; replicas mounting it get it as a supplementary group. */
  gid: number;
  created_at: string;
  /** The backend that made it (migration 0015): null for `image`, or `quota-dir`. */
  backend: Optional<string>;
  /** A `quota-dir` volume's quota id (XFS project id, btrfs qgroup 1/<id>); null for an image. */
  quota_id: Optional<number>;
}

export interface Database {
  projects: ProjectsTable;
  service_accounts: ServiceAccountsTable;
  apps: AppsTable;
  builds: BuildsTable;
  build_log_lines: BuildLogLinesTable;
  runs: RunsTable;
  run_log_lines: RunLogLinesTable;
  run_log_stats: RunLogStatsTable;
  webhook_deliveries: WebhookDeliveriesTable;
  webhook_attempts: WebhookAttemptsTable;
  secrets: SecretsTable;
  registry_logins: RegistryLoginsTable;
  volumes: VolumesTable;
  nodes: NodesTable;
  schedules: SchedulesTable;
}

export type Project = Selectable<ProjectsTable>;
export type ServiceAccount = Selectable<ServiceAccountsTable>;
export type App = Selectable<AppsTable>;
export type Build = Selectable<BuildsTable>;
export type Run = Selectable<RunsTable>;
export type Schedule = Selectable<SchedulesTable>;
