/**
 * `GET /v2/projects/{p}/apps` pages by cursor (issue 31: every list pages by cursor): by name, `limit`
 * apps a page, the next page after `next_after`; without `limit`, every app as before. One app is
 * deployed for real; the others are rows copied from its build (their files are never needed: nothing
 * calls them).
 */
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, startServer, type TestServer } from './helpers/ferry.js';

describe('the apps list', { timeout: 120_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  const list = (query = '') => http(`${server.url}/v2/projects/${auth.projectId}/apps${query}`, { token: auth.token });

  before(async () => {
    server = await startServer({ env: { FERRY_RETENTION_INTERVAL_SECONDS: '0' } });
    auth = await server.bootstrap();
    const build = await deployFiles(server, auth, 'app-c', {
      'ferry.toml': '[app]\nname = "app-c"\n',
      'main.ts': 'export function run() { return 1; }\n',
    });
    const row = await server.services.store
      .selectFrom('builds')
      .selectAll()
      .where('id', '=', build.id)
      .executeTakeFirstOrThrow();
    const now = new Date().toISOString();
    for (const [i, name] of ['app-a', 'app-b', 'app-d', 'app-e'].entries()) {
      const id = `${build.id.slice(0, 24)}${(i + 1).toString(16).padStart(12, '0')}`;
      await server.services.store
        .insertInto('builds')
        .values({ ...row, id, app_id: name })
        .execute();
      await server.services.store
        .insertInto('apps')
        .values({
          id: name,
          project_id: auth.projectId,
          name,
          active_build_id: id,
          scaling_json: null,
          created_at: now,
          updated_at: now,
        })
        .execute();
    }
  });

  after(async () => {
    await server?.close();
  });

  it('pages by name with limit and after, and lists every app without limit', async () => {
    const all = await list();
    assert.equal(all.status, 200, all.text);
    assert.deepEqual(
      all.json.apps.map((a: { id: string }) => a.id),
      ['app-a', 'app-b', 'app-c', 'app-d', 'app-e'],
    );
    assert.equal(all.json.next_after, null);

    const seen: string[] = [];
    let query = '?limit=2';
    for (let page = 0; page < 5; page++) {
      const res = await list(query);
      assert.equal(res.status, 200, res.text);
      for (const a of res.json.apps as Array<{ id: string; latest_build_id: string | null }>) {
        seen.push(a.id);
        assert.ok(a.latest_build_id, `${a.id} has its latest build`);
      }
      if (res.json.next_after === null) break;
      query = `?limit=2&after=${res.json.next_after}`;
    }
    assert.deepEqual(seen, ['app-a', 'app-b', 'app-c', 'app-d', 'app-e']);
    const last = await list('?limit=2&after=app-d');
    assert.deepEqual(
      last.json.apps.map((a: { id: string }) => a.id),
      ['app-e'],
    );
    assert.equal(last.json.next_after, null);
  });

  it('refuses a bad cursor or limit with a 400', async () => {
    for (const query of ['?after=NOT_AN_APP', '?limit=0', '?limit=1001']) {
      const res = await list(query);
      assert.equal(res.status, 400, `${query}: ${res.text}`);
      assert.match(res.json.error.code, /^FERRY_/);
    }
  });
});
