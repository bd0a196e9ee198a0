/**
 * The custom builder in temporary folders: it checks that the entrypoint can start (the command, its
 * script) without running anything, and fails with a message that says what is wrong.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { createCustomBuilder, parseFirstCommand } from '../src/runtimes/custom/builder.js';
import { createDefaultBuilders, selectBuilder } from '../src/runtimes/index.js';
import { assertFailed, assertReady, buildHarness, type Workspace } from './helpers/builds.js';

const h = buildHarness('custom', () => createCustomBuilder());
const { workspace, runBuild } = h;

/** A ferry.toml for the custom runtime; `entrypoint` is TOML (a string or a list). */
function toml(entrypoint: string, extra = ''): string {
  return `[app]\nname = "custom-app"\nruntime = "custom"\n\n[runtime.custom]\nentrypoint = ${entrypoint}\n${extra}`;
}

async function app(entrypoint: string, files: Record<string, string> = {}): Promise<Workspace> {
  return workspace(null, { 'ferry.toml': toml(entrypoint), ...files });
}

const SERVER_JS = "require('node:http').createServer((q, s) => s.end('ok')).listen(process.env.PORT);\n";

describe('custom builder', () => {
  it('passes a list entrypoint whose interpreter and script exist, and writes nothing', async () => {
    const ws = await workspace(null, {
      'ferry.toml': toml('["node", "--enable-source-maps", "server.js"]', 'healthcheck_endpoint = "/health"\n'),
      'server.js': SERVER_JS,
    });
    const outcome = await runBuild(ws);
    assert.deepEqual(assertReady(outcome), { runtime: 'custom', entry: 'source' });
    const log = outcome.lines.join('\n');
    assert.ok(outcome.lines.includes('Entrypoint: ["node","--enable-source-maps","server.js"] (run directly)'), log);
    assert.ok(
      outcome.lines.some((l) => /^Command: node \(\/usr(\/local)?\/bin\/node\)$/.test(l)),
      log,
    );
    assert.ok(outcome.lines.includes('Script: server.js (found in the app folder)'), log);
    assert.ok(outcome.lines.includes('Port: 8080 (given to your server as PORT)'), log);
    assert.ok(outcome.lines.includes('Health check: GET /health answers 2xx or 3xx'), log);
    assert.ok(outcome.lines.includes('Ready check: TCP connect to port 8080'), log);
    assert.ok(!outcome.lines.some((l) => l.startsWith('Hint:')), 'no exec hint for the list form');
    assert.deepEqual((await fs.readdir(ws.sourceDir)).sort(), ['ferry.toml', 'server.js']);
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
  });

  it('fails when the interpreter script is not in the app folder', async () => {
    const ws = await app('["node", "src/server.js"]', { 'server.js': SERVER_JS });
    const err = assertFailed(await runBuild(ws), /script src\/server\.js is not in the app folder/);
    assert.match(err.message, /^runtime\.custom\.entrypoint: /);
  });

  it('fails for a command that is not on the replica PATH', async () => {
    const ws = await app('["ferry-no-such-server", "--port", "8080"]');
    assertFailed(
      await runBuild(ws),
      /command "ferry-no-such-server" was not found on the replica's PATH \(\/usr\/local\/bin:\/usr\/bin:\/bin\)/,
    );
  });

  it('says a shell builtin in the list form needs the string form', async () => {
    const ws = await app('["exec", "node", "server.js"]', { 'server.js': SERVER_JS });
    assertFailed(await runBuild(ws), /"exec" is a shell builtin, not a program: write the entrypoint as a string/);
  });

  it('refuses paths that escape the app folder', async () => {
    const up = await app('["../server"]');
    // Something real outside the folder, so the failure is about where it is, not whether it exists.
    await fs.writeFile(path.join(up.root, 'server'), '#!/bin/sh\n', { mode: 0o755 });
    assertFailed(await runBuild(up), /command \.\.\/server is outside the app folder/);

    const script = await app('["python3", "../../main.py"]');
    assertFailed(await runBuild(script), /script \.\.\/\.\.\/main\.py is outside the app folder/);

    const absolute = await app(JSON.stringify(['node', path.join(h.tmpRoot, 'server.js')]));
    assertFailed(
      await runBuild(absolute),
      /is outside the folders a replica sees .* relative path such as \.\/server\.js/,
    );

    const link = await app('["./server"]');
    await fs.writeFile(path.join(link.root, 'real-server'), '#!/bin/sh\n', { mode: 0o755 });
    await fs.symlink(path.join(link.root, 'real-server'), path.join(link.sourceDir, 'server'));
    assertFailed(await runBuild(link), /command \.\/server is a link to a file outside the app folder/);
  });

  it('passes a relative program of the app, warning when it lost its exec bit', async () => {
    const ws = await app('["./bin/server", "--verbose"]', { 'bin/server': '#!/bin/sh\nexec sleep 1\n' });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(outcome.lines.includes('Command: ./bin/server (found in the app folder)'), outcome.lines.join('\n'));
    assert.ok(
      outcome.lines.some((l) => l.startsWith('Warning: ./bin/server is not executable')),
      outcome.lines.join('\n'),
    );

    await fs.chmod(path.join(ws.sourceDir, 'bin/server'), 0o755);
    const again = await runBuild(ws);
    assertReady(again);
    assert.ok(again.lines.includes('Command: ./bin/server (found in the app folder, executable)'));
    assert.ok(!again.lines.some((l) => l.startsWith('Warning:')), again.lines.join('\n'));
  });

  it('passes a string entrypoint starting with exec, checking the command after it', async () => {
    const ws = await app('"exec python3 -u server.py --port \\"$PORT\\""', { 'server.py': 'print("hi")\n' });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    const log = outcome.lines.join('\n');
    assert.ok(
      outcome.lines.includes('Entrypoint: "exec python3 -u server.py --port \\"$PORT\\"" (run with /bin/sh -c)'),
      log,
    );
    assert.ok(
      outcome.lines.some((l) => /^Command: python3 \(\/usr(\/local)?\/bin\/python3\)$/.test(l)),
      log,
    );
    assert.ok(outcome.lines.includes('Script: server.py (found in the app folder)'), log);
    assert.ok(!outcome.lines.some((l) => l.startsWith('Hint:')), log);

    const dynamic = await app('"exec node $MAIN"');
    const dynamicOutcome = await runBuild(dynamic);
    assertReady(dynamicOutcome);
    assert.ok(
      dynamicOutcome.lines.includes('Entrypoint not checked from $MAIN on: the shell computes it when it runs'),
      dynamicOutcome.lines.join('\n'),
    );

    const missing = await app('"PYTHONUNBUFFERED=1 exec python3 app.py"', { 'server.py': '' });
    assertFailed(await runBuild(missing), /script app\.py is not in the app folder/);
  });

  it('hints at exec for a string entrypoint without it', async () => {
    const ws = await app('"node server.js"', { 'server.js': SERVER_JS });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(
      outcome.lines.some(
        (l) => l.startsWith('Hint: start the entrypoint with "exec "') && l.includes('docs/functions.md'),
      ),
      outcome.lines.join('\n'),
    );
  });

  it('checks only the first command of a string with shell syntax', async () => {
    const ws = await app('"node server.js && echo done | tee log.txt"', { 'server.js': SERVER_JS });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    const log = outcome.lines.join('\n');
    assert.ok(outcome.lines.includes('Script: server.js (found in the app folder)'), log);
    assert.ok(
      outcome.lines.includes('Entrypoint not checked beyond its first command: it uses shell syntax (&&)'),
      log,
    );

    // The first command is still checked.
    const bad = await app('"nodee server.js; sleep 1"', { 'server.js': SERVER_JS });
    assertFailed(await runBuild(bad), /command "nodee" was not found/);

    // A builtin first (cd), a command substitution: nothing to look up, but the build passes.
    const cd = await app('"cd sub && exec ./server"');
    const cdOutcome = await runBuild(cd);
    assertReady(cdOutcome);
    assert.ok(cdOutcome.lines.includes('Entrypoint not checked: it starts with the shell builtin "cd"'));
    const sub = await app('"exec $(cat cmd.txt)"');
    const subOutcome = await runBuild(sub);
    assertReady(subOutcome);
    assert.ok(subOutcome.lines.includes('Entrypoint not checked: it starts with shell syntax ($()'));
  });

  it('accepts a system program by absolute path and follows env to the command it runs', async () => {
    const ws = await app('["/usr/bin/env", "-u", "DEBUG", "MODE=prod", "node", "server.js"]', {
      'server.js': SERVER_JS,
    });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    const log = outcome.lines.join('\n');
    assert.ok(outcome.lines.includes('Command: /usr/bin/env (found)'), log);
    assert.ok(
      outcome.lines.some((l) => l.startsWith('Command: node (')),
      log,
    );
    assert.ok(outcome.lines.includes('Script: server.js (found in the app folder)'), log);

    const missing = await app('["/usr/bin/env", "node", "nope.js"]');
    assertFailed(await runBuild(missing), /script nope\.js is not in the app folder/);

    const noFile = await app('["/usr/bin/ferry-no-such-program"]');
    assertFailed(await runBuild(noFile), /command \/usr\/bin\/ferry-no-such-program does not exist on this server/);
  });

  it('does not look for a script behind inline code', async () => {
    const ws = await app('["node", "-e", "require(\'./gone.js\')"]');
    const outcome = await runBuild(ws);
    assertReady(outcome);
    assert.ok(outcome.lines.includes('Script: not checked (node -e runs code that is not a file of the app)'));
  });

  it("is the default builders' choice for the custom runtime", async () => {
    const ws = await app('["node", "server.js"]', { 'server.js': SERVER_JS });
    const config = parseAppConfig(await fs.readFile(path.join(ws.sourceDir, 'ferry.toml'), 'utf8'));
    assert.equal(selectBuilder(config, ws.sourceDir, createDefaultBuilders()).name, 'custom');
  });
});

describe('custom builder: shell words', () => {
  it('splits the first command the way sh does', () => {
    const words = (s: string) => parseFirstCommand(s).words.map((w) => (w.dynamic ? `<${w.text}>` : w.text));
    assert.deepEqual(words(`exec node 'my server.js' "a \\"b\\"" c\\ d`), [
      'exec',
      'node',
      'my server.js',
      'a "b"',
      'c d',
    ]);
    assert.deepEqual(words('FOO=1 exec $APP ~/x "$HOME"'), ['FOO=1', 'exec', '<$APP>', '<~/x>', '<$HOME>']);
    assert.deepEqual(parseFirstCommand('a b | c').syntax, '|');
    assert.deepEqual(parseFirstCommand('a b || c').syntax, '||');
    assert.deepEqual(parseFirstCommand('a `b`').syntax, '`');
    assert.deepEqual(parseFirstCommand('a # comment; b').syntax, null);
    assert.throws(() => parseFirstCommand("exec node 'server.js"), /unterminated ' quote/);
  });
});
