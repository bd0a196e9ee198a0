/**
 * Prometheus metrics, served at `/metrics`. One registry per server so tests can run several servers in
 * one process. Later parts (runs, replicas, webhooks) add their metrics to the same registry.
 *
 * Every metric carries the process's `node` (its id in the cluster, cluster/node.ts) and `role` as default
 * labels, so a Prometheus scraping several processes of one cluster tells their series apart.
 */
import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from 'prom-client';
import { HotCounter, HotHistogram } from './hot-metrics.js';

export interface Metrics {
  registry: Registry;
  httpRequests: HotCounter<'method' | 'route' | 'status'>;
  httpDuration: HotHistogram<'method' | 'route'>;
  builds: Counter<'state'>;
  buildDuration: Histogram<'state'>;
  runs: HotCounter<'project' | 'app' | 'state' | 'status'>;
  runDuration: HotHistogram<'project' | 'app'>;
  coldStarts: Counter<'project' | 'app'>;
  coldStartDuration: Histogram<'project' | 'app'>;
  replicas: Gauge<'project' | 'app' | 'state'>;
  queueDepth: Gauge<'project' | 'app'>;
  runsInFlight: Gauge<'project' | 'app'>;
  /** Warm sandboxes (FERRY_WARM_POOL) by runtime and state (ready, starting). */
  warmSandboxes: Gauge<'runtime' | 'state'>;
  webhookAttempts: Counter<'outcome'>;
  webhookDeliveries: Counter<'state'>;
  /** With --nats-url: async runs published to the runs stream, at acceptance or by the relay. */
  asyncPublished: Counter<'via'>;
  /** With --nats-url: publishes that failed (the relay publishes those runs later). */
  asyncPublishFailures: Counter;
  /** With --nats-url: messages fetched from the runs stream, by what became of them. */
  asyncFetched: Counter<'outcome'>;
  /** With --nats-url: seconds an async run spent in each stage of the JetStream queue (runs/jetstream-queue.ts). */
  asyncStage: Histogram<'stage'>;
  /** Builds deleted (files and rows), by why: `retention`, `deleted` (a build or its app, through the API). */
  buildsDeleted: Counter<'reason'>;
  /** Run records deleted with their logs, by why: `retention`, `deleted` (with their app). */
  runsDeleted: Counter<'reason'>;
  /** Bytes of build files this process deleted, by why. */
  bytesFreed: Counter<'reason'>;
  /** Retention passes this process ran. */
  retentionPasses: Counter;
  /**
   * Runs' ends this process computed but did not write: the run was settled (recovery) or taken over while
   * this process could not renew its lease (it was paused or cut off from the store).
   */
  lateResultsDiscarded: Counter;
  /** Schedules' ticks that started a run, by how (`tick`, `trigger`). */
  scheduleRuns: Counter<'via'>;
  /** Due ticks of schedules that started no run, by why (`downtime`, `overlap`). */
  scheduleTicksSkipped: Counter<'reason'>;
}

export function createMetrics(labels?: { node: string; role: string }): Metrics {
  const registry = new Registry();
  if (labels) registry.setDefaultLabels(labels);
  collectDefaultMetrics({ register: registry, prefix: 'ferry_' });
  return {
    registry,
    httpRequests: new HotCounter({
      name: 'ferry_http_requests_total',
      help: 'HTTP requests answered, by route and status',
      labelNames: ['method', 'route', 'status'],
      registers: [registry],
    }),
    httpDuration: new HotHistogram({
      name: 'ferry_http_request_duration_seconds',
      help: 'Time to answer HTTP requests',
      labelNames: ['method', 'route'],
      buckets: [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30],
      registers: [registry],
    }),
    builds: new Counter({
      name: 'ferry_builds_total',
      help: 'Builds that reached a final state',
      labelNames: ['state'],
      registers: [registry],
    }),
    buildDuration: new Histogram({
      name: 'ferry_build_duration_seconds',
      help: 'Time from a build starting to its final state',
      labelNames: ['state'],
      buckets: [0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600],
      registers: [registry],
    }),
    runs: new HotCounter({
      name: 'ferry_runs_total',
      help: 'Runs that ended, by app, final state and HTTP status',
      labelNames: ['project', 'app', 'state', 'status'],
      registers: [registry],
    }),
    runDuration: new HotHistogram({
      name: 'ferry_run_duration_seconds',
      help: 'Time from a run being accepted to its end (queueing and cold start included)',
      labelNames: ['project', 'app'],
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900],
      registers: [registry],
    }),
    coldStarts: new Counter({
      name: 'ferry_cold_starts_total',
      help: 'Replicas started',
      labelNames: ['project', 'app'],
      registers: [registry],
    }),
    coldStartDuration: new Histogram({
      name: 'ferry_cold_start_duration_seconds',
      help: 'Time from starting a replica to its socket accepting',
      labelNames: ['project', 'app'],
      buckets: [0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10],
      registers: [registry],
    }),
    replicas: new Gauge({
      name: 'ferry_replicas',
      help: 'Replicas by state (starting, ready)',
      labelNames: ['project', 'app', 'state'],
      registers: [registry],
    }),
    queueDepth: new Gauge({
      name: 'ferry_queue_depth',
      help: 'Runs waiting for a replica slot',
      labelNames: ['project', 'app'],
      registers: [registry],
    }),
    webhookAttempts: new Counter({
      name: 'ferry_webhook_attempts_total',
      help: 'Webhook delivery attempts, by outcome (delivered, retry, permanent)',
      labelNames: ['outcome'],
      registers: [registry],
    }),
    webhookDeliveries: new Counter({
      name: 'ferry_webhook_deliveries_total',
      help: 'Webhook deliveries that reached a final state (delivered, failed)',
      labelNames: ['state'],
      registers: [registry],
    }),
    runsInFlight: new Gauge({
      name: 'ferry_runs_in_flight',
      help: 'Runs executing in replicas',
      labelNames: ['project', 'app'],
      registers: [registry],
    }),
    warmSandboxes: new Gauge({
      name: 'ferry_warm_sandboxes',
      help: 'Warm sandboxes waiting for an app (FERRY_WARM_POOL), by runtime and state (ready, starting)',
      labelNames: ['runtime', 'state'],
      registers: [registry],
    }),
    buildsDeleted: new Counter({
      name: 'ferry_builds_deleted_total',
      help: 'Builds deleted with their files, by reason (retention, deleted)',
      labelNames: ['reason'],
      registers: [registry],
    }),
    runsDeleted: new Counter({
      name: 'ferry_runs_deleted_total',
      help: 'Run records deleted with their logs, by reason (retention, deleted)',
      labelNames: ['reason'],
      registers: [registry],
    }),
    bytesFreed: new Counter({
      name: 'ferry_bytes_freed_total',
      help: 'Bytes of build archives and outputs deleted by this process, by reason (retention, deleted)',
      labelNames: ['reason'],
      registers: [registry],
    }),
    retentionPasses: new Counter({
      name: 'ferry_retention_passes_total',
      help: 'Retention passes this process ran (FERRY_KEEP_BUILDS, FERRY_RUN_RETENTION_DAYS)',
      registers: [registry],
    }),
    scheduleRuns: new Counter({
      name: 'ferry_schedule_runs_total',
      help: "Runs started by schedules, by how: a tick (tick) or 'ferry schedules trigger' (trigger)",
      labelNames: ['via'],
      registers: [registry],
    }),
    scheduleTicksSkipped: new Counter({
      name: 'ferry_schedule_ticks_skipped_total',
      help: 'Due ticks of schedules that started no run: passed over after downtime (downtime), while the last run was unfinished with overlap = "skip" (overlap), or refused by a full async backlog (backlog)',
      labelNames: ['reason'],
      registers: [registry],
    }),
    lateResultsDiscarded: new Counter({
      name: 'ferry_late_results_discarded_total',
      help: "Runs' results not written because the run was settled or taken over while this process had lost its lease",
      registers: [registry],
    }),
    asyncPublished: new Counter({
      name: 'ferry_async_published_total',
      help: 'Async runs published to the JetStream runs stream, by who published them (accept, relay)',
      labelNames: ['via'],
      registers: [registry],
    }),
    asyncPublishFailures: new Counter({
      name: 'ferry_async_publish_failures_total',
      help: 'Publishes of async runs to the JetStream runs stream that failed (the relay publishes them later)',
      registers: [registry],
    }),
    asyncFetched: new Counter({
      name: 'ferry_async_fetched_total',
      help: "Messages fetched from the JetStream runs stream: run claimed here (claimed), or not this node's to run (skipped)",
      labelNames: ['outcome'],
      registers: [registry],
    }),
    asyncStage: new Histogram({
      name: 'ferry_async_stage_seconds',
      help: "Seconds an async run spent in a stage of the JetStream queue: publish (committed -> stored in the stream, on the accepting node), claim (stored -> claimed here; the NATS server's clock against this node's), start (claimed -> its start written), ack (done here -> its message acknowledged)",
      labelNames: ['stage'],
      buckets: [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30],
      registers: [registry],
    }),
  };
}
