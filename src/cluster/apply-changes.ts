/**
 * What this process does when a change reaches it through the change feed (change-feed.ts), whichever
 * process made it: the same as the process that made it does, so every process acts alike.
 *
 * - a service account changed: forget every cached token check (auth), so a revoked token is refused;
 * - a build activated (a deploy, or a rollback to an earlier build): forget the app's cached run target
 *   and switch its replicas to the build now (old replicas drain; an app scaled to zero switches on its
 *   next run);
 * - an app changed (its scaling, through the API): the same; its replicas take the new scaling in place;
 * - a run cancelled: the process performing it stops it (invoke.ts cancel);
 * - an app deleted: forget its run target (its calls get 404), stop its replicas once their runs are
 *   done, drop its queue consumer; a build deleted (alone, or one event per build of a deleted app): the
 *   local copy, at once or when the last replica running it stops;
 * - a build queued by a gateway (which builds nothing): a process that builds claims it;
 * - a project's secrets changed: nothing to forget. Replicas read the project's secrets from the store
 *   when they start, so new replicas get the change and running ones keep the environment they started
 *   with until they are replaced (as on one process: see the secrets routes);
 * - resync (the feed may have lost events): all of the above for everything this process holds.
 */
import type { Logger } from 'pino';
import { volumesOf } from '../apps/app-config.js';
import type { Authenticator } from '../auth/authenticate.js';
import type { ReplicaManager } from '../replicas/manager.js';
import type { RunTargets } from '../runs/targets.js';
import type { ChangeFeed, FeedEvent } from './change-feed.js';

export interface ApplyChangesDeps {
  auth: Pick<Authenticator, 'invalidate'>;
  runTargets: Pick<RunTargets, 'forget'>;
  replicas: Pick<ReplicaManager, 'activate' | 'pools' | 'warmUp'>;
  /** Set on processes that build (worker, all): claims builds left free by a gateway. */
  claimBuilds?: () => void;
  /** Cancels a run this process performs (POST .../runs/{run_id}/cancel made on any process). */
  cancelRun?: (runId: string) => void;
  /** The app was deleted: stop its replicas, drop its queue, remove local copies of its builds. */
  deleteApp?: (projectId: string, appId: string) => void;
  /** Stops the app's replicas here (they take no new runs; the next call starts new ones). */
  stopApp?: (projectId: string, appId: string, reason: string) => void;
  /** A build was deleted (alone, or with its app): remove the local copy once no replica here runs it. */
  buildDeleted?: (buildId: string) => void;
  logger: Logger;
}

/** Subscribes this process's caches and replicas to `feed`; returns the function that stops it. */
export function applyChanges(feed: ChangeFeed, deps: ApplyChangesDeps): () => void {
  const { auth, runTargets, replicas, logger } = deps;

  function activate(projectId: string, appId: string): void {
    runTargets.forget(projectId, appId);
    void replicas.activate(projectId, appId).catch((err: unknown) => {
      logger.error({ err, project: projectId, app: appId }, 'switching replicas to the new build failed');
    });
  }

  return feed.subscribe(function onChange(event: FeedEvent) {
    switch (event.type) {
      case 'service-account.changed':
        auth.invalidate();
        return;
      case 'build.activated':
      case 'app.changed':
        activate(event.projectId, event.appId);
        return;
      case 'secrets.changed':
        return;
      case 'build.queued':
        deps.claimBuilds?.();
        return;
      case 'run.cancel':
        deps.cancelRun?.(event.runId);
        return;
      case 'app.deleted':
        runTargets.forget(event.projectId, event.appId);
        deps.deleteApp?.(event.projectId, event.appId);
        return;
      case 'build.deleted':
        deps.buildDeleted?.(event.buildId);
        return;
      case 'volume.deleted': {
        // The replicas binding it would go on writing into a filesystem that no longer has a name.
        const apps = new Set<string>();
        for (const pool of replicas.pools()) {
          const { projectId, appId, config } = pool.build;
          if (projectId !== event.projectId) continue;
          if (volumesOf(config).some((v) => v.name === event.volume)) apps.add(appId);
        }
        for (const appId of apps)
          deps.stopApp?.(event.projectId, appId, `volume ${event.volume} was deleted (force=true)`);
        return;
      }
      case 'resync': {
        auth.invalidate();
        // Apps with replicas here switch if their active build changed; run targets of other apps
        // expire within a second on their own; warmUp starts (on the newest build) apps with a minimum.
        const apps = new Map(replicas.pools().map((p) => [`${p.build.projectId}/${p.build.appId}`, p.build]));
        for (const build of apps.values()) activate(build.projectId, build.appId);
        void replicas.warmUp().catch((err: unknown) => logger.error({ err }, 'warming replicas after a resync failed'));
        return;
      }
    }
  });
}
