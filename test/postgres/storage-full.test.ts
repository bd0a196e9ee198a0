/**
 * PostgreSQL's disk full (SQLSTATE 53100, issue 43 point 3) answers 507 FERRY_STORAGE_FULL with
 * Retry-After, never 500: a real server on a fresh PostgreSQL database whose `runs` and `secrets` tables
 * get a trigger that raises `disk_full` as PostgreSQL does when it cannot extend a file, for rows above a
 * size (so the same server keeps answering smaller writes). The real driver error, through the real
 * routes: the async run endpoint (one statement, the recorder's group insert) and a management write.
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import pg from 'pg';
import { deployFiles, http, startServer, type TestServer } from '../helpers/ferry.js';

process.env.FERRY_TEST_STORE = 'postgres';

describe('on PostgreSQL: a write refused with 53100 disk_full', () => {
  let server: TestServer | undefined;
  let auth: { projectId: string; token: string };

  before(async () => {
    server = await startServer();
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'echo', {
      'ferry.toml': '[app]\nname = "echo"\n',
      'main.ts': 'export function run({ n = 0 }) { return { n }; }\n',
    });
    const client = new pg.Client({ connectionString: server.databaseUrl });
    await client.connect();
    try {
      await client.query(`
        CREATE FUNCTION ferry_test_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          RAISE EXCEPTION 'could not extend file "base/16384/16390": No space left on device'
            USING ERRCODE = 'disk_full', HINT = 'Check free disk space.';
        END $$;
        CREATE TRIGGER ferry_test_disk_full BEFORE INSERT ON runs FOR EACH ROW
          WHEN (length(NEW.input) > 100000) EXECUTE FUNCTION ferry_test_disk_full();
        CREATE TRIGGER ferry_test_disk_full BEFORE INSERT OR UPDATE ON secrets FOR EACH ROW
          WHEN (NEW.name = 'BIG') EXECUTE FUNCTION ferry_test_disk_full();
      `);
    } finally {
      await client.end();
    }
  });
  after(() => server?.close());

  it('answers an async call 507 FERRY_STORAGE_FULL with Retry-After, and the next call 202', async () => {
    const call = (pad: number) =>
      http(`${server!.url}/v4/${auth.projectId}/echo/run?async=true`, {
        method: 'POST',
        token: auth.token,
        body: { n: 1, pad: 'x'.repeat(pad) },
      });
    const refused = await call(200 * 1024);
    assert.equal(refused.status, 507, refused.text);
    assert.equal(refused.json.error.code, 'FERRY_STORAGE_FULL');
    assert.ok(Number(refused.headers.get('retry-after')) > 0);
    // Nothing was stored: the answer names no run (issue 43 point 9), the request keeps its id.
    assert.equal(refused.json.run_id, undefined);
    assert.ok(refused.headers.get('x-request-id'));
    const accepted = await call(10);
    assert.equal(accepted.status, 202, accepted.text);
  });

  it('answers a management write 507 too', async () => {
    const res = await http(`${server!.url}/v2/projects/${auth.projectId}/secrets/BIG`, {
      method: 'PUT',
      token: auth.token,
      body: { value: 'v' },
    });
    assert.equal(res.status, 507, res.text);
    assert.equal(res.json.error.code, 'FERRY_STORAGE_FULL');
    assert.ok(Number(res.headers.get('retry-after')) > 0);
    const ok = await http(`${server!.url}/v2/projects/${auth.projectId}/secrets/SMALL`, {
      method: 'PUT',
      token: auth.token,
      body: { value: 'v' },
    });
    assert.ok(ok.status < 300, ok.text);
  });
});
