/**
 * The auth matrix (spec section 5, invariant 3) on a management route and on zip-contents: no token,
 * malformed, bad signature, expired, revoked, other project, missing scope.
 * The management routes in-process (`server.inject`), the run endpoint over the socket.
 */
import assert from 'node:assert/strict';
import { randomBytes, randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { createSignInSession } from '../src/auth/sessions.js';
import { signToken } from '../src/auth/tokens.js';
import { helloApp } from './helpers/app-zip.js';
import { http, startServer, type TestServer, waitFor } from './helpers/ferry.js';

describe('authentication', () => {
  let server: TestServer;
  let projectId: string;
  let token: string;
  let other: { projectId: string; token: string };
  let buildId: string;

  before(async () => {
    server = await startServer();
    ({ projectId, token } = await server.bootstrap('main'));
    other = await server.bootstrap('other');
    const upload = await server.inject(`/v2/projects/${projectId}/apps/hello/builds`, {
      method: 'POST',
      token,
      body: await helloApp(),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(upload.status, 201, upload.text);
    buildId = upload.json.id;
  });
  after(() => server.close());

  const routes = () => [
    { name: 'apps list', path: `/v2/projects/${projectId}/apps` },
    { name: 'zip-contents', path: `/v2/projects/${projectId}/apps/hello/builds/${buildId}/zip-contents` },
  ];

  async function expectError(path: string, authorization: string | undefined, status: number, code: string) {
    const res = await server.inject(path, authorization === undefined ? {} : { headers: { authorization } });
    assert.equal(res.status, status, `${path}: ${res.text}`);
    assert.equal(res.json.error.code, code);
    assert.equal(typeof res.json.error.message, 'string');
    assert.doesNotMatch(res.text, /at .*\.js:\d+/, 'no stack traces in error bodies');
  }

  it('accepts a valid token', async () => {
    for (const route of routes()) {
      const res = await server.inject(route.path, { token });
      assert.equal(res.status, 200, `${route.name}: ${res.text}`);
    }
  });

  it('refuses a request without a token (401)', async () => {
    for (const route of routes()) await expectError(route.path, undefined, 401, 'FERRY_UNAUTHENTICATED');
  });

  it('refuses a malformed Authorization header or token (401)', async () => {
    for (const route of routes()) {
      await expectError(route.path, 'Basic abc', 401, 'FERRY_TOKEN_INVALID');
      await expectError(route.path, 'Bearer not-a-jwt', 401, 'FERRY_TOKEN_INVALID');
      await expectError(route.path, `Bearer ${token.slice(0, -4)}`, 401, 'FERRY_TOKEN_INVALID');
    }
  });

  it('refuses a token signed with another key (401)', async () => {
    const forged = await signToken(randomBytes(32), {
      serviceAccountId: 'sa-000000000000',
      projectId,
      scopes: ['manage', 'run'],
      tokenId: randomUUID(),
      expiresAt: new Date(Date.now() + 3600_000),
    });
    for (const route of routes()) await expectError(route.path, `Bearer ${forged}`, 401, 'FERRY_TOKEN_INVALID');
  });

  it('refuses a token whose claims were edited (401)', async () => {
    const [h, p, s] = token.split('.');
    const claims = JSON.parse(Buffer.from(p!, 'base64url').toString());
    claims.scp = ['manage', 'run'];
    claims.prj = other.projectId;
    const edited = `${h}.${Buffer.from(JSON.stringify(claims)).toString('base64url')}.${s}`;
    for (const route of routes()) await expectError(route.path, `Bearer ${edited}`, 401, 'FERRY_TOKEN_INVALID');
  });

  it('refuses an expired token (401)', async () => {
    // 4 s of life: room for the first call below to be made in time on a busy machine (idle: a few ms), even
    // with the token's expiry rounded down to the second.
    const expiresAt = Date.now() + 4_000;
    const created = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'short', expires_at: new Date(expiresAt).toISOString() },
    });
    assert.equal(created.status, 201, created.text);
    const res = await server.inject(routes()[0]!.path, { token: created.json.token });
    assert.equal(res.status, 200);
    // Then wait until it has surely expired: waiting longer never makes this pass wrongly.
    await new Promise((r) => setTimeout(r, expiresAt + 100 - Date.now()));
    for (const route of routes())
      await expectError(route.path, `Bearer ${created.json.token}`, 401, 'FERRY_TOKEN_EXPIRED');
  });

  it('refuses a revoked token at once (401)', async () => {
    const created = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'to-revoke' },
    });
    const revoked = await server.inject(`/v2/projects/${projectId}/service-accounts/${created.json.id}`, {
      method: 'DELETE',
      token,
    });
    assert.equal(revoked.status, 200);
    assert.ok(revoked.json.revoked_at);
    for (const route of routes())
      await expectError(route.path, `Bearer ${created.json.token}`, 401, 'FERRY_TOKEN_REVOKED');
  });

  it('refuses a token of another project (403), and an unknown project (404)', async () => {
    for (const route of routes())
      await expectError(route.path, `Bearer ${other.token}`, 403, 'FERRY_FORBIDDEN_PROJECT');
    await expectError('/v2/projects/p-00000000/apps', `Bearer ${token}`, 404, 'FERRY_PROJECT_NOT_FOUND');
  });

  it('refuses a run-only token on the management API (403)', async () => {
    const created = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'runner', scopes: ['run'] },
    });
    assert.deepEqual(created.json.scopes, ['run']);
    for (const route of routes())
      await expectError(route.path, `Bearer ${created.json.token}`, 403, 'FERRY_MISSING_SCOPE');
  });

  it('answers 404 for an unknown app or build, and for a build of another app', async () => {
    await expectError(
      `/v2/projects/${projectId}/apps/nope/builds/${buildId}/zip-contents`,
      `Bearer ${token}`,
      404,
      'FERRY_BUILD_NOT_FOUND',
    );
    await expectError(
      `/v2/projects/${projectId}/apps/hello/builds/${randomUUID()}/zip-contents`,
      `Bearer ${token}`,
      404,
      'FERRY_BUILD_NOT_FOUND',
    );
    const second = await server.inject(`/v2/projects/${projectId}/apps/second/builds`, {
      method: 'POST',
      token,
      body: await helloApp('second'),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(second.status, 201);
    await expectError(
      `/v2/projects/${projectId}/apps/hello/builds/${second.json.id}/zip-contents`,
      `Bearer ${token}`,
      404,
      'FERRY_BUILD_NOT_FOUND',
    );
    await expectError(`/v2/projects/${projectId}/apps/nope`, `Bearer ${token}`, 404, 'FERRY_APP_NOT_FOUND');
    await waitFor(async () => {
      const b = await server.inject(`/v2/projects/${projectId}/apps/second/builds/${second.json.id}`, { token });
      return b.json.state !== 'pending' && b.json.state !== 'building';
    });
  });

  it('refuses a run call without a token, with a manage-only token, and for another project', async () => {
    const manageOnly = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'manager', scopes: ['manage'] },
    });
    const run = (auth?: string, project = projectId) =>
      http(`${server.url}/v4/${project}/hello/run`, {
        method: 'POST',
        body: {},
        headers: auth ? { authorization: auth } : {},
      });
    let res = await run();
    assert.equal(res.status, 401);
    assert.match(res.headers.get('x-request-id') ?? '', /^[0-9a-f-]{36}$/);
    res = await run(`Bearer ${manageOnly.json.token}`);
    assert.equal(res.status, 403);
    assert.equal(res.json.error.code, 'FERRY_MISSING_SCOPE');
    res = await run(`Bearer ${other.token}`);
    assert.equal(res.status, 403);
  });

  it('a sign-in session (ferry admin login-link): manage only, no account of its own, ends with its account or at its expiry', async () => {
    const { store, jwtKey } = server.services;
    const owner = await server.bootstrap('sessions');
    const accounts = async () =>
      Number(
        (
          await store
            .selectFrom('service_accounts')
            .select((e) => e.fn.countAll().as('n'))
            .executeTakeFirstOrThrow()
        ).n,
      );
    const before = await accounts();
    // 4 s of life, as for the expired token above: room for the first calls on a busy machine.
    const expiresAt = Date.now() + 4_000;
    const session = await createSignInSession(store, jwtKey, {
      projectId: owner.projectId,
      until: new Date(expiresAt),
    });
    assert.ok(session, 'the owner account takes sessions');
    assert.equal(session.account.name, 'owner');
    assert.equal(await accounts(), before, 'no account row is made, so none is left behind (issue 43)');
    const listed = await server.inject(`/v2/projects/${owner.projectId}/service-accounts`, { token: owner.token });
    assert.deepEqual(
      listed.json.service_accounts.map((a: { name: string }) => a.name),
      ['owner'],
      'the API keys page lists the accounts, and a session is none',
    );
    const apps = `/v2/projects/${owner.projectId}/apps`;
    assert.equal((await server.inject(apps, { token: session.token })).status, 200, 'it signs in (manage)');
    const runCall = await http(`${server.url}/v4/${owner.projectId}/hello/run`, {
      method: 'POST',
      body: {},
      token: session.token,
    });
    assert.equal(runCall.status, 403, runCall.text);
    assert.equal(runCall.json.error.code, 'FERRY_MISSING_SCOPE');
    await expectError(`/v2/projects/${projectId}/apps`, `Bearer ${session.token}`, 403, 'FERRY_FORBIDDEN_PROJECT');

    // A session claims no more than its account has: one of a run-only account is refused.
    const runner = await server.inject(`/v2/projects/${owner.projectId}/service-accounts`, {
      method: 'POST',
      token: owner.token,
      body: { name: 'runner', scopes: ['run'] },
    });
    const stretched = await signToken(jwtKey, {
      serviceAccountId: runner.json.id,
      projectId: owner.projectId,
      scopes: ['manage'],
      tokenId: randomUUID(),
      expiresAt: new Date(Date.now() + 3600_000),
      session: true,
    });
    await expectError(apps, `Bearer ${stretched}`, 401, 'FERRY_TOKEN_INVALID');

    // Its own expiry ends it (waiting longer never makes this pass wrongly).
    await new Promise((r) => setTimeout(r, expiresAt + 1_100 - Date.now()));
    await expectError(apps, `Bearer ${session.token}`, 401, 'FERRY_TOKEN_EXPIRED');

    // Revoking its account ends it at once.
    const later = await createSignInSession(store, jwtKey, {
      projectId: owner.projectId,
      until: new Date(Date.now() + 3600_000),
    });
    assert.ok(later);
    assert.equal((await server.inject(apps, { token: later.token })).status, 200);
    const revoked = await server.inject(`/v2/projects/${owner.projectId}/service-accounts/${later.account.id}`, {
      method: 'DELETE',
      token: owner.token,
    });
    assert.equal(revoked.status, 200, revoked.text);
    await expectError(apps, `Bearer ${later.token}`, 401, 'FERRY_TOKEN_REVOKED');
    // With no active manage account left, there is nothing for a session to belong to.
    assert.equal(
      await createSignInSession(store, jwtKey, { projectId: owner.projectId, until: new Date(Date.now() + 60_000) }),
      undefined,
    );
  });
});
