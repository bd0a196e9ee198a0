/**
 * A new user's first hour with the CLI (issue 11, points 5 to 9), against a real `ferry serve` process on a
 * port other than the default: the address `ferry admin bootstrap` prints, a token from another data
 * directory, sign-in links without new owners, `--json` on every command that prints a result (and the
 * command tree that declares them), `ferry deploy`'s function URLs and its refusals, and the message of
 * a Node app that throws while loading.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { Command } from 'commander';
import { createProgram } from '../src/cli/program.js';
import { http, REPO_ROOT, runCli, type ServeProcess, spawnServe, tempDir } from './helpers/ferry.js';

/** Commands that run rather than print a result. */
const NO_RESULT = new Set(['ferry serve']);

function walk(command: Command, trail: string[] = []): Array<{ name: string; command: Command; leaf: boolean }> {
  const name = [...trail, command.name()].join(' ');
  const here = { name, command, leaf: command.commands.length === 0 };
  return [here, ...command.commands.flatMap((c) => walk(c, [...trail, command.name()]))];
}

describe('the ferry command tree', () => {
  it('describes every command, and every command that prints a result takes --json', () => {
    const all = walk(createProgram());
    assert.ok(all.length > 20, `found ${all.length} commands`);
    const undescribed = all.filter((c) => c.command.description().trim() === '').map((c) => c.name);
    assert.deepEqual(undescribed, [], 'commands without a description in --help');
    const withoutJson = all
      .filter((c) => c.leaf && !NO_RESULT.has(c.name))
      .filter((c) => !c.command.options.some((o) => o.long === '--json'))
      .map((c) => c.name);
    assert.deepEqual(withoutJson, [], 'commands that print a result but reject --json');
  });
});

/** A pid that belonged to a process which has exited. */
async function deadPid(): Promise<number> {
  const child = spawn(process.execPath, ['-e', '0'], { stdio: 'ignore' });
  await new Promise((resolve) => child.on('exit', resolve));
  assert.ok(child.pid);
  return child.pid;
}

function parseJson(text: string, what: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    assert.fail(`${what} did not print JSON:\n${text}`);
  }
}

describe('the CLI against a running server (issue 11)', { timeout: 300_000 }, () => {
  let dataDir: string;
  let home: string;
  let serve: ServeProcess;
  let env: NodeJS.ProcessEnv;
  let projectId: string;

  before(async () => {
    dataDir = await tempDir();
    home = await tempDir('ferry-home-');
    serve = await spawnServe(dataDir);
    assert.doesNotMatch(serve.url, /:8000$/, 'the server runs on a port other than the default');
  });
  after(async () => {
    await serve?.stop();
  });

  const cli = (args: string[], extra: NodeJS.ProcessEnv = {}) => runCli(args, { ...env, ...extra });

  it('bootstrap prints the address of the server running on the data dir', async () => {
    const record = JSON.parse(await fs.readFile(path.join(dataDir, 'server.json'), 'utf8'));
    assert.equal(record.url, serve.url);
    assert.equal(typeof record.pid, 'number');

    const res = await runCli(['admin', 'bootstrap', '--data-dir', dataDir], { HOME: home });
    assert.equal(res.code, 0, res.stderr);
    const token = /Token \(shown once[^\n]*\n(\S+)/.exec(res.stdout)?.[1];
    assert.ok(token, res.stdout);
    projectId = String(/FERRY_PROJECT=(\S+)/.exec(res.stdout)?.[1]);
    assert.ok(res.stdout.includes(`export FERRY_URL=${serve.url} FERRY_PROJECT=`), res.stdout);
    assert.ok(res.stdout.includes(`  ${serve.url}/#token=${token}\n`), res.stdout);
    env = { HOME: home, FERRY_URL: serve.url, FERRY_TOKEN: token, FERRY_PROJECT: projectId };
    const apps = await http(`${serve.url}/v2/projects/${projectId}/apps`, { token });
    assert.equal(apps.status, 200);
  });

  it('bootstrap without a running server prints the configured address, ignoring a stale server.json', async () => {
    const other = await tempDir();
    await fs.writeFile(
      path.join(other, 'server.json'),
      JSON.stringify({ pid: await deadPid(), url: 'http://127.0.0.1:1' }),
    );
    const res = await runCli(['admin', 'bootstrap', '--data-dir', other], { HOME: home, FERRY_PORT: '8765' });
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /export FERRY_URL=http:\/\/127\.0\.0\.1:8765 /);
    assert.match(res.stdout, /No ferry serve is running/);
    const flags = await runCli(['admin', 'bootstrap', '--data-dir', other, '--host', '0.0.0.0', '--port', '9001'], {
      HOME: home,
    });
    assert.match(
      flags.stdout,
      /export FERRY_URL=http:\/\/127\.0\.0\.1:9001 /,
      'all interfaces are reached on loopback',
    );
  });

  it('a token signed on another data dir gets a 401 that says so', async () => {
    const other = await tempDir();
    const made = await runCli(['admin', 'bootstrap', '--data-dir', other, '--json'], { HOME: home });
    const foreign = parseJson(made.stdout, 'bootstrap --json') as { project_id: string; token: string };
    const res = await http(`${serve.url}/v2/projects/${foreign.project_id}/apps`, { token: foreign.token });
    assert.equal(res.status, 401);
    assert.equal(res.json.error.code, 'FERRY_TOKEN_INVALID');
    assert.match(res.json.error.message, /signed by another server's key/);
    assert.doesNotMatch(res.text, /jwt\.key|secret|stack/i);
    const viaCli = await runCli(['apps', 'list'], {
      HOME: home,
      FERRY_URL: serve.url,
      FERRY_TOKEN: foreign.token,
    });
    assert.equal(viaCli.code, 1);
    assert.match(viaCli.stderr, /another server's key.*FERRY_TOKEN_INVALID/);
    // An altered token is still simply not valid (a signature that does not match is told apart only).
    const bad = await http(`${serve.url}/v2/projects/${projectId}/apps`, { token: 'not-a-jwt' });
    assert.equal(bad.json.error.code, 'FERRY_TOKEN_INVALID');
  });

  it('login-link signs in without another owner (nor any account), and tokens list shows each account by name', async () => {
    const accounts = async () => {
      const list = await cli(['tokens', 'list', '--json']);
      assert.equal(list.code, 0, list.stderr);
      return parseJson(list.stdout, 'tokens list') as Array<{ name: string }>;
    };
    const owners = async () => (await accounts()).filter((a) => a.name === 'owner');
    const before = (await owners()).length;
    const allBefore = (await accounts()).length;
    const res = await runCli(['admin', 'login-link', '--data-dir', dataDir], { HOME: home });
    assert.equal(res.code, 0, res.stderr);
    const link = new RegExp(`  (${serve.url.replace(/[.]/g, '\\.')}/#token=(\\S+))\\n`).exec(res.stdout);
    assert.ok(link, res.stdout);
    const token = String(link[2]);
    const project = await http(`${serve.url}/v2/projects/${projectId}`, { token });
    assert.equal(project.status, 200, 'the link signs in to the project (manage scope)');
    assert.equal((await owners()).length, before, 'no new owner account');
    // A session of an owner account, not an account of its own: nothing is left behind (issue 43).
    assert.match(res.stdout, /sign-in session \(scope manage, no account of its own\) of the service account "owner"/);
    assert.equal((await accounts()).length, allBefore, 'no account at all');

    const json = await runCli(['admin', 'login-link', '--data-dir', dataDir, '--json'], { HOME: home });
    const out = parseJson(json.stdout, 'login-link --json') as { link: string; url: string; expires_at: string };
    assert.equal(out.url, serve.url);
    assert.ok(out.link.startsWith(`${serve.url}/#token=`));
    const minutes = (Date.parse(out.expires_at) - Date.now()) / 60_000;
    assert.ok(minutes > 30 && minutes <= 60, `short-lived: ${minutes} minutes`);

    const table = await cli(['tokens', 'list']);
    assert.match(table.stdout, /^ID\s+NAME\s+SCOPES\s+STATUS\s+CREATED_AT\s/m);
    assert.doesNotMatch(table.stdout, /sign-in link/, 'sign-in links make no accounts');
    assert.match(table.stdout, /\bowner\s+manage,run\s+active\s/);

    const again = await runCli(['admin', 'bootstrap', '--data-dir', dataDir], { HOME: home });
    assert.match(again.stdout, /already had \d+ active owner account/);
    assert.match(again.stdout, /ferry admin login-link/);

    const missing = await runCli(['admin', 'login-link', '--data-dir', dataDir, '--project-name', 'nope'], {
      HOME: home,
    });
    assert.equal(missing.code, 1);
    assert.match(missing.stderr, /No project named nope/);
  });

  it('deploy prints the URL of each public function, not /run when there is none', async () => {
    const dir = await tempDir('ferry-app-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "greeter"\n');
    await fs.writeFile(
      path.join(dir, 'main.ts'),
      'export function hello() { return "hi"; }\nexport function bye() { return "bye"; }\n',
    );
    const res = await cli(['deploy', dir]);
    assert.equal(res.code, 0, res.stderr);
    const base = `${serve.url}/v4/${projectId}/greeter`;
    assert.ok(res.stdout.includes(`  ${base}/hello\n`), res.stdout);
    assert.ok(res.stdout.includes(`  ${base}/bye\n`), res.stdout);
    assert.ok(!res.stdout.includes(`${base}/run`), res.stdout);
    const json = parseJson((await cli(['deploy', dir, '--json'])).stdout, 'deploy --json') as {
      run_url: string | null;
      function_urls: Record<string, string>;
    };
    assert.equal(json.run_url, null);
    assert.deepEqual(json.function_urls, { hello: `${base}/hello`, bye: `${base}/bye` });
    const apps = await cli(['apps', 'list']);
    const row = apps.stdout.split('\n').find((l) => l.startsWith('greeter '));
    assert.ok(row, apps.stdout);
    assert.match(row, /\s(hello,bye|bye,hello)\s/);
    assert.ok(!row.includes('/run'), row);

    // The default export is not callable by name: no public function at all.
    await fs.writeFile(path.join(dir, 'main.ts'), 'export default function () {\n  return 42;\n}\n');
    const none = await cli(['deploy', dir]);
    assert.equal(none.code, 0, none.stderr);
    assert.match(none.stderr, /Warning: greeter has no public function/);
    assert.ok(!none.stdout.includes('/v4/'), none.stdout);
  });

  it('deploy refuses a folder that does not exist, and one with main.ts and main.py but no entry', async () => {
    const missing = await cli(['deploy', '/nonexistent']);
    assert.equal(missing.code, 2);
    assert.match(missing.stderr, /^ferry: The folder \/nonexistent does not exist\n$/);

    const dir = await tempDir('ferry-app-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "twoentries"\n');
    await fs.writeFile(path.join(dir, 'main.ts'), 'export function run() { return 1; }\n');
    await fs.writeFile(path.join(dir, 'main.py'), 'def run():\n    return 1\n');
    const both = await cli(['deploy', dir]);
    assert.equal(both.code, 2);
    assert.match(both.stderr, /Both main\.ts and main\.py .*entry = "main\.ts" or entry = "main\.py"/);
    const app = await http(`${serve.url}/v2/projects/${projectId}/apps/twoentries`, { token: String(env.FERRY_TOKEN) });
    assert.equal(app.status, 404, 'nothing was uploaded');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "twoentries"\nentry = "main.py"\n');
    const named = await cli(['deploy', dir, '--json']);
    assert.equal(named.code, 0, named.stderr);
  });

  it('a Node app that throws while loading answers 502 with its message', async () => {
    const dir = await tempDir('ferry-app-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "boom"\n');
    await fs.writeFile(
      path.join(dir, 'main.ts'),
      "const broken = true;\nif (broken) throw new Error('kaboom at load');\nexport function run() {\n  return 1;\n}\n",
    );
    const deployed = await cli(['deploy', dir]);
    assert.equal(deployed.code, 0, deployed.stderr);
    const res = await http(`${serve.url}/v4/${projectId}/boom/run`, {
      method: 'POST',
      token: String(env.FERRY_TOKEN),
      body: {},
    });
    assert.equal(res.status, 502, res.text);
    assert.equal(res.json.error.code, 'FERRY_REPLICA_START_FAILED');
    assert.match(res.json.error.message, /exit code 3/);
    assert.match(res.json.error.message, /Error: kaboom at load/);
    const run = await cli(['run', 'boom']);
    assert.equal(run.code, 1);
    assert.match(run.stderr, /kaboom at load/);
  });

  it('prints JSON of the documented shape: arrays for lists, objects for one thing', async () => {
    const deployed = parseJson(
      (await cli(['deploy', path.join(REPO_ROOT, 'examples', 'hello'), '--json'])).stdout,
      'deploy',
    );
    const { build_id } = deployed as { build_id: string };
    const isArray = async (args: string[]) => {
      const res = await cli([...args, '--json']);
      assert.equal(res.code, 0, `${args.join(' ')}: ${res.stderr}`);
      const value = parseJson(res.stdout, args.join(' '));
      assert.ok(Array.isArray(value), `${args.join(' ')} prints an array`);
      return value as Array<Record<string, unknown>>;
    };
    const isObject = async (args: string[]) => {
      const res = await cli([...args, '--json']);
      assert.equal(res.code, 0, `${args.join(' ')}: ${res.stderr}`);
      const value = parseJson(res.stdout, args.join(' '));
      assert.ok(value && typeof value === 'object' && !Array.isArray(value), `${args.join(' ')} prints an object`);
      return value as Record<string, unknown>;
    };
    assert.ok((await isArray(['apps', 'list'])).some((a) => a.id === 'hello'));
    assert.ok((await isArray(['builds', 'list', 'hello'])).some((b) => b.id === build_id));
    const lines = await isArray(['builds', 'logs', build_id]);
    assert.ok(lines.length > 0 && lines.every((l) => typeof l.line === 'string' && typeof l.seq === 'number'));
    const follow = await cli(['builds', 'logs', build_id, '--follow', '--json']);
    const ndjson = follow.stdout
      .trimEnd()
      .split('\n')
      .map((l) => JSON.parse(l) as { line: string });
    assert.deepEqual(
      ndjson.map((l) => l.line),
      lines.map((l) => l.line),
      'with --follow, one object per line',
    );
    assert.equal(typeof (await isObject(['builds', 'files', build_id])).count, 'number');
    const ran = await isObject(['run', 'hello', '--data', '{"name":"JSON"}']);
    const runId = String(ran.run_id);
    assert.deepEqual(ran.result, { message: 'Hello, JSON!' });
    assert.ok((await isArray(['runs', 'list', 'hello'])).some((r) => r.run_id === runId));
    assert.equal((await isObject(['runs', 'get', 'hello', runId])).run_id, runId);
    await isArray(['runs', 'logs', 'hello', runId]);
    const appLog = await isArray(['logs', 'hello']);
    assert.ok(appLog.every((l) => typeof l.seq === 'number'));
    assert.equal((await isObject(['secrets', 'set', 'JSON_TEST', 'value'])).name, 'JSON_TEST');
    assert.ok((await isArray(['secrets', 'list'])).some((s) => s.name === 'JSON_TEST'));
    assert.deepEqual(await isObject(['secrets', 'delete', 'JSON_TEST']), { name: 'JSON_TEST', deleted: true });
    const created = await isObject(['tokens', 'create', 'json-test']);
    assert.equal(typeof created.token, 'string');
    const revoked = await isObject(['tokens', 'revoke', String(created.id)]);
    assert.equal(revoked.id, created.id);
    assert.equal(typeof revoked.revoked_at, 'string');
    const login = await isObject(['login', '--url', serve.url, '--token', String(env.FERRY_TOKEN)]);
    assert.equal(login.project_id, projectId);
  });
});
