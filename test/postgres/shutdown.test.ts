// test/shutdown.test.ts on the PostgreSQL store, a fresh database for its processes (test/helpers/store.ts),
// nested in a suite so the report tells the two runs apart.
import { describe } from 'node:test';

process.env.FERRY_TEST_STORE = 'postgres';
describe('on PostgreSQL', async () => {
  await import('../shutdown.test.js');
});
