/**
 * The Python client (clients/python, issue 45) against a real Ferry: a sync call, a spawned run and its
 * result, logs and cancel, a stream that is cut mid-way by a proxy on loopback and resumed (every item
 * once, in order), typed errors with Ferry's codes (a bad token, an unknown function, a function that
 * raises), webhook verification of a real signed delivery, and the package built offline with pip (the
 * in-tree backend: nothing fetched) and installed into a fresh virtual environment.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import { findPython } from '../src/runtimes/python/interpreter.js';
import { CLIENT_TEST_APP } from './helpers/client-app.js';
import { cuttingProxy } from './helpers/cutting-proxy.js';
import { deployFiles, REPO_ROOT, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';

const run = promisify(execFile);
const CLIENT = path.join(REPO_ROOT, 'clients', 'python');

describe('the Python client (clients/python)', { timeout: 300_000 }, () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let python: string;
  let work: string;
  let receiver: Receiver;

  before(async () => {
    const found = await findPython();
    assert.ok(found, 'a python3 of 3.9 or newer is needed (bash scripts/setup-system.sh installs it)');
    python = found;
    work = await tempDir('ferry-pyclient-');
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'pyclient', CLIENT_TEST_APP('pyclient'));
    receiver = await startReceiver();
  });
  after(async () => {
    await receiver?.close();
    await server?.close();
    await fs.rm(work, { recursive: true, force: true });
  });

  /** Runs `script` with the client on PYTHONPATH and FERRY_* set; its last stdout line as JSON. */
  async function py(script: string, env: Record<string, string> = {}): Promise<Record<string, unknown>> {
    const file = path.join(work, `script-${Math.random().toString(36).slice(2)}.py`);
    await fs.writeFile(file, script);
    const { stdout } = await run(python, [file], {
      env: {
        PATH: process.env.PATH ?? '/usr/bin:/bin',
        PYTHONPATH: CLIENT,
        FERRY_URL: server.url,
        FERRY_TOKEN: auth.token,
        FERRY_PROJECT: auth.projectId,
        ...env,
      },
      timeout: 120_000,
    });
    return JSON.parse(stdout.trim().split('\n').pop()!);
  }

  it('calls a function, spawns a run and waits for its result, reads its logs, cancels another', async () => {
    const out = await py(`
import json
from ferry_client import Ferry, RunFailedError
app = Ferry().app("pyclient")
called = app.call("run", {"name": "Ada"})
spawned = app.spawn("run", {"name": "Bob"})
result = spawned.result(timeout=60)
logs = [l["line"] for l in spawned.logs() if l["stream"] == "stdout"]
slow = app.spawn("slow")
cancelled = slow.cancel()
try:
    slow.result(timeout=30)
    after_cancel = "no error"
except RunFailedError as e:
    after_cancel = e.code
print(json.dumps({"called": called, "id": spawned.id, "result": result, "logs": logs,
                  "cancelled": cancelled["state"], "after_cancel": after_cancel}))
`);
    assert.deepEqual(out.called, { message: 'Hello, Ada!' });
    assert.match(String(out.id), /^[0-9a-f-]{36}$/);
    assert.deepEqual(out.result, { message: 'Hello, Bob!' });
    assert.deepEqual(out.logs, ['greeting Bob']);
    assert.equal(out.cancelled, 'cancelled');
    assert.match(String(out.after_cancel), /FERRY_/);
  });

  it('raises typed errors carrying Ferry’s codes', async () => {
    const out = await py(`
import json
from ferry_client import Ferry, AuthError, NotFoundError, RunFailedError
seen = {}
try:
    Ferry(token="not-a-token").app("pyclient").call("run")
except AuthError as e:
    seen["bad_token"] = [type(e).__name__, e.code, e.status]
try:
    Ferry().app("pyclient").call("nope")
except NotFoundError as e:
    seen["unknown"] = [type(e).__name__, e.code, e.status]
try:
    Ferry().app("pyclient").call("fail")
except RunFailedError as e:
    seen["raised"] = [type(e).__name__, e.code, e.details.get("type"), bool(e.run_id)]
print(json.dumps(seen))
`);
    assert.equal((out.bad_token as unknown[])[0], 'AuthError');
    assert.match(String((out.bad_token as unknown[])[1]), /^FERRY_/);
    assert.equal((out.bad_token as unknown[])[2], 401);
    assert.deepEqual(out.unknown, ['NotFoundError', 'FERRY_FUNCTION_NOT_FOUND', 404]);
    assert.deepEqual(out.raised, ['RunFailedError', 'FERRY_FUNCTION_ERROR', 'TypeError', true]);
  });

  it('streams items as they come and resumes a cut connection without running anything twice', async () => {
    const proxy = await cuttingProxy(new URL(server.url));
    try {
      const out = await py(
        `
import json
from ferry_client import Ferry
items = [item["i"] for item in Ferry().app("pyclient").stream("count", {"n": 6})]
print(json.dumps({"items": items}))
`,
        { FERRY_URL: proxy.url },
      );
      assert.deepEqual(out.items, [0, 1, 2, 3, 4, 5], 'every item once, in order');
      assert.equal(proxy.resumes(), 1, 'the client resumed once, with Last-Event-ID');
    } finally {
      await proxy.close();
    }
  });

  it('verifies a real signed webhook delivery, and refuses a changed body or another secret', async () => {
    const secret = 'py-client-secret';
    const out = await py(`
import json
from ferry_client import Ferry
run = Ferry().app("pyclient").spawn("run", {"name": "hook"}, webhook="${receiver.url}/hook", webhook_secret="${secret}")
run.result(timeout=60)
print(json.dumps({"id": run.id}))
`);
    const delivery = await (async () => {
      for (let i = 0; i < 200; i++) {
        const found = receiver.requests.find((r) => r.headers['x-request-id'] === out.id);
        if (found) return found;
        await new Promise((r) => setTimeout(r, 100));
      }
      throw new Error('no delivery within 20 s');
    })();
    const bodyFile = path.join(work, 'delivery.bin');
    await fs.writeFile(bodyFile, delivery.body);
    const checks = await py(`
import json
from ferry_client import verify_webhook
headers = json.loads(${JSON.stringify(JSON.stringify(delivery.headers))})
body = open(${JSON.stringify(bodyFile)}, "rb").read()
print(json.dumps({
    "valid": verify_webhook("${secret}", headers, body),
    "changed": verify_webhook("${secret}", headers, body + b" "),
    "other_secret": verify_webhook("another", headers, body),
    "stale": verify_webhook("${secret}", headers, body, now=int(headers["x-service-webhook-timestamp"]) + 301),
    "capitalized": verify_webhook("${secret}", {k.title(): v for k, v in headers.items()}, body),
}))
`);
    assert.deepEqual(checks, { valid: true, changed: false, other_secret: false, stale: false, capitalized: true });
  });

  it('builds offline with pip (the in-tree backend) and installs into a fresh virtual environment', async () => {
    const wheels = path.join(work, 'wheels');
    await run(python, ['-m', 'pip', 'wheel', '--no-index', '--no-build-isolation', '--no-deps', '-w', wheels, CLIENT], {
      timeout: 120_000,
      env: { PATH: process.env.PATH ?? '/usr/bin:/bin', PIP_NO_INDEX: '1', HOME: work },
    });
    const [wheel] = await fs.readdir(wheels);
    assert.equal(wheel, 'ferry_client-0.1.0-py3-none-any.whl');
    const venv = path.join(work, 'venv');
    await run(python, ['-m', 'venv', venv], { timeout: 120_000 });
    await run(path.join(venv, 'bin', 'python'), ['-m', 'pip', 'install', '--no-index', path.join(wheels, wheel!)], {
      timeout: 120_000,
      env: { PATH: process.env.PATH ?? '/usr/bin:/bin', HOME: work },
    });
    const { stdout } = await run(
      path.join(venv, 'bin', 'python'),
      ['-c', 'import ferry_client, json; print(json.dumps([ferry_client.__version__, ferry_client.__file__]))'],
      { cwd: work, timeout: 60_000 },
    );
    const [version, file] = JSON.parse(stdout) as [string, string];
    assert.equal(version, '0.1.0');
    assert.ok(file.startsWith(venv), `imported from the virtual environment: ${file}`);
  });
});
