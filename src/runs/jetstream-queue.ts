/**
 * The run queue on NATS JetStream (`--nats-url`): see run-queue.ts for the seam, docs/scaling-out.md
 * ("The async queue on JetStream") for the design in prose.
 *
 * - **Publish.** An accepted run is committed free (no owner) before its 202, then published, after the 202 and never
 *   in its way, to the work-queue stream `<cluster>_runs` on `<cluster>.runs.<project>.<app>`. One message carries the
 *   runs of one app handed over together (committed by one write of the store; at most MESSAGE_RUNS, their ids one per
 *   line), with the message id `<first run id>.0` (JetStream drops a second publish of one id within its duplicate
 *   window). Publishes are pipelined on the one connection as plain publishes whose replies (JetStream's
 *   acknowledgements) come to one subscription of the node (publishAccepted says why). Acknowledged ones are recorded
 *   (`published_at`) once a second old, one UPDATE a second for all of them, on the runs still waiting for a node and
 *   never started (a run started and queued again since had that message acknowledged; a run claimed by then needs no
 *   mark: the relay leaves held runs alone).
 * - **Relay.** Every node republishes queued runs held by nobody with no known message (their publish failed or was
 *   never tried, NATS being down; or recovery freed them, their message gone), once they are a few seconds old, one to
 *   a message, as `<run id>.<publishes>`: a fresh id, so JetStream never drops a republish as a duplicate of a message
 *   it acknowledged earlier. Runs published long ago and still waiting are republished too, rarely (a message lost with
 *   the stream); a duplicate is harmless (below).
 * - **Consume** (only on nodes that run work, `consume`). One durable pull consumer per app, filtered on the app's
 *   subject (NATS 2.9 has no multi-filter consumers, and a work-queue stream forbids overlapping ones), created on
 *   demand. Which apps have messages is read from the stream's per-subject counts, which count every message not yet
 *   acknowledged, redeliveries included. Each app has its own fetch loop asking for about as many messages as this node
 *   has room to hold runs of it (the async worker's limits), going by the runs per message seen lately, and loops are
 *   started taking turns over projects, so one project's backlog never stands in front of another's: a busy app is
 *   bounded by its own room, and every other app has its own consumer and loop.
 * - **Claim.** The runs of the messages that arrive together are claimed in one UPDATE (owner = this node, where
 *   queued, due and held by nobody), at most the room this node has for the app now. The record decides: a run not
 *   claimed is finished, or held by another node (which runs it; if that node dies, recovery frees the run and the
 *   relay publishes it again), or left free (over the room). A message with runs left free is nak'd, for the next node
 *   with room (the runs of it claimed here are held with no message); one with none held here is acknowledged. Claimed
 *   runs go to the async worker, which runs them as on the store queue (fenced by owner, `attempts` counted at start).
 * - **Acknowledge.** A held message is kept alive with in-progress acks (`working()`) every third of the ack wait,
 *   while a run of it waits here or runs. Once the worker is done with a run and its final state is committed (the
 *   recorder reports it, or the store no longer shows the run as this node's unfinished run), the run no longer stands
 *   on its message; the message is acknowledged once none of its runs does. A node that dies stops sending in-progress
 *   acks: its messages are redelivered after the ack wait, and its lease runs out; the record decides again.
 * - **Stages** (`metrics.stage`, the histogram `ferry_async_stage_seconds`): how long a run spent in each step above:
 *   `publish` (committed -> its publish acknowledged by JetStream, on the accepting node), `claim` (stored in the
 *   stream -> claimed here: the NATS server's clock against this node's), `start` (claimed -> its start written, a
 *   replica slot taken) and `ack` (the worker done with it -> its message acknowledged). Its run time is the record's
 *   `started_at` -> `finished_at`.
 */
import {
  AckPolicy,
  type Consumer,
  type ConsumerMessages,
  DeliverPolicy,
  type JetStreamClient,
  type JetStreamManager,
  type JsMsg,
  jetstream,
  jetstreamManager,
  RetentionPolicy,
  StorageType,
} from '@nats-io/jetstream';
import { createInbox, headers, type Msg, type NatsConnection, nanos, type Subscription } from '@nats-io/transport-node';
import type { Logger } from 'pino';
import type { ClusterNames, NatsLink } from '../cluster/nats.js';
import { nowIso } from '../ids.js';
import {
  claimPublishedRuns,
  claimRunsToPublish,
  freeQueuedRunsOf,
  markRunsPublished,
  releaseQueuedRuns,
  unfinishedRunsOf,
  unmarkRunsPublished,
} from '../store/claims.js';
import type { Store } from '../store/index.js';
import type { AsyncWorker } from './async-worker.js';
import type { AcceptedRun, RunQueue } from './run-queue.js';

export interface JetStreamQueueMetrics {
  /** A run's message was published: at acceptance (`accept`) or by the relay (`relay`). */
  published(via: 'accept' | 'relay', count: number): void;
  /** A publish failed (NATS down or slow); the relay publishes the run later. */
  publishFailed(count: number): void;
  /** Messages fetched: their run claimed here (`claimed`), or not this node's to run (`skipped`). */
  fetched(outcome: 'claimed' | 'skipped', count: number): void;
  /** Seconds one run spent in a stage of the queue (see the module comment). */
  stage?(stage: AsyncStage, seconds: number): void;
}

/** The stages of an async run through the queue that `JetStreamQueueMetrics.stage` times. */
export type AsyncStage = 'publish' | 'claim' | 'start' | 'ack';

export interface JetStreamQueueOptions {
  link: NatsLink;
  names: ClusterNames;
  store: Store;
  logger: Logger;
  /** This node's id (cluster/node.ts). */
  owner: string;
  /**
   * Whether this node fetches and runs async runs (a worker, or `--role all`); false: it only publishes
   * (a gateway). The relay runs either way.
   */
  consume: boolean;
  /** Makes the async worker that performs claimed runs, with the queue's hooks (consume only). */
  createWorker(hooks: {
    claimFromStore: false;
    onSettled(runId: string): void;
    onReleased(runIds: string[]): void;
    onRoom(): void;
    onStarted?(runId: string): void;
  }): AsyncWorker;
  metrics?: JetStreamQueueMetrics;
  /** How long a delivered message may go without an ack or in-progress ack before it is redelivered. Default 30 s. */
  ackWaitMs?: number;
  /** How often the relay looks for runs to publish. Default 1 s. */
  relayIntervalMs?: number;
  /** How old a run with no known message must be before the relay publishes it. Default 3 s. */
  relayAfterMs?: number;
  /** A run published this long ago and still waiting for a node is published again. Default 10 minutes. */
  republishAfterMs?: number;
  /** How often the stream's per-subject counts are read to find apps with messages. Default 250 ms. */
  discoverIntervalMs?: number;
}

/** The longest a fetch waits for messages before it is asked again. */
const FETCH_EXPIRES_MS = 5_000;
/** At most this many runs wanted per fetch (and so at most this many messages). */
const FETCH_MAX = 64;
/**
 * At most this many runs in one message: the runs of one app accepted together (committed by one write of
 * the recorder, or a few) go in one message, so the stream, its consumers and the acks cost a message per
 * batch rather than per run (bench/README.md, bench:cluster (c)).
 */
const MESSAGE_RUNS = 64;
/** An app's fetch loop stops after this long with no messages seen on its subject. */
const APP_IDLE_MS = 30_000;
const RELAY_BATCH = 500;
const MARK_EVERY_MS = 1_000;
/** How long an accepted run's publish waits for the stream's acknowledgement before it counts as failed. */
const PUBLISH_ACK_MS = 10_000;
/** An accepted run's publish is recorded only once it is this old and its run still waits (markPublished). */
const MARK_AFTER_MS = 1_000;
const ACK_EVERY_MS = 50;
/**
 * A settled run's end is looked for in the store only once it is this old: the recorder reports the ends it
 * commits at once (`finished`), so the store is asked only about runs that ended otherwise (queued again for
 * a later attempt, let go, settled by another node).
 */
const ASK_STORE_AFTER_MS = 1_000;
const DUPLICATE_WINDOW_MS = 120_000;

interface AppFeed {
  projectId: string;
  appId: string;
  key: string;
  durable: string;
  subject: string;
  consumer?: Consumer;
  fetching: boolean;
  lastSeen: number;
  current?: ConsumerMessages;
  /** The app was deleted: its loop ends and never makes its consumer again. */
  forgotten?: boolean;
  /** Runs per message fetched lately (a moving average): how many messages a fetch asks for. */
  runsPerMessage: number;
}

/** A fetched message and the runs of it this node holds (queued here or running) under it. */
interface HeldMessage {
  msg: JsMsg;
  runs: Set<string>;
  /** Acknowledged or nak'd: nothing more is said about it. */
  gone?: boolean;
}

/** Separates the run ids of one message (run ids are letters and digits: ids.ts). */
const RUN_SEPARATOR = '\n';

/** The run ids a message of the runs stream carries: one or more (a relayed run's message has one). */
function runsOfMessage(body: string): string[] {
  return body.split(RUN_SEPARATOR).filter((id) => id !== '');
}

/** The runs one message carries, with when each was committed (performance.now(); with `stage` only). */
interface OutgoingMessage {
  subject: string;
  runs: AcceptedRun[];
  committedAt: Array<number | undefined>;
}

/**
 * The messages that carry runs accepted together: one per app (its subject), of at most MESSAGE_RUNS
 * runs each, in the order they were accepted.
 */
function messagesOf(
  runs: AcceptedRun[],
  committedAt: number[],
  subjectOf: (run: AcceptedRun) => string,
): OutgoingMessage[] {
  const bySubject = new Map<string, OutgoingMessage>();
  const full: OutgoingMessage[] = [];
  for (const [i, run] of runs.entries()) {
    const subject = subjectOf(run);
    let group = bySubject.get(subject);
    if (!group) {
      group = { subject, runs: [], committedAt: [] };
      bySubject.set(subject, group);
    }
    group.runs.push(run);
    group.committedAt.push(committedAt[i]);
    if (group.runs.length === MESSAGE_RUNS) {
      full.push(group);
      bySubject.delete(subject);
    }
  }
  return [...full, ...bySubject.values()];
}

export function createJetStreamRunQueue(options: JetStreamQueueOptions): RunQueue {
  const { link, names, store, logger, owner, metrics } = options;
  const stage = metrics?.stage?.bind(metrics);
  const ackWaitMs = options.ackWaitMs ?? 30_000;
  const relayIntervalMs = options.relayIntervalMs ?? 1_000;
  const relayAfterMs = options.relayAfterMs ?? 3_000;
  const republishAfterMs = options.republishAfterMs ?? 600_000;
  const discoverMs = options.discoverIntervalMs ?? 250;
  // Well before the relay would take an unmarked run for one never published (relayAfterMs).
  const markAfterMs = Math.min(MARK_AFTER_MS, Math.floor(relayAfterMs / 2));
  let closed = false;
  let started = false;
  const timers: NodeJS.Timeout[] = [];

  // ---- the stream ----
  let js: JetStreamClient | undefined;
  let jsmPromise: Promise<JetStreamManager> | undefined;
  let streamReady: Promise<void> | undefined;

  function client(): JetStreamClient | undefined {
    const nc = link.current();
    if (!nc) return undefined;
    js ??= jetstream(nc);
    return js;
  }

  function manager(): Promise<JetStreamManager> {
    const nc = link.current();
    if (!nc) return Promise.reject(new Error('NATS has not been reached yet'));
    if (!jsmPromise) {
      const opening = jetstreamManager(nc);
      jsmPromise = opening;
      opening.catch(() => {
        if (jsmPromise === opening) jsmPromise = undefined;
      });
    }
    return jsmPromise;
  }

  /** Creates the runs stream once (it may exist: then it is used as it is). */
  function ensureStream(): Promise<void> {
    if (!streamReady) {
      const making = (async () => {
        const jsm = await manager();
        try {
          await jsm.streams.info(names.runsStream);
        } catch {
          await jsm.streams.add({
            name: names.runsStream,
            subjects: [names.runsSubjects],
            retention: RetentionPolicy.Workqueue,
            storage: StorageType.File,
            duplicate_window: nanos(DUPLICATE_WINDOW_MS),
          });
        }
      })();
      streamReady = making;
      making.catch(() => {
        if (streamReady === making) streamReady = undefined;
      });
    }
    return streamReady;
  }

  // ---- publishing ----
  let toPublish: AcceptedRun[] = [];
  /** When each run of `toPublish` was handed over (committed), by performance.now(): with `stage` only. */
  let acceptedAt: number[] = [];
  let publishScheduled = false;
  /** Runs whose accepted publish JetStream acknowledged, with when (Date.now()), oldest first: marked once MARK_AFTER old. */
  let toMark: Array<{ id: string; at: number }> = [];

  /**
   * The accepted runs' publishes are JetStream publishes without the client's request machinery: each is a
   * plain publish with the message id header, whose reply subject is `<inbox>.<token>` under one wildcard
   * subscription of this node, which JetStream answers with its acknowledgement (as the Go client's
   * PublishAsync does). A `js.publish` per run made a request each (a reply subscription entry, a timer, two
   * Error objects for their stacks): the publish cost a gateway more than its HTTP intake (bench/README.md,
   * bench:cluster (c)). An acknowledgement not come within PUBLISH_ACK_MS counts as a failed publish: the run
   * stays unmarked and the relay publishes it again (a duplicate, if the first was stored, is dropped by
   * JetStream or skipped by the claim).
   */
  let acks: { nc: NatsConnection; inbox: string; subscription: Subscription } | undefined;
  const awaitingAck = new Map<string, Omit<OutgoingMessage, 'subject'> & { sentAt: number }>();
  let nextToken = 0;

  function acksInbox(nc: NatsConnection): string {
    if (acks?.nc === nc) return acks.inbox;
    acks?.subscription.unsubscribe();
    const inbox = createInbox();
    const subscription = nc.subscribe(`${inbox}.*`, {
      callback: (err, msg) => (err ? undefined : publishAnswered(inbox, msg)),
    });
    acks = { nc, inbox, subscription };
    return inbox;
  }

  /** At close: the acknowledgements of publishes in flight, for a second at most (then the relay has them). */
  async function publishesAnswered(): Promise<void> {
    for (let i = 0; i < 20 && awaitingAck.size > 0 && link.connected; i++) await new Promise((r) => setTimeout(r, 50));
    expireUnacknowledged(true);
  }

  function publishAnswered(inbox: string, msg: Msg): void {
    const token = msg.subject.slice(inbox.length + 1);
    const waiting = awaitingAck.get(token);
    if (!waiting) return;
    awaitingAck.delete(token);
    let stored = false;
    // A status message (503: no stream takes the subject) or an error answer is not an acknowledgement.
    if (!msg.headers?.hasError) {
      try {
        const answer = msg.json<{ stream?: string; error?: unknown }>();
        stored = !answer.error && typeof answer.stream === 'string' && answer.stream !== '';
      } catch {
        stored = false;
      }
    }
    if (!stored) {
      metrics?.publishFailed(waiting.runs.length);
      logger.debug({ runs: waiting.runs.length }, 'publishing accepted runs failed; the relay publishes them');
      return;
    }
    metrics?.published('accept', waiting.runs.length);
    const now = performance.now();
    const at = Date.now();
    for (const [i, run] of waiting.runs.entries()) {
      const committedAt = waiting.committedAt[i];
      if (stage && committedAt !== undefined) stage('publish', (now - committedAt) / 1000);
      toMark.push({ id: run.id, at });
    }
  }

  /** Publishes not acknowledged within PUBLISH_ACK_MS: failed (the relay publishes their runs). */
  function expireUnacknowledged(all = false): void {
    const before = all ? Number.POSITIVE_INFINITY : Date.now() - PUBLISH_ACK_MS;
    let failed = 0;
    for (const [token, waiting] of awaitingAck) {
      if (waiting.sentAt > before) break;
      awaitingAck.delete(token);
      failed += waiting.runs.length;
    }
    if (failed > 0) {
      metrics?.publishFailed(failed);
      logger.debug(
        { runs: failed },
        'accepted runs were not acknowledged by the runs stream; the relay publishes them',
      );
    }
  }

  function publishAccepted(): void {
    publishScheduled = false;
    const batch = toPublish;
    const batchAt = acceptedAt;
    toPublish = [];
    acceptedAt = [];
    const nc = link.current();
    // NATS is down: the runs are in the store, unpublished; the relay publishes them once it is back.
    if (!nc || !link.connected || closed) return;
    void ensureStream().then(
      () => {
        if (closed) return;
        const inbox = acksInbox(nc);
        const sentAt = Date.now();
        for (const group of messagesOf(batch, batchAt, (r) => names.runsSubject(r.projectId, r.appId))) {
          const token = String(nextToken++);
          const h = headers();
          // Its first run's id: a run is accepted once, in one message (the relay's ids end in 1, 2, …).
          h.set('Nats-Msg-Id', `${group.runs[0]!.id}.0`);
          try {
            nc.publish(group.subject, group.runs.map((r) => r.id).join(RUN_SEPARATOR), {
              reply: `${inbox}.${token}`,
              headers: h,
            });
          } catch (err) {
            metrics?.publishFailed(group.runs.length);
            logger.debug({ err, runs: group.runs.length }, 'publishing accepted runs failed; the relay publishes them');
            continue;
          }
          awaitingAck.set(token, { runs: group.runs, committedAt: group.committedAt, sentAt });
        }
      },
      (err: unknown) => {
        metrics?.publishFailed(batch.length);
        logger.warn({ err }, 'the runs stream is not available; the relay publishes the accepted runs');
      },
    );
  }

  /**
   * Records the accepted runs published at least `markAfterMs` ago that are still waiting for a node (all of
   * them when closing). Most runs are claimed sooner: the claim makes the mark needless (the relay leaves
   * held runs alone), and the UPDATE then finds nothing to write for them (one a second of up to a second's
   * publishes, which were each a row written before: bench/README.md, bench:cluster (c)).
   */
  async function markPublished(all = false): Promise<void> {
    const before = all ? Number.POSITIVE_INFINITY : Date.now() - markAfterMs;
    let n = 0;
    while (n < toMark.length && toMark[n]!.at <= before) n += 1;
    if (n === 0) return;
    const batch = toMark.slice(0, n).map((m) => m.id);
    toMark = toMark.slice(n);
    try {
      await markRunsPublished(store, batch, nowIso());
    } catch (err) {
      // Not recorded: the relay may publish some again (a duplicate message is acknowledged unused).
      logger.warn({ err, runs: batch.length }, 'could not record published runs');
    }
  }

  let relaying: Promise<void> | undefined;
  let relayAgain = false;
  let lastStaleCheck = 0;

  function relay(): Promise<void> {
    if (relaying) {
      relayAgain = true;
      return relaying;
    }
    // `.finally` after the assignment: a pass that returns at once must not leave `relaying` set for good.
    relaying = (async () => {
      try {
        do {
          relayAgain = false;
          if (closed || !link.connected) return;
          await ensureStream();
          const nowMs = Date.now();
          const now = new Date(nowMs).toISOString();
          let runs = await claimRunsToPublish(store, {
            now,
            createdBefore: new Date(nowMs - relayAfterMs).toISOString(),
            limit: RELAY_BATCH,
          });
          if (runs.length === 0 && nowMs - lastStaleCheck >= Math.min(60_000, republishAfterMs)) {
            lastStaleCheck = nowMs;
            runs = await claimRunsToPublish(store, {
              now,
              createdBefore: now,
              staleBefore: new Date(nowMs - republishAfterMs).toISOString(),
              limit: RELAY_BATCH,
            });
          }
          if (runs.length === 0) return;
          const jsc = client();
          if (!jsc) return;
          const failed: string[] = [];
          await Promise.all(
            runs.map((run) =>
              jsc
                .publish(names.runsSubject(run.project_id, run.app_id), run.id, { msgID: `${run.id}.${run.publishes}` })
                .catch((err: unknown) => {
                  failed.push(run.id);
                  logger.debug({ err, runId: run.id }, 'relaying a run failed; trying again');
                }),
            ),
          );
          metrics?.published('relay', runs.length - failed.length);
          if (failed.length > 0) {
            metrics?.publishFailed(failed.length);
            await unmarkRunsPublished(store, failed, now);
            return;
          }
          logger.info({ runs: runs.length }, 'published queued runs that had no message in the runs stream');
          if (runs.length === RELAY_BATCH) relayAgain = true;
        } while (relayAgain && !closed);
      } catch (err) {
        logger.warn({ err }, 'relaying queued runs failed; trying again');
      }
    })().finally(() => {
      relaying = undefined;
    });
    return relaying;
  }

  // ---- consuming ----
  const feeds = new Map<string, AppFeed>();
  /**
   * The message of every run this node holds (queued here or running) under one: a message carries one or
   * more runs, and is acknowledged once none of its runs is held here any more (HeldMessage). A run held
   * with no message (its message was nak'd for runs of it left to other nodes, or let go at close) has no
   * entry: the record and its lease stand for it.
   */
  const heldMessages = new Map<string, HeldMessage>();
  /**
   * Runs the worker is done with, whose message waits for their end to be committed: reported by the
   * recorder (`finished`), or else found in the store (ackSettled), with when the worker was done.
   */
  const settled = new Map<string, number>();
  const claimsInFlight = new Set<Promise<void>>();
  /** With `stage`: when each held run was claimed here, until it starts; when each settled run was settled. */
  const claimedAt = new Map<string, number>();
  const settledAt = new Map<string, number>();
  let projectTurn = 0;
  let reservedTotal = 0;

  const worker = options.consume
    ? options.createWorker({
        claimFromStore: false,
        onSettled(runId) {
          claimedAt.delete(runId);
          if (heldMessages.has(runId)) {
            settled.set(runId, performance.now());
            if (stage) settledAt.set(runId, performance.now());
          }
        },
        onReleased(runIds) {
          // Let go in the store already (published_at cleared): another node may take them at once. Their
          // messages are nak'd (the runs of them still running here are held on with no message: a node
          // that takes the message acknowledges it for them), but a nak'd message may go to a pull request
          // of this node's still open on the server, and wait out the ack wait there: the relay publishes
          // them again, so a mark of their publish not yet written must not be written now.
          const released = new Set(runIds);
          toMark = toMark.filter((m) => !released.has(m.id));
          for (const id of runIds) {
            const held = heldMessages.get(id);
            forgetHeld(id);
            if (held) letGo(held);
          }
        },
        onRoom: () => kick(),
        ...(stage
          ? {
              onStarted(runId: string) {
                const at = claimedAt.get(runId);
                if (at === undefined) return;
                claimedAt.delete(runId);
                stage('start', (performance.now() - at) / 1000);
              },
            }
          : {}),
      })
    : undefined;

  /** Apps being forgotten (deleted) now: discovery leaves them alone until their messages are purged. */
  const forgetting = new Set<string>();

  function feedFor(projectId: string, appId: string): AppFeed {
    const key = `${projectId}/${appId}`;
    let feed = feeds.get(key);
    if (!feed) {
      feed = {
        projectId,
        appId,
        key,
        durable: `runs_${projectId}_${appId}`,
        subject: names.runsSubject(projectId, appId),
        fetching: false,
        lastSeen: Date.now(),
        runsPerMessage: 1,
      };
      feeds.set(key, feed);
    }
    return feed;
  }

  /** Reads which apps have messages in the stream (every message not yet acknowledged counts). */
  let discovering = false;
  async function discover(): Promise<void> {
    if (discovering || closed || !link.connected) return;
    discovering = true;
    try {
      await ensureStream();
      const jsm = await manager();
      const info = await jsm.streams.info(names.runsStream, { subjects_filter: names.runsSubjects });
      const prefix = `${names.cluster}.runs.`;
      const now = Date.now();
      for (const [subject, count] of Object.entries(info.state.subjects ?? {})) {
        if (count <= 0 || !subject.startsWith(prefix)) continue;
        const [projectId, appId] = subject.slice(prefix.length).split('.');
        if (!projectId || !appId || forgetting.has(`${projectId}/${appId}`)) continue;
        feedFor(projectId, appId).lastSeen = now;
      }
      kick();
    } catch (err) {
      logger.debug({ err }, 'reading the runs stream failed; trying again');
    } finally {
      discovering = false;
    }
  }

  /** Starts fetch loops for apps with room and recent messages, taking turns over projects. */
  function kick(): void {
    if (!worker || closed || !started) return;
    const now = Date.now();
    const byProject = new Map<string, AppFeed[]>();
    for (const feed of feeds.values()) {
      if (feed.fetching || now - feed.lastSeen > APP_IDLE_MS) continue;
      const list = byProject.get(feed.projectId);
      if (list) list.push(feed);
      else byProject.set(feed.projectId, [feed]);
    }
    const projects = [...byProject.keys()].sort();
    if (projects.length === 0) return;
    projectTurn = (projectTurn + 1) % projects.length;
    const order = [...projects.slice(projectTurn), ...projects.slice(0, projectTurn)];
    // Round after round, one app of each project, while this node has room.
    for (let round = 0; ; round++) {
      let any = false;
      for (const projectId of order) {
        const feed = byProject.get(projectId)?.[round];
        if (!feed) continue;
        any = true;
        if (worker.room(feed.projectId, feed.appId).total - reservedTotal <= 0) return;
        void fetchLoop(feed);
      }
      if (!any) return;
    }
  }

  async function consumerOf(feed: AppFeed): Promise<Consumer> {
    if (feed.forgotten) throw new Error(`app ${feed.key} was deleted`);
    if (feed.consumer) return feed.consumer;
    const jsm = await manager();
    try {
      await jsm.consumers.info(names.runsStream, feed.durable);
    } catch {
      await jsm.consumers.add(names.runsStream, {
        durable_name: feed.durable,
        filter_subject: feed.subject,
        ack_policy: AckPolicy.Explicit,
        ack_wait: nanos(ackWaitMs),
        deliver_policy: DeliverPolicy.All,
        max_deliver: -1,
      });
    }
    const nc = link.current();
    if (!nc) throw new Error('NATS has not been reached yet');
    feed.consumer = await jetstream(nc).consumers.get(names.runsStream, feed.durable);
    return feed.consumer;
  }

  async function fetchLoop(feed: AppFeed): Promise<void> {
    if (!worker || feed.fetching) return;
    feed.fetching = true;
    try {
      while (!closed && !feed.forgotten && link.connected && Date.now() - feed.lastSeen <= APP_IDLE_MS) {
        const room = worker.room(feed.projectId, feed.appId);
        // At most FETCH_MAX runs reserved per fetch, so one app's loop never takes the room of every other.
        const want = Math.min(FETCH_MAX, room.app, room.total - reservedTotal);
        if (want <= 0) return;
        // Messages, each of one run or more: about as many as the runs wanted. A message with more runs than
        // the room left has the rest left to other nodes (claimBatch).
        const n = Math.max(1, Math.floor(want / feed.runsPerMessage));
        const consumer = await consumerOf(feed);
        reservedTotal += want;
        let got = 0;
        try {
          const messages = await consumer.fetch({ max_messages: n, expires: FETCH_EXPIRES_MS });
          feed.current = messages;
          // A pull request the server lost (it restarted) would leave the fetch waiting forever.
          const watchdog = setTimeout(() => messages.stop(), FETCH_EXPIRES_MS + 2_000);
          void messages.closed().finally(() => clearTimeout(watchdog));
          let batch: JsMsg[] = [];
          let claiming = Promise.resolve();
          const flush = () => {
            const b = batch;
            batch = [];
            claiming = claiming.then(() => claimBatch(feed, b));
            claimsInFlight.add(claiming);
            const mine = claiming;
            void mine.finally(() => claimsInFlight.delete(mine));
          };
          for await (const m of messages) {
            got += 1;
            if (batch.length === 0) setImmediate(flush);
            batch.push(m);
            if (closed) break;
          }
          if (batch.length > 0) flush();
          await claiming;
        } finally {
          feed.current = undefined;
          reservedTotal -= want;
        }
        if (got > 0) feed.lastSeen = Date.now();
      }
    } catch (err) {
      feed.consumer = undefined;
      if (!closed) {
        logger.debug({ err, app: feed.key }, 'fetching runs failed; trying again');
        await new Promise((r) => setTimeout(r, 1000));
      }
    } finally {
      feed.fetching = false;
    }
  }

  async function claimBatch(feed: AppFeed, messages: JsMsg[]): Promise<void> {
    if (messages.length === 0 || !worker) return;
    if (closed) {
      for (const m of messages) m.nak();
      return;
    }
    const runsOf = new Map<JsMsg, string[]>();
    let carried = 0;
    for (const m of messages) {
      const runs = runsOfMessage(m.string());
      runsOf.set(m, runs);
      carried += runs.length;
    }
    feed.runsPerMessage = Math.max(1, 0.8 * feed.runsPerMessage + (0.2 * carried) / messages.length);
    const ids = [...new Set([...runsOf.values()].flat())];
    // Up to the room this node has for the app now: what a fetch asked for is a guess of the runs to come.
    const limit = worker.room(feed.projectId, feed.appId).app;
    let claimed: Awaited<ReturnType<typeof claimPublishedRuns>>;
    try {
      claimed = await claimPublishedRuns(store, owner, ids, Date.now(), limit);
    } catch (err) {
      logger.warn({ err, runs: ids.length }, 'claiming fetched runs failed; they are delivered again');
      for (const m of messages) m.nak(1000);
      return;
    }
    if (closed && claimed.length > 0) {
      // Closed while the claim was answered: the worker takes no more runs; let them go for any node.
      await releaseQueuedRuns(
        store,
        owner,
        claimed.map((r) => r.id),
      ).catch((err: unknown) =>
        logger.warn(
          { err, runs: claimed.length },
          'could not let go of claimed runs; they are freed when the lease ends',
        ),
      );
      for (const m of messages) m.nak();
      return;
    }
    const claimedIds = new Set(claimed.map((r) => r.id));
    // Not claimed yet free: over the room (left to other nodes), or a race with another statement on the
    // row (asked again shortly). Their message is delivered again, never dropped.
    const unclaimed = ids.filter((id) => !claimedIds.has(id) && !heldMessages.has(id));
    let stillFree = new Set<string>();
    try {
      if (unclaimed.length > 0) stillFree = await freeQueuedRunsOf(store, unclaimed);
    } catch (err) {
      stillFree = new Set(unclaimed);
      logger.warn({ err }, 'checking unclaimed runs failed; they are delivered again');
    }
    let skipped = 0;
    const cameIn = new Map<string, JsMsg>();
    for (const m of messages) {
      const runs = runsOf.get(m) ?? [];
      const mine: string[] = [];
      let free = 0;
      let taken = 0;
      for (const id of runs) {
        if (claimedIds.has(id)) {
          taken += 1;
          // Claimed now: the first message of it in this batch brings it; a later one stands for it.
          mine.push(id);
          if (!cameIn.has(id)) cameIn.set(id, m);
        } else if (stillFree.has(id)) free += 1;
        else if (heldMessages.has(id)) mine.push(id);
        // Else finished, or another node's: the record decides, and nothing here runs it.
        else skipped += 1;
      }
      if (free > 0) {
        // Runs of it left free: the message goes to the next node with room (at once when this node took
        // some of it now; else shortly, so a message no node has room for does not go round and round).
        // The runs it took are held with no message.
        if (taken > 0) m.nak();
        else m.nak(200);
        continue;
      }
      if (mine.length === 0) {
        m.ack();
        continue;
      }
      // A message of runs held here (this one, or a second of a run held here: redelivered, or
      // republished): it stands for them now.
      const held: HeldMessage = { msg: m, runs: new Set(mine) };
      for (const id of mine) {
        const before = heldMessages.get(id);
        heldMessages.set(id, held);
        if (before && before !== held) done(before, id);
      }
    }
    if (skipped > 0) metrics?.fetched('skipped', skipped);
    if (claimed.length > 0) metrics?.fetched('claimed', claimed.length);
    const claimedNow = performance.now();
    const wallNow = Date.now();
    for (const run of claimed) {
      const m = cameIn.get(run.id);
      if (stage) {
        claimedAt.set(run.id, claimedNow);
        // Since the stream stored the message (the server's clock); a clock ahead of this node's reads 0.
        if (m) stage('claim', Math.max(0, wallNow - Number(m.timestampNanos / 1_000_000n)) / 1000);
      }
      // Its call came with the claim (store/claims.ts ClaimedCall): no read of the record before it runs.
      const call = run.whole
        ? {
            function_name: run.function_name,
            input: run.input,
            webhook_endpoint: run.webhook_endpoint,
            http_request: run.http_request,
            attempt_log: run.attempt_log,
          }
        : undefined;
      worker.enqueue({ id: run.id, projectId: run.project_id, appId: run.app_id, call });
    }
  }

  /** Run `id` no longer stands on message `held`: once none does, the message is acknowledged. */
  function done(held: HeldMessage, id: string): void {
    held.runs.delete(id);
    if (held.runs.size > 0 || held.gone) return;
    held.gone = true;
    held.msg.ack();
  }

  /** Lets go of a message at once (nak): its runs held here keep running with no message. */
  function letGo(held: HeldMessage): void {
    if (held.gone) return;
    for (const id of held.runs) if (heldMessages.get(id) === held) heldMessages.delete(id);
    held.runs.clear();
    held.gone = true;
    held.msg.nak();
  }

  /** Forgets all this node holds about run `id`: its message, its settled mark and its stage times. */
  function forgetHeld(id: string): void {
    heldMessages.delete(id);
    settled.delete(id);
    claimedAt.delete(id);
    settledAt.delete(id);
  }

  /**
   * Done with a held run's message (its run is over here): the message is acknowledged once none of its runs
   * is held here any more.
   */
  function ackHeld(id: string): void {
    const held = heldMessages.get(id);
    // Its end reported by the recorder before the worker settled it: acknowledged as it was done.
    const at = settledAt.get(id);
    forgetHeld(id);
    if (held) done(held, id);
    if (stage) stage('ack', at === undefined ? 0 : (performance.now() - at) / 1000);
  }

  /**
   * Acknowledges the messages of settled runs the store no longer shows as this node's unfinished runs: the
   * runs whose end this node's recorder did not report (`finished`): queued again for a later attempt, let
   * go, or settled by another node.
   */
  let acking = false;
  async function ackSettled(all = false): Promise<void> {
    if (acking || settled.size === 0) return;
    // Most runs' ends are reported by the recorder within milliseconds: the store is asked only about the
    // runs settled longer ago than that (all of them when closing).
    const before = performance.now() - (all ? 0 : ASK_STORE_AFTER_MS);
    const ids: string[] = [];
    for (const [id, at] of settled) if (at <= before) ids.push(id);
    if (ids.length === 0) return;
    acking = true;
    try {
      const unfinished = await unfinishedRunsOf(store, owner, ids);
      for (const id of ids) {
        // Acknowledged meanwhile (`finished`), or a newer message of the run stands for it now.
        if (unfinished.has(id) || !settled.has(id)) continue;
        ackHeld(id);
      }
    } catch (err) {
      logger.debug({ err }, 'checking finished runs failed; trying again');
    } finally {
      acking = false;
    }
  }

  function keepAlive(): void {
    for (const held of new Set(heldMessages.values())) held.msg.working();
  }

  return {
    async forgetApp(projectId, appId) {
      const key = `${projectId}/${appId}`;
      const feed = feeds.get(key);
      feeds.delete(key);
      // Its fetch loop ends first (a loop left running would make the consumer again after the delete),
      // and until the purge is done a discovery pass does not start another.
      forgetting.add(key);
      if (feed) {
        feed.forgotten = true;
        feed.current?.stop();
      }
      try {
        const jsm = await manager();
        // Its runs are cancelled in the store: their messages would only be fetched to be dropped.
        await jsm.streams
          .purge(names.runsStream, { filter: names.runsSubject(projectId, appId) })
          .catch(() => undefined);
        await jsm.consumers
          .delete(names.runsStream, feed?.durable ?? `runs_${projectId}_${appId}`)
          .catch(() => undefined);
      } finally {
        forgetting.delete(key);
      }
    },
    ownerFor() {
      // Every accepted run goes through the stream, so any consuming node may take it.
      return null;
    },
    finished(runIds) {
      // Their final state is committed with this node's fence: nothing is left to ask the store, and the
      // message is acknowledged now rather than at the next look (every ACK_EVERY_MS).
      for (const id of runIds) if (heldMessages.has(id)) ackHeld(id);
    },
    accepted(run) {
      toPublish.push(run);
      if (stage) acceptedAt.push(performance.now());
      if (!publishScheduled) {
        publishScheduled = true;
        setImmediate(publishAccepted);
      }
      // This node runs work: look at the app now rather than at the next discovery.
      if (worker) {
        feedFor(run.projectId, run.appId).lastSeen = Date.now();
        kick();
      }
    },
    wake() {
      void relay();
    },
    get backlog() {
      return worker?.backlog ?? 0;
    },
    async start() {
      started = true;
      link.onConnect(() => {
        js = undefined;
        jsmPromise = undefined;
        // Pull requests made before a reconnect may be lost with the server: ask again.
        for (const feed of feeds.values()) {
          feed.current?.stop();
          feed.consumer = undefined;
        }
        void relay();
        void discover();
      });
      const every = (ms: number, fn: () => unknown) => {
        const t = setInterval(() => {
          if (!closed) void fn();
        }, ms);
        t.unref();
        timers.push(t);
      };
      every(relayIntervalMs, relay);
      every(MARK_EVERY_MS, () => {
        expireUnacknowledged();
        return markPublished();
      });
      if (worker) {
        await worker.start();
        every(discoverMs, discover);
        every(ACK_EVERY_MS, ackSettled);
        every(Math.max(500, Math.floor(ackWaitMs / 3)), keepAlive);
        void discover();
      }
      void relay();
    },
    async close() {
      closed = true;
      for (const t of timers) clearInterval(t);
      for (const feed of feeds.values()) feed.current?.stop();
      if (worker) {
        // Until every held message is settled: runs finishing during the close keep theirs alive.
        const alive = setInterval(keepAlive, Math.max(500, Math.floor(ackWaitMs / 3)));
        const acks = setInterval(() => void ackSettled(true), ACK_EVERY_MS);
        // The worker first, before any await: from here it starts no run it holds (they are let go, their
        // messages nak'd), and runs running finish; then their messages are acked. Awaiting the relay or the
        // marks first let it start queued runs meanwhile (test/contract-run-queue.test.ts). A claim answered
        // after this lets its runs go itself (claimBatch).
        const stopping = worker.close();
        await Promise.allSettled([...claimsInFlight]);
        await stopping;
        await relaying;
        await publishesAnswered();
        await markPublished(true);
        for (let i = 0; i < 100 && settled.size > 0; i++) {
          await ackSettled(true);
          if (settled.size > 0) await new Promise((r) => setTimeout(r, 50));
        }
        clearInterval(alive);
        clearInterval(acks);
      } else {
        await relaying;
        await publishesAnswered();
        await markPublished(true);
      }
      acks?.subscription.unsubscribe();
    },
  };
}
