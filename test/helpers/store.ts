/**
 * Which store the tests run on, and a fresh one per use.
 *
 * `FERRY_TEST_STORE` picks it: `sqlite` (the default: a ferry.db in the test's data dir) or `postgres` (a
 * fresh database `ferry_t_<random hex>` on the PostgreSQL at `FERRY_TEST_PG_ADMIN_URL`, default
 * postgres://postgres@127.0.0.1:5432/postgres, created here and dropped when the test is done). The files
 * under test/postgres/ set it to `postgres` and import a test file, so one `node --test` run covers both.
 * When PostgreSQL cannot be reached the tests fail with a message saying so; they never skip.
 *
 * A fresh database is a copy of a pre-migrated template, `ferry_template_<hash of the compiled
 * migrations>`, made once per migration set by whichever test process needs it first (a few hundred
 * milliseconds of migrations per database otherwise, on every server a PostgreSQL test starts). Ferry
 * still runs its migrator at open, which finds nothing to do. The migrations from an empty database stay
 * covered: `{ icuLocale }` databases (test/store-collation) and the cluster tests' databases
 * (test/helpers/fleet.ts) start empty.
 */
import { createHash, randomBytes } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import pg from 'pg';
import type { Store } from '../../src/store/index.js';
import { withoutPassword } from '../../src/store/outage.js';

export type TestStoreKind = 'sqlite' | 'postgres';

export const DEFAULT_PG_ADMIN_URL = 'postgres://postgres@127.0.0.1:5432/postgres';

/** The store this test process runs on, from `FERRY_TEST_STORE` (read at each call). */
export function testStoreKind(): TestStoreKind {
  const value = process.env.FERRY_TEST_STORE || 'sqlite';
  if (value !== 'sqlite' && value !== 'postgres')
    throw new Error(`FERRY_TEST_STORE must be sqlite or postgres, not "${value}"`);
  return value;
}

/** The URL of a database to create the test databases from (any database the user may connect to). */
export function pgAdminUrl(): string {
  return process.env.FERRY_TEST_PG_ADMIN_URL || DEFAULT_PG_ADMIN_URL;
}

export interface TestDatabase {
  /** The new database's name, `ferry_t_<hex>`. */
  name: string;
  /** A postgres:// URL of the new database, for `databaseUrl` or `FERRY_DATABASE_URL`. */
  url: string;
  /** Drops the database, closing whatever connections are still open to it. Safe to call twice. */
  drop(): Promise<void>;
}

/** Runs `fn` with one client connected to the admin URL. */
export async function withAdminClient<T>(fn: (client: pg.Client) => Promise<T>): Promise<T> {
  const adminUrl = pgAdminUrl();
  const client = new pg.Client({ connectionString: adminUrl, connectionTimeoutMillis: 10_000 });
  // A server that terminates this connection must not crash the test process.
  client.on('error', () => {});
  try {
    await client.connect();
  } catch (err) {
    throw new Error(
      `FERRY_TEST_STORE=postgres needs a PostgreSQL at ${withoutPassword(adminUrl)} (FERRY_TEST_PG_ADMIN_URL), and it ` +
        `cannot be reached: ${(err as Error).message}. Start it with: bash scripts/start-services.sh`,
      { cause: err },
    );
  }
  try {
    return await fn(client);
  } finally {
    await client.end().catch(() => {});
  }
}

export interface CreateTestDatabaseOptions {
  /**
   * An ICU locale for the database's default collation (e.g. `en-US`), to run Ferry on a database whose
   * text order is not byte order; default: the server's default (this machine's: C.UTF-8).
   */
  icuLocale?: string;
}

/** The URL of database `name` on the admin URL's server. */
function databaseUrl(name: string): string {
  const url = new URL(pgAdminUrl());
  url.pathname = `/${name}`;
  return url.toString();
}

/** PostgreSQL's error code, if `err` is an error the server sent. */
function pgCode(err: unknown): string | undefined {
  return (err as { code?: unknown })?.code === undefined ? undefined : String((err as { code: unknown }).code);
}

/** Runs `statement` on the admin connection, again while a session still leaving `database` is in the way. */
async function adminStatement(statement: string): Promise<void> {
  for (let attempt = 0; ; attempt++) {
    try {
      await withAdminClient((client) => client.query(statement));
      return;
    } catch (err) {
      // 55006: "database is being accessed by other users", a backend of a pool just closed still exiting.
      if (pgCode(err) !== '55006' || attempt >= 50) throw err;
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
}

let template: Promise<string> | undefined;

/**
 * The name of the pre-migrated template database for the migrations this build has, made if missing.
 * Several test processes may race to make it: each migrates a database of its own and renames it to the
 * template's name, which succeeds for one (a rename is atomic); the others drop theirs. Nobody connects to
 * the template (connections are disallowed on it), so copying it never finds it in use.
 */
function migratedTemplate(): Promise<string> {
  if (template) return template;
  template = (async () => {
    const migrations = await readFile(new URL('../../src/store/migrations.js', import.meta.url));
    const name = `ferry_template_${createHash('sha256').update(migrations).digest('hex').slice(0, 16)}`;
    const found = await withAdminClient((client) =>
      client.query('select 1 from pg_database where datname = $1', [name]),
    );
    if (found.rowCount) return name;
    const building = `ferry_tb_${randomBytes(6).toString('hex')}`;
    await adminStatement(`CREATE DATABASE "${building}"`);
    try {
      const { openPostgresStore } = await import('../../src/store/index.js');
      const store = await openPostgresStore({ databaseUrl: databaseUrl(building), poolSize: 1 });
      await store.destroy();
      await adminStatement(`ALTER DATABASE "${building}" WITH ALLOW_CONNECTIONS false`);
      try {
        await adminStatement(`ALTER DATABASE "${building}" RENAME TO "${name}"`);
      } catch (err) {
        // 42P04: another process made the template first; theirs is the same schema.
        if (pgCode(err) !== '42P04') throw err;
      }
    } finally {
      await adminStatement(`DROP DATABASE IF EXISTS "${building}" WITH (FORCE)`);
    }
    return name;
  })();
  // A failure (PostgreSQL unreachable) is reported by this call, and the next call tries again.
  template.catch(() => {
    template = undefined;
  });
  return template;
}

/**
 * Creates a fresh database: a copy of the pre-migrated template, or (with `icuLocale`) an empty database
 * of that collation, migrated when a store opens it.
 */
export async function createTestDatabase(options: CreateTestDatabaseOptions = {}): Promise<TestDatabase> {
  const name = `ferry_t_${randomBytes(6).toString('hex')}`;
  const from = options.icuLocale
    ? ` TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE '${options.icuLocale.replace(/[^A-Za-z0-9@=;_-]/g, '')}'`
    : ` TEMPLATE "${await migratedTemplate()}"`;
  await adminStatement(`CREATE DATABASE "${name}"${from}`);
  let dropped: Promise<void> | undefined;
  return {
    name,
    url: databaseUrl(name),
    drop() {
      dropped ??= withAdminClient(async (client) => {
        await client.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
      });
      return dropped;
    },
  };
}

export interface TestStore {
  store: Store;
  kind: TestStoreKind;
  /** The PostgreSQL database's URL (undefined on SQLite). */
  databaseUrl: string | undefined;
  /** Closes the store and, on PostgreSQL, drops its database. */
  close(): Promise<void>;
}

/**
 * Opens a store of the kind under test for a test that uses one directly: SQLite in `dataDir`, or
 * PostgreSQL in a fresh database (created with `options`).
 */
export async function openTestStore(dataDir: string, options: CreateTestDatabaseOptions = {}): Promise<TestStore> {
  if (testStoreKind() === 'sqlite') {
    const { openSqliteStore } = await import('../../src/store/index.js');
    const store = await openSqliteStore({ dataDir });
    return { store, kind: 'sqlite', databaseUrl: undefined, close: () => store.destroy() };
  }
  const database = await createTestDatabase(options);
  let store: Store;
  try {
    const { openPostgresStore } = await import('../../src/store/index.js');
    store = await openPostgresStore({ databaseUrl: database.url });
  } catch (err) {
    await database.drop();
    throw err;
  }
  return {
    store,
    kind: 'postgres',
    databaseUrl: database.url,
    async close() {
      await store.destroy();
      await database.drop();
    },
  };
}
