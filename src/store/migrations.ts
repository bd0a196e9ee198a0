/**
 * Schema migrations, in code, applied in order by Kysely's Migrator at start.
 *
 * Written with Kysely's schema builder and portable types only, so the same migrations create the
 * PostgreSQL schema when Ferry is scaled out. Never edit a released migration: add a new one. A migration
 * that must differ on PostgreSQL asks `isPostgres` (this folder is the only place allowed to).
 */
import { type Kysely, type Migration, type MigrationProvider, PostgresAdapter, sql } from 'kysely';

const migrations: Record<string, Migration> = {
  '0001_initial': {
    async up(db: Kysely<unknown>) {
      await db.schema
        .createTable('projects')
        .addColumn('id', 'text', (c) => c.primaryKey())
        .addColumn('name', 'text', (c) => c.notNull().unique())
        .addColumn('created_at', 'text', (c) => c.notNull())
        .execute();

      await db.schema
        .createTable('service_accounts')
        .addColumn('id', 'text', (c) => c.primaryKey())
        .addColumn('project_id', 'text', (c) => c.notNull().references('projects.id'))
        .addColumn('name', 'text', (c) => c.notNull())
        .addColumn('scopes', 'text', (c) => c.notNull())
        .addColumn('token_id', 'text', (c) => c.notNull().unique())
        .addColumn('token_hash', 'text', (c) => c.notNull())
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('expires_at', 'text', (c) => c.notNull())
        .addColumn('revoked_at', 'text')
        .addColumn('last_used_at', 'text')
        .execute();
      await db.schema.createIndex('service_accounts_project').on('service_accounts').column('project_id').execute();

      await db.schema
        .createTable('apps')
        .addColumn('project_id', 'text', (c) => c.notNull().references('projects.id'))
        .addColumn('id', 'text', (c) => c.notNull())
        .addColumn('name', 'text', (c) => c.notNull())
        .addColumn('active_build_id', 'text')
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('updated_at', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('apps_pk', ['project_id', 'id'])
        .execute();

      await db.schema
        .createTable('builds')
        .addColumn('id', 'text', (c) => c.primaryKey())
        .addColumn('project_id', 'text', (c) => c.notNull())
        .addColumn('app_id', 'text', (c) => c.notNull())
        .addColumn('state', 'text', (c) => c.notNull())
        .addColumn('config_toml', 'text', (c) => c.notNull())
        .addColumn('config_json', 'text', (c) => c.notNull())
        .addColumn('runtime', 'text')
        .addColumn('entry', 'text')
        .addColumn('archive_bytes', 'bigint', (c) => c.notNull())
        .addColumn('file_count', 'integer', (c) => c.notNull())
        .addColumn('error', 'text')
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('started_at', 'text')
        .addColumn('finished_at', 'text')
        .execute();
      await db.schema.createIndex('builds_app').on('builds').columns(['project_id', 'app_id', 'created_at']).execute();
      await db.schema.createIndex('builds_state').on('builds').column('state').execute();

      await db.schema
        .createTable('build_log_lines')
        .addColumn('build_id', 'text', (c) => c.notNull())
        .addColumn('seq', 'integer', (c) => c.notNull())
        .addColumn('at', 'text', (c) => c.notNull())
        .addColumn('line', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('build_log_lines_pk', ['build_id', 'seq'])
        .execute();

      await db.schema
        .createTable('runs')
        .addColumn('id', 'text', (c) => c.primaryKey())
        .addColumn('project_id', 'text', (c) => c.notNull())
        .addColumn('app_id', 'text', (c) => c.notNull())
        .addColumn('build_id', 'text')
        .addColumn('function_name', 'text', (c) => c.notNull())
        .addColumn('mode', 'text', (c) => c.notNull())
        .addColumn('state', 'text', (c) => c.notNull())
        .addColumn('status_code', 'integer')
        .addColumn('input', 'text')
        .addColumn('result', 'text')
        .addColumn('error_code', 'text')
        .addColumn('error_message', 'text')
        .addColumn('reason', 'text')
        .addColumn('cold_start', 'integer', (c) => c.notNull().defaultTo(0))
        .addColumn('webhook_endpoint', 'text')
        .addColumn('webhook_secret', 'text')
        .addColumn('idempotency_key', 'text')
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('started_at', 'text')
        .addColumn('finished_at', 'text')
        .addColumn('run_time_ms', 'integer')
        .execute();
      await db.schema.createIndex('runs_app').on('runs').columns(['project_id', 'app_id', 'id']).execute();
      await db.schema.createIndex('runs_state').on('runs').columns(['state', 'mode']).execute();

      await db.schema
        .createTable('run_log_lines')
        .addColumn('run_id', 'text', (c) => c.notNull())
        .addColumn('seq', 'integer', (c) => c.notNull())
        .addColumn('at', 'text', (c) => c.notNull())
        .addColumn('stream', 'text', (c) => c.notNull())
        .addColumn('line', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('run_log_lines_pk', ['run_id', 'seq'])
        .execute();

      await db.schema
        .createTable('webhook_deliveries')
        .addColumn('run_id', 'text', (c) => c.primaryKey())
        .addColumn('url', 'text', (c) => c.notNull())
        .addColumn('payload', 'text', (c) => c.notNull())
        .addColumn('state', 'text', (c) => c.notNull())
        .addColumn('attempts', 'integer', (c) => c.notNull().defaultTo(0))
        .addColumn('next_attempt_at', 'text')
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('updated_at', 'text', (c) => c.notNull())
        .execute();
      await db.schema
        .createIndex('webhook_deliveries_due')
        .on('webhook_deliveries')
        .columns(['state', 'next_attempt_at'])
        .execute();

      await db.schema
        .createTable('webhook_attempts')
        .addColumn('run_id', 'text', (c) => c.notNull())
        .addColumn('attempt', 'integer', (c) => c.notNull())
        .addColumn('at', 'text', (c) => c.notNull())
        .addColumn('status_code', 'integer')
        .addColumn('error', 'text')
        .addColumn('duration_ms', 'integer', (c) => c.notNull())
        .addPrimaryKeyConstraint('webhook_attempts_pk', ['run_id', 'attempt'])
        .execute();

      await db.schema
        .createTable('secrets')
        .addColumn('project_id', 'text', (c) => c.notNull())
        .addColumn('name', 'text', (c) => c.notNull())
        .addColumn('value', 'text', (c) => c.notNull())
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('updated_at', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('secrets_pk', ['project_id', 'name'])
        .execute();
    },
  },
  '0002_build_functions': {
    async up(db: Kysely<unknown>) {
      // JSON array of the exported names found at build time; null when the builder cannot tell.
      await db.schema.alterTable('builds').addColumn('functions', 'text').execute();
    },
  },
  '0003_idempotency': {
    async up(db: Kysely<unknown>) {
      // One run per Idempotency-Key per app; NULL keys do not collide (SQLite and PostgreSQL alike).
      await db.schema
        .createIndex('runs_idempotency')
        .on('runs')
        .columns(['project_id', 'app_id', 'idempotency_key'])
        .unique()
        .execute();
    },
  },
  '0004_http_request': {
    async up(db: Kysely<unknown>) {
      // Custom-runtime runs: the HTTP request to forward ({method, path, headers, body_base64}), kept until
      // an async run has been performed; null for cortex runs.
      await db.schema.alterTable('runs').addColumn('http_request', 'text').execute();
    },
  },
  '0005_runs_project_backlog': {
    async up(db: Kysely<unknown>) {
      // The per-project async backlog counts a project's queued and running runs on the run endpoint.
      await db.schema.createIndex('runs_project_state').on('runs').columns(['project_id', 'state', 'mode']).execute();
    },
  },
  '0006_leases': {
    async up(db: Kysely<unknown>) {
      // Every Ferry process sharing the store is a node with a lease it renews; work it holds (an async run
      // it claimed or runs, a webhook attempt it sends, a build it builds) names it as `owner`. Work whose
      // owner's lease ran out is taken over; nothing is reset at start.
      await db.schema
        .createTable('nodes')
        .addColumn('id', 'text', (c) => c.primaryKey())
        .addColumn('started_at', 'text', (c) => c.notNull())
        .addColumn('lease_until', 'text', (c) => c.notNull())
        .addColumn('info', 'text', (c) => c.notNull())
        .execute();
      await db.schema.alterTable('runs').addColumn('owner', 'text').execute();
      // How many times the run was started (an interrupted async run may start again, see retry_interrupted).
      await db.schema
        .alterTable('runs')
        .addColumn('attempts', 'integer', (c) => c.notNull().defaultTo(0))
        .execute();
      await db.schema.createIndex('runs_owner_state').on('runs').columns(['owner', 'state']).execute();
      await db.schema.alterTable('webhook_deliveries').addColumn('owner', 'text').execute();
      await db.schema.alterTable('builds').addColumn('owner', 'text').execute();
    },
  },
  '0007_postgres_byte_order': {
    async up(db: Kysely<unknown>) {
      // SQLite compares text by bytes (BINARY); PostgreSQL by the database's collation, which is whatever
      // the cluster was created with (en_US.UTF-8 on many hosts, where '-' is ignored and 'a' < 'B'). Ferry
      // pages and claims with `id < before`, `next_attempt_at <= now` and ORDER BY on text ids, timestamps
      // and names, and must mean the same on both stores, whatever the locale: every text column of
      // Ferry's tables compares by bytes ("C", which also makes comparisons plain memcmp). A text column
      // added by a later migration needs COLLATE "C" on PostgreSQL too (test/store-collation.test.ts).
      if (!isPostgres(db)) return;
      const { rows } = await sql<{ table_name: string; column_name: string }>`
        select table_name, column_name from information_schema.columns
        where table_schema = current_schema() and data_type = 'text'
          and table_name not in ('kysely_migration', 'kysely_migration_lock')
          and collation_name is distinct from 'C'
        order by table_name, ordinal_position`.execute(db);
      const byTable = new Map<string, string[]>();
      for (const r of rows) byTable.set(r.table_name, [...(byTable.get(r.table_name) ?? []), r.column_name]);
      for (const [table, columns] of byTable) {
        const changes = columns.map((c) => sql`alter column ${sql.ref(c)} type text collate "C"`);
        await sql`alter table ${sql.table(table)} ${sql.join(changes)}`.execute(db);
      }
    },
  },
  '0008_run_publishing': {
    async up(db: Kysely<unknown>) {
      // With --nats-url, an accepted async run is published to the JetStream runs stream after its insert.
      // `published_at`: when a message of it was last known to be in the stream (null: none is, or not
      // known: the relay publishes it); `publishes`: how many times the relay published it, which names the
      // message (`<run id>.<publishes>`) so a republish is not dropped as a duplicate of an earlier message.
      await db.schema.alterTable('runs').addColumn('published_at', 'text').execute();
      if (isPostgres(db)) await sql`alter table runs alter column published_at type text collate "C"`.execute(db);
      await db.schema
        .alterTable('runs')
        .addColumn('publishes', 'integer', (c) => c.notNull().defaultTo(0))
        .execute();
      // What the relay looks for: queued runs with no known message (few at any time: the index stays small).
      await sql`create index runs_unpublished on runs (created_at) where published_at is null and state = 'queued'`.execute(
        db,
      );
    },
  },
  '0009_app_scaling': {
    async up(db: Kysely<unknown>) {
      // `PATCH /v2/projects/{p}/apps/{a}` with {"scaling": {...}}: keys of [scaling] that override those of
      // every build's ferry.toml until cleared (JSON object; null: none).
      await db.schema.alterTable('apps').addColumn('scaling_json', 'text').execute();
      if (isPostgres(db)) await sql`alter table apps alter column scaling_json type text collate "C"`.execute(db);
    },
  },
  '0010_runs_partial_indexes': {
    async up(db: Kysely<unknown>) {
      // The indexes over runs' state serve only questions about unfinished runs (claims, recovery, the
      // project backlog), yet held every run ever made, and every run's end moved its entries: each is
      // now kept for queued and running runs only, so a run's end only removes entries and the indexes stay
      // small. SQLite uses such an index only for a query with this very term (`state in ('queued',
      // 'running')`, written out, not bound): store/unfinished.ts makes it for the queries that need it.
      for (const [name, columns] of [
        // With `owner`: a claim looks for free queued runs (owner null), not at every queued and running one.
        ['runs_state', 'state, mode, owner'],
        ['runs_project_state', 'project_id, state, mode'],
        ['runs_owner_state', 'owner, state'],
      ] as const) {
        await sql`drop index ${sql.ref(name)}`.execute(db);
        await sql`create index ${sql.ref(name)} on runs (${sql.raw(columns)}) where state in ('queued', 'running')`.execute(
          db,
        );
      }
      // The relay (--nats-url) looks only for runs nobody holds: a run held from its insert (the store queue's
      // runs, accepted by a node with room) never needs to be in its index.
      await sql`drop index runs_unpublished`.execute(db);
      await sql`create index runs_unpublished on runs (created_at) where published_at is null and state = 'queued' and owner is null`.execute(
        db,
      );
      // Most runs have no Idempotency-Key, and NULL keys never collided: only keys are kept. The uniqueness is
      // the same, and `idempotency_key = ?` implies the index's condition on both stores.
      await sql`drop index runs_idempotency`.execute(db);
      await sql`create unique index runs_idempotency on runs (project_id, app_id, idempotency_key) where idempotency_key is not null`.execute(
        db,
      );
    },
  },
  '0011_run_log_stats': {
    async up(db: Kysely<unknown>) {
      // Per run with log lines: the bytes of its stored lines (what the project's log budget counts,
      // apps/housekeeping.ts), and what was dropped: past the per-run bound (FERRY_RUN_LOG_BYTES, the
      // recorder) or removed by the project's budget (FERRY_PROJECT_LOG_BYTES). A row of its own, not
      // columns of runs: only runs that print have one, and the hot insert of run records stays as it is.
      await db.schema
        .createTable('run_log_stats')
        .addColumn('run_id', 'text', (c) => c.primaryKey())
        .addColumn('bytes', 'bigint', (c) => c.notNull())
        .addColumn('dropped_lines', 'bigint', (c) => c.notNull())
        .addColumn('dropped_bytes', 'bigint', (c) => c.notNull())
        .execute();
      if (isPostgres(db)) await sql`alter table run_log_stats alter column run_id type text collate "C"`.execute(db);
    },
  },
  '0012_volumes': {
    async up(db: Kysely<unknown>) {
      // A project's volumes (src/volumes/): the name, the size its filesystem image was made with, and the
      // host group that owns its files (every replica mounting it gets that group; unique over all volumes).
      await db.schema
        .createTable('volumes')
        .addColumn('project_id', 'text', (c) => c.notNull().references('projects.id'))
        .addColumn('name', 'text', (c) => c.notNull())
        .addColumn('size_mib', 'integer', (c) => c.notNull())
        .addColumn('gid', 'bigint', (c) => c.notNull().unique())
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('volumes_pk', ['project_id', 'name'])
        .execute();
      if (isPostgres(db)) {
        await sql`alter table volumes alter column project_id type text collate "C", alter column name type text collate "C", alter column created_at type text collate "C"`.execute(
          db,
        );
      }
    },
  },
  '0013_schedules_retries': {
    async up(db: Kysely<unknown>) {
      // `[[schedules]]` of the active build of each app (src/schedules/): replaced when a build becomes
      // active, paused and resumed by the API. `next_tick_at` is the next due tick; a node advances it with
      // a compare-and-set after the tick's run is inserted, and the run's idempotency key names the tick, so
      // nodes racing on one tick, or a node killed between the two statements, give one run per tick.
      await db.schema
        .createTable('schedules')
        .addColumn('app_id', 'text', (c) => c.notNull())
        .addColumn('name', 'text', (c) => c.notNull())
        .addColumn('project_id', 'text', (c) => c.notNull())
        .addColumn('build_id', 'text', (c) => c.notNull())
        .addColumn('cron', 'text', (c) => c.notNull())
        .addColumn('timezone', 'text', (c) => c.notNull())
        .addColumn('function_name', 'text', (c) => c.notNull())
        .addColumn('args', 'text', (c) => c.notNull())
        .addColumn('webhook_endpoint', 'text')
        .addColumn('overlap', 'text', (c) => c.notNull())
        .addColumn('paused', 'integer', (c) => c.notNull().defaultTo(0))
        .addColumn('next_tick_at', 'text', (c) => c.notNull())
        .addColumn('last_tick_at', 'text')
        .addColumn('last_run_id', 'text')
        .addColumn('ticks_skipped', 'bigint', (c) => c.notNull().defaultTo(0))
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('updated_at', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('schedules_pk', ['project_id', 'app_id', 'name'])
        .execute();
      await sql`create index schedules_due on schedules (next_tick_at) where paused = 0`.execute(db);
      // A run's origin: `trigger` null for a call, 'schedule' for a tick (with the schedule's name and the
      // tick's time), 'retry' for `runs retry` (with the run it repeats). `not_before`: a queued run waiting
      // for its next attempt's delay is not claimed or published before it. `dead`: 1 for a run that ended
      // after exhausting its retry attempts.
      for (const column of ['trigger', 'schedule_name', 'scheduled_for', 'retry_of', 'not_before'])
        await db.schema.alterTable('runs').addColumn(column, 'text').execute();
      await db.schema.alterTable('runs').addColumn('dead', 'integer').execute();
      // The attempts of a run under a retry policy that have ended, as a JSON array (null for a run with one
      // attempt, nearly all): written with the run's other changes when an attempt ends, read with its call.
      await db.schema.alterTable('runs').addColumn('attempt_log', 'text').execute();
      if (isPostgres(db)) {
        for (const [table, columns] of [
          [
            'schedules',
            [
              'app_id',
              'name',
              'project_id',
              'build_id',
              'cron',
              'timezone',
              'function_name',
              'args',
              'webhook_endpoint',
              'overlap',
              'next_tick_at',
              'last_tick_at',
              'last_run_id',
              'created_at',
              'updated_at',
            ],
          ],
          ['runs', ['trigger', 'schedule_name', 'scheduled_for', 'retry_of', 'not_before', 'attempt_log']],
        ] as const) {
          const changes = columns.map((c) => sql`alter column ${sql.ref(c)} type text collate "C"`);
          await sql`alter table ${sql.table(table)} ${sql.join(changes)}`.execute(db);
        }
      }
    },
  },
  '0014_build_images': {
    async up(db: Kysely<unknown>) {
      // A build of an app with `[image]`: the manifest digest of the image its replicas run on, and what they
      // need of it (images/build-image.ts `BuildImageRecord`, JSON: the reference pinned by digest, the run
      // config, the environment, the custom runtime's command and port). Null for a host-runtime build.
      await db.schema.alterTable('builds').addColumn('image_digest', 'text').execute();
      await db.schema.alterTable('builds').addColumn('image_json', 'text').execute();
      if (isPostgres(db)) {
        await sql`alter table builds alter column image_digest type text collate "C", alter column image_json type text collate "C"`.execute(
          db,
        );
      }
    },
  },
  '0015_volume_backends': {
    async up(db: Kysely<unknown>) {
      // Which backend made each volume (FERRY_VOLUMES_BACKEND; null: `image`, every volume made before this),
      // so a server with the other backend refuses it by name rather than looking for what is not there; and
      // the quota id a `quota-dir` volume's folder is bounded by (its XFS project id, its btrfs qgroup 1/<id>),
      // chosen like the gid and unique over all volumes.
      await db.schema.alterTable('volumes').addColumn('backend', 'text').execute();
      await db.schema.alterTable('volumes').addColumn('quota_id', 'bigint').execute();
      await db.schema.createIndex('volumes_quota_id').on('volumes').column('quota_id').unique().execute();
      if (isPostgres(db)) await sql`alter table volumes alter column backend type text collate "C"`.execute(db);
    },
  },
  '0016_scale_indexes': {
    async up(db: Kysely<unknown>) {
      // The list of an app's runs filtered by a state other than success, or by `dead`, scanned the app's
      // runs newest first until it had a page: with a million runs, an app with no queued run (or whose
      // runs rarely fail, or never died) was read whole for one page (bench:scale, issue 31). Partial
      // indexes hold only those runs, so a run that succeeds at once (a sync run is written once, ended)
      // costs no more to write; a list names their condition (store/unfinished.ts). runs_project_state
      // (0010) has the unfinished ones, but without the app SQLite prefers to scan runs_app in order.
      await sql`create index runs_app_state on runs (project_id, app_id, state, id) where state <> 'success'`.execute(
        db,
      );
      await sql`create index runs_app_dead on runs (project_id, app_id, id) where dead = 1`.execute(db);
      // The webhook deliverer erases the secrets of runs that ended a week ago without a delivery, at start
      // and every hour: a scan of every run (334 ms of a blocked event loop at a million, on SQLite). Only
      // runs that still hold a secret are here (its condition is the query's own term).
      await sql`create index runs_webhook_secret on runs (finished_at) where webhook_secret is not null`.execute(db);
    },
  },
  '0017_registry_logins': {
    async up(db: Kysely<unknown>) {
      // A project's credentials for a private registry (images/registry-logins.ts, issue 43): its pulls send
      // them, no other project's do. A table of their own, not rows of `secrets`, so that nothing that reads
      // secrets (a replica's environment, the secrets list) can come across one; the password is ciphertext.
      await db.schema
        .createTable('registry_logins')
        .addColumn('project_id', 'text', (c) => c.notNull().references('projects.id'))
        .addColumn('registry', 'text', (c) => c.notNull())
        .addColumn('username', 'text', (c) => c.notNull())
        .addColumn('password', 'text', (c) => c.notNull())
        .addColumn('created_at', 'text', (c) => c.notNull())
        .addColumn('updated_at', 'text', (c) => c.notNull())
        .addPrimaryKeyConstraint('registry_logins_pk', ['project_id', 'registry'])
        .execute();
      if (isPostgres(db)) {
        const changes = ['project_id', 'registry', 'username', 'password', 'created_at', 'updated_at'].map(
          (c) => sql`alter column ${sql.ref(c)} type text collate "C"`,
        );
        await sql`alter table registry_logins ${sql.join(changes)}`.execute(db);
      }
    },
  },
};

/** Whether a migration runs on PostgreSQL (the adapter tells, on the migrator's transaction too). */
function isPostgres(db: Kysely<unknown>): boolean {
  return db.getExecutor().adapter instanceof PostgresAdapter;
}

/** Hands Kysely's Migrator the migrations above. */
export const migrationProvider: MigrationProvider = {
  async getMigrations() {
    return migrations;
  },
};
