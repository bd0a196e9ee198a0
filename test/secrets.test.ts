/**
 * Secrets: the four routes in-process (Fastify's inject), the auth matrix, name and value rules, encryption at rest
 * (checked in every table of the store, and in the raw SQLite files on SQLite), AAD binding, `secretEnvironment`, and the CLI with
 * the value piped on stdin.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { sql } from 'kysely';
import { decryptSecret, encryptSecret, secretEnvironment, setSecret } from '../src/secrets/secrets.js';
import { FERRY_BIN, type Response, runCli, startServer, type TestServer, tempDir } from './helpers/ferry.js';

const KEY = randomBytes(32);
const unique = (label: string) => `${label}-${randomBytes(8).toString('hex')}`;

describe('secret encryption', () => {
  const binding = { projectId: 'p-0000abcd', name: 'API_TOKEN' };

  it('round-trips text, including empty and non-ASCII values, in the v1 format', () => {
    for (const plain of ['', 'x', 'päss wörd ✓ 🔑', 'line1\nline2\n', 'a'.repeat(65_536)]) {
      const stored = encryptSecret(KEY, plain, binding);
      assert.match(stored, /^v1\.[A-Za-z0-9_-]{16}\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]*$/);
      assert.equal(decryptSecret(KEY, stored, binding), plain);
    }
  });

  it('uses a fresh IV each time, so equal values give different ciphertexts', () => {
    const a = encryptSecret(KEY, 'same', binding);
    const b = encryptSecret(KEY, 'same', binding);
    assert.notEqual(a, b);
    assert.notEqual(a.split('.')[1], b.split('.')[1]);
  });

  it('refuses another key, another project, another name, and any tampering', () => {
    const stored = encryptSecret(KEY, 'hunter2', binding);
    assert.throws(() => decryptSecret(randomBytes(32), stored, binding), /does not decrypt/);
    assert.throws(() => decryptSecret(KEY, stored, { ...binding, projectId: 'p-0000abce' }), /does not decrypt/);
    assert.throws(() => decryptSecret(KEY, stored, { ...binding, name: 'API_TOKEN2' }), /does not decrypt/);
    const [v, iv, tag, data] = stored.split('.') as [string, string, string, string];
    const flip = (b64: string) => {
      const buf = Buffer.from(b64, 'base64url');
      buf[0] = (buf[0] ?? 0) ^ 1;
      return buf.toString('base64url');
    };
    assert.throws(() => decryptSecret(KEY, [v, iv, tag, flip(data)].join('.'), binding), /does not decrypt/);
    assert.throws(() => decryptSecret(KEY, [v, iv, flip(tag), data].join('.'), binding), /does not decrypt/);
    assert.throws(() => decryptSecret(KEY, [v, flip(iv), tag, data].join('.'), binding), /does not decrypt/);
    assert.throws(() => decryptSecret(KEY, ['v2', iv, tag, data].join('.'), binding), /unknown format/);
    assert.throws(() => decryptSecret(KEY, `${iv}.${tag}.${data}`, binding), /unknown format/);
    assert.throws(() => decryptSecret(KEY, [v, iv.slice(2), tag, data].join('.'), binding), /malformed/);
    assert.throws(() => encryptSecret(randomBytes(16), 'x', binding), /32 bytes/);
  });
});

describe('secrets API', () => {
  let server: TestServer;
  let projectId: string;
  let token: string;
  let other: { projectId: string; token: string };
  let runOnly: string;
  /** Every response body the API gave in this suite; none may contain a value. */
  const bodies: string[] = [];
  /** Every value set in this suite. */
  const values: string[] = [];

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

  // The routes are called in-process (Fastify's inject); the CLI's suite below goes over a socket.
  const secretsPath = (name?: string, project = projectId) =>
    `/v2/projects/${project}/secrets${name === undefined ? '' : `/${encodeURIComponent(name)}`}`;

  async function api(
    method: string,
    name?: string,
    options: { body?: unknown; token?: string; project?: string } = {},
  ): Promise<Response> {
    const res = await server.inject(secretsPath(name, options.project), {
      method,
      token: options.token ?? token,
      ...(options.body === undefined ? {} : { body: options.body }),
    });
    bodies.push(res.text);
    return res;
  }

  async function put(name: string, value: string, options: { token?: string; project?: string } = {}) {
    values.push(value);
    return api('PUT', name, { ...options, body: { value } });
  }

  function assertMetadata(body: unknown, name: string) {
    assert.deepEqual(Object.keys(body as object).sort(), ['created_at', 'name', 'updated_at']);
    const meta = body as { name: string; created_at: string; updated_at: string };
    assert.equal(meta.name, name);
    assert.match(meta.created_at, /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/);
    assert.match(meta.updated_at, /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/);
  }

  it('sets, lists, shows and deletes secrets', async () => {
    const apiToken = unique('api-token');
    const dbUrl = unique('postgres://user:pw@db/x');
    let res = await put('API_TOKEN', apiToken);
    assert.equal(res.status, 200, res.text);
    assertMetadata(res.json, 'API_TOKEN');
    assert.equal(res.json.created_at, res.json.updated_at);
    res = await put('db_url', dbUrl);
    assert.equal(res.status, 200, res.text);
    res = await put('_Z9', 'z');
    assert.equal(res.status, 200, res.text);

    res = await api('GET');
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(Object.keys(res.json), ['secrets']);
    assert.deepEqual(
      res.json.secrets.map((s: { name: string }) => s.name),
      ['API_TOKEN', '_Z9', 'db_url'],
      'sorted by name, code unit order',
    );
    for (const s of res.json.secrets) assertMetadata(s, s.name);

    res = await api('GET', 'API_TOKEN');
    assert.equal(res.status, 200, res.text);
    assertMetadata(res.json, 'API_TOKEN');

    res = await api('DELETE', 'API_TOKEN');
    assert.equal(res.status, 204, res.text);
    assert.equal(res.text, '');
    res = await api('GET', 'API_TOKEN');
    assert.equal(res.status, 404, res.text);
    assert.equal(res.json.error.code, 'FERRY_SECRET_NOT_FOUND');
    res = await api('GET');
    assert.deepEqual(
      res.json.secrets.map((s: { name: string }) => s.name),
      ['_Z9', 'db_url'],
    );
    assert.deepEqual(await secretEnvironment(server.services.store, server.services.secretsKey, projectId), {
      _Z9: 'z',
      db_url: dbUrl,
    });
  });

  it('keeps created_at and moves updated_at when a secret is replaced', async () => {
    const first = await put('ROTATED', unique('first'));
    assert.equal(first.status, 200, first.text);
    await new Promise((r) => setTimeout(r, 15));
    const second = unique('second');
    const res = await put('ROTATED', second);
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.created_at, first.json.created_at);
    assert.ok(res.json.updated_at > first.json.updated_at, `${res.json.updated_at} > ${first.json.updated_at}`);
    const shown = await api('GET', 'ROTATED');
    assert.equal(shown.json.created_at, first.json.created_at);
    assert.equal(shown.json.updated_at, res.json.updated_at);
    const env = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.equal(env.ROTATED, second);
  });

  it('refuses reserved and malformed names with 400 FERRY_VALIDATION', async () => {
    const bad = [
      'FERRY_X',
      'FERRY_',
      'FERRY_TOKEN',
      'PATH',
      'HOME',
      'APP_NAME',
      'PROJECT_ID',
      'BUILD_ID',
      '1ABC',
      'has-dash',
      'has space',
      'DOT.NAME',
      'ÄB',
    ];
    for (const name of bad) {
      const res = await put(name, 'v');
      assert.equal(res.status, 400, `${name}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_VALIDATION', name);
    }
    const listed = await api('GET');
    for (const name of bad) assert.ok(!listed.json.secrets.some((s: { name: string }) => s.name === name), name);
    // The same rules hold below the API.
    await assert.rejects(setSecret(server.services.store, KEY, projectId, 'PATH', 'x'), { code: 'FERRY_VALIDATION' });
    await assert.rejects(setSecret(server.services.store, KEY, projectId, 'FERRY_X', 'x'), {
      code: 'FERRY_VALIDATION',
    });

    for (const name of ['lower_case', '_x', 'PATH2', 'MY_HOME', 'path', 'ferry_lower']) {
      const res = await put(name, 'ok');
      assert.equal(res.status, 200, `${name}: ${res.text}`);
    }
  });

  it('takes names up to 128 characters and refuses longer ones with 400 FERRY_VALIDATION', async () => {
    for (const method of ['PUT', 'GET', 'DELETE']) {
      const res = await api(method, 'B'.repeat(129), method === 'PUT' ? { body: { value: 'v' } } : {});
      assert.equal(res.status, 400, `${method} of a 129-character name: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    }
    const name = 'A'.repeat(128);
    let res = await put(name, unique('long-name'));
    assert.equal(res.status, 200, `PUT of a 128-character name: ${res.text}`);
    res = await api('GET', name);
    assert.equal(res.status, 200, res.text);
    res = await api('DELETE', name);
    assert.equal(res.status, 204, res.text);
  });

  it('refuses bodies that are not {"value": string} and values over 64 KiB', async () => {
    for (const body of [{}, { value: 42 }, { value: null }, { value: 'x', extra: 1 }, [], 'text']) {
      const res = await api('PUT', 'BODY_CHECK', { body });
      assert.equal(res.status, 400, `${JSON.stringify(body)}: ${res.text}`);
      assert.match(res.json.error.code, /^FERRY_(VALIDATION|BODY_NOT_OBJECT)$/);
    }
    // 2-byte characters: under the character limit, over the byte limit.
    let res = await put('BIG', 'é'.repeat(32_769));
    assert.equal(res.status, 400, res.text);
    assert.equal(res.json.error.code, 'FERRY_VALIDATION');
    res = await put('BIG', 'x'.repeat(65_537));
    assert.equal(res.status, 400, res.text);
    res = await put('NUL', 'a\0b');
    assert.equal(res.status, 400, res.text);
    res = await api('GET', 'BIG');
    assert.equal(res.status, 404, 'a refused value is not stored');

    res = await put('BIG', 'é'.repeat(32_768));
    assert.equal(res.status, 200, res.text);
    res = await put('EMPTY', '');
    assert.equal(res.status, 200, res.text);
    const env = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.equal(env.BIG, 'é'.repeat(32_768));
    assert.equal(env.EMPTY, '');
  });

  it('answers 404 FERRY_SECRET_NOT_FOUND for a missing secret', async () => {
    let res = await api('DELETE', 'NEVER_SET');
    assert.equal(res.status, 404, res.text);
    assert.equal(res.json.error.code, 'FERRY_SECRET_NOT_FOUND');
    res = await api('GET', 'NEVER_SET');
    assert.equal(res.status, 404, res.text);
    assert.equal(res.json.error.code, 'FERRY_SECRET_NOT_FOUND');
  });

  it('needs a manage token of the project on every route', async () => {
    const value = unique('guarded');
    assert.equal((await put('GUARDED', value)).status, 200);
    const calls: Array<[string, string | undefined, unknown]> = [
      ['PUT', 'GUARDED', { value: 'overwritten' }],
      ['GET', undefined, undefined],
      ['GET', 'GUARDED', undefined],
      ['DELETE', 'GUARDED', undefined],
    ];
    for (const [method, name, body] of calls) {
      const what = `${method} ${name ?? '(list)'}`;
      const anonymous = await server.inject(secretsPath(name), {
        method,
        ...(body === undefined ? {} : { body }),
      });
      bodies.push(anonymous.text);
      assert.equal(anonymous.status, 401, `${what}: ${anonymous.text}`);
      assert.equal(anonymous.json.error.code, 'FERRY_UNAUTHENTICATED');
      let res = await api(method, name, { token: runOnly, body });
      assert.equal(res.status, 403, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_MISSING_SCOPE');
      res = await api(method, name, { token: other.token, body });
      assert.equal(res.status, 403, `${what}: ${res.text}`);
      assert.equal(res.json.error.code, 'FERRY_FORBIDDEN_PROJECT');
    }
    const env = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.equal(env.GUARDED, value, 'no refused call changed or deleted the secret');

    // Projects are separate namespaces.
    const theirs = unique('theirs');
    assert.equal((await put('GUARDED', theirs, { token: other.token, project: other.projectId })).status, 200);
    assert.deepEqual(await secretEnvironment(server.services.store, server.services.secretsKey, other.projectId), {
      GUARDED: theirs,
    });
    assert.equal(
      (await secretEnvironment(server.services.store, server.services.secretsKey, projectId)).GUARDED,
      value,
    );
  });

  it('stores only ciphertext bound to its project and name', async () => {
    const plain = unique('at-rest-plaintext');
    assert.equal((await put('AT_REST', plain)).status, 200);
    const row = await server.services.store
      .selectFrom('secrets')
      .selectAll()
      .where('project_id', '=', projectId)
      .where('name', '=', 'AT_REST')
      .executeTakeFirstOrThrow();
    assert.notEqual(row.value, plain);
    assert.ok(!row.value.includes(plain));
    assert.match(row.value, /^v1\./);
    const key = server.services.secretsKey;
    assert.equal(decryptSecret(key, row.value, { projectId, name: 'AT_REST' }), plain);
    // The key in use is the one on disk, keys/secrets.key.
    const onDisk = Buffer.from(
      (await fs.readFile(path.join(server.dataDir, 'keys', 'secrets.key'), 'utf8')).trim(),
      'base64url',
    );
    assert.equal(decryptSecret(onDisk, row.value, { projectId, name: 'AT_REST' }), plain);

    // A value copied to another row does not decrypt there, and secretEnvironment refuses to hand it out.
    await server.services.store
      .insertInto('secrets')
      .values({ ...row, name: 'COPIED' })
      .execute();
    assert.throws(() => decryptSecret(key, row.value, { projectId, name: 'COPIED' }), /does not decrypt/);
    await assert.rejects(secretEnvironment(server.services.store, key, projectId), /COPIED .*does not decrypt/);
    await server.services.store
      .insertInto('secrets')
      .values({ ...row, project_id: other.projectId })
      .execute();
    await assert.rejects(secretEnvironment(server.services.store, key, other.projectId), /does not decrypt/);
    const copied = await api('GET', 'COPIED');
    assert.equal(copied.status, 200, 'the copy is listed, only its value is unusable');
    assert.equal((await api('DELETE', 'COPIED')).status, 204);
    await server.services.store
      .deleteFrom('secrets')
      .where('project_id', '=', other.projectId)
      .where('name', '=', 'AT_REST')
      .execute();
    assert.equal((await secretEnvironment(server.services.store, key, projectId)).AT_REST, plain);

    // Nowhere in the store: no column of any table holds a value in plain text.
    const tables = await server.services.store.introspection.getTables();
    assert.ok(
      tables.some((t) => t.name === 'secrets'),
      'the tables are listed',
    );
    let cells = 0;
    for (const table of tables) {
      const rows = await sql<Record<string, unknown>>`select * from ${sql.table(table.name)}`.execute(
        server.services.store,
      );
      for (const row of rows.rows) {
        for (const [column, cell] of Object.entries(row)) {
          if (typeof cell !== 'string') continue;
          cells += 1;
          for (const v of values.filter((x) => x.length >= 8)) {
            assert.ok(!cell.includes(v), `${table.name}.${column} holds a plaintext value`);
          }
        }
      }
    }
    assert.ok(cells > 0, 'the store was read');
    // Nor in the SQLite files (the WAL holds recent writes), where the store is SQLite.
    if (server.databaseUrl === undefined) {
      for (const file of ['ferry.db', 'ferry.db-wal']) {
        const bytes = await fs.readFile(path.join(server.dataDir, file)).catch(() => Buffer.alloc(0));
        for (const v of values.filter((x) => x.length >= 8)) {
          assert.equal(bytes.indexOf(Buffer.from(v, 'utf8')), -1, `${file} holds a plaintext value`);
        }
      }
    }
  });

  it('documents the routes in the OpenAPI document without any value in responses', async () => {
    const doc = (await server.inject('/v2/openapi.json')).json;
    const one = doc.paths['/v2/projects/{project_id}/secrets/{name}'];
    const list = doc.paths['/v2/projects/{project_id}/secrets'];
    assert.ok(one?.put && one.get && one.delete && list?.get, 'all four routes are documented');
    for (const op of [one.put, one.get, one.delete, list.get]) assert.ok(op.summary, 'each has a summary');
    const nameParam = one.put.parameters.find((p: { name: string }) => p.name === 'name');
    assert.equal(nameParam.schema.pattern, '^[A-Za-z_][A-Za-z0-9_]{0,127}$');
    const body = one.put.requestBody.content['application/json'].schema;
    assert.deepEqual(Object.keys(body.properties), ['value']);
    assert.equal(body.additionalProperties, false);
    const shown = JSON.stringify([one.put.responses['200'], one.get.responses['200'], list.get.responses['200']]);
    assert.ok(!shown.includes('"value"'), 'no response schema has a value');
  });

  it('never returned a value in any response body', () => {
    assert.ok(bodies.length > 40, `only ${bodies.length} bodies were collected`);
    for (const v of values.filter((x) => x.length >= 4)) {
      for (const text of bodies) assert.ok(!text.includes(v), `a response body contains the value ${v.slice(0, 20)}`);
    }
  });
});

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs a child process with `input` piped on its stdin (runCli's stdin is closed). */
function runWithStdin(args: string[], env: NodeJS.ProcessEnv, input: string | undefined): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, args, {
      env: { PATH: process.env.PATH, ...env },
      stdio: [input === undefined ? 'ignore' : 'pipe', 'pipe', 'pipe'],
    });
    let stdout = '';
    let stderr = '';
    child.stdout?.on('data', (d: Buffer) => (stdout += d));
    child.stderr?.on('data', (d: Buffer) => (stderr += d));
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`${args.join(' ')} timed out\n${stdout}\n${stderr}`));
    }, 60_000);
    child.on('error', reject);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
    if (input !== undefined) child.stdin?.end(input);
  });
}

describe('ferry secrets', () => {
  let server: TestServer;
  let projectId: string;
  let env: NodeJS.ProcessEnv;
  /** Whether the built `ferry` has the secrets commands; when not, the command functions run in a child. */
  let registered = false;

  before(async () => {
    server = await startServer();
    let token: string;
    ({ projectId, token } = await server.bootstrap('cli'));
    env = { HOME: await tempDir('ferry-home-'), FERRY_URL: server.url, FERRY_TOKEN: token, FERRY_PROJECT: projectId };
    // An unknown command with --help still exits 0 (the program's help), so look for the subcommand's usage.
    const help = await runCli(['secrets', '--help'], env).catch(() => undefined);
    registered = help?.code === 0 && help.stdout.includes('Usage: ferry secrets');
  });
  after(() => server.close());

  const COMMANDS = { set: 'secretsSetCommand', list: 'secretsListCommand', delete: 'secretsDeleteCommand' } as const;

  /** `ferry secrets <args>`, through the real CLI when it is registered, else through src/cli/secrets.ts. */
  function ferrySecrets(args: string[], input?: string): Promise<Run> {
    if (registered) return runWithStdin([FERRY_BIN, 'secrets', ...args], env, input);
    const [command, ...rest] = args;
    const json = rest.includes('--json');
    const positional = rest.filter((a) => a !== '--json');
    const fn = COMMANDS[command as keyof typeof COMMANDS];
    const callArgs =
      command === 'set' ? [positional[0], positional[1], { json }] : command === 'list' ? [{ json }] : positional;
    const moduleUrl = new URL('../src/cli/secrets.js', import.meta.url).href;
    const script = `const m = await import(${JSON.stringify(moduleUrl)});
const args = ${JSON.stringify(callArgs)}.map((a) => (a === null ? undefined : a));
try { await m[${JSON.stringify(fn)}](...args); }
catch (err) { process.stderr.write('ferry: ' + err.message + '\\n'); process.exit(1); }`;
    // Keeps loader flags (tsx) so this also runs from the TypeScript sources.
    const flags = process.execArgv.filter((a) => !a.startsWith('--test'));
    return runWithStdin([...flags, '--input-type=module', '-e', script], env, input);
  }

  it('sets a value from stdin, lists and deletes it', async (t) => {
    if (!registered) t.diagnostic('`ferry secrets` is not registered in the built CLI; ran the command functions');
    const value = unique('from-stdin');
    let res = await ferrySecrets(['set', 'FROM_STDIN'], value);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /FROM_STDIN/);
    assert.ok(!res.stdout.includes(value) && !res.stderr.includes(value));
    const env1 = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.equal(env1.FROM_STDIN, value, 'stdin is taken exactly, no newline added or trimmed');

    const dash = `${unique('dash')}\n`;
    res = await ferrySecrets(['set', 'FROM_DASH', '-'], dash);
    assert.equal(res.code, 0, res.stderr);
    res = await ferrySecrets(['set', 'FROM_ARG', 'arg-value']);
    assert.equal(res.code, 0, res.stderr);
    const env2 = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.equal(env2.FROM_DASH, dash);
    assert.equal(env2.FROM_ARG, 'arg-value');

    // No argument and nothing on stdin: refused rather than set to ''.
    res = await ferrySecrets(['set', 'NOTHING'], '');
    assert.notEqual(res.code, 0);
    assert.match(res.stderr, /stdin/);
    res = await ferrySecrets(['set', 'PATH', 'x']);
    assert.notEqual(res.code, 0);
    assert.match(res.stderr, /FERRY_VALIDATION/);

    res = await ferrySecrets(['list']);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /^NAME\s+CREATED_AT\s+UPDATED_AT/);
    assert.match(res.stdout, /FROM_ARG/);
    assert.ok(!res.stdout.includes(value) && !res.stdout.includes('arg-value'));
    res = await ferrySecrets(['list', '--json']);
    assert.equal(res.code, 0, res.stderr);
    const listed = JSON.parse(res.stdout) as Array<{ name: string }>;
    assert.deepEqual(
      listed.map((s) => s.name),
      ['FROM_ARG', 'FROM_DASH', 'FROM_STDIN'],
    );

    res = await ferrySecrets(['delete', 'FROM_STDIN']);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /Deleted secret FROM_STDIN/);
    res = await ferrySecrets(['delete', 'FROM_STDIN']);
    assert.notEqual(res.code, 0);
    assert.match(res.stderr, /FERRY_SECRET_NOT_FOUND/);
    const env3 = await secretEnvironment(server.services.store, server.services.secretsKey, projectId);
    assert.deepEqual(Object.keys(env3).sort(), ['FROM_ARG', 'FROM_DASH']);
  });
});
