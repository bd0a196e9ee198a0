/**
 * A project's registry logins (issue 43, point 5): the three routes in-process (Fastify's inject), their
 * refusals (a registry name no reference could name, a missing or empty password, a wrong token, a run-only
 * token, another project's token, a logout of no login), the password never answered and kept only as
 * ciphertext bound to the project and registry, which no secret's binding can open, apart from the secrets
 * (neither their list nor a replica's environment has it), and `ferry registries login --password-stdin`,
 * `list` and `logout` through the built CLI. The pulls that use a login are test/images-project-logins.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import { decryptSecret, secretEnvironment } from '../src/secrets/secrets.js';
import { FERRY_BIN, type Response, startServer, type TestServer, tempDir } from './helpers/ferry.js';

const unique = (label: string) => `${label}-${randomBytes(8).toString('hex')}`;
const TIME = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/;

describe('registry logins API', () => {
  let server: TestServer;
  let projectId: string;
  let token: string;
  let other: { projectId: string; token: string };
  let runOnly: string;
  /** Every response body of this suite: none may hold a password. */
  const bodies: string[] = [];
  /** Every password sent in this suite. */
  const passwords: string[] = [];

  before(async () => {
    server = await startServer();
    ({ projectId, token } = await server.bootstrap('main'));
    other = await server.bootstrap('other');
    const created = await server.inject(`/v2/projects/${projectId}/service-accounts`, {
      method: 'POST',
      token,
      body: { name: 'runner', scopes: ['run'] },
    });
    assert.equal(created.status, 201, created.text);
    runOnly = created.json.token;
  });
  after(() => server.close());

  const registriesPath = (registry?: string, project = projectId) =>
    `/v2/projects/${project}/registries${registry === undefined ? '' : `/${encodeURIComponent(registry)}`}`;

  async function api(
    method: string,
    registry?: string,
    options: { body?: unknown; token?: string | null; project?: string } = {},
  ): Promise<Response> {
    const bearer = options.token === undefined ? token : options.token;
    const res = await server.inject(registriesPath(registry, options.project), {
      method,
      ...(bearer === null ? {} : { token: bearer }),
      ...(options.body === undefined ? {} : { body: options.body }),
    });
    bodies.push(res.text);
    return res;
  }

  async function login(
    registry: string,
    username: string,
    password: string,
    options: { token?: string; project?: string } = {},
  ) {
    passwords.push(password);
    return api('PUT', registry, { ...options, body: { username, password } });
  }

  function assertLogin(body: unknown, registry: string, username: string) {
    assert.deepEqual(Object.keys(body as object).sort(), ['created_at', 'registry', 'updated_at', 'username']);
    const shown = body as { registry: string; username: string; created_at: string; updated_at: string };
    assert.equal(shown.registry, registry);
    assert.equal(shown.username, username);
    assert.match(shown.created_at, TIME);
    assert.match(shown.updated_at, TIME);
  }

  it('logs in, lists without passwords, replaces and logs out', async () => {
    const ghcr = unique('ghcr-token');
    let res = await login('ghcr.io', 'octo', ghcr);
    assert.equal(res.status, 200, res.text);
    assertLogin(res.json, 'ghcr.io', 'octo');
    // Written as image references name it: lower case, Docker Hub's aliases are docker.io.
    res = await login('Index.Docker.IO', 'hubber', unique('hub-password'));
    assert.equal(res.status, 200, res.text);
    assertLogin(res.json, 'docker.io', 'hubber');
    res = await login('127.0.0.1:5000', 'local', unique('local-password'));
    assert.equal(res.status, 200, res.text);
    res = await login('localhost', 'me', unique('localhost-password'));
    assert.equal(res.status, 200, res.text);

    res = await api('GET');
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(Object.keys(res.json), ['registries']);
    assert.deepEqual(
      res.json.registries.map((r: { registry: string }) => r.registry),
      ['127.0.0.1:5000', 'docker.io', 'ghcr.io', 'localhost'],
      'sorted by registry, code unit order',
    );
    for (const r of res.json.registries) assertLogin(r, r.registry, r.username);

    // Replacing keeps created_at, moves updated_at and takes the new credentials.
    const first = (await api('GET')).json.registries.find((r: { registry: string }) => r.registry === 'ghcr.io');
    await new Promise((r) => setTimeout(r, 15));
    const rotated = unique('ghcr-rotated');
    res = await login('GHCR.io', 'octo2', rotated);
    assert.equal(res.status, 200, res.text);
    assertLogin(res.json, 'ghcr.io', 'octo2');
    assert.equal(res.json.created_at, first.created_at);
    assert.ok(res.json.updated_at > first.updated_at);
    assert.deepEqual(await server.services.registries.credentials(projectId, 'ghcr.io'), {
      username: 'octo2',
      password: rotated,
    });
    // Another project has no login of this one's.
    assert.equal(await server.services.registries.credentials(other.projectId, 'ghcr.io'), undefined);

    res = await api('DELETE', 'ghcr.io');
    assert.equal(res.status, 204, res.text);
    assert.equal(res.text, '');
    assert.equal(await server.services.registries.credentials(projectId, 'ghcr.io'), undefined);
    res = await api('DELETE', 'registry-1.docker.io');
    assert.equal(res.status, 204, 'an alias of Docker Hub logs out of docker.io');
    res = await api('GET');
    assert.deepEqual(
      res.json.registries.map((r: { registry: string }) => r.registry),
      ['127.0.0.1:5000', 'localhost'],
    );
  });

  it('refuses registry names no image reference could name with 400 FERRY_VALIDATION', async () => {
    for (const bad of [
      'https://ghcr.io',
      'ghcr.io/org',
      'noport',
      'host:99999',
      'host:',
      '-bad.example',
      'a b.example',
      `${'a'.repeat(248)}.example`,
    ]) {
      for (const method of ['PUT', 'DELETE']) {
        const res = await api(method, bad, method === 'PUT' ? { body: { username: 'u', password: 'p' } } : {});
        assert.equal(res.status, 400, `${method} ${bad}: ${res.text}`);
        assert.equal(res.json.error.code, 'FERRY_VALIDATION', `${method} ${bad}`);
      }
    }
    const listed = await api('GET');
    assert.deepEqual(
      listed.json.registries.filter((r: { registry: string }) => /example|ghcr|host:|noport/.test(r.registry)),
      [],
      'nothing refused is stored',
    );
  });

  it('refuses a missing, empty or non-string password and a bad username with 400 FERRY_VALIDATION', async () => {
    for (const body of [
      { username: 'u' },
      { username: 'u', password: '' },
      { username: 'u', password: 42 },
      { username: 'u', password: null },
      { password: 'p' },
      { username: '', password: 'p' },
      { username: 'a:b', password: 'p' },
      { username: 'tab\there', password: 'p' },
      { username: 'u', password: 'nul\0inside' },
      { username: 'u', password: 'x'.repeat(16_385) },
      { username: 'u', password: 'p', extra: 1 },
      [],
      'text',
    ]) {
      const res = await api('PUT', 'refused.example', { body });
      assert.equal(res.status, 400, `${JSON.stringify(body).slice(0, 80)}: ${res.text}`);
      assert.match(res.json.error.code, /^FERRY_(VALIDATION|BODY_NOT_OBJECT)$/);
    }
    const res = await api('GET');
    assert.ok(
      !res.json.registries.some((r: { registry: string }) => r.registry === 'refused.example'),
      'nothing refused is stored',
    );
  });

  it('answers 404 FERRY_REGISTRY_LOGIN_NOT_FOUND for a logout of no login', async () => {
    const res = await api('DELETE', 'never.example');
    assert.equal(res.status, 404, res.text);
    assert.equal(res.json.error.code, 'FERRY_REGISTRY_LOGIN_NOT_FOUND');
    assert.match(res.json.error.message, /never\.example/);
  });

  it('needs a manage token of the project on every route', async () => {
    const password = unique('guarded');
    assert.equal((await login('guarded.example', 'owner', password)).status, 200);
    const calls: Array<[string, string | undefined, unknown]> = [
      ['PUT', 'guarded.example', { username: 'intruder', password: 'overwritten' }],
      ['GET', undefined, undefined],
      ['DELETE', 'guarded.example', undefined],
    ];
    for (const [method, registry, body] of calls) {
      const what = `${method} ${registry ?? '(list)'}`;
      let res = await api(method, registry, { token: null, body });
      assert.equal(res.status, 401, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_UNAUTHENTICATED');
      res = await api(method, registry, { token: `${token}x`, body });
      assert.equal(res.status, 401, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_TOKEN_INVALID');
      res = await api(method, registry, { token: runOnly, body });
      assert.equal(res.status, 403, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_MISSING_SCOPE');
      res = await api(method, registry, { token: other.token, body });
      assert.equal(res.status, 403, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_FORBIDDEN_PROJECT');
    }
    assert.deepEqual(await server.services.registries.credentials(projectId, 'guarded.example'), {
      username: 'owner',
      password,
    });
    // Projects are separate: the other project's login for the same registry is its own.
    const theirs = unique('theirs');
    assert.equal(
      (await login('guarded.example', 'them', theirs, { token: other.token, project: other.projectId })).status,
      200,
    );
    assert.deepEqual(await server.services.registries.credentials(other.projectId, 'guarded.example'), {
      username: 'them',
      password: theirs,
    });
    assert.equal((await server.services.registries.credentials(projectId, 'guarded.example'))?.password, password);
  });

  it('keeps the password as ciphertext no secret can be, apart from the secrets', async () => {
    const plain = unique('at-rest-password');
    assert.equal((await login('rest.example:8443', 'rest-user', plain)).status, 200);
    const row = await server.services.store
      .selectFrom('registry_logins')
      .selectAll()
      .where('project_id', '=', projectId)
      .where('registry', '=', 'rest.example:8443')
      .executeTakeFirstOrThrow();
    assert.match(row.password, /^v1\./);
    assert.ok(!row.password.includes(plain));
    const key = server.services.secretsKey;
    assert.equal(decryptSecret(key, row.password, { projectId, name: 'registry:rest.example:8443' }), plain);
    // Bound to its project and registry: moved to another, it does not decrypt.
    assert.throws(() =>
      decryptSecret(key, row.password, { projectId: other.projectId, name: 'registry:rest.example:8443' }),
    );
    assert.throws(() => decryptSecret(key, row.password, { projectId, name: 'registry:other.example' }));
    await server.services.store
      .insertInto('registry_logins')
      .values({ ...row, project_id: other.projectId })
      .execute();
    await assert.rejects(server.services.registries.credentials(other.projectId, 'rest.example:8443'), {
      code: 'FERRY_IMAGE_REGISTRY_AUTH',
    });
    await server.services.store
      .deleteFrom('registry_logins')
      .where('project_id', '=', other.projectId)
      .where('registry', '=', 'rest.example:8443')
      .execute();

    // Not a secret: the secrets list and a replica's environment never have it.
    const secrets = await server.inject(`/v2/projects/${projectId}/secrets`, { token });
    assert.equal(secrets.status, 200, secrets.text);
    assert.deepEqual(secrets.json.secrets, []);
    assert.deepEqual(await secretEnvironment(server.services.store, key, projectId), {});
    // Copied into the secrets table, under any name a secret may have, it is refused, never handed to a replica.
    for (const name of ['REGISTRY', 'rest', 'registry_rest_example_8443']) {
      assert.throws(() => decryptSecret(key, row.password, { projectId, name }), /does not decrypt/);
    }
    await server.services.store
      .insertInto('secrets')
      .values({
        project_id: projectId,
        name: 'STOLEN',
        value: row.password,
        created_at: row.created_at,
        updated_at: row.updated_at,
      })
      .execute();
    await assert.rejects(secretEnvironment(server.services.store, key, projectId), /does not decrypt/);
    await server.services.store.deleteFrom('secrets').where('project_id', '=', projectId).execute();

    // Nowhere in the store in plain text, nor in the SQLite files.
    const tables = await server.services.store.introspection.getTables();
    assert.ok(tables.some((t) => t.name === 'registry_logins'));
    for (const table of tables) {
      const rows = await sql<Record<string, unknown>>`select * from ${sql.table(table.name)}`.execute(
        server.services.store,
      );
      for (const r of rows.rows) {
        for (const [column, cell] of Object.entries(r)) {
          if (typeof cell !== 'string') continue;
          for (const p of passwords.filter((x) => x.length >= 8))
            assert.ok(!cell.includes(p), `${table.name}.${column} holds a plaintext password`);
        }
      }
    }
    if (server.databaseUrl === undefined) {
      for (const file of ['ferry.db', 'ferry.db-wal']) {
        const bytes = await fs.readFile(path.join(server.dataDir, file)).catch(() => Buffer.alloc(0));
        for (const p of passwords.filter((x) => x.length >= 8))
          assert.equal(bytes.indexOf(Buffer.from(p, 'utf8')), -1, `${file} holds a plaintext password`);
      }
    }
  });

  it('documents the routes in the OpenAPI document, with no password in any response', async () => {
    const doc = (await server.inject('/v2/openapi.json')).json;
    const one = doc.paths['/v2/projects/{project_id}/registries/{registry}'];
    const list = doc.paths['/v2/projects/{project_id}/registries'];
    assert.ok(one?.put && one.delete && list?.get, 'the three routes are documented');
    for (const op of [one.put, one.delete, list.get]) assert.ok(op.summary);
    const body = one.put.requestBody.content['application/json'].schema;
    assert.deepEqual(Object.keys(body.properties).sort(), ['password', 'username']);
    assert.deepEqual(body.required.sort(), ['password', 'username']);
    assert.equal(body.additionalProperties, false);
    for (const status of ['400', '401', '403', '404']) assert.ok(one.put.responses[status], `PUT declares ${status}`);
    const shown = JSON.stringify([one.put.responses['200'], list.get.responses['200']]);
    assert.ok(!shown.includes('"password"'), 'no response schema has a password member');
  });

  it('never answered a password in any response body', () => {
    assert.ok(bodies.length > 50, `only ${bodies.length} bodies were collected`);
    for (const p of passwords.filter((x) => x.length >= 8)) {
      for (const text of bodies) assert.ok(!text.includes(p), `a response body holds the password ${p.slice(0, 12)}`);
    }
  });
});

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs `ferry <args>` with `input` piped on its stdin (none: stdin closed). */
function ferry(args: string[], env: NodeJS.ProcessEnv, input?: string): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [FERRY_BIN, ...args], {
      env: { PATH: process.env.PATH, ...env },
      stdio: [input === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
    });
    let stdout = '';
    let stderr = '';
    child.stdout?.on('data', (d: Buffer) => (stdout += d));
    child.stderr?.on('data', (d: Buffer) => (stderr += d));
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`ferry ${args.join(' ')} timed out\n${stdout}\n${stderr}`));
    }, 60_000);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
    if (input !== undefined) child.stdin?.end(input);
  });
}

describe('ferry registries', () => {
  let server: TestServer;
  let projectId: string;
  let env: NodeJS.ProcessEnv;

  before(async () => {
    server = await startServer();
    let token: string;
    ({ projectId, token } = await server.bootstrap('cli'));
    env = { HOME: await tempDir('ferry-home-'), FERRY_URL: server.url, FERRY_TOKEN: token, FERRY_PROJECT: projectId };
  });
  after(() => server.close());

  it('logs in with the password on stdin, lists without it, and logs out', async () => {
    const password = unique('cli-password');
    let res = await ferry(
      ['registries', 'login', '127.0.0.1:5999', '--username', 'cli-user', '--password-stdin'],
      env,
      `${password}\n`,
    );
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /Logged in to 127\.0\.0\.1:5999 as cli-user/);
    assert.ok(!res.stdout.includes(password) && !res.stderr.includes(password));
    // One trailing line break is not part of the password (what echo adds), as docker login reads it.
    assert.deepEqual(await server.services.registries.credentials(projectId, '127.0.0.1:5999'), {
      username: 'cli-user',
      password,
    });

    res = await ferry(['registries', 'list'], env);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /^REGISTRY\s+USERNAME\s+CREATED_AT\s+UPDATED_AT/);
    assert.match(res.stdout, /127\.0\.0\.1:5999\s+cli-user/);
    assert.ok(!res.stdout.includes(password));
    res = await ferry(['registries', 'list', '--json'], env);
    assert.equal(res.code, 0, res.stderr);
    const listed = JSON.parse(res.stdout) as Array<Record<string, string>>;
    assert.deepEqual(
      listed.map((l) => [l.registry, l.username]),
      [['127.0.0.1:5999', 'cli-user']],
    );
    assert.ok(!res.stdout.includes(password));

    res = await ferry(['registries', 'logout', '127.0.0.1:5999'], env);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /Logged out of 127\.0\.0\.1:5999/);
    res = await ferry(['registries', 'logout', '127.0.0.1:5999'], env);
    assert.notEqual(res.code, 0);
    assert.match(res.stderr, /FERRY_REGISTRY_LOGIN_NOT_FOUND/);
    assert.equal(await server.services.registries.credentials(projectId, '127.0.0.1:5999'), undefined);
  });

  it('takes no password but on stdin, and refuses an empty one or a bad registry', async () => {
    let res = await ferry(['registries', 'login', 'ghcr.io', '--username', 'u'], env, 'secret-on-stdin');
    assert.equal(res.code, 2, res.stderr);
    assert.match(res.stderr, /--password-stdin/);
    res = await ferry(['registries', 'login', 'ghcr.io', '--username', 'u', '--password-stdin'], env, '\n');
    assert.equal(res.code, 2, res.stderr);
    assert.match(res.stderr, /No password on stdin/);
    res = await ferry(['registries', 'login', 'ghcr.io', '--password-stdin'], env, 'p');
    assert.equal(res.code, 2, res.stderr);
    assert.match(res.stderr, /--username/);
    res = await ferry(['registries', 'login', 'https://ghcr.io', '--username', 'u', '--password-stdin'], env, 'p');
    assert.notEqual(res.code, 0);
    assert.match(res.stderr, /FERRY_VALIDATION/);
    const listed = await ferry(['registries', 'list', '--json'], env);
    assert.deepEqual(JSON.parse(listed.stdout), [], 'nothing refused was stored');
  });
});
