/**
 * Server settings: command-line flags, then environment variables, then defaults.
 * Every setting is documented in docs/operations.md.
 */
import path from 'node:path';
import { MAX_SCHEDULES_CEILING } from './apps/app-config.js';
import { DEFAULT_ZIP_LIMITS, type ZipLimits } from './builds/zip-archive.js';
import { registryName } from './images/reference.js';
import { parseInsecureRegistries } from './images/registry-guard.js';
import { type BuildLimits, DEFAULT_BUILD_LIMITS } from './sandbox/build-step.js';
import { type Nameserver, parseNameservers } from './sandbox/dns-forwarder.js';
import { DEFAULT_EGRESS_POOL, type EgressPolicy, normalizeCidr, parseEgressPolicy } from './sandbox/egress-policy.js';
import { parseAllowList } from './webhooks/address-guard.js';

/** A database URL must name PostgreSQL; anything else is a mistake to report at start, not at first query. */
function checkDatabaseUrl(url: string | undefined): string | undefined {
  if (url === undefined) return undefined;
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    throw new Error('--database-url / FERRY_DATABASE_URL must be a URL like postgres://user@host:5432/ferry');
  }
  if (parsed.protocol !== 'postgres:' && parsed.protocol !== 'postgresql:') {
    throw new Error(
      `--database-url / FERRY_DATABASE_URL must start with postgres:// (not ${parsed.protocol}//); leave it unset for the embedded SQLite store`,
    );
  }
  return url;
}

/** What a cluster name may be: it is used inside NATS stream and bucket names, which allow little else. */
export type NodeRole = 'gateway' | 'worker' | 'all';
export const NODE_ROLES: readonly NodeRole[] = ['gateway', 'worker', 'all'];

function checkRole(value: string): NodeRole {
  const role = value.trim().toLowerCase();
  if (!(NODE_ROLES as readonly string[]).includes(role)) {
    throw new Error(`--role / FERRY_ROLE must be gateway, worker or all, not "${value}"`);
  }
  return role as NodeRole;
}

/** Where other nodes reach this one: an http(s) URL with a host and no path, query or credentials. */
function checkAdvertiseUrl(value: string | undefined): string | undefined {
  if (value === undefined) return undefined;
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new Error(`--advertise-url / FERRY_ADVERTISE_URL must be a URL like http://10.0.0.5:9000, not "${value}"`);
  }
  if (
    (url.protocol !== 'http:' && url.protocol !== 'https:') ||
    !url.hostname ||
    url.username ||
    url.password ||
    (url.pathname !== '/' && url.pathname !== '') ||
    url.search ||
    url.hash
  ) {
    throw new Error(`--advertise-url / FERRY_ADVERTISE_URL must be http(s)://host:port with no path, not "${value}"`);
  }
  return url.origin;
}

/**
 * The run endpoint's public address (`{run_url}`): an http(s) URL with a host, perhaps a path (a proxy's
 * prefix), no credentials, query or fragment; kept without a trailing slash.
 */
function checkRunUrl(value: string | undefined): string | undefined {
  if (value === undefined) return undefined;
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new Error(`--run-url / FERRY_RUN_URL must be a URL like https://run.example.com, not "${value}"`);
  }
  if (
    (url.protocol !== 'http:' && url.protocol !== 'https:') ||
    !url.hostname ||
    url.username ||
    url.password ||
    url.search ||
    url.hash
  ) {
    throw new Error(
      `--run-url / FERRY_RUN_URL must be http(s)://host[:port][/path] with no query or credentials, not "${value}"`,
    );
  }
  return `${url.origin}${url.pathname}`.replace(/\/+$/, '');
}

export const CLUSTER_NAME = /^[A-Za-z0-9_-]{1,32}$/;

/** NATS server URLs, comma-separated: each must be nats:// (or tls://) with a host. */
function checkNatsUrl(url: string | undefined): string | undefined {
  if (url === undefined) return undefined;
  for (const one of url.split(',')) {
    let parsed: URL;
    try {
      parsed = new URL(one.trim());
    } catch {
      throw new Error('--nats-url / FERRY_NATS_URL must be URLs like nats://127.0.0.1:4222 (comma-separated)');
    }
    if ((parsed.protocol !== 'nats:' && parsed.protocol !== 'tls:') || !parsed.hostname) {
      throw new Error(`--nats-url / FERRY_NATS_URL must start with nats:// or tls://, not "${one.trim()}"`);
    }
  }
  return url;
}

function checkClusterName(name: string): string {
  if (!CLUSTER_NAME.test(name)) {
    throw new Error(`--cluster-name / FERRY_CLUSTER_NAME must be 1 to 32 of A-Z, a-z, 0-9, "_" and "-", not "${name}"`);
  }
  return name;
}

/** Validates the webhook allow-list at start, so a typo is an error now rather than refused deliveries later. */
/**
 * `FERRY_SHARED_REGISTRIES`: the registries whose credentials in FERRY_REGISTRY_AUTH_FILE every project's
 * pulls may send (comma-separated, as image references name them), or `*` for every registry. Empty by
 * default: the file then serves no registry, and each project logs in to the registries it uses itself.
 */
export function parseSharedRegistries(text: string | undefined): string[] {
  const items = (text ?? '')
    .split(',')
    .map((item) => item.trim())
    .filter((item) => item !== '');
  if (items.length === 1 && items[0] === '*') return ['*'];
  return items.map((item) => {
    const name = registryName(item);
    if (!name) {
      throw new Error(
        `FERRY_SHARED_REGISTRIES: "${item.slice(0, 100)}" is not a registry (host with a dot or a port, localhost, or docker.io; or * alone)`,
      );
    }
    return name;
  });
}

/** Validates the image settings at start (used by image builds, coming with the `[image]` feature). */
function resolveImages(env: NodeJS.ProcessEnv): ImageSettings {
  const insecureRegistries = env.FERRY_INSECURE_REGISTRIES ?? '';
  try {
    parseInsecureRegistries(insecureRegistries);
  } catch (err) {
    throw new Error(`FERRY_INSECURE_REGISTRIES: ${(err as Error).message}`);
  }
  const registryAllow = env.FERRY_REGISTRY_ALLOW ?? '';
  try {
    parseAllowList(registryAllow);
  } catch (err) {
    throw new Error(`FERRY_REGISTRY_ALLOW: ${(err as Error).message}`);
  }
  const authFile = env.FERRY_REGISTRY_AUTH_FILE ? path.resolve(env.FERRY_REGISTRY_AUTH_FILE) : undefined;
  return {
    authFile,
    sharedRegistries: parseSharedRegistries(env.FERRY_SHARED_REGISTRIES),
    insecureRegistries,
    registryAllow,
    cacheBytes:
      (intFrom(env.FERRY_IMAGE_CACHE_MIB, 'FERRY_IMAGE_CACHE_MIB', 64, 64 * 1024 * 1024) ?? DEFAULTS.imageCacheMib) *
      1024 *
      1024,
    buildTimeoutMs:
      (intFrom(env.FERRY_IMAGE_BUILD_TIMEOUT_SECONDS, 'FERRY_IMAGE_BUILD_TIMEOUT_SECONDS', 10, 7 * 24 * 3600) ??
        DEFAULTS.imageBuildTimeoutSeconds) * 1000,
  };
}

function checkAllowList(text: string): string {
  try {
    parseAllowList(text);
  } catch (err) {
    throw new Error(`webhook allow-list (--webhook-allow / FERRY_WEBHOOK_ALLOW): ${(err as Error).message}`);
  }
  return text;
}

export interface ServerConfig {
  host: string;
  port: number;
  /**
   * `--run-port` / `FERRY_RUN_PORT`: a second listener, on the same host, that serves the run endpoint
   * (`/v4`) and `/healthz` only, so tenants' apps answer on an origin apart from the dashboard's
   * (docs/operations.md, "Two origins"). The main port keeps serving `/v4` too. Unset: no second listener.
   */
  runPort: number | undefined;
  /**
   * `--run-url` / `FERRY_RUN_URL`: the run endpoint's address as callers reach it (`{run_url}` of the
   * interface, behind a proxy); what the API, the CLI and the dashboard show. Unset: derived (run-address.ts).
   */
  runUrl: string | undefined;
  dataDir: string;
  /**
   * `--database-url` / `FERRY_DATABASE_URL`: a `postgres://` URL puts the store on PostgreSQL (several
   * processes may share it); unset, the store is the embedded SQLite file in the data directory.
   */
  databaseUrl: string | undefined;
  /** `--keys-dir` / `FERRY_KEYS_DIR`: the JWT and secrets keys (default `<data-dir>/keys`); shared by a fleet. */
  keysDir: string;
  /**
   * `--artifacts-dir` / `FERRY_ARTIFACTS_DIR`: uploaded archives and build outputs (default
   * `<data-dir>/artifacts`); several processes may share it.
   */
  artifactsDir: string;
  /**
   * `FERRY_MIN_FREE_MIB`: below this much free space in the data folder, new runs and uploads answer 507
   * FERRY_STORAGE_FULL and `/readyz` 503, so that what was accepted can still end (disk-space.ts). 0: never.
   */
  minFreeMib: number;
  /**
   * `FERRY_STORE_BUSY_TIMEOUT_MS`: how long a statement on the embedded SQLite store waits (off the event
   * loop) while another process holds a lock on the file, before the request answers 503 FERRY_STORE_BUSY.
   */
  storeBusyTimeoutMs: number;
  /** `--nats-url` / `FERRY_NATS_URL`: NATS with JetStream for a cluster (issue 13); unset, none is used. */
  natsUrl: string | undefined;
  /** `--cluster-name` / `FERRY_CLUSTER_NAME`: the prefix of every NATS stream, bucket and subject. */
  clusterName: string;
  /**
   * `--role` / `FERRY_ROLE`: `all` (default) runs everything in one process; `gateway` serves the public
   * interface and runs no user code; `worker` runs builds and replicas behind an internal listener.
   */
  role: NodeRole;
  /** `--advertise-url` / `FERRY_ADVERTISE_URL`: where other nodes reach this one (default http://<host>:<port>). */
  advertiseUrl: string | undefined;
  /** `FERRY_WORKER_MAX_REPLICAS`: replicas this node runs over all apps at once (0: no cap). */
  workerMaxReplicas: number;
  /**
   * `FERRY_WARM_POOL`: generic sandboxes kept started per cortex runtime (Node, Python), handed to an app
   * when it needs a replica, so its first run does not wait for a runtime to start (0: none).
   */
  warmPool: number;
  /** Largest accepted archive upload, bytes. */
  maxUploadBytes: number;
  /** Largest accepted JSON body (management API and run endpoint), bytes. */
  maxBodyBytes: number;
  zipLimits: ZipLimits;
  /** Memory and processes of each build step, and the wall-clock time of a build. */
  buildLimits: BuildLimits;
  /** Log level for pino. */
  logLevel: string;
  /** Runs that may wait per app when every replica slot is taken (503 past it). */
  maxQueuePerApp: number;
  /** How long a replica may take to start accepting on its socket. */
  replicaStartTimeoutMs: number;
  /**
   * Async runs this process holds in its in-memory queue (accepted here, not finished); past it
   * `?async=true` answers 429 FERRY_ASYNC_BACKLOG_FULL. A safety cap on the process's memory.
   */
  maxAsyncBacklog: number;
  /**
   * Async runs of one project queued or running, counted from the store; past it the project's
   * `?async=true` calls answer 429 FERRY_PROJECT_BACKLOG_FULL (other projects are not affected).
   */
  maxAsyncBacklogPerProject: number;
  /** `[[schedules]]` one app may have (FERRY_MAX_SCHEDULES_PER_APP); more are refused at deploy. */
  maxSchedulesPerApp: number;
  /** Schedules of all apps of one project (FERRY_MAX_SCHEDULES_PER_PROJECT); a deploy past it is refused. */
  maxSchedulesPerProject: number;
  /** `FERRY_WEBHOOK_ALLOW` / `--webhook-allow`: CIDRs webhooks may reach although they are internal. */
  webhookAllow: string;
  /** One webhook attempt's timeout. */
  webhookTimeoutMs: number;
  /** Results over this size are not kept on the run record. */
  maxStoredResultBytes: number;
  /** A result's JSON, bytes (FERRY_MAX_RESULT_BYTES): past it the run fails with FERRY_RESULT_TOO_LARGE. */
  maxResultBytes: number;
  /** One yielded item's JSON, bytes (FERRY_MAX_STREAM_ITEM_BYTES): past it FERRY_STREAM_ITEM_TOO_LARGE. */
  maxStreamItemBytes: number;
  /** One log line of a run, bytes (FERRY_MAX_LOG_LINE_BYTES): past it the rest of the line is dropped. */
  maxLogLineBytes: number;
  /**
   * Bytes a streaming response may hold for a caller that does not read (FERRY_STREAM_BUFFER_BYTES):
   * past it the gateway stops reading the replica until the caller takes some. At least 64 KiB: over the
   * 16 KiB Node buffers before a write asks to wait, so the `drain` that says the caller read always comes.
   */
  streamBufferBytes: number;
  /**
   * How long a caller may leave its response full without reading (FERRY_CALLER_STALL_SECONDS) before
   * its connection is cut and the run handled as a caller gone away; SSE, custom HTTP and WebSockets.
   */
  callerStallSeconds: number;
  /** Lines of replica output (outside runs) the app log keeps per app, in memory. */
  appLogLines: number;
  /** How long a finished streaming run's events stay resumable (`Last-Event-ID`), seconds. */
  streamReplaySeconds: number;
  /** Event bytes kept per streaming run for resuming; past it the oldest events are dropped. */
  streamReplayBytes: number;
  /** Event bytes kept for resuming over all streaming runs of this server. */
  streamReplayTotalBytes: number;
  /** How long a streaming run goes on after its last client went away, waiting for a reconnect, seconds. */
  streamResumeGraceSeconds: number;
  /** How long a cancelled cortex function has to return before its replica is stopped (FERRY_CANCEL_GRACE_SECONDS). */
  cancelGraceSeconds: number;
  /**
   * How long `ferry serve` waits after SIGTERM for runs in flight to end before it interrupts the rest
   * (FERRY_SHUTDOWN_GRACE_SECONDS, cli/shutdown.ts).
   */
  shutdownGraceSeconds: number;
  /** Ready builds kept per app by retention (FERRY_KEEP_BUILDS; 0: keep all). The active build always stays. */
  keepBuilds: number;
  /** Finished runs older than this many days are deleted with their logs (FERRY_RUN_RETENTION_DAYS; 0: keep all). */
  runRetentionDays: number;
  /** Seconds between retention passes (FERRY_RETENTION_INTERVAL_SECONDS; 0: this process runs none). */
  retentionIntervalSeconds: number;
  /** UTF-8 bytes of build output stored per build (FERRY_BUILD_LOG_BYTES); the rest are counted as dropped. */
  buildLogBytes: number;
  /** UTF-8 bytes of log lines stored per run (FERRY_RUN_LOG_BYTES); the rest are counted as dropped. */
  runLogBytes: number;
  /**
   * Bytes of run logs stored per project (FERRY_PROJECT_LOG_BYTES; 0: no budget); past it each retention
   * pass removes the logs of the project's oldest finished runs.
   */
  projectLogBytes: number;
  /** The network sandboxes get (docs/operations.md, "Sandbox network"). */
  egress: EgressConfig;
  /** Image pulls, builds and the node's image cache (docs/operations.md, "Images"). */
  images: ImageSettings;
  /**
   * `FERRY_LEASE_SECONDS`: how long this process's hold on its work (async runs, webhook attempts, builds)
   * lasts without renewal; past it, other processes sharing the store take the work over.
   */
  leaseMs: number;
  /**
   * `FERRY_VOLUMES_DIR`: where volumes' images and mount points are (default `<data dir>/volumes`). In a
   * cluster, one shared filesystem mounted at the same path on every node (docs/scaling-out.md).
   */
  volumesDir: string;
  /**
   * `FERRY_VOLUMES_BACKEND`: what bounds a volume. `image` (default): an ext4 image on a loop device, one
   * machine at a time. `quota-dir`: a folder bounded by its filesystem's own quota (btrfs simple quotas, XFS
   * project quotas), shared by every node that mounts the filesystem (src/volumes/quota-dirs.ts).
   */
  volumesBackend: VolumesBackendKind;
  /** `FERRY_VOLUME_MAX_MIB`: the largest `size_mib` a project may ask for. */
  volumeMaxMiB: number;
  /** `FERRY_VOLUMES_TOTAL_MIB`: the sizes of all volumes (every project) together. */
  volumesTotalMiB: number;
}

/**
 * Settings of images (`[image]` in ferry.toml): read and validated now, used by image builds and the
 * node's image cache as the images feature lands (src/images/).
 */
export interface ImageSettings {
  /**
   * `FERRY_REGISTRY_AUTH_FILE`: a Docker/containers `config.json` with credentials for private registries,
   * sent only to the registries of `sharedRegistries` (by every project).
   */
  authFile: string | undefined;
  /** `FERRY_SHARED_REGISTRIES`, normalized (images/reference.ts `registryName`), or `['*']`: every registry. */
  sharedRegistries: string[];
  /** `FERRY_INSECURE_REGISTRIES`: comma-separated `host:port` reached over plain HTTP, exempt from the address guard. */
  insecureRegistries: string;
  /** `FERRY_REGISTRY_ALLOW`: CIDRs a registry may be in although internal (HTTPS registries on a private network). */
  registryAllow: string;
  /** `FERRY_IMAGE_CACHE_MIB`, in bytes: disk bound of the unpacked images of this node. */
  cacheBytes: number;
  /** `FERRY_IMAGE_BUILD_TIMEOUT_SECONDS`, in milliseconds: wall-clock time of one image build. */
  buildTimeoutMs: number;
}

export interface EgressConfig {
  /** `FERRY_EGRESS=off` gives every sandbox loopback only. */
  enabled: boolean;
  /** `FERRY_EGRESS_ALLOW` / `FERRY_EGRESS_DENY` (and the flags), validated. */
  policy: EgressPolicy;
  /** `FERRY_EGRESS_POOL`: the IPv4 range the sandboxes' /30 links come from. */
  pool: string;
  /** `FERRY_EGRESS_DNS`: where the sandboxes' resolver forwards queries (default: /etc/resolv.conf's). */
  nameservers: Nameserver[];
}

export const DEFAULTS = {
  host: '127.0.0.1',
  port: 8000,
  dataDir: './.ferry',
  /** 100 GiB per volume, 500 GiB for all volumes of the server. */
  volumeMaxMiB: 100 * 1024,
  volumesTotalMiB: 500 * 1024,
  storeBusyTimeoutMs: 5000,
  minFreeMib: 64,
  maxUploadBytes: 256 * 1024 * 1024,
  maxBodyBytes: 10 * 1024 * 1024,
  logLevel: 'info',
  maxQueuePerApp: 100,
  replicaStartTimeoutMs: 30_000,
  maxAsyncBacklog: 100_000,
  maxAsyncBacklogPerProject: 10_000,
  maxSchedulesPerApp: 50,
  maxSchedulesPerProject: 200,
  webhookTimeoutMs: 10_000,
  maxStoredResultBytes: 256 * 1024,
  maxResultBytes: 10 * 1024 * 1024,
  maxStreamItemBytes: 4 * 1024 * 1024,
  maxLogLineBytes: 64 * 1024,
  streamBufferBytes: 1024 * 1024,
  callerStallSeconds: 30,
  appLogLines: 2000,
  streamReplaySeconds: 300,
  streamReplayBytes: 1024 * 1024,
  streamReplayTotalBytes: 64 * 1024 * 1024,
  streamResumeGraceSeconds: 10,
  cancelGraceSeconds: 5,
  shutdownGraceSeconds: 30,
  keepBuilds: 10,
  imageCacheMib: 20_480,
  imageBuildTimeoutSeconds: 1800,
  runRetentionDays: 30,
  retentionIntervalSeconds: 600,
  runLogBytes: 1024 * 1024,
  buildLogBytes: 4 * 1024 * 1024,
  projectLogBytes: 4 * 1024 ** 3,
  leaseSeconds: 10,
  warmPool: 1,
} as const;

export type VolumesBackendKind = 'image' | 'quota-dir';

function checkVolumesBackend(value: string): VolumesBackendKind {
  if (value !== 'image' && value !== 'quota-dir') {
    throw new Error(`FERRY_VOLUMES_BACKEND must be image or quota-dir, not "${value}"`);
  }
  return value;
}

function intFrom(value: string | undefined, name: string, min: number, max: number): number | undefined {
  if (value === undefined || value === '') return undefined;
  const n = Number(value);
  if (!Number.isInteger(n) || n < min || n > max)
    throw new Error(`${name} must be a whole number from ${min} to ${max}, not "${value}"`);
  return n;
}

export interface ConfigFlags {
  host?: string | undefined;
  port?: string | number | undefined;
  runPort?: string | number | undefined;
  runUrl?: string | undefined;
  dataDir?: string | undefined;
  databaseUrl?: string | undefined;
  keysDir?: string | undefined;
  artifactsDir?: string | undefined;
  natsUrl?: string | undefined;
  clusterName?: string | undefined;
  role?: string | undefined;
  advertiseUrl?: string | undefined;
  webhookAllow?: string | undefined;
  egressAllow?: string | undefined;
  egressDeny?: string | undefined;
}

function resolveEgress(flags: ConfigFlags, env: NodeJS.ProcessEnv): EgressConfig {
  const mode = (env.FERRY_EGRESS ?? 'on').trim().toLowerCase();
  if (mode !== 'on' && mode !== 'off') throw new Error(`FERRY_EGRESS must be "on" or "off", not "${env.FERRY_EGRESS}"`);
  const pool = normalizeCidr((env.FERRY_EGRESS_POOL ?? '').trim() || DEFAULT_EGRESS_POOL, 'FERRY_EGRESS_POOL');
  const prefix = Number(pool.split('/')[1]);
  if (pool.includes(':') || prefix < 8 || prefix > 30) {
    throw new Error(`FERRY_EGRESS_POOL must be an IPv4 range from /8 to /30, not "${env.FERRY_EGRESS_POOL}"`);
  }
  return {
    enabled: mode === 'on',
    policy: parseEgressPolicy(
      flags.egressAllow ?? env.FERRY_EGRESS_ALLOW ?? '',
      flags.egressDeny ?? env.FERRY_EGRESS_DENY ?? '',
    ),
    pool,
    nameservers: parseNameservers(env.FERRY_EGRESS_DNS),
  };
}

/** Resolves the server's settings; throws an Error with a readable message for a bad value. */
export function resolveServerConfig(flags: ConfigFlags = {}, env: NodeJS.ProcessEnv = process.env): ServerConfig {
  const port = intFrom(
    flags.port === undefined ? env.FERRY_PORT : String(flags.port),
    'port (--port / FERRY_PORT)',
    0,
    65535,
  );
  const runPort = intFrom(
    flags.runPort === undefined ? env.FERRY_RUN_PORT : String(flags.runPort),
    'run port (--run-port / FERRY_RUN_PORT)',
    0,
    65535,
  );
  const dataDir = flags.dataDir ?? env.FERRY_DATA_DIR ?? DEFAULTS.dataDir;
  const databaseUrl = checkDatabaseUrl(flags.databaseUrl ?? (env.FERRY_DATABASE_URL || undefined));
  const natsUrl = checkNatsUrl(flags.natsUrl ?? (env.FERRY_NATS_URL || undefined));
  const role = checkRole(flags.role ?? (env.FERRY_ROLE || 'all'));
  if (role !== 'all' && (!databaseUrl || !natsUrl)) {
    throw new Error(
      `--role ${role} needs --database-url (PostgreSQL) and --nats-url (NATS JetStream): a ${role} shares them with the rest of the cluster`,
    );
  }
  if (runPort !== undefined && role === 'worker') {
    throw new Error(
      '--run-port / FERRY_RUN_PORT is a listener of the public interface: set it on gateways, not workers',
    );
  }
  if (runPort !== undefined && runPort !== 0 && runPort === (port ?? DEFAULTS.port)) {
    throw new Error(`--run-port / FERRY_RUN_PORT must differ from the main port (${runPort}): it is a second listener`);
  }
  return {
    host: flags.host ?? env.FERRY_HOST ?? DEFAULTS.host,
    port: port ?? DEFAULTS.port,
    runPort,
    runUrl: checkRunUrl(flags.runUrl ?? (env.FERRY_RUN_URL || undefined)),
    dataDir,
    databaseUrl,
    keysDir: path.resolve(flags.keysDir ?? (env.FERRY_KEYS_DIR || path.join(dataDir, 'keys'))),
    artifactsDir: path.resolve(flags.artifactsDir ?? (env.FERRY_ARTIFACTS_DIR || path.join(dataDir, 'artifacts'))),
    natsUrl,
    clusterName: checkClusterName(flags.clusterName ?? (env.FERRY_CLUSTER_NAME || 'ferry')),
    role,
    advertiseUrl: checkAdvertiseUrl(flags.advertiseUrl ?? (env.FERRY_ADVERTISE_URL || undefined)),
    workerMaxReplicas: intFrom(env.FERRY_WORKER_MAX_REPLICAS, 'FERRY_WORKER_MAX_REPLICAS', 0, 100_000) ?? 0,
    warmPool: intFrom(env.FERRY_WARM_POOL, 'FERRY_WARM_POOL', 0, 64) ?? DEFAULTS.warmPool,
    storeBusyTimeoutMs:
      intFrom(env.FERRY_STORE_BUSY_TIMEOUT_MS, 'FERRY_STORE_BUSY_TIMEOUT_MS', 0, 600_000) ??
      DEFAULTS.storeBusyTimeoutMs,
    minFreeMib: intFrom(env.FERRY_MIN_FREE_MIB, 'FERRY_MIN_FREE_MIB', 0, 1024 * 1024) ?? DEFAULTS.minFreeMib,
    maxUploadBytes:
      intFrom(env.FERRY_MAX_UPLOAD_BYTES, 'FERRY_MAX_UPLOAD_BYTES', 1024, 16 * 1024 ** 3) ?? DEFAULTS.maxUploadBytes,
    maxBodyBytes: intFrom(env.FERRY_MAX_BODY_BYTES, 'FERRY_MAX_BODY_BYTES', 1024, 1024 ** 3) ?? DEFAULTS.maxBodyBytes,
    zipLimits: {
      ...DEFAULT_ZIP_LIMITS,
      maxEntries:
        intFrom(env.FERRY_ZIP_MAX_ENTRIES, 'FERRY_ZIP_MAX_ENTRIES', 1, 1_000_000) ?? DEFAULT_ZIP_LIMITS.maxEntries,
      maxUncompressedBytes:
        intFrom(env.FERRY_ZIP_MAX_BYTES, 'FERRY_ZIP_MAX_BYTES', 1024, 64 * 1024 ** 3) ??
        DEFAULT_ZIP_LIMITS.maxUncompressedBytes,
      maxRatio: intFrom(env.FERRY_ZIP_MAX_RATIO, 'FERRY_ZIP_MAX_RATIO', 2, 100_000) ?? DEFAULT_ZIP_LIMITS.maxRatio,
    },
    buildLimits: {
      memoryMiB:
        intFrom(env.FERRY_BUILD_MEMORY_MIB, 'FERRY_BUILD_MEMORY_MIB', 128, 1024 * 1024) ??
        DEFAULT_BUILD_LIMITS.memoryMiB,
      maxProcesses:
        intFrom(env.FERRY_BUILD_MAX_PROCESSES, 'FERRY_BUILD_MAX_PROCESSES', 16, 1_000_000) ??
        DEFAULT_BUILD_LIMITS.maxProcesses,
      timeoutMs:
        (intFrom(env.FERRY_BUILD_TIMEOUT_SECONDS, 'FERRY_BUILD_TIMEOUT_SECONDS', 10, 7 * 24 * 3600) ?? 0) * 1000 ||
        DEFAULT_BUILD_LIMITS.timeoutMs,
    },
    logLevel: env.FERRY_LOG_LEVEL ?? DEFAULTS.logLevel,
    maxQueuePerApp:
      intFrom(env.FERRY_MAX_QUEUE_PER_APP, 'FERRY_MAX_QUEUE_PER_APP', 0, 1_000_000) ?? DEFAULTS.maxQueuePerApp,
    replicaStartTimeoutMs:
      intFrom(env.FERRY_REPLICA_START_TIMEOUT_MS, 'FERRY_REPLICA_START_TIMEOUT_MS', 100, 600_000) ??
      DEFAULTS.replicaStartTimeoutMs,
    appLogLines: intFrom(env.FERRY_APP_LOG_LINES, 'FERRY_APP_LOG_LINES', 10, 1_000_000) ?? DEFAULTS.appLogLines,
    maxAsyncBacklog:
      intFrom(env.FERRY_MAX_ASYNC_BACKLOG, 'FERRY_MAX_ASYNC_BACKLOG', 0, 100_000_000) ?? DEFAULTS.maxAsyncBacklog,
    maxAsyncBacklogPerProject:
      intFrom(env.FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT, 'FERRY_MAX_ASYNC_BACKLOG_PER_PROJECT', 0, 100_000_000) ??
      DEFAULTS.maxAsyncBacklogPerProject,
    maxSchedulesPerApp:
      intFrom(env.FERRY_MAX_SCHEDULES_PER_APP, 'FERRY_MAX_SCHEDULES_PER_APP', 0, MAX_SCHEDULES_CEILING) ??
      DEFAULTS.maxSchedulesPerApp,
    maxSchedulesPerProject:
      intFrom(env.FERRY_MAX_SCHEDULES_PER_PROJECT, 'FERRY_MAX_SCHEDULES_PER_PROJECT', 0, 1_000_000) ??
      DEFAULTS.maxSchedulesPerProject,
    webhookAllow: checkAllowList(flags.webhookAllow ?? env.FERRY_WEBHOOK_ALLOW ?? ''),
    webhookTimeoutMs:
      intFrom(env.FERRY_WEBHOOK_TIMEOUT_MS, 'FERRY_WEBHOOK_TIMEOUT_MS', 100, 600_000) ?? DEFAULTS.webhookTimeoutMs,
    maxStoredResultBytes:
      intFrom(env.FERRY_MAX_STORED_RESULT_BYTES, 'FERRY_MAX_STORED_RESULT_BYTES', 0, 1024 ** 3) ??
      DEFAULTS.maxStoredResultBytes,
    maxResultBytes:
      intFrom(env.FERRY_MAX_RESULT_BYTES, 'FERRY_MAX_RESULT_BYTES', 1024, 1024 ** 3) ?? DEFAULTS.maxResultBytes,
    maxStreamItemBytes:
      intFrom(env.FERRY_MAX_STREAM_ITEM_BYTES, 'FERRY_MAX_STREAM_ITEM_BYTES', 1024, 1024 ** 3) ??
      DEFAULTS.maxStreamItemBytes,
    maxLogLineBytes:
      intFrom(env.FERRY_MAX_LOG_LINE_BYTES, 'FERRY_MAX_LOG_LINE_BYTES', 256, 64 * 1024 ** 2) ??
      DEFAULTS.maxLogLineBytes,
    streamBufferBytes:
      intFrom(env.FERRY_STREAM_BUFFER_BYTES, 'FERRY_STREAM_BUFFER_BYTES', 65_536, 1024 ** 3) ??
      DEFAULTS.streamBufferBytes,
    callerStallSeconds:
      intFrom(env.FERRY_CALLER_STALL_SECONDS, 'FERRY_CALLER_STALL_SECONDS', 1, 86_400) ?? DEFAULTS.callerStallSeconds,
    streamReplaySeconds:
      intFrom(env.FERRY_STREAM_REPLAY_SECONDS, 'FERRY_STREAM_REPLAY_SECONDS', 0, 86_400) ??
      DEFAULTS.streamReplaySeconds,
    streamReplayBytes:
      intFrom(env.FERRY_STREAM_REPLAY_BYTES, 'FERRY_STREAM_REPLAY_BYTES', 1024, 1024 ** 3) ??
      DEFAULTS.streamReplayBytes,
    streamReplayTotalBytes:
      intFrom(env.FERRY_STREAM_REPLAY_TOTAL_BYTES, 'FERRY_STREAM_REPLAY_TOTAL_BYTES', 1024, 64 * 1024 ** 3) ??
      DEFAULTS.streamReplayTotalBytes,
    streamResumeGraceSeconds:
      intFrom(env.FERRY_STREAM_RESUME_GRACE_SECONDS, 'FERRY_STREAM_RESUME_GRACE_SECONDS', 0, 3600) ??
      DEFAULTS.streamResumeGraceSeconds,
    cancelGraceSeconds:
      intFrom(env.FERRY_CANCEL_GRACE_SECONDS, 'FERRY_CANCEL_GRACE_SECONDS', 0, 3600) ?? DEFAULTS.cancelGraceSeconds,
    shutdownGraceSeconds:
      intFrom(env.FERRY_SHUTDOWN_GRACE_SECONDS, 'FERRY_SHUTDOWN_GRACE_SECONDS', 0, 86_400) ??
      DEFAULTS.shutdownGraceSeconds,
    keepBuilds: intFrom(env.FERRY_KEEP_BUILDS, 'FERRY_KEEP_BUILDS', 0, 100_000) ?? DEFAULTS.keepBuilds,
    runRetentionDays:
      intFrom(env.FERRY_RUN_RETENTION_DAYS, 'FERRY_RUN_RETENTION_DAYS', 0, 36_500) ?? DEFAULTS.runRetentionDays,
    retentionIntervalSeconds:
      intFrom(env.FERRY_RETENTION_INTERVAL_SECONDS, 'FERRY_RETENTION_INTERVAL_SECONDS', 0, 86_400) ??
      DEFAULTS.retentionIntervalSeconds,
    buildLogBytes:
      intFrom(env.FERRY_BUILD_LOG_BYTES, 'FERRY_BUILD_LOG_BYTES', 1024, 1024 ** 3) ?? DEFAULTS.buildLogBytes,
    runLogBytes: intFrom(env.FERRY_RUN_LOG_BYTES, 'FERRY_RUN_LOG_BYTES', 1024, 1024 ** 3) ?? DEFAULTS.runLogBytes,
    projectLogBytes:
      intFrom(env.FERRY_PROJECT_LOG_BYTES, 'FERRY_PROJECT_LOG_BYTES', 0, 1024 ** 5) ?? DEFAULTS.projectLogBytes,
    egress: resolveEgress(flags, env),
    volumesDir: path.resolve(env.FERRY_VOLUMES_DIR || path.join(dataDir, 'volumes')),
    volumesBackend: checkVolumesBackend(env.FERRY_VOLUMES_BACKEND || 'image'),
    volumeMaxMiB:
      intFrom(env.FERRY_VOLUME_MAX_MIB, 'FERRY_VOLUME_MAX_MIB', 16, 64 * 1024 * 1024) ?? DEFAULTS.volumeMaxMiB,
    volumesTotalMiB:
      intFrom(env.FERRY_VOLUMES_TOTAL_MIB, 'FERRY_VOLUMES_TOTAL_MIB', 16, 1024 * 1024 * 1024) ??
      DEFAULTS.volumesTotalMiB,
    images: resolveImages(env),
    leaseMs: (intFrom(env.FERRY_LEASE_SECONDS, 'FERRY_LEASE_SECONDS', 2, 3600) ?? DEFAULTS.leaseSeconds) * 1000,
  };
}
