/**
 * The build pipeline (`builds/pipeline.ts`, `createBuildPipeline`) as a component: a fake builder the
 * test scripts (succeeds, fails, waits for the test or for its abort), the real build log and claims on a
 * SQLite file. Covers a build's states, which build becomes active (a ready one, never over a newer one),
 * one build at a time per app in upload order, cancel, the time limit, a stop leaving the build for the
 * next start, a build another node holds, and a build whose activation the project's schedules limit
 * refuses (issue 43). No sandbox, no server, no socket.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { createBuildActivation } from '../src/builds/activation.js';
import { BuildFailedError } from '../src/builds/build-failed.js';
import { createBuildLog } from '../src/builds/build-log.js';
import type { Builder, BuildResult } from '../src/builds/builder.js';
import { type BuildPipeline, createBuildPipeline } from '../src/builds/pipeline.js';
import { createLocalChangeFeed } from '../src/cluster/change-feed.js';
import { FerryError } from '../src/errors.js';
import { uuidv7 } from '../src/ids.js';
import { createLogger } from '../src/logger.js';
import { DEFAULT_BUILD_LIMITS } from '../src/sandbox/build-step.js';
import type { SandboxCapabilities } from '../src/sandbox/launch.js';
import { createLoopbackOnlyNetwork } from '../src/sandbox/network.js';
import type { ScheduleLimits } from '../src/schedules/limits.js';
import { openSqliteStore, type Store } from '../src/store/index.js';
import type { Build } from '../src/store/schema.js';
import { tempDir } from './helpers/ferry.js';

const OWNER = 'node-pipeline-test';
const PROJECT = 'p-pipeline';
const logger = createLogger({ level: 'silent', pretty: false });

/** What the fake builder does with a build: succeed, fail as the app's fault, or wait. */
type Step = 'ready' | 'fail' | 'wait';

interface FakeBuilder {
  builder: Builder;
  /** In order: `build:<id>`, `done:<id>`, `aborted:<id>`. */
  events: string[];
  steps: Map<string, Step>;
  /** Ends a waiting build successfully. */
  finish(id: string): void;
}

function fakeBuilder(): FakeBuilder {
  const waiting = new Map<string, () => void>();
  const fake: FakeBuilder = {
    events: [],
    steps: new Map(),
    finish: (id) => waiting.get(id)?.(),
    builder: {
      name: 'node',
      async build(ctx): Promise<BuildResult> {
        fake.events.push(`build:${ctx.buildId}`);
        const step = fake.steps.get(ctx.buildId) ?? 'ready';
        if (step === 'fail') throw new BuildFailedError('main.ts: a syntax error');
        if (step === 'wait') {
          await new Promise<void>((resolve, reject) => {
            waiting.set(ctx.buildId, resolve);
            // Aborted before the builder ran (the time limit passed while the pipeline prepared the build).
            if (ctx.signal.aborted) {
              fake.events.push(`aborted:${ctx.buildId}`);
              return reject(ctx.signal.reason);
            }
            ctx.signal.addEventListener(
              'abort',
              () => {
                fake.events.push(`aborted:${ctx.buildId}`);
                reject(ctx.signal.reason);
              },
              { once: true },
            );
          });
        }
        await fs.writeFile(path.join(ctx.outputDir, 'main.mjs'), 'export const run = () => 1;\n');
        fake.events.push(`done:${ctx.buildId}`);
        return { runtime: 'node', entry: 'main.mjs', functions: ['run'] };
      },
    },
  };
  return fake;
}

describe('the build pipeline with a fake builder', () => {
  let dir: string;
  let store: Store;
  const pipelines: BuildPipeline[] = [];
  /** The builds announced active (`build.activated` on the change feed), in order. */
  const announced: string[] = [];
  const changes = createLocalChangeFeed({ logger });
  changes.subscribe((event) => {
    if (event.type === 'build.activated') announced.push(event.buildId);
  });

  before(async () => {
    dir = await tempDir('ferry-pipeline-');
    store = await openSqliteStore({ dataDir: dir });
    await store.insertInto('projects').values({ id: PROJECT, name: 'pipeline', created_at: now() }).execute();
  });
  after(async () => {
    for (const pipeline of pipelines) await pipeline.close();
    await store.destroy();
    await fs.rm(dir, { recursive: true, force: true });
  });

  function pipelineOf(
    fake: FakeBuilder,
    options: { timeoutMs?: number; finished?: Build[]; scheduleLimits?: ScheduleLimits } = {},
  ) {
    const pipeline = createBuildPipeline({
      store,
      buildLog: createBuildLog({ store }),
      // The real activation (builds/activation.ts, the one writer of the active build), on an in-process feed.
      activation: createBuildActivation({
        store,
        changes,
        switchHere: async () => {},
        ...(options.scheduleLimits ? { scheduleLimits: options.scheduleLimits } : {}),
      }),
      buildsDir: path.join(dir, 'builds'),
      cacheDir: path.join(dir, 'cache'),
      builders: { node: fake.builder },
      sandbox: { bwrap: null } as unknown as SandboxCapabilities,
      network: createLoopbackOnlyNetwork(),
      limits: { ...DEFAULT_BUILD_LIMITS, timeoutMs: options.timeoutMs ?? DEFAULT_BUILD_LIMITS.timeoutMs },
      logger,
      owner: OWNER,
      onFinished: (build) => options.finished?.push(build),
    });
    pipelines.push(pipeline);
    return pipeline;
  }

  /** A new app, and a function making pending builds of it held by `owner` (time-ordered ids). */
  async function appOf() {
    const appId = `a${uuidv7().slice(-8)}`;
    await store
      .insertInto('apps')
      .values({
        id: appId,
        project_id: PROJECT,
        name: appId,
        active_build_id: null,
        scaling_json: null,
        created_at: now(),
        updated_at: now(),
      })
      .execute();
    /** `schedules`: how many `[[schedules]]` its ferry.toml has. */
    const newBuild = async (owner: string | null = OWNER, schedules = 0): Promise<Build> => {
      const id = uuidv7();
      let toml = `[app]\nname = "${appId}"\n`;
      for (let i = 0; i < schedules; i++) toml += `[[schedules]]\nname = "s-${i}"\ncron = "@hourly"\n`;
      const build = {
        id,
        project_id: PROJECT,
        app_id: appId,
        state: 'pending' as const,
        config_toml: toml,
        config_json: JSON.stringify(parseAppConfig(toml)),
        runtime: null,
        entry: null,
        archive_bytes: 0,
        file_count: 1,
        functions: null,
        error: null,
        owner,
        created_at: now(),
        started_at: null,
        finished_at: null,
        image_digest: null,
        image_json: null,
      };
      await store.insertInto('builds').values(build).execute();
      await fs.mkdir(path.join(dir, 'builds', id, 'source'), { recursive: true });
      await fs.writeFile(path.join(dir, 'builds', id, 'source', 'main.ts'), 'export const run = () => 1;\n');
      return build;
    };
    return { appId, newBuild };
  }

  const buildRow = (id: string) =>
    store.selectFrom('builds').selectAll().where('id', '=', id).executeTakeFirstOrThrow();
  const activeOf = async (appId: string) =>
    (await store.selectFrom('apps').select('active_build_id').where('id', '=', appId).executeTakeFirstOrThrow())
      .active_build_id;
  const logOf = async (id: string) =>
    (await store.selectFrom('build_log_lines').select('line').where('build_id', '=', id).orderBy('seq').execute()).map(
      (r) => r.line,
    );

  /** Waits until the build has a final state (or, with `state`, that one). */
  async function settled(id: string, state?: string): Promise<Build> {
    return waitFor(async () => {
      const row = await buildRow(id);
      return (state ? row.state === state : ['ready', 'failed', 'cancelled'].includes(row.state)) ? row : undefined;
    });
  }

  it('builds a pending build, records what the builder found, and makes it the active build', async () => {
    const fake = fakeBuilder();
    const finished: Build[] = [];
    const pipeline = pipelineOf(fake, { finished });
    const { appId, newBuild } = await appOf();
    const build = await newBuild();
    pipeline.enqueue(build);
    const done = await settled(build.id);
    assert.equal(done.state, 'ready');
    assert.equal(done.entry, 'main.mjs');
    assert.equal(done.functions, '["run"]');
    assert.equal(done.owner, OWNER);
    assert.equal(await activeOf(appId), build.id);
    await waitFor(async () => finished.length === 1);
    assert.equal(finished[0]?.id, build.id, 'told of the final state');
    const log = await logOf(build.id);
    assert.match(log.join('\n'), /Building .* \(build /);
    assert.match(log.at(-1) ?? '', /^Build ready in /);
  });

  it('runs one build at a time per app, in upload order', async () => {
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake);
    const { appId, newBuild } = await appOf();
    const first = await newBuild();
    const second = await newBuild();
    fake.steps.set(first.id, 'wait');
    pipeline.enqueue(first);
    pipeline.enqueue(second);
    await waitFor(async () => fake.events.includes(`build:${first.id}`));
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.equal((await buildRow(second.id)).state, 'pending', 'the second waits for the first');
    fake.finish(first.id);
    await settled(second.id);
    assert.deepEqual(fake.events, [`build:${first.id}`, `done:${first.id}`, `build:${second.id}`, `done:${second.id}`]);
    assert.equal(await activeOf(appId), second.id);
  });

  it('never lets an older build that becomes ready replace (or be announced over) a newer active one', async () => {
    const fake = fakeBuilder();
    const finished: Build[] = [];
    const pipeline = pipelineOf(fake, { finished });
    const { appId, newBuild } = await appOf();
    const older = await newBuild();
    const newer = await newBuild();
    pipeline.enqueue(newer);
    await settled(newer.id);
    await waitFor(async () => announced.includes(newer.id));
    pipeline.enqueue(older);
    assert.equal((await settled(older.id)).state, 'ready');
    assert.equal(await activeOf(appId), newer.id, 'the newer build stays active');
    // The pipeline announces after its onFinished: once told, an announcement would have been made.
    await waitFor(async () => finished.some((b) => b.id === older.id));
    assert.ok(!announced.includes(older.id), 'a build kept inactive is not announced active');
  });

  it('records a failed build with its message, leaves the active build alone, and removes its output', async () => {
    const fake = fakeBuilder();
    const finished: Build[] = [];
    const pipeline = pipelineOf(fake, { finished });
    const { appId, newBuild } = await appOf();
    const good = await newBuild();
    pipeline.enqueue(good);
    await settled(good.id);
    const bad = await newBuild();
    fake.steps.set(bad.id, 'fail');
    pipeline.enqueue(bad);
    const done = await settled(bad.id);
    assert.equal(done.state, 'failed');
    assert.equal(done.error, 'main.ts: a syntax error');
    assert.equal(await activeOf(appId), good.id);
    // The pipeline tells of a final state once it is written and the build's folders are tidied.
    await waitFor(async () => finished.some((b) => b.id === bad.id));
    await assert.rejects(fs.access(path.join(dir, 'builds', bad.id, 'out')), 'no output left of a failed build');
    assert.equal((await logOf(bad.id)).at(-1), 'Build failed: main.ts: a syntax error');
  });

  it('fails a build past its time limit (a failure, not a cancel)', async () => {
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake, { timeoutMs: 50 });
    const { newBuild } = await appOf();
    const build = await newBuild();
    fake.steps.set(build.id, 'wait');
    pipeline.enqueue(build);
    const done = await settled(build.id);
    assert.equal(done.state, 'failed');
    assert.match(done.error ?? '', /took longer than its time limit/);
    assert.ok(fake.events.includes(`aborted:${build.id}`), 'the builder was told to stop');
  });

  it('cancels a running build and a pending one; a finished build is not cancellable', async () => {
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake);
    const { appId, newBuild } = await appOf();
    const running = await newBuild();
    const pending = await newBuild();
    fake.steps.set(running.id, 'wait');
    pipeline.enqueue(running);
    await waitFor(async () => fake.events.includes(`build:${running.id}`));
    const cancelledPending = await pipeline.cancel(PROJECT, appId, pending.id);
    assert.equal(cancelledPending.state, 'cancelled');
    const cancelledRunning = await pipeline.cancel(PROJECT, appId, running.id);
    assert.equal(cancelledRunning.state, 'cancelled', 'the answer shows the final state');
    assert.ok(fake.events.includes(`aborted:${running.id}`));
    assert.equal(await activeOf(appId), null);
    await assert.rejects(
      pipeline.cancel(PROJECT, appId, running.id),
      (err: unknown) => err instanceof FerryError && err.code === 'FERRY_BUILD_NOT_CANCELLABLE',
    );
    await assert.rejects(
      pipeline.cancel(PROJECT, appId, uuidv7()),
      (err: unknown) => err instanceof FerryError && err.code === 'FERRY_BUILD_NOT_FOUND',
    );
  });

  it('leaves a build stopped by close pending and free, and recover() on the next start builds it', async () => {
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake);
    const { appId, newBuild } = await appOf();
    const build = await newBuild();
    fake.steps.set(build.id, 'wait');
    pipeline.enqueue(build);
    await waitFor(async () => fake.events.includes(`build:${build.id}`));
    await pipeline.close();
    const left = await buildRow(build.id);
    assert.equal(left.state, 'pending');
    assert.equal(left.owner, null, 'free for any node');
    const next = fakeBuilder();
    const restarted = pipelineOf(next);
    assert.ok((await restarted.recover()) >= 1);
    assert.equal((await settled(build.id)).state, 'ready');
    assert.equal(await activeOf(appId), build.id);
  });

  it('does not build a build another node holds', async () => {
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake);
    const { appId, newBuild } = await appOf();
    const theirs = await newBuild('node-elsewhere');
    const mine = await newBuild();
    pipeline.enqueue(theirs);
    pipeline.enqueue(mine);
    await settled(mine.id);
    assert.ok(!fake.events.includes(`build:${theirs.id}`));
    assert.equal((await buildRow(theirs.id)).state, 'pending');
    assert.equal(await activeOf(appId), mine.id);
  });

  it("fails a ready build whose schedules would pass the project's limit, and refuses such a rollback", async () => {
    const scheduleLimits = { perApp: 50, perProject: 3 };
    const fake = fakeBuilder();
    const pipeline = pipelineOf(fake, { scheduleLimits });
    const schedulesOf = async (appId: string) =>
      (await store.selectFrom('schedules').select('name').where('app_id', '=', appId).execute()).length;
    // Two apps deployed at once: each upload counted the project without the other's schedules, which only
    // exist once its build is active. Whichever build becomes ready second is refused its activation.
    const x = await appOf();
    const y = await appOf();
    const builds = [await x.newBuild(OWNER, 2), await y.newBuild(OWNER, 2)];
    for (const b of builds) pipeline.enqueue(b);
    const ended = await Promise.all(builds.map((b) => settled(b.id)));
    const won = ended.find((b) => b.state === 'ready');
    const lost = ended.find((b) => b.state === 'failed');
    assert.ok(won && lost, `one ready, one failed: ${ended.map((b) => `${b.state} ${b.error}`).join(', ')}`);
    assert.match(
      lost.error ?? '',
      /^FERRY_PROJECT_SCHEDULES_FULL: The project's other apps have 2 schedules and this one would have 2/,
    );
    assert.match((await logOf(lost.id)).join('\n'), /Build failed: FERRY_PROJECT_SCHEDULES_FULL/);
    assert.equal(await activeOf(won.app_id), won.id);
    assert.equal(await activeOf(lost.app_id), null, 'the refused build did not become active');
    assert.equal(await schedulesOf(won.app_id), 2);
    assert.equal(await schedulesOf(lost.app_id), 0);

    // A rollback is refused the same way, and the app keeps its active build and schedules.
    const loser = lost.app_id === x.appId ? x : y;
    const winner = loser === x ? y : x;
    const one = await loser.newBuild(OWNER, 1);
    pipeline.enqueue(one);
    assert.equal((await settled(one.id)).state, 'ready');
    const none = await loser.newBuild(OWNER, 0);
    pipeline.enqueue(none);
    assert.equal((await settled(none.id)).state, 'ready');
    const three = await winner.newBuild(OWNER, 3);
    pipeline.enqueue(three);
    assert.equal((await settled(three.id)).state, 'ready', 'going from 2 to 3 with none elsewhere fits');
    const activation = createBuildActivation({ store, changes, switchHere: async () => {}, scheduleLimits });
    await assert.rejects(activation.activate(PROJECT, loser.appId, one.id), (err: unknown) => {
      assert.ok(err instanceof FerryError);
      assert.equal(err.code, 'FERRY_PROJECT_SCHEDULES_FULL');
      assert.equal(err.status, 409);
      return true;
    });
    assert.equal(await activeOf(loser.appId), none.id);
    assert.equal(await schedulesOf(loser.appId), 0);
  });
});

function now(): string {
  return new Date().toISOString();
}

/** Polls `check` until it returns a value (bounded generously: the machine may be busy). */
async function waitFor<T>(check: () => Promise<T | undefined | false>, ms = 30_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > end) throw new Error('timed out waiting');
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
