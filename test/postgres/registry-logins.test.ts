// test/registry-logins.test.ts on the PostgreSQL store, a fresh database per server (test/helpers/store.ts),
// nested in a suite so the report tells the two runs apart.
import { describe } from 'node:test';

process.env.FERRY_TEST_STORE = 'postgres';
describe('on PostgreSQL', async () => {
  await import('../registry-logins.test.js');
});
