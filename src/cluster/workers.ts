/**
 * Workers announce themselves; gateways keep a directory of the live ones (ARCHITECTURE.md, "Scaling out").
 *
 * Each worker puts its announcement (advertised URL, version, load) into the JetStream KV bucket
 * `<cluster>_nodes` every second, under a key of its own. Gateways (and workers, to know which apps they
 * are home to) watch the bucket. A worker counts as live while its last announcement arrived less than
 * `staleMs` (3 s) before the directory last heard anything at all, judged by the watcher's own clock when
 * it received it, not by the sender's; so a worker that is SIGKILLed or cut off stops getting new calls
 * within 5 seconds. A worker that stops cleanly deletes its key, and watchers drop it at once. The bucket
 * keeps one value per key for 10 seconds (its TTL), so a gateway starting up sees the workers announced
 * just before.
 *
 * Silence proves nothing when the directory itself is unreachable (NATS down, frozen, slow, or this node
 * cut off from it): every worker would look dead at once. So staleness is judged against the last time
 * the watch delivered something (another worker's announcement, or this directory's own probe, a key it
 * puts whenever the watch has been quiet for half a second), not against the clock. While nothing arrives,
 * the workers last seen alive stay live, and leave only on their own failure (a call that could not
 * connect: `markDown`) or when the directory, working again, has not heard from them for `staleMs`. After
 * such a gap the workers get `staleMs` to announce again before they count as stale.
 *
 * Neither side needs NATS to be up when it starts or to stay up: both wait for the connection, retry, and
 * watch again after NATS comes back; an outage is logged once, not every tick.
 */
import { randomBytes } from 'node:crypto';
import { type KV, Kvm } from '@nats-io/kv';
import type { NatsConnection } from '@nats-io/transport-node';
import type { Logger } from 'pino';

export interface WorkerAppLoad {
  replicas: number;
  /** Runs in flight on the app's replicas here, plus runs waiting here for a slot. */
  inflight: number;
  /** Slots the worker has or could start for the app (replicas it may run × replica_concurrency). */
  capacity: number;
  /** Of `inflight`, the calls sent by each gateway (by node id); the rest are async runs taken here. */
  by?: Record<string, number>;
}

export interface WorkerLoad {
  /** Replicas the worker may run over all apps (FERRY_WORKER_MAX_REPLICAS); 0: no cap. */
  capacity: number;
  inflight: number;
  replicas: number;
  /** Per app, key `${projectId}/${appId}`. */
  apps: Record<string, WorkerAppLoad>;
}

export interface WorkerAnnouncement {
  id: string;
  url: string;
  role: 'worker' | 'all';
  version: string;
  startedAt: string;
  load: WorkerLoad;
  /** When it was sent, ms, by the sender's clock (informative only). */
  at: number;
}

/** What the NATS connection looks like to this module: ready once connected (cluster/nats.ts NatsLink). */
export interface NatsSource {
  ready(): Promise<NatsConnection>;
}

const BUCKET_TTL_MS = 10_000;
const RETRY_MS = 1000;
/** A directory whose watch has delivered nothing for this long puts a probe to hear it echo back. */
const PROBE_QUIET_MS = 500;
/** Silence longer than this is a gap in the directory (an outage), after which workers get staleMs to announce. */
const GAP_MS = 1500;

async function openBucket(nc: NatsConnection, bucket: string): Promise<KV> {
  return new Kvm(nc).create(bucket, { ttl: BUCKET_TTL_MS, history: 1 });
}

/** KV keys are subject tokens: a node id (hostname-pid-random) is written as hex to be safe whatever it holds. */
function keyOf(id: string): string {
  return `w_${Buffer.from(id).toString('hex')}`;
}

export interface WorkerAnnouncer {
  start(): Promise<void>;
  /** Announces now (a replica started or stopped), besides the once-a-second announcement. */
  announceNow(): void;
  /** Deletes this worker's key so gateways drop it at once, and stops announcing. */
  close(): Promise<void>;
}

export function createWorkerAnnouncer(options: {
  nats: NatsSource;
  bucket: string;
  describe(): Omit<WorkerAnnouncement, 'at'>;
  everyMs?: number;
  logger: Logger;
}): WorkerAnnouncer {
  const { logger } = options;
  const everyMs = options.everyMs ?? 1000;
  let kv: KV | undefined;
  let timer: NodeJS.Timeout | undefined;
  let closed = false;
  let failing = false;
  let sending: Promise<void> | undefined;
  let again = false;

  async function announce(): Promise<void> {
    if (closed) return;
    if (sending) {
      again = true;
      return;
    }
    sending = (async () => {
      try {
        if (!kv) kv = await openBucket(await options.nats.ready(), options.bucket);
        const value = { ...options.describe(), at: Date.now() };
        await kv.put(keyOf(value.id), JSON.stringify(value));
        if (failing) logger.info('announcing this worker again');
        failing = false;
      } catch (err) {
        kv = undefined;
        if (!failing && !closed) logger.warn({ err }, 'announcing this worker failed; retrying every second');
        failing = true;
      }
    })();
    await sending;
    sending = undefined;
    if (again && !closed) {
      again = false;
      await announce();
    }
  }

  return {
    async start() {
      if (timer || closed) return;
      timer = setInterval(() => void announce(), everyMs);
      timer.unref();
      // The first announcement is not waited for longer than a moment: NATS may be down at start.
      await Promise.race([announce(), new Promise((r) => setTimeout(r, 2000).unref())]);
    },
    announceNow() {
      void announce();
    },
    async close() {
      closed = true;
      clearInterval(timer);
      await sending;
      try {
        if (kv) await kv.delete(keyOf(options.describe().id));
      } catch (err) {
        logger.warn({ err }, 'removing this worker’s announcement failed (gateways drop it within seconds)');
      }
    },
  };
}

export interface WorkerDirectory {
  start(): Promise<void>;
  /**
   * Workers whose last announcement arrived within staleMs of the last thing the watch delivered (so all
   * of them stay while the directory is unreachable), less those marked down.
   */
  live(): WorkerAnnouncement[];
  get(id: string): WorkerAnnouncement | undefined;
  /** A call to it could not connect: leave it out for `forMs` and until it announces again after that. */
  markDown(id: string, forMs?: number): void;
  close(): Promise<void>;
}

interface Seen {
  announcement: WorkerAnnouncement;
  receivedAt: number;
}

export function createWorkerDirectory(options: {
  nats: NatsSource;
  bucket: string;
  staleMs?: number;
  logger: Logger;
}): WorkerDirectory {
  const { logger } = options;
  const staleMs = options.staleMs ?? 3000;
  const seen = new Map<string, Seen>();
  const down = new Map<string, number>();
  // When the watch last delivered an entry (any key), and when it started delivering again after a gap.
  let heard = 0;
  let resumed = 0;
  // This directory's probe key: not an announcement, so every watcher's parseAnnouncement ignores it.
  const probeKey = `p_${randomBytes(8).toString('hex')}`;
  let probeKv: KV | undefined;
  let probing = false;
  let probeTimer: NodeJS.Timeout | undefined;
  let closed = false;
  let watcher: { stop(): void } | undefined;
  let loop: Promise<void> | undefined;
  let first: (() => void) | undefined;
  const firstPass = new Promise<void>((resolve) => {
    first = resolve;
  });

  function take(entry: { key: string; operation: string; value: Uint8Array }): void {
    const now = Date.now();
    if (now - heard > GAP_MS) resumed = now;
    heard = now;
    if (entry.key === probeKey) return;
    if (entry.operation !== 'PUT') {
      for (const [id] of seen) if (keyOf(id) === entry.key) seen.delete(id);
      return;
    }
    const parsed = parseAnnouncement(entry.value);
    if (!parsed || keyOf(parsed.id) !== entry.key) return;
    seen.set(parsed.id, { announcement: parsed, receivedAt: now });
  }

  /** Puts the probe when the watch has been quiet; one at a time, so a frozen NATS holds at most one. */
  function probe(): void {
    const kv = probeKv;
    if (closed || probing || !kv || Date.now() - heard < PROBE_QUIET_MS) return;
    probing = true;
    kv.put(probeKey, '{"probe":1}')
      .catch(() => undefined)
      .finally(() => {
        probing = false;
      });
  }

  async function watchForever(): Promise<void> {
    let failing = false;
    while (!closed) {
      try {
        const kv = await openBucket(await options.nats.ready(), options.bucket);
        const iterator = await kv.watch({ key: '>' });
        watcher = iterator;
        probeKv = kv;
        if (failing) logger.info('watching the workers again');
        failing = false;
        // The watch sends the current values first; an empty bucket sends nothing, so do not wait for them.
        first?.();
        for await (const entry of iterator) {
          if (closed) break;
          take(entry);
        }
      } catch (err) {
        probeKv = undefined;
        if (closed) return;
        if (!failing) logger.warn({ err }, 'watching the workers failed; retrying every second');
        failing = true;
      }
      if (!closed) await new Promise((r) => setTimeout(r, RETRY_MS).unref());
    }
  }

  return {
    async start() {
      if (loop) return;
      loop = watchForever();
      probeTimer = setInterval(probe, PROBE_QUIET_MS);
      probeTimer.unref();
      // A moment for the current announcements to arrive; NATS may be down at start, so not longer.
      await Promise.race([
        firstPass.then(() => new Promise((r) => setTimeout(r, 200).unref())),
        new Promise((r) => setTimeout(r, 2000).unref()),
      ]);
    },
    live() {
      const now = Date.now();
      const result: WorkerAnnouncement[] = [];
      for (const [id, s] of seen) {
        // Stale only if the directory heard something staleMs after this worker's last word (and after
        // the end of the last gap): silence while nothing arrives at all is the directory's, not the worker's.
        if (heard - Math.max(s.receivedAt, resumed) > staleMs) continue;
        const until = down.get(id);
        if (until !== undefined) {
          if (now < until || s.receivedAt <= until) continue;
          down.delete(id);
        }
        result.push(s.announcement);
      }
      return result;
    },
    get(id) {
      return seen.get(id)?.announcement;
    },
    markDown(id, forMs = 2000) {
      down.set(id, Date.now() + forMs);
    },
    async close() {
      closed = true;
      clearInterval(probeTimer);
      watcher?.stop();
      await loop?.catch(() => undefined);
    },
  };
}

const num = (v: unknown): number => (typeof v === 'number' && Number.isFinite(v) && v >= 0 ? v : 0);

/** An announcement read back; undefined when it is not one (another version's, or junk). */
export function parseAnnouncement(value: Uint8Array): WorkerAnnouncement | undefined {
  let data: Record<string, unknown>;
  try {
    const parsed = JSON.parse(Buffer.from(value).toString('utf8')) as unknown;
    if (!parsed || typeof parsed !== 'object' || Array.isArray(parsed)) return undefined;
    data = parsed as Record<string, unknown>;
  } catch {
    return undefined;
  }
  if (typeof data.id !== 'string' || !data.id || typeof data.url !== 'string') return undefined;
  let url: URL;
  try {
    url = new URL(data.url);
  } catch {
    return undefined;
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') return undefined;
  const load = (data.load ?? {}) as Record<string, unknown>;
  const apps: Record<string, WorkerAppLoad> = {};
  if (load.apps && typeof load.apps === 'object') {
    for (const [key, app] of Object.entries(load.apps as Record<string, unknown>)) {
      if (!app || typeof app !== 'object') continue;
      const a = app as Record<string, unknown>;
      apps[key] = { replicas: num(a.replicas), inflight: num(a.inflight), capacity: num(a.capacity) };
      if (a.by && typeof a.by === 'object') {
        const by: Record<string, number> = {};
        for (const [node, n] of Object.entries(a.by as Record<string, unknown>)) by[node] = num(n);
        apps[key].by = by;
      }
    }
  }
  return {
    id: data.id,
    url: url.origin,
    role: data.role === 'all' ? 'all' : 'worker',
    version: typeof data.version === 'string' ? data.version : 'unknown',
    startedAt: typeof data.startedAt === 'string' ? data.startedAt : '',
    at: num(data.at),
    load: { capacity: num(load.capacity), inflight: num(load.inflight), replicas: num(load.replicas), apps },
  };
}
