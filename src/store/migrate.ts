/** Brings a store's schema up to date with the migrations in migrations.ts (both dialects). */
import { type Kysely, Migrator } from 'kysely';
import { migrationProvider } from './migrations.js';
import type { Database } from './schema.js';

export async function migrate(db: Kysely<Database>): Promise<void> {
  const migrator = new Migrator({ db, provider: migrationProvider });
  const { error, results } = await migrator.migrateToLatest();
  const failed = results?.find((r) => r.status === 'Error');
  if (error || failed) {
    const reason = error instanceof Error ? error.message : String(error ?? failed?.migrationName);
    throw new Error(`Store migration failed: ${reason}`, { cause: error });
  }
}
