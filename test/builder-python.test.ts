/**
 * The Python builder against the real interpreter and the real pip, in temporary folders (fixtures are
 * copied, never built in place). pip never reaches a package index: dependencies are a wheel inside the
 * app folder, or a local server that never answers when a test needs pip to hang.
 */
import assert from 'node:assert/strict';
import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { describe, it } from 'node:test';
import { promisify } from 'node:util';
import { parseAppConfig } from '../src/apps/app-config.js';
import { BuildFailedError } from '../src/builds/build-failed.js';
import { createDefaultBuilders, selectBuilder } from '../src/runtimes/index.js';
import { createPythonBuilder, requirementsImageSteps } from '../src/runtimes/python/builder.js';
import { PYTHON_BOOTSTRAP } from '../src/runtimes/python/index.js';
import { findPython } from '../src/runtimes/python/interpreter.js';
import { pipFailure } from '../src/runtimes/python/pip-failure.js';
import { requirementsLocalPaths, requirementsProblem } from '../src/runtimes/python/requirements.js';
import { detectSandbox } from '../src/sandbox/launch.js';
import {
  assertFailed,
  assertReady,
  buildHarness,
  processesIn,
  processesWithArgs,
  shareTestNetwork,
  type Workspace,
  waitUntilGone,
} from './helpers/builds.js';
import { LEFTPAD_WHEEL, leftpadWheel } from './helpers/python-wheel.js';

const TIMEOUT = 60_000;
/**
 * How long a cancelled build may take to end after the abort: idle, pip ends well under a second after it.
 * Generous on purpose (a busy 2-core machine stretches that several times), yet below the 15 s read timeout
 * the builder gives pip: a pip that was never stopped, and gave up on the silent index by itself, still fails.
 */
const CANCEL_BOUND_MS = 12_000;

const h = buildHarness('python', () => createPythonBuilder());
const { workspace, runBuild } = h;

async function wheelHash(): Promise<string> {
  return createHash('sha256')
    .update(await leftpadWheel())
    .digest('hex');
}

async function depsWorkspace(extra: Record<string, string | Buffer> = {}): Promise<Workspace> {
  return workspace('python-deps', { [`wheels/${LEFTPAD_WHEEL}`]: await leftpadWheel(), ...extra });
}

/** Runs the Python bootstrap on a built workspace, without a sandbox, the way a replica starts. */
async function startBootstrap(ws: Workspace): Promise<{ socket: string; child: ChildProcess; output: () => string }> {
  const python = await findPython();
  assert.ok(python, 'a python3 interpreter');
  const socket = path.join(ws.root, 'replica.sock');
  const child = spawn(python, ['-u', PYTHON_BOOTSTRAP], {
    env: {
      PATH: '/usr/local/bin:/usr/bin:/bin',
      HOME: '/tmp',
      FERRY_SOCKET: socket,
      FERRY_ENTRY: path.join(ws.sourceDir, 'main.py'),
      PYTHONDONTWRITEBYTECODE: '1',
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout?.on('data', (d: Buffer) => (output += d));
  child.stderr?.on('data', (d: Buffer) => (output += d));
  const end = Date.now() + 10_000;
  while (!(await fs.stat(socket).catch(() => null))) {
    if (child.exitCode !== null || Date.now() > end) assert.fail(`the bootstrap did not start:\n${output}`);
    await new Promise((r) => setTimeout(r, 20));
  }
  return { socket, child, output: () => output };
}

function callReplica(socket: string, fn: string, body: unknown): Promise<string> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      {
        socketPath: socket,
        path: `/_ferry/call/${fn}`,
        method: 'POST',
        headers: { 'content-type': 'application/json' },
      },
      (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (d: string) => (text += d));
        res.on('end', () => resolve(text));
      },
    );
    req.on('error', reject);
    req.end(JSON.stringify(body));
  });
}

describe('python builder: checks', () => {
  it('builds main.py without dependencies and lists its public functions', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "py-plain"\n',
      'main.py': [
        'import os',
        'from os.path import join',
        'COUNT = 0',
        'KEY = os.environ.get("KEY")',
        'def run(name: str = "world"):',
        '    global COUNT',
        '    COUNT += 1',
        '    return f"Hello, {name}!"',
        'async def later(): return 1',
        'def stream():',
        '    yield 1',
        'alias = run',
        'def _private(): pass',
        'class Model: pass',
        '',
      ].join('\n'),
    });
    const outcome = await runBuild(ws);
    const result = assertReady(outcome);
    assert.deepEqual(result, {
      runtime: 'python',
      entry: 'source/main.py',
      functions: ['alias', 'later', 'run', 'stream'],
    });
    assert.ok(outcome.lines.includes('Entry: main.py'), outcome.lines.join('\n'));
    assert.ok(
      outcome.lines.some((l) => /^Python 3\.\d+\.\d+ \(\/.*python3[\d.]*\)$/.test(l)),
      outcome.lines.join('\n'),
    );
    assert.ok(outcome.lines.includes('Public functions: alias, later, run, stream'), outcome.lines.join('\n'));
    assert.ok(!outcome.lines.some((l) => l.startsWith('Running pip')), 'no requirements.txt, so no pip');
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
    assert.deepEqual(await fs.readdir(ws.sourceDir), ['ferry.toml', 'main.py'], 'no __pycache__ written');
  });

  it('leaves functions unknown when a public name may be bound to a callable at import', async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "py-dynamic"\n',
      'main.py': 'def _make():\n    def inner(): return 1\n    return inner\nrun = _make()\ndef other(): pass\n',
    });
    const outcome = await runBuild(ws);
    const result = assertReady(outcome);
    assert.deepEqual(result, { runtime: 'python', entry: 'source/main.py' });
    assert.ok(
      outcome.lines.some((l) => l.startsWith('Public functions: decided when a replica loads main.py')),
      outcome.lines.join('\n'),
    );
  });

  it('never runs the app while checking it', { timeout: TIMEOUT }, async () => {
    const marker = path.join(h.tmpRoot, 'ran-at-build');
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "py-side-effect"\n',
      'main.py': `open(${JSON.stringify(marker)}, "w").write("ran")\ndef run(): return 1\n`,
    });
    assertReady(await runBuild(ws));
    await assert.rejects(fs.access(marker), 'main.py did not run during the build');
  });

  it('fails on a syntax error and logs the file and line', { timeout: TIMEOUT }, async () => {
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "py-broken"\n',
      'main.py': 'def run():\n    return 1 +\n',
    });
    const outcome = await runBuild(ws);
    const error = assertFailed(outcome, /^Syntax check failed: main\.py:2:\d+: invalid syntax$/);
    assert.ok(error);
    assert.ok(
      outcome.lines.some((l) => /^main\.py:2:\d+: SyntaxError: invalid syntax$/.test(l)),
      outcome.lines.join('\n'),
    );
    assert.ok(outcome.lines.includes('        return 1 +'), 'the offending line is quoted');
  });

  it('fails on errors only the compiler finds, not just the parser', async () => {
    const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "py-return"\n', 'main.py': 'x = 1\nreturn x\n' });
    assertFailed(await runBuild(ws), /^Syntax check failed: main\.py:2:\d+: 'return' outside function$/);
  });

  it('fails clearly when there is no main.py', async () => {
    const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "py-empty"\n', 'app.py': 'def run(): pass\n' });
    assertFailed(
      await runBuild(ws),
      /^No entry file: expected main\.ts, main\.js or main\.mjs \(TypeScript\/JavaScript\) or main\.py \(Python\) at the archive root$/,
    );
  });

  it('is the builder the server picks for main.py', async () => {
    const ws = await workspace(null, { 'ferry.toml': '[app]\nname = "py-pick"\n', 'main.py': '' });
    const builder = selectBuilder(parseAppConfig('[app]\nname = "py-pick"\n'), ws.sourceDir, createDefaultBuilders());
    assert.equal(builder.name, 'python');
  });
});

describe('python builder: shipped bytecode (issue 30)', () => {
  it('drops an uploaded __pycache__ and .pyc files, so main.py runs and not a bytecode stand-in', {
    timeout: TIMEOUT,
  }, async () => {
    const python = await findPython();
    assert.ok(python, 'a python3 interpreter');
    const run = promisify(execFile);
    const { stdout: tag } = await run(python, ['-c', 'import sys; print(sys.implementation.cache_tag)']);
    // Bytecode of another main.py, compiled so that Python never compares it with the source beside it.
    const work = await fs.mkdtemp(path.join(h.tmpRoot, 'pyc-'));
    await fs.writeFile(path.join(work, 'main.py'), 'def run():\n    return "FROM-THE-PYC"\n');
    const pyc = path.join(work, 'main.pyc');
    await run(python, [
      '-c',
      'import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)',
      path.join(work, 'main.py'),
      pyc,
    ]);
    const ws = await workspace(null, {
      'ferry.toml': '[app]\nname = "py-pyc"\n',
      'main.py': 'import helper\n\ndef run():\n    return "FROM-MAIN-PY " + helper.NAME\n',
      'helper.py': 'NAME = "helper.py"\n',
      [`__pycache__/main.${tag.trim()}.pyc`]: await fs.readFile(pyc),
      'lib/__pycache__/x.pyc': 'stale',
      'stray.pyo': 'stale',
    });
    const outcome = await runBuild(ws);
    assertReady(outcome);
    // What runs is main.py (the old builder left the bytecode, and the function answered FROM-THE-PYC).
    const replica = await startBootstrap(ws);
    try {
      const text = await callReplica(replica.socket, 'run', {});
      assert.equal(text, '{"type":"result","data":"FROM-MAIN-PY helper.py"}\n', replica.output());
    } finally {
      replica.child.kill('SIGTERM');
    }
    assert.ok(
      outcome.lines.includes(
        'Removed 3 compiled Python files (__pycache__, .pyc) from the upload: replicas run the .py files shipped',
      ),
      outcome.lines.join('\n'),
    );
    await assert.rejects(fs.access(path.join(ws.sourceDir, '__pycache__')));
    await assert.rejects(fs.access(path.join(ws.sourceDir, 'lib', '__pycache__')));
    await assert.rejects(fs.access(path.join(ws.sourceDir, 'stray.pyo')));
  });
});

describe('python builder: dependencies', () => {
  it('installs requirements.txt into out/site-packages, where a replica imports them', {
    timeout: TIMEOUT,
  }, async () => {
    const ws = await depsWorkspace();
    const outcome = await runBuild(ws);
    const result = assertReady(outcome);
    assert.deepEqual(result, { runtime: 'python', entry: 'source/main.py', functions: ['run'] });
    const log = outcome.lines.join('\n');
    assert.ok(outcome.lines.includes('Running pip install -r requirements.txt --target out/site-packages'), log);
    assert.ok(
      outcome.lines.some((l) => /Successfully installed leftpad-1\.0\.0/.test(l)),
      log,
    );
    assert.ok(
      outcome.lines.some((l) => /^pip install finished in [\d.]+ s$/.test(l)),
      log,
    );
    await fs.access(path.join(ws.outputDir, 'site-packages', 'leftpad', '__init__.py'));
    // Nothing was installed anywhere else: the source folder holds exactly what was uploaded.
    assert.deepEqual((await fs.readdir(ws.sourceDir)).sort(), [
      'ferry.toml',
      'main.py',
      'requirements.txt',
      'vendor',
      'wheels',
    ]);

    const replica = await startBootstrap(ws);
    try {
      const text = await callReplica(replica.socket, 'run', { text: 'ab' });
      assert.equal(
        text,
        '{"type":"result","data":{"padded":"....ab","from":"out/site-packages/leftpad/__init__.py"}}\n',
        replica.output(),
      );
    } finally {
      replica.child.kill('SIGTERM');
    }
  });

  it('refuses to build a source package (wheels only, so builds stay predictable)', { timeout: TIMEOUT }, async () => {
    const ws = await depsWorkspace({
      'requirements.txt': './srcpkg\n',
      'srcpkg/setup.py':
        "open('/tmp/ferry-setup-py-ran', 'w').write('ran')\nfrom setuptools import setup\nsetup(name='srcpkg', version='1.0')\n",
    });
    await fs.rm('/tmp/ferry-setup-py-ran', { force: true });
    const outcome = await runBuild(ws);
    assertFailed(
      outcome,
      /^requirements\.txt line 1: "\.\/srcpkg": a local folder is built from source; Ferry installs wheels only/,
    );
    await assert.rejects(fs.access('/tmp/ferry-setup-py-ran'), 'setup.py did not run');
    for (const line of ['-e ./srcpkg', 'pkg @ git+https://example.invalid/pkg.git', 'pkg-1.0.tar.gz', '-r more.txt']) {
      const other = await runBuild(await depsWorkspace({ 'requirements.txt': `${line}\n` }));
      assertFailed(other, /Ferry installs wheels only/);
    }
  });

  describe('requirements.txt read as pip reads it (issue 30)', () => {
    /** An in-tree build backend that says when pip runs it. */
    const backend = {
      'pkg/pyproject.toml':
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n\n[project]\nname = "evilpkg"\nversion = "1.0"\n',
      'pkg/backend.py':
        'import sys\ndef _ran(*a, **k):\n    print("FERRY-ATTACK backend ran", file=sys.stderr)\n    raise RuntimeError("no")\nget_requires_for_build_wheel = prepare_metadata_for_build_wheel = build_wheel = _ran\n',
    };

    const bypasses: Array<{ file: string; line: number; text: string; reason: RegExp }> = [
      // Shortened long options (optparse takes any unambiguous prefix), and the other spellings pip reads.
      { file: '--requirem /etc/passwd\n', line: 1, text: '--requirem /etc/passwd', reason: /nested requirements file/ },
      { file: '--constr /etc/passwd\n', line: 1, text: '--constr /etc/passwd', reason: /constraints file/ },
      { file: 'leftpad\n-r/etc/passwd\n', line: 2, text: '-r/etc/passwd', reason: /nested requirements file/ },
      { file: '--requirement=/etc/passwd\n', line: 1, text: '--requirement=/etc/passwd', reason: /nested/ },
      { file: '--ed pkg/\n', line: 1, text: '--ed pkg/', reason: /editable install/ },
      // A continuation, a comment, spaces and a tab: the logical line pip reads.
      { file: '# deps\n--requi\\\nrement /etc/passwd\n', line: 2, text: '--requirement /etc/passwd', reason: /nested/ },
      { file: '  -c /etc/passwd   # pinned\n', line: 1, text: '-c /etc/passwd', reason: /constraints file/ },
      { file: '--pre \t-r /etc/passwd\n', line: 1, text: '--pre \t-r /etc/passwd', reason: /nested/ },
      // Local folders pip builds with their own backend, however they are written.
      { file: 'pkg/\n', line: 1, text: 'pkg/', reason: /a local folder is built from source/ },
      { file: 'pkg/[extra]\n', line: 1, text: 'pkg/[extra]', reason: /a local folder is built from source/ },
      { file: '.\n', line: 1, text: '.', reason: /a local folder is built from source/ },
      {
        file: 'evilpkg @ file:pkg\n',
        line: 1,
        text: 'evilpkg @ file:pkg',
        reason: /a local folder is built from source/,
      },
      {
        file: 'evilpkg@file:./pkg\n',
        line: 1,
        text: 'evilpkg@file:./pkg',
        reason: /a local folder is built from source/,
      },
      { file: 'pkg/ ; python_version > "3"\n', line: 1, text: 'pkg/ ; python_version > "3"', reason: /local folder/ },
      // Files outside the app, and what pip would expand or decode differently.
      { file: '--find-links /etc\nleftpad\n', line: 1, text: '--find-links /etc', reason: /a folder of the app/ },
      { file: '-f../..\nleftpad\n', line: 1, text: '-f../..', reason: /a folder of the app/ },
      { file: '--index-url file:///etc\n', line: 1, text: '--index-url file:///etc', reason: /http or https URL/ },
      {
        file: '../../etc/x-1.0-py3-none-any.whl\n',
        line: 1,
        text: '../../etc/x-1.0-py3-none-any.whl',
        reason: /outside the app/,
      },
      { file: `\${HOME}/x.whl\n`, line: 1, text: `\${HOME}/x.whl`, reason: /environment variables/ },
      { file: '# -*- coding: utf-7 -*-\n+AC0-r /etc/passwd\n', line: 1, text: '', reason: /must be UTF-8/ },
      { file: 'pkg-1.0.zip\n', line: 1, text: 'pkg-1.0.zip', reason: /source archive/ },
      {
        file: 'https://example.invalid/pkg-1.0.tar.gz\n',
        line: 1,
        text: 'https://example.invalid/pkg-1.0.tar.gz',
        reason: /not a wheel/,
      },
      {
        file: 'leftpad --index-url http://x.invalid/\n',
        line: 1,
        text: 'leftpad --index-url http://x.invalid/',
        reason: /line of its own/,
      },
      { file: '--r /etc/passwd\n', line: 1, text: '--r /etc/passwd', reason: /ambiguous/ },
      { file: '--no-such-option\n', line: 1, text: '--no-such-option', reason: /not an option pip reads/ },
    ];

    it('reads lines, continuations, comments and options as pip does', () => {
      const dir = h.tmpRoot;
      const check = (text: string) => requirementsProblem(Buffer.from(text), dir);
      // pip-compile's output: continued hashes, indented comments, markers.
      assert.equal(
        check(
          'leftpad==1.0.0 \\\n    --hash=sha256:abc \\\n    --hash=sha256:def\n    # via -r requirements.in\nrequests[socks]>=2,<3 ; python_version >= "3.8"\n',
        ),
        undefined,
      );
      assert.equal(
        check('\ufeffzope.interface==6.0\r\n-i https://pypi.org/simple\r\n--extra https://x.example/\r\n'),
        undefined,
      );
      assert.equal(check('x @ https://files.example/x-1.0-py3-none-any.whl#sha256=abc\n'), undefined);
      // Python splits lines at \v and U+2028 too: the option is a line of its own there.
      for (const sep of ['\v', '\u2028', '\x1c', '\r']) {
        assert.deepEqual(check(`foo${sep}-r /etc/passwd\n`), {
          line: 2,
          text: '-r /etc/passwd',
          reason: 'a nested requirements file (-r/--requirement) is not supported',
        });
      }
      // After "--" pip reads no options; a path climbing out through a URL is still a path to pip.
      assert.equal(check('leftpad -- -r /etc/passwd\n'), undefined);
      assert.match(check('x @ https://a/../../../../../../../etc/x.whl\n')?.reason ?? '', /outside the app/);
      assert.match(check('--pypi /etc\n')?.reason ?? '', /--pypi-url must be an http or https URL/);
      assert.match(check('-f\n')?.reason ?? '', /needs a value/);
      assert.match(check("--find-links '/e'tc\n")?.reason ?? '', /a folder of the app/);
      // UTF-16 (a byte order mark) and a declared coding: pip would decode them otherwise than this check.
      const utf16 = Buffer.concat([Buffer.from([0xff, 0xfe]), Buffer.from('-r /etc/passwd\n', 'utf16le')]);
      assert.match(requirementsProblem(utf16, dir)?.reason ?? '', /must be UTF-8/);
      assert.match(check('# coding: latin-1\nleftpad\n')?.reason ?? '', /must be UTF-8/);
      assert.equal(check('# -*- coding: utf-8 -*-\nleftpad\n'), undefined);
    });

    it('refuses each way round the check, naming the line, before pip runs', { timeout: 4 * TIMEOUT }, async () => {
      for (const bypass of bypasses) {
        const ws = await depsWorkspace({ 'requirements.txt': bypass.file, ...backend });
        const outcome = await runBuild(ws);
        const log = outcome.lines.join('\n');
        const quoted = bypass.text === '' ? '' : `: "${bypass.text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}"`;
        const error = assertFailed(outcome, new RegExp(`^requirements\\.txt line ${bypass.line}${quoted}: `));
        assert.match(error.message, bypass.reason, `${JSON.stringify(bypass.file)}: ${error.message}`);
        assert.match(error.message, /Ferry installs wheels only/);
        assert.ok(
          !outcome.lines.some((l) => l.startsWith('Running pip')),
          `pip ran for ${JSON.stringify(bypass.file)}:\n${log}`,
        );
        assert.doesNotMatch(log, /FERRY-ATTACK|root:x:0/, log);
      }
    });

    it('still installs wheels of the app however they are named, and from --find-links', {
      timeout: TIMEOUT,
    }, async () => {
      for (const file of [
        `wheels/${LEFTPAD_WHEEL}\n`,
        `./wheels/${LEFTPAD_WHEEL} --hash=sha256:${await wheelHash()}\n`,
        `file:wheels/${LEFTPAD_WHEEL}\n`,
        '--no-index\n--find-links ./wheels\nleftpad==1.0.0 ; python_version >= "3"\n',
        "--no-index \\\n  -f wheels   # the app's own\n--only-binary :all:\nleftpad\n",
      ]) {
        const outcome = await runBuild(await depsWorkspace({ 'requirements.txt': file }));
        assertReady(outcome);
        assert.ok(
          outcome.lines.some((l) => /Successfully installed leftpad-1\.0\.0/.test(l)),
          `${JSON.stringify(file)}:\n${outcome.lines.join('\n')}`,
        );
      }
    });
  });

  it("fails when pip fails, coded, with pip's last lines in the error and its output in the log", {
    timeout: TIMEOUT,
  }, async () => {
    // A wheel the check lets through (it is inside the app) but that is not there.
    const ws = await depsWorkspace({ 'requirements.txt': './vendor/does_not_exist-1.0-py3-none-any.whl\n' });
    const outcome = await runBuild(ws);
    const err = assertFailed(
      outcome,
      /^FERRY_BUILD_DEPENDENCIES_FAILED: pip install failed \(exit code [1-9]\d*\); pip's last lines:\nERROR: .*does_not_exist-1\.0/,
    );
    assert.match(err.message, /docs\/functions\.md#python \("Dependencies": ship wheels in the app\)/);
    assert.ok(
      outcome.lines.some((l) => l.startsWith('ERROR:') && l.includes('does_not_exist-1.0')),
      outcome.lines.join('\n'),
    );
    assert.ok(!outcome.lines.some((l) => l.startsWith('Public functions')), 'the build stopped at pip');
  });

  it('a requirement no index has, with no network: coded at once, not after pip retried (issue 43)', {
    timeout: TIMEOUT,
  }, async () => {
    // The harness's build network is loopback only (FERRY_EGRESS=off): no index pip knows can answer.
    const ws = await depsWorkspace({ 'requirements.txt': 'ferry-surely-not-a-package==9.9.9\n' });
    const outcome = await runBuild(ws);
    const err = assertFailed(outcome, /^FERRY_BUILD_DEPENDENCIES_FAILED: pip install failed \(exit code 1\); /);
    assert.match(err.message, /\nERROR: No matching distribution found for ferry-surely-not-a-package==9\.9\.9\n/);
    assert.match(err.message, /The build sandbox has no network \(loopback only: FERRY_EGRESS=off/);
    assert.match(err.message, /See docs\/functions\.md#python/);
    // Before, pip retried the unreachable index five times (12 s) before it said the same.
    assert.ok(!outcome.lines.some((l) => /Retrying \(Retry\(/.test(l)), outcome.lines.join('\n'));
  });

  it("says what pip's failure most likely means where the build has a network", () => {
    const unreachable = pipFailure(
      'failed (exit code 1)',
      [
        "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken by 'NewConnectionError(...: Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/x/",
        'ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)',
        'ERROR: No matching distribution found for x==1',
      ],
      'veth',
    );
    assert.equal(unreachable.code, 'FERRY_BUILD_DEPENDENCIES_FAILED');
    assert.match(
      unreachable.message,
      /pip's last lines:\nERROR: Could not find a version .*\nERROR: No matching distribution found for x==1\n/,
    );
    assert.doesNotMatch(unreachable.message, /WARNING/, "only pip's conclusion is quoted");
    assert.match(unreachable.message, /pip could not reach the package index from the build sandbox/);
    const missing = pipFailure('failed (exit code 1)', ['ERROR: No matching distribution found for x==1'], 'user');
    assert.match(missing.message, /No index pip reaches has a wheel of that requirement/);
    const killed = pipFailure('was killed: it ran out of memory (the limit is 2048 MiB)', [], 'veth');
    assert.match(
      killed.message,
      /^FERRY_BUILD_DEPENDENCIES_FAILED: pip install was killed: it ran out of memory \(the limit is 2048 MiB\)\. /,
    );
  });

  it("gives pip a minimal environment, never the server's", { timeout: TIMEOUT }, async () => {
    const ws = await depsWorkspace();
    // Answers the builder's check like Python would, and shows the environment pip would get.
    const fakePython = path.join(ws.root, 'fake-python.sh');
    await fs.writeFile(
      fakePython,
      '#!/bin/sh\nif [ "$2" = "-c" ]; then echo \'{"version":[3,11,0],"functions":["run"]}\'; exit 0; fi\necho "args: $*"\nenv\n',
      { mode: 0o755 },
    );
    process.env.FERRY_TEST_SECRET = 'top-secret-value';
    try {
      const outcome = await runBuild(ws, { builder: createPythonBuilder({ python: fakePython }) });
      assertReady(outcome);
      const log = outcome.lines.join('\n');
      assert.ok(!log.includes('top-secret-value'), log);
      // Sandboxed, pip sees the build's folders at /app/...; without bwrap, the host paths.
      const sandboxed = (await detectSandbox()).bwrap !== null;
      const out = sandboxed ? '/app/out' : ws.outputDir;
      const cache = sandboxed ? '/app/cache' : path.join(h.cacheDir, 'builds', 'b_test');
      assert.ok(
        outcome.lines.includes(
          // --retries 0: the harness's build network is loopback only, where no index can answer (pip-failure.ts).
          `args: -I -m pip install --no-input --disable-pip-version-check --no-cache-dir --timeout 15 --retries 0 --only-binary=:all: --target ${out}/site-packages -r requirements.txt`,
        ),
        log,
      );
      assert.ok(outcome.lines.includes(`HOME=${cache}/home`), log);
      assert.ok(outcome.lines.includes('PIP_DISABLE_PIP_VERSION_CHECK=1'), log);
      const searchPath = outcome.lines.find((l) => l.startsWith('PATH='))?.slice('PATH='.length) ?? '';
      assert.ok(!searchPath.split(':').some((dir) => dir.startsWith(sandboxed ? '/app' : ws.root)), searchPath);
    } finally {
      delete process.env.FERRY_TEST_SECRET;
    }
  });
});

describe('python builder: cancellation', () => {
  it('kills a real pip that is waiting on an index, promptly and completely', { timeout: TIMEOUT }, async () => {
    const controller = new AbortController();
    const reason = new Error('cancelled');
    let abortedAt = 0;
    // An index that accepts the request and never answers: pip is surely mid-install when we abort.
    const index = http.createServer(() => {
      if (abortedAt === 0) {
        abortedAt = Date.now();
        controller.abort(reason);
      }
    });
    await new Promise<void>((resolve) => index.listen(0, '127.0.0.1', resolve));
    const port = (index.address() as AddressInfo).port;
    try {
      const ws = await depsWorkspace({
        'requirements.txt': `--index-url http://127.0.0.1:${port}/simple\nsome-package-from-an-index\n`,
      });
      const outcome = await runBuild(ws, { signal: controller.signal, network: shareTestNetwork() });
      assert.ok(abortedAt > 0, `pip never asked the index; log:\n${outcome.lines.join('\n')}`);
      assert.equal(outcome.error, reason, `expected the abort reason, got ${String(outcome.error)}`);
      const afterAbort = Date.now() - abortedAt;
      assert.ok(afterAbort < CANCEL_BOUND_MS, `took ${afterAbort} ms after the abort`);
      assert.deepEqual(await processesIn(ws.sourceDir), [], 'no pip process left behind');
    } finally {
      index.closeAllConnections();
      await new Promise<void>((resolve) => index.close(() => resolve()));
    }
  });

  it("kills pip's whole process group", { timeout: TIMEOUT }, async () => {
    const ws = await depsWorkspace();
    const fakePython = path.join(ws.root, 'fake-python.sh');
    // A child of pip (a build backend, a compiler) that would outlive pip if only pip were killed. Its
    // unusual argument finds it from the host, whose pids differ from the sandbox's.
    const marker = String(5000 + Math.floor(Math.random() * 4000));
    await fs.writeFile(
      fakePython,
      `#!/bin/sh\nif [ "$2" = "-c" ]; then echo '{"version":[3,11,0],"functions":[]}'; exit 0; fi\nsleep ${marker} &\necho started\nwait\n`,
      { mode: 0o755 },
    );
    const controller = new AbortController();
    let found: number[] = [];
    const outcome = await runBuild(ws, {
      builder: createPythonBuilder({ python: fakePython }),
      signal: controller.signal,
      onLog: (line) => {
        if (line !== 'started') return;
        void (async () => {
          for (let i = 0; i < 100 && found.length === 0; i++) {
            found = await processesWithArgs(['sleep', marker]);
            if (found.length === 0) await new Promise((r) => setTimeout(r, 50));
          }
          controller.abort();
        })();
      },
    });
    assert.ok(found.length > 0, `the sleep was never seen running; log:\n${outcome.lines.join('\n')}`);
    assert.ok(outcome.error instanceof Error && outcome.error.name === 'AbortError', String(outcome.error));
    assert.ok(!(outcome.error instanceof BuildFailedError));
    assert.ok(outcome.ms < CANCEL_BOUND_MS, `took ${outcome.ms} ms`);
    // Killed with the sandbox; the kernel may still be finishing its exit when the build returns.
    await waitUntilGone(found);
    assert.deepEqual(await processesWithArgs(['sleep', marker]), []);
  });

  it('does nothing when already cancelled', async () => {
    const ws = await depsWorkspace();
    const outcome = await runBuild(ws, { signal: AbortSignal.abort() });
    assert.ok(outcome.error instanceof Error && outcome.error.name === 'AbortError', String(outcome.error));
    assert.deepEqual(outcome.lines, []);
    assert.deepEqual(await fs.readdir(ws.outputDir), []);
  });
});

describe('python builder: requirements.txt on an image (issue 26)', () => {
  it('copies requirements.txt and exactly the paths of the app it names, then runs pip in the image', async () => {
    const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'pyimg-reqpaths-'));
    try {
      for (const file of [
        'pkgs/a-1.0.tar.gz',
        'wheels/b-1.0-py3-none-any.whl',
        'more/c.txt',
        'more/d-1.whl',
        'lib/setup.py',
        'main.py',
      ]) {
        await fs.mkdir(path.dirname(path.join(dir, file)), { recursive: true });
        await fs.writeFile(path.join(dir, file), 'x');
      }
      await fs.writeFile(path.join(dir, 'more/c.txt'), './more/d-1.whl\n-f ../wheels\n');
      const text = [
        '--no-index',
        '--find-links ./wheels',
        './pkgs/a-1.0.tar.gz  # a source archive: fine in an image',
        'b==1.0',
        '-r more/c.txt',
        '-e ./lib',
        'e @ file:./pkgs/a-1.0.tar.gz',
        'requests>=2',
        './missing-1.0.tar.gz',
        '../outside.tar.gz',
        '/etc/passwd',
        '',
      ].join('\n');
      await fs.writeFile(path.join(dir, 'requirements.txt'), text);
      assert.deepEqual(requirementsLocalPaths(Buffer.from(text), dir), [
        'lib',
        'more/c.txt',
        'more/d-1.whl',
        'pkgs/a-1.0.tar.gz',
        'wheels',
      ]);
      assert.deepEqual(requirementsLocalPaths(Buffer.from('.\nrequests\n'), dir), ['.']);
      assert.deepEqual(requirementsLocalPaths(Buffer.from('requests\nnumpy==2\n'), dir), []);

      const steps = await requirementsImageSteps(dir);
      assert.deepEqual(steps.slice(0, -1), [
        { kind: 'copy', source: 'requirements.txt', dest: '/ferry/requirements/requirements.txt' },
        { kind: 'copy', source: 'lib', dest: '/ferry/requirements/lib/' },
        { kind: 'copy', source: 'more/c.txt', dest: '/ferry/requirements/more/c.txt' },
        { kind: 'copy', source: 'more/d-1.whl', dest: '/ferry/requirements/more/d-1.whl' },
        { kind: 'copy', source: 'pkgs/a-1.0.tar.gz', dest: '/ferry/requirements/pkgs/a-1.0.tar.gz' },
        { kind: 'copy', source: 'wheels', dest: '/ferry/requirements/wheels/' },
      ]);
      const pip = steps.at(-1)!;
      assert.equal(pip.kind, 'run');
      if (pip.kind === 'run') {
        assert.equal(pip.cwd, '/ferry/requirements');
        assert.match(pip.command, /exec python3 -m pip install --no-cache-dir -r requirements\.txt$/);
        assert.equal(pip.env.PIP_BREAK_SYSTEM_PACKAGES, '1');
      }
      await fs.rm(path.join(dir, 'requirements.txt'));
      assert.deepEqual(await requirementsImageSteps(dir), []);
    } finally {
      await fs.rm(dir, { recursive: true, force: true });
    }
  });
});
