/**
 * The app row as the lock over its active build. Whatever changes `apps.active_build_id` (activating a
 * build, a build becoming ready) or deletes a build takes the app's row first, inside its transaction, so
 * an activation and a delete of the same build never interleave: without it, on PostgreSQL, a delete could
 * check "not active", an activation commit, and the delete then remove the build the app now points at.
 *
 * On SQLite every write transaction is `BEGIN IMMEDIATE` (one writer at a time), so the lock is already held;
 * on PostgreSQL it is a `SELECT … FOR UPDATE` of the app's row.
 */
import type { Kysely } from 'kysely';
import { dialectOf } from './index.js';
import type { Database } from './schema.js';

/** Locks the app's row until the transaction ends and reads its active build (undefined: no such app). */
export async function lockApp(
  trx: Kysely<Database>,
  projectId: string,
  appId: string,
): Promise<{ active_build_id: string | null } | undefined> {
  let query = trx
    .selectFrom('apps')
    .select('active_build_id')
    .where('project_id', '=', projectId)
    .where('id', '=', appId);
  if (dialectOf(trx) === 'postgres') query = query.forUpdate();
  return query.executeTakeFirst();
}
