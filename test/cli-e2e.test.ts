/**
 * The quickstart, end to end, as a user runs it: a real `ferry serve` process, `ferry admin bootstrap`
 * on its data dir while it runs, `ferry deploy examples/hello`, `ferry builds files`, a restart that keeps
 * everything, and a second server on the same data dir refused.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { selectFiles } from '../src/cli/pack.js';
import { http, REPO_ROOT, runCli, type ServeProcess, spawnServe, tempDir } from './helpers/ferry.js';

describe('CLI end to end', () => {
  let dataDir: string;
  let home: string;
  let serve: ServeProcess;
  let env: NodeJS.ProcessEnv;
  let deployed: {
    project_id: string;
    app_id: string;
    app_name: string;
    build_id: string;
    status: string;
    run_url: string;
    function_urls: Record<string, string>;
  };

  before(async () => {
    dataDir = await tempDir();
    home = await tempDir('ferry-home-');
    serve = await spawnServe(dataDir);
  });
  after(async () => {
    await serve?.stop();
  });

  it('bootstraps a project offline while the server runs', async () => {
    const res = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], { HOME: home });
    assert.equal(res.code, 0, res.stderr);
    const out = JSON.parse(res.stdout) as { project_id: string; token: string };
    assert.deepEqual(Object.keys(out).sort(), ['project_id', 'token']);
    assert.match(out.project_id, /^p-[0-9a-f]{8}$/);
    const stat = await fs.stat(path.join(dataDir, 'keys', 'jwt.key'));
    assert.equal(stat.mode & 0o777, 0o600, 'the signing key is readable by its owner only');
    env = { HOME: home, FERRY_URL: serve.url, FERRY_TOKEN: out.token, FERRY_PROJECT: out.project_id };
    const apps = await http(`${serve.url}/v2/projects/${out.project_id}/apps`, { token: out.token });
    assert.equal(apps.status, 200, 'the running server accepts the new token');
  });

  it('deploys examples/hello and prints only the JSON summary on stdout', async () => {
    const res = await runCli(['deploy', path.join(REPO_ROOT, 'examples', 'hello'), '--json'], env);
    assert.equal(res.code, 0, `${res.stdout}\n${res.stderr}`);
    deployed = JSON.parse(res.stdout);
    assert.deepEqual(Object.keys(deployed).sort(), [
      'app_id',
      'app_name',
      'build_id',
      'function_urls',
      'project_id',
      'run_url',
      'status',
    ]);
    assert.equal(deployed.status, 'ready');
    assert.equal(deployed.app_name, 'hello');
    assert.equal(deployed.run_url, `${serve.url}/v4/${env.FERRY_PROJECT}/hello/run`);
    assert.deepEqual(deployed.function_urls, { run: deployed.run_url });
    assert.match(res.stderr, /Build ready/, 'the build log was streamed');
  });

  it('shows the progress and the run URL without --json', async () => {
    const res = await runCli(['deploy', path.join(REPO_ROOT, 'examples', 'hello')], env);
    assert.equal(res.code, 0, res.stderr);
    assert.match(res.stdout, /files, /);
    assert.match(res.stdout, /uploaded/);
    assert.match(res.stdout, /\| Build ready/);
    assert.ok(res.stdout.trimEnd().endsWith(`/v4/${env.FERRY_PROJECT}/hello/run`), res.stdout);
  });

  it('lists the same files that deploy packed', async () => {
    const res = await runCli(['builds', 'files', deployed.build_id, '--json'], env);
    assert.equal(res.code, 0, res.stderr);
    const listing = JSON.parse(res.stdout) as { count: number; files: Array<{ path: string; size: number }> };
    const dir = path.join(REPO_ROOT, 'examples', 'hello');
    const packed = await selectFiles(dir, parseAppConfig(await fs.readFile(path.join(dir, 'ferry.toml'), 'utf8')));
    assert.deepEqual(listing.files.map((f) => [f.path, f.size]).sort(), packed.map((f) => [f.path, f.size]).sort());
    assert.equal(listing.count, packed.length);
    const table = await runCli(['builds', 'files', deployed.build_id], env);
    assert.match(table.stdout, /main\.ts/);
  });

  it('fails with a readable line and a non-zero exit for a bad ferry.toml', async () => {
    const dir = await tempDir('ferry-app-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "Bad Name"\n');
    const res = await runCli(['deploy', dir], env);
    assert.equal(res.code, 1);
    assert.match(res.stderr, /^ferry: .*app\.name/m);
    assert.doesNotMatch(res.stderr, /\n\s+at /, 'no stack trace');
  });

  it('exits non-zero when the build fails', async () => {
    const dir = await tempDir('ferry-app-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "broken"\n');
    await fs.writeFile(path.join(dir, 'main.ts'), 'export function run( {\n');
    const res = await runCli(['deploy', dir, '--json'], env);
    assert.equal(res.code, 1);
    assert.equal(JSON.parse(res.stdout).status, 'failed');
    assert.match(res.stderr, /Build .* failed/);
  });

  it('manages tokens and lists apps and builds from the CLI', async () => {
    const created = await runCli(['tokens', 'create', 'ci', '--scope', 'run', '--json'], env);
    assert.equal(created.code, 0, created.stderr);
    const sa = JSON.parse(created.stdout) as { id: string; token: string; scopes: string[] };
    assert.deepEqual(sa.scopes, ['run']);
    const list = await runCli(['tokens', 'list'], env);
    assert.match(list.stdout, new RegExp(sa.id));
    assert.ok(!list.stdout.includes(sa.token), 'tokens are never listed');
    const revoke = await runCli(['tokens', 'revoke', sa.id], env);
    assert.equal(revoke.code, 0, revoke.stderr);
    const apps = await runCli(['apps', 'list'], env);
    assert.match(apps.stdout, /hello\s+active/);
    const builds = await runCli(['builds', 'list', 'hello'], env);
    assert.match(builds.stdout, new RegExp(deployed.build_id));
  });

  it('stores the login in a 0600 config file', async () => {
    const res = await runCli(['login', '--url', serve.url, '--token', String(env.FERRY_TOKEN)], { HOME: home });
    assert.equal(res.code, 0, res.stderr);
    const file = path.join(home, '.config', 'ferry', 'config.json');
    assert.equal((await fs.stat(file)).mode & 0o777, 0o600);
    const apps = await runCli(['apps', 'list', '--json'], { HOME: home });
    assert.equal(apps.code, 0, apps.stderr);
    assert.ok(JSON.parse(apps.stdout).some((a: { id: string }) => a.id === 'hello'));
  });

  it('refuses a second server on the same data dir', async () => {
    const res = await runCli(['serve', '--port', '0', '--data-dir', dataDir], {}, 30_000);
    assert.equal(res.code, 1);
    assert.match(res.stderr, /already using the data directory/);
  });

  it('keeps everything across a restart', async () => {
    const code = await serve.stop('SIGTERM');
    assert.equal(code, 0, serve.output());
    serve = await spawnServe(dataDir);
    const token = String(env.FERRY_TOKEN);
    const app = await http(`${serve.url}/v2/projects/${env.FERRY_PROJECT}/apps/hello`, { token });
    assert.equal(app.status, 200);
    assert.equal(app.json.state, 'active');
    const listing = await http(
      `${serve.url}/v2/projects/${env.FERRY_PROJECT}/apps/hello/builds/${deployed.build_id}/zip-contents`,
      { token },
    );
    assert.equal(listing.status, 200);
    assert.ok(listing.json.count > 0);
  });

  it('takes over the lock of a server killed with SIGKILL', async () => {
    await serve.stop('SIGKILL');
    serve = await spawnServe(dataDir);
    const health = await http(`${serve.url}/healthz`);
    assert.equal(health.status, 200);
  });
});
