/**
 * `ferry.toml`: parsing and validation of an app's configuration file.
 *
 * Shared by the CLI (which refuses an invalid file before uploading) and the server (which checks the
 * copy inside every uploaded archive). Errors name the key and what is wrong with it.
 */

import { parse as parseToml } from 'smol-toml';
import { type Static, Type } from 'typebox';
import { Value } from 'typebox/value';
import type { ErrorCode } from '../errors.js';
import { FerryError } from '../errors.js';
import { type ImageSpec, parseImageTable } from '../images/image-spec.js';
import { MAX_ATTEMPTS_LIMIT, NO_RETRIES, RETRYABLE_ENDINGS, type RetryPolicy } from '../runs/retries.js';
import { parseTiming, ScheduleSpecError } from '../schedules/spec.js';
import { parseWebhookUrl, WebhookUrlError } from '../webhooks/webhook-url.js';

/** The longest `response_grace_period` allowed: 12 hours (spec section 8). */
export const MAX_GRACE_PERIOD_SECONDS = 43_200;

const AppName = Type.String({ pattern: '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$' });
const EnvName = '^[A-Za-z_][A-Za-z0-9_]*$';

const AppSection = Type.Object(
  {
    name: AppName,
    runtime: Type.Optional(Type.Union([Type.Literal('cortex'), Type.Literal('custom')])),
    entry: Type.Optional(
      Type.Union([Type.Literal('main.ts'), Type.Literal('main.js'), Type.Literal('main.mjs'), Type.Literal('main.py')]),
    ),
    include: Type.Optional(Type.Array(Type.String({ minLength: 1 }))),
    exclude: Type.Optional(Type.Array(Type.String({ minLength: 1 }))),
    disable_auth: Type.Optional(Type.Boolean()),
    retry_interrupted: Type.Optional(Type.Boolean()),
  },
  { additionalProperties: false },
);

/** A check path on the user's server: "" (a TCP connect instead) or an absolute path such as "/health". */
const Endpoint = Type.String({ maxLength: 2048, pattern: '^(/[\\x21-\\x7e]*)?$' });

const CustomSection = Type.Object(
  {
    // Optional with an [image]: its ENTRYPOINT/CMD runs then (checked in withDefaults).
    entrypoint: Type.Optional(
      Type.Union([Type.String({ minLength: 1 }), Type.Array(Type.String({ minLength: 1 }), { minItems: 1 })]),
    ),
    // Replicas run unprivileged: ports below 1024 cannot be bound in the sandbox.
    port: Type.Optional(Type.Integer({ minimum: 1024, maximum: 65535 })),
    healthcheck_endpoint: Type.Optional(Endpoint),
    readycheck_endpoint: Type.Optional(Endpoint),
    start_timeout: Type.Optional(Type.Integer({ minimum: 1, maximum: 3600 })),
    healthcheck_interval: Type.Optional(Type.Integer({ minimum: 1, maximum: 3600 })),
    websocket_idle_timeout: Type.Optional(Type.Integer({ minimum: 1, maximum: 86_400 })),
  },
  { additionalProperties: false },
);

const ScalingSection = Type.Object(
  {
    min_replicas: Type.Optional(Type.Integer({ minimum: 0, maximum: 100 })),
    max_replicas: Type.Optional(Type.Integer({ minimum: 1, maximum: 100 })),
    replica_concurrency: Type.Optional(Type.Integer({ minimum: 1, maximum: 1000 })),
    cooldown: Type.Optional(Type.Integer({ minimum: 0, maximum: 86_400 })),
    response_grace_period: Type.Optional(Type.Integer({ minimum: 1, maximum: MAX_GRACE_PERIOD_SECONDS })),
  },
  { additionalProperties: false },
);

const ResourcesSection = Type.Object(
  {
    cpu: Type.Optional(Type.Number({ exclusiveMinimum: 0, maximum: 64 })),
    memory: Type.Optional(Type.Integer({ minimum: 32, maximum: 262_144 })),
    max_processes: Type.Optional(Type.Integer({ minimum: 8, maximum: 32_768 })),
  },
  { additionalProperties: false },
);

/**
 * The most `[[schedules]]` any server lets an app have: the config's own bound, so the CLI refuses no
 * more than a server could accept. The server's own limit, under it, is FERRY_MAX_SCHEDULES_PER_APP
 * (default 50), checked at upload and at activation (schedules/limits.ts).
 */
export const MAX_SCHEDULES_CEILING = 1000;

const ScheduleEntry = Type.Object(
  {
    name: AppName,
    cron: Type.String({ minLength: 1, maxLength: 200 }),
    timezone: Type.Optional(Type.String({ minLength: 1, maxLength: 64 })),
    function: Type.Optional(Type.String({ pattern: '^[A-Za-z_][A-Za-z0-9_]{0,127}$' })),
    args: Type.Optional(Type.Unknown()),
    // Its rule is every webhook URL's (webhooks/webhook-url.ts), checked in schedulesOf.
    webhook: Type.Optional(Type.String()),
    overlap: Type.Optional(Type.Union([Type.Literal('skip'), Type.Literal('allow')])),
  },
  { additionalProperties: false },
);

const RetriesSection = Type.Object(
  {
    max_attempts: Type.Optional(Type.Integer({ minimum: 1, maximum: MAX_ATTEMPTS_LIMIT })),
    initial_delay: Type.Optional(Type.Number({ minimum: 0, maximum: 86_400 })),
    backoff: Type.Optional(Type.Number({ minimum: 1, maximum: 10 })),
    max_delay: Type.Optional(Type.Number({ minimum: 0, maximum: 86_400 })),
    on: Type.Optional(
      Type.Array(Type.Union(RETRYABLE_ENDINGS.map((e) => Type.Literal(e))), { minItems: 1, uniqueItems: true }),
    ),
  },
  { additionalProperties: false },
);

/** Same rule as app names. */
export const VOLUME_NAME_PATTERN = '^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$';
/** Sandbox folders a volume may not be mounted on or under: the sandbox's own. */
export const RESERVED_MOUNTS = ['/proc', '/dev', '/tmp', '/run', '/app'] as const;

const VolumeSection = Type.Object(
  {
    name: Type.String({ pattern: VOLUME_NAME_PATTERN }),
    mount: Type.String({ minLength: 1, maxLength: 1024 }),
    read_only: Type.Optional(Type.Boolean()),
  },
  { additionalProperties: false },
);

const RawConfig = Type.Object(
  {
    app: AppSection,
    runtime: Type.Optional(Type.Object({ custom: Type.Optional(CustomSection) }, { additionalProperties: false })),
    scaling: Type.Optional(ScalingSection),
    resources: Type.Optional(ResourcesSection),
    env: Type.Optional(Type.Record(Type.String({ pattern: EnvName }), Type.String(), { additionalProperties: false })),
    schedules: Type.Optional(Type.Array(ScheduleEntry, { maxItems: MAX_SCHEDULES_CEILING })),
    retries: Type.Optional(RetriesSection),
    volumes: Type.Optional(Type.Array(VolumeSection, { maxItems: 16 })),
    // Checked by images/image-spec.ts (its own coded errors, naming the key).
    image: Type.Optional(Type.Unknown()),
  },
  { additionalProperties: false },
);
type RawConfig = Static<typeof RawConfig>;

/** A validated `ferry.toml` with every default filled in. */
export interface AppConfig {
  app: {
    name: string;
    runtime: 'cortex' | 'custom';
    /** Only for the cortex runtime; `undefined` means "the one of main.ts, main.js, main.mjs, main.py that exists". */
    entry: string | undefined;
    include: string[];
    exclude: string[];
    disable_auth: boolean;
    /**
     * An async run whose server died while it ran is queued again (up to MAX_RUN_STARTS starts in all)
     * instead of ending `failure`, reason `interrupted`. For functions that are safe to run twice.
     */
    retry_interrupted: boolean;
  };
  runtime: {
    custom?: {
      /** Absent only with an `[image]`: the image's ENTRYPOINT/CMD runs (runtimes/custom/builder.ts). */
      entrypoint?: string | string[];
      port: number;
      /**
       * Whether ferry.toml set `port`: on an image without it, the image's last EXPOSEd port is used.
       * Absent in configs stored before images (they set it or meant the default).
       */
      port_given?: boolean;
      healthcheck_endpoint: string;
      readycheck_endpoint: string;
      /** Seconds a replica's server has to pass its readiness check. */
      start_timeout: number;
      /** Seconds between health checks of a ready replica. */
      healthcheck_interval: number;
      /** Seconds a proxied WebSocket may stay silent (both ways) before Ferry closes it. */
      websocket_idle_timeout: number;
    };
  };
  scaling: {
    min_replicas: number;
    max_replicas: number;
    replica_concurrency: number;
    cooldown: number;
    response_grace_period: number;
  };
  /** cpu: cores as a CFS quota; memory: MiB, tmpfs included; max_processes: tasks (threads count too). */
  resources: { cpu: number; memory: number; max_processes: number };
  env: Record<string, string>;
  /** `[[schedules]]`: runs started on a timetable (src/schedules/). */
  schedules: ScheduleConfig[];
  /** `[retries]`: how async and scheduled runs are tried again (src/runs/retries.ts). */
  retries: RetryPolicy;
  /**
   * `[[volumes]]`: the project's volumes mounted in every replica (never in builds). Builds made before
   * volumes existed have none stored: read it with `volumesOf(config)`.
   */
  volumes: VolumeMount[];
  /**
   * `[image]`: the environment the app runs in, built from a base image (images/image-spec.ts). Absent:
   * the host runtime, as before images existed.
   */
  image?: ImageSpec;
}

/** One `[[schedules]]` entry with its defaults filled in. */
export interface ScheduleConfig {
  name: string;
  /** A 5-field cron expression, a nickname (`@daily`) or `@every <duration>`. */
  cron: string;
  /** IANA name; default UTC. */
  timezone: string;
  /** The function each tick runs; default `run`. */
  function: string;
  /** The run's JSON body; default `{}`. */
  args: unknown;
  /** As `?webhookEndpoint=` on the run (the same rule, webhooks/webhook-url.ts, and normalized), or null. */
  webhook: string | null;
  /** `skip`: no tick starts while the schedule's last run is unfinished; `allow`: ticks overlap. */
  overlap: 'skip' | 'allow';
}

export interface VolumeMount {
  name: string;
  /** Absolute, normalized path inside the sandbox. */
  mount: string;
  read_only: boolean;
}

/** An app's volumes; `[]` for a config stored before `[[volumes]]` existed. */
export function volumesOf(config: Pick<AppConfig, 'volumes'> | undefined): VolumeMount[] {
  return config?.volumes ?? [];
}

/** Why `mount` cannot be a volume's mount point, or undefined. */
export function mountProblem(mount: string): string | undefined {
  if (!mount.startsWith('/') || mount.includes('\0')) return 'must be an absolute path';
  const parts = mount.split('/').filter((p) => p !== '');
  if (parts.some((p) => p === '.' || p === '..')) return 'must not contain "." or ".." components';
  const normal = `/${parts.join('/')}`;
  if (normal === '/') return 'must not be /';
  const reserved = RESERVED_MOUNTS.find((dir) => normal === dir || normal.startsWith(`${dir}/`));
  if (reserved) return `must not be ${reserved} or under it (the sandbox's own folder)`;
  return undefined;
}

/** `[scaling]` when ferry.toml says nothing. */
export const DEFAULT_SCALING = {
  min_replicas: 0,
  max_replicas: 2,
  replica_concurrency: 1,
  cooldown: 60,
  response_grace_period: 900,
} as const;

/** Default of `[resources].max_processes`: room for a runtime's threads and a few child processes. */
export const DEFAULT_MAX_PROCESSES = 256;

export const DEFAULT_INCLUDE = ['**/*'];
// Without a slash a pattern names a file or folder at any depth, so nested __pycache__ folders stay home too.
export const DEFAULT_EXCLUDE = ['.*', 'node_modules', '__pycache__'];

/** Thrown for an unreadable or invalid `ferry.toml`; `key` is the dotted path of the offending key. */
/**
 * Why a cortex app's entry is ambiguous, or undefined: a Node entry and `main.py` side by side need
 * `app.entry`, since either could be meant. `has` says whether a file is at the app's root. Checked by
 * `ferry deploy` before it uploads, and by the build for archives uploaded without the CLI.
 */
export function entryConflict(config: AppConfig, has: (file: string) => boolean): string | undefined {
  if (config.app.runtime !== 'cortex' || config.app.entry !== undefined) return undefined;
  const node = ['main.ts', 'main.js', 'main.mjs'].find(has);
  if (node === undefined || !has('main.py')) return undefined;
  return `Both ${node} and main.py are at the app's root: say which one is the entry with entry = "${node}" or entry = "main.py" under [app] in ferry.toml`;
}

export class AppConfigError extends Error {
  readonly key: string | undefined;
  /** The coded error the server answers with (FERRY_CONFIG_INVALID unless a part has its own, as `[image]`). */
  readonly code: ErrorCode;
  constructor(message: string, key?: string, code: ErrorCode = 'FERRY_CONFIG_INVALID') {
    super(message);
    this.name = 'AppConfigError';
    this.key = key;
    this.code = code;
  }
}

function keyOf(path: string): string {
  // TypeBox paths look like "/scaling/max_replicas" or "/env/1"; ferry.toml users think in dotted keys.
  return path.replace(/^\//, '').replaceAll('/', '.') || '(top level)';
}

/**
 * Parses and validates the text of a `ferry.toml`.
 *
 * @example
 *   const config = parseAppConfig('[app]\nname = "hello"\n');
 *   config.scaling.response_grace_period; // 900
 */
export function parseAppConfig(text: string): AppConfig {
  let data: unknown;
  try {
    data = parseToml(text);
  } catch (err) {
    const message = err instanceof Error ? err.message.split('\n')[0] : String(err);
    throw new AppConfigError(`ferry.toml is not valid TOML: ${message}`);
  }
  const errors = Value.Errors(RawConfig, data);
  if (errors.length > 0) throw new AppConfigError(...explain(errors));
  return withDefaults(data as RawConfig);
}

type ValidationError = ReturnType<typeof Value.Errors>[number];

/** Picks the most useful error and words it in terms of ferry.toml keys. */
function explain(errors: ValidationError[]): [string, string] {
  // "schema is false" is how an unknown key shows up; the additionalProperties error beside it says which.
  const useful = errors.filter((e) => e.keyword !== 'boolean');
  const first = useful[0] ?? errors[0]!;
  const base = keyOf(first.instancePath);
  const params = first.params as Record<string, unknown>;
  let key = base;
  let what: string;
  if (first.keyword === 'required') {
    const missing = (params.requiredProperties as string[] | undefined)?.[0] ?? '?';
    key = base === '(top level)' ? missing : `${base}.${missing}`;
    what = first.instancePath === '' ? 'section is required' : 'is required';
  } else if (first.keyword === 'additionalProperties') {
    const extra = (params.additionalProperties as string[] | undefined)?.[0] ?? '?';
    key = base === '(top level)' ? extra : `${base}.${extra}`;
    what = base === 'env' ? 'is not a valid environment variable name' : 'is not a known key';
  } else if (first.keyword === 'pattern' && /endpoint$/.test(key)) {
    what = 'must be "" (a TCP check) or a path starting with "/"';
  } else if (first.keyword === 'pattern' && key === 'app.name') {
    what = 'must use only a-z, 0-9 and "-", start and end with a letter or digit, and be at most 63 characters';
  } else {
    what = first.message;
  }
  return [`ferry.toml: ${key}: ${what}`, key];
}

function withDefaults(raw: RawConfig): AppConfig {
  const runtime = raw.app.runtime ?? 'cortex';
  if (runtime === 'cortex' && raw.runtime?.custom) {
    throw new AppConfigError(
      'ferry.toml: runtime.custom: is only allowed when app.runtime is "custom"',
      'runtime.custom',
    );
  }
  if (runtime === 'custom' && raw.app.entry !== undefined) {
    throw new AppConfigError('ferry.toml: app.entry: is only used by the cortex runtime', 'app.entry');
  }
  let image: ImageSpec | undefined;
  try {
    image = parseImageTable(raw.image);
  } catch (err) {
    if (err instanceof FerryError) {
      const key = /^ferry\.toml: (image[^:]*):/.exec(err.message)?.[1] ?? 'image';
      throw new AppConfigError(err.message, key, err.code);
    }
    throw err;
  }
  if (runtime === 'custom' && !raw.runtime?.custom && !image) {
    throw new AppConfigError(
      'ferry.toml: runtime.custom: is required when app.runtime is "custom" (without an [image], whose ENTRYPOINT/CMD would run)',
      'runtime.custom',
    );
  }
  if (runtime === 'custom' && raw.runtime?.custom?.entrypoint === undefined && !image) {
    throw new AppConfigError(
      'ferry.toml: runtime.custom.entrypoint: is required (without an [image], whose ENTRYPOINT/CMD would run)',
      'runtime.custom.entrypoint',
    );
  }
  const scaling = {
    min_replicas: raw.scaling?.min_replicas ?? DEFAULT_SCALING.min_replicas,
    max_replicas: raw.scaling?.max_replicas ?? DEFAULT_SCALING.max_replicas,
    replica_concurrency: raw.scaling?.replica_concurrency ?? DEFAULT_SCALING.replica_concurrency,
    cooldown: raw.scaling?.cooldown ?? DEFAULT_SCALING.cooldown,
    response_grace_period: raw.scaling?.response_grace_period ?? DEFAULT_SCALING.response_grace_period,
  };
  if (scaling.min_replicas > scaling.max_replicas) {
    throw new AppConfigError(
      `ferry.toml: scaling.min_replicas: ${scaling.min_replicas} is more than scaling.max_replicas (${scaling.max_replicas})`,
      'scaling.min_replicas',
    );
  }
  // With an [image] every key of [runtime.custom] has a default (the image's ENTRYPOINT/CMD and EXPOSE),
  // so the table may be left out: it reads as an empty one, and every reader finds it filled in.
  const custom: Static<typeof CustomSection> | undefined =
    raw.runtime?.custom ?? (runtime === 'custom' ? {} : undefined);
  const volumes: VolumeMount[] = [];
  for (const [i, v] of (raw.volumes ?? []).entries()) {
    const problem = mountProblem(v.mount);
    if (problem) throw new AppConfigError(`ferry.toml: volumes.${i}.mount: ${problem}`, `volumes.${i}.mount`);
    const mount = `/${v.mount
      .split('/')
      .filter((p) => p !== '')
      .join('/')}`;
    const clash = volumes.find(
      (o) => o.mount === mount || o.mount.startsWith(`${mount}/`) || mount.startsWith(`${o.mount}/`),
    );
    if (clash) {
      throw new AppConfigError(
        `ferry.toml: volumes.${i}.mount: ${mount} overlaps the mount of volume "${clash.name}" (${clash.mount})`,
        `volumes.${i}.mount`,
      );
    }
    if (volumes.some((o) => o.name === v.name)) {
      throw new AppConfigError(
        `ferry.toml: volumes.${i}.name: volume "${v.name}" is mounted twice`,
        `volumes.${i}.name`,
      );
    }
    volumes.push({ name: v.name, mount, read_only: v.read_only ?? false });
  }
  return {
    app: {
      name: raw.app.name,
      runtime,
      entry: raw.app.entry,
      include: raw.app.include ?? DEFAULT_INCLUDE,
      exclude: raw.app.exclude ?? DEFAULT_EXCLUDE,
      disable_auth: raw.app.disable_auth ?? false,
      retry_interrupted: raw.app.retry_interrupted ?? false,
    },
    runtime: custom
      ? {
          custom: {
            ...(custom.entrypoint !== undefined ? { entrypoint: custom.entrypoint } : {}),
            port: custom.port ?? 8080,
            port_given: custom.port !== undefined,
            healthcheck_endpoint: custom.healthcheck_endpoint ?? '',
            readycheck_endpoint: custom.readycheck_endpoint ?? '',
            start_timeout: custom.start_timeout ?? 60,
            healthcheck_interval: custom.healthcheck_interval ?? 10,
            websocket_idle_timeout: custom.websocket_idle_timeout ?? 300,
          },
        }
      : {},
    scaling,
    resources: {
      cpu: raw.resources?.cpu ?? 1,
      memory: raw.resources?.memory ?? 1024,
      max_processes: raw.resources?.max_processes ?? DEFAULT_MAX_PROCESSES,
    },
    env: raw.env ?? {},
    schedules: schedulesOf(raw.schedules ?? []),
    retries: retriesOf(raw.retries),
    volumes,
    ...(image ? { image } : {}),
  };
}

function schedulesOf(entries: NonNullable<RawConfig['schedules']>): ScheduleConfig[] {
  const seen = new Set<string>();
  return entries.map((entry, i) => {
    if (seen.has(entry.name)) {
      throw new AppConfigError(
        `ferry.toml: schedules.${i}.name: "${entry.name}" is used by an earlier schedule (names are unique in the app)`,
        `schedules.${i}.name`,
      );
    }
    seen.add(entry.name);
    const timezone = entry.timezone ?? 'UTC';
    try {
      parseTiming(entry.cron, timezone);
    } catch (err) {
      if (!(err instanceof ScheduleSpecError)) throw err;
      throw new AppConfigError(`ferry.toml: schedules.${i}.${err.key}: ${err.message}`, `schedules.${i}.${err.key}`);
    }
    const args = toPlainJson(entry.args ?? {});
    if (!isJson(args)) {
      throw new AppConfigError(
        `ferry.toml: schedules.${i}.args: must be JSON data (TOML dates and times are not)`,
        `schedules.${i}.args`,
      );
    }
    let webhook: string | null = null;
    try {
      if (entry.webhook !== undefined) webhook = parseWebhookUrl(entry.webhook);
    } catch (err) {
      if (!(err instanceof WebhookUrlError)) throw err;
      throw new AppConfigError(`ferry.toml: schedules.${i}.webhook: ${err.message}`, `schedules.${i}.webhook`);
    }
    return {
      name: entry.name,
      cron: entry.cron.trim(),
      timezone,
      function: entry.function ?? 'run',
      args,
      webhook,
      overlap: entry.overlap ?? 'skip',
    };
  });
}

/** `value` as plain objects (smol-toml's tables have no prototype), or itself when it is not JSON data. */
function toPlainJson(value: unknown): unknown {
  return isJson(value) ? JSON.parse(JSON.stringify(value)) : value;
}

/** Whether `value` is plain JSON data (what smol-toml gives for everything but dates and times). */
function isJson(value: unknown): boolean {
  if (value === null || typeof value === 'string' || typeof value === 'boolean') return true;
  if (typeof value === 'number') return Number.isFinite(value);
  if (Array.isArray(value)) return value.every(isJson);
  // smol-toml's tables have no prototype; a date or time is a Date subclass.
  const proto = typeof value === 'object' ? Object.getPrototypeOf(value) : undefined;
  if (proto === null || proto === Object.prototype) {
    return Object.values(value as Record<string, unknown>).every(isJson);
  }
  return false;
}

function retriesOf(raw: RawConfig['retries']): RetryPolicy {
  const policy: RetryPolicy = {
    max_attempts: raw?.max_attempts ?? NO_RETRIES.max_attempts,
    initial_delay: raw?.initial_delay ?? NO_RETRIES.initial_delay,
    backoff: raw?.backoff ?? NO_RETRIES.backoff,
    max_delay: raw?.max_delay ?? NO_RETRIES.max_delay,
    on: raw?.on ? [...raw.on] : [...NO_RETRIES.on],
  };
  if (policy.max_delay < policy.initial_delay) {
    throw new AppConfigError(
      `ferry.toml: retries.max_delay: ${policy.max_delay} is less than retries.initial_delay (${policy.initial_delay})`,
      'retries.max_delay',
    );
  }
  return policy;
}

export type Scaling = AppConfig['scaling'];
export type ScalingOverride = Partial<Scaling>;

/**
 * Checks a `{"scaling": {...}}` override from the API exactly as `[scaling]` in ferry.toml is checked
 * (same keys, bounds and messages, `scaling.<key>`), and returns it. Throws AppConfigError.
 */
export function parseScalingOverride(value: unknown): ScalingOverride {
  const errors = Value.Errors(ScalingSection, value);
  if (errors.length > 0) {
    const [message, key] = explain(errors);
    const dotted = key === '(top level)' ? 'scaling' : `scaling.${key}`;
    throw new AppConfigError(message.replace(`ferry.toml: ${key}:`, `${dotted}:`), dotted);
  }
  return { ...(value as ScalingOverride) };
}

/**
 * The scaling in force: the build's `[scaling]` with the app's override over it. When the two together
 * put min_replicas above max_replicas (a later ferry.toml lowered max under an overridden min), max wins.
 */
export function effectiveScaling(base: Scaling, override: ScalingOverride | null | undefined): Scaling {
  if (!override) return base;
  const merged = { ...base, ...override };
  if (merged.min_replicas > merged.max_replicas) merged.min_replicas = merged.max_replicas;
  return merged;
}

/** The override stored on an app row (`apps.scaling_json`), or null; a row that does not parse is ignored. */
export function storedScalingOverride(text: string | null | undefined): ScalingOverride | null {
  if (!text) return null;
  try {
    return parseScalingOverride(JSON.parse(text));
  } catch {
    return null;
  }
}

/** `config` with the app's override applied to its scaling. */
export function withScalingOverride(config: AppConfig, scalingJson: string | null | undefined): AppConfig {
  const override = storedScalingOverride(scalingJson);
  return override ? { ...config, scaling: effectiveScaling(config.scaling, override) } : config;
}
