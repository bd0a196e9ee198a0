/**
 * A lock over a budget shared by rows of one table (FERRY_VOLUMES_TOTAL_MIB over `volumes`, and each
 * project's FERRY_MAX_SCHEDULES_PER_PROJECT over its `schedules`), held until the transaction ends, so that two transactions checking "the total plus mine fits" and inserting
 * cannot both pass on a total that holds neither's row.
 *
 * On SQLite every write transaction is `BEGIN IMMEDIATE` (one writer at a time), so the lock is already
 * held; on PostgreSQL it is a transaction-scoped advisory lock on the budget's key (the lock ends with the
 * commit or rollback, and no row has to exist to be locked, as it would for `SELECT … FOR UPDATE`).
 */
import { type Kysely, sql } from 'kysely';
import { dialectOf } from './index.js';
import type { Database } from './schema.js';

/** The budgets with a lock: each its own advisory key (any fixed 64-bit number Ferry does not use elsewhere). */
const BUDGET_KEYS = { volumes_total: 0x4665727279_01 } as const;

export type Budget = keyof typeof BUDGET_KEYS;

/** Locks `budget` until `trx` ends. Call first in the transaction that checks and spends it. */
export async function lockBudget(trx: Kysely<Database>, budget: Budget): Promise<void> {
  if (dialectOf(trx) !== 'postgres') return;
  await sql`select pg_advisory_xact_lock(${BUDGET_KEYS[budget]})`.execute(trx);
}

/**
 * The per-project budgets with a lock: each a class of advisory keys, one key per project (the two-key form
 * of the advisory lock, whose keys never meet the one-key form's above).
 */
const PROJECT_BUDGET_CLASSES = { schedules: 0x46727901 } as const;

export type ProjectBudget = keyof typeof PROJECT_BUDGET_CLASSES;

/**
 * Locks the project's `budget` until `trx` ends. Two projects' hashes may meet: they then wait for each
 * other's (short) transaction, which is harmless.
 */
export async function lockProjectBudget(
  trx: Kysely<Database>,
  budget: ProjectBudget,
  projectId: string,
): Promise<void> {
  if (dialectOf(trx) !== 'postgres') return;
  await sql`select pg_advisory_xact_lock(${PROJECT_BUDGET_CLASSES[budget]}, hashtext(${projectId}))`.execute(trx);
}
