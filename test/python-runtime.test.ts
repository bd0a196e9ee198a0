/**
 * Python functions through the real run endpoint, against real (sandboxed) replicas running the Python
 * bootstrap: keyword arguments and their errors, def and async def, exceptions, streaming from generators
 * (progressive arrival, disconnects closing them), per-run logs under concurrency, async mode with a
 * webhook, timeouts, memory limits, import failures, dependencies from requirements.txt, and the sandbox.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseAppConfig } from '../src/apps/app-config.js';
import { selectFiles } from '../src/cli/pack.js';
import { detectSandbox } from '../src/sandbox/launch.js';
import { zipFiles } from './helpers/app-zip.js';
import { http as call, deployFiles, REPO_ROOT, startServer, type TestServer, waitFor } from './helpers/ferry.js';
import { LEFTPAD_WHEEL, leftpadWheel } from './helpers/python-wheel.js';
import { type Receiver, startReceiver } from './helpers/receiver.js';
import { disconnectAfterFirstItem, endEvent, streamRequest, streamWire } from './helpers/stream.js';

const toml = (name: string, extra = '') => `[app]\nname = "${name}"\n${extra}`;

describe('python runtime', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let receiver: Receiver;
  const url = (app: string, fn: string, query = '') =>
    `${server.url}/v4/${auth.projectId}/${app}/${fn}${query ? `?${query}` : ''}`;
  const run = (app: string, fn: string, body: unknown = {}, query = '') =>
    call(url(app, fn, query), { method: 'POST', token: auth.token, body });
  const record = (app: string, runId: string) =>
    call(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}`, { token: auth.token });
  const logs = async (app: string, runId: string): Promise<Array<{ stream: string; line: string }>> =>
    (
      await call(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/runs/${runId}/logs`, {
        token: auth.token,
      })
    ).json.lines;

  before(async () => {
    receiver = await startReceiver();
    // A short resume grace, so a streaming caller that goes away for good frees its slot soon.
    server = await startServer({ env: { FERRY_WEBHOOK_ALLOW: '127.0.0.0/8', FERRY_STREAM_RESUME_GRACE_SECONDS: '1' } });
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'py', {
      'ferry.toml': toml('py', '[env]\nGREETING = "Hi"\n'),
      'helper.py': 'def shout(text):\n    return text.upper()\n',
      'main.py': `
import asyncio
import os
import time
from os.path import join  # imported: not callable from outside

from helper import shout

LOADS = 0
LOADS += 1
CALLS = 0


def run(name: str = "world"):
    return {"message": f"{os.environ['GREETING']}, {name}!"}


def complete(prompt: str, max_tokens: int = 16, *, temperature: float = 1.0):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}


def anything(**kwargs):
    return sorted(kwargs)


async def later(ms: int = 10, value: str = "done"):
    await asyncio.sleep(ms / 1000)
    return shout(value)


def loaded():
    global CALLS
    CALLS += 1
    return {"loads": LOADS, "calls": CALLS}


class QuotaError(Exception):
    pass


def fail():
    raise ValueError("bad input")


async def fail_async():
    await asyncio.sleep(0)
    raise QuotaError("over quota")


def typo(x: int):
    return x + "1"


def nothing():
    pass


def a_set():
    return {1, 2}


def some_bytes():
    return b"raw"


def not_a_number():
    return float("nan")


def _private():
    return "hidden"


def env():
    return sorted(os.environ)


def read_root():
    try:
        return {"listed": os.listdir("/root")}
    except OSError as err:
        return {"error": type(err).__name__}


def whoami():
    return {"uid": os.getuid(), "cwd": os.getcwd()}
`,
    });
  });
  after(async () => {
    await server.close();
    await receiver.close();
  });

  describe('calls', () => {
    it('passes the JSON members as keyword arguments, with defaults', async () => {
      const hello = await run('py', 'run', { name: 'Ferry' });
      assert.equal(hello.status, 200, hello.text);
      assert.deepEqual(hello.json.result, { message: 'Hi, Ferry!' });
      assert.deepEqual((await run('py', 'run')).json.result, { message: 'Hi, world!' });
      const done = await run('py', 'complete', { prompt: 'p', temperature: 0.5 });
      assert.deepEqual(done.json.result, { prompt: 'p', max_tokens: 16, temperature: 0.5 });
      assert.deepEqual((await run('py', 'anything', { b: 1, a: 2 })).json.result, ['a', 'b']);
    });

    it('answers 400 FERRY_ARGUMENT_ERROR naming a missing or unexpected argument', async () => {
      const missing = await run('py', 'complete', { max_tokens: 3 });
      assert.equal(missing.status, 400, missing.text);
      assert.equal(missing.json.error.code, 'FERRY_ARGUMENT_ERROR');
      assert.equal(missing.json.error.message, "missing required argument 'prompt'");
      assert.equal(missing.json.run_id, missing.headers.get('x-request-id'));

      const unexpected = await run('py', 'complete', { prompt: 'p', top_k: 3 });
      assert.equal(unexpected.status, 400, unexpected.text);
      assert.equal(unexpected.json.error.code, 'FERRY_ARGUMENT_ERROR');
      assert.equal(unexpected.json.error.message, "unexpected argument 'top_k'");

      const saved = await record('py', unexpected.json.run_id);
      assert.equal(saved.json.state, 'failure');
      assert.equal(saved.json.status_code, 400);
      // A TypeError raised inside the function is the function's error, not an argument error.
      const inside = await run('py', 'typo', { x: 1 });
      assert.equal(inside.status, 500, inside.text);
      assert.equal(inside.json.error.code, 'FERRY_FUNCTION_ERROR');
      assert.equal(inside.json.error.type, 'TypeError');
    });

    it('runs async def functions, and imports the app folder’s own modules', async () => {
      const res = await run('py', 'later', { value: 'quiet' });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.result, 'QUIET');
    });

    it('answers null for None and 500 FERRY_RESULT_NOT_SERIALIZABLE for values JSON cannot hold', async () => {
      assert.equal((await run('py', 'nothing')).json.result, null);
      for (const fn of ['a_set', 'some_bytes', 'not_a_number']) {
        const res = await run('py', fn);
        assert.equal(res.status, 500, `${fn}: ${res.text}`);
        assert.equal(res.json.error.code, 'FERRY_RESULT_NOT_SERIALIZABLE', fn);
      }
    });

    it('answers 404 for private, imported and unknown names', async () => {
      for (const fn of ['_private', 'join', 'shout', 'QuotaError', 'missing']) {
        const res = await run('py', fn);
        assert.equal(res.status, 404, `${fn}: ${res.text}`);
        assert.equal(res.json.error.code, 'FERRY_FUNCTION_NOT_FOUND', fn);
      }
    });

    it('puts the exception type and message in the body and the traceback in the run logs only', async () => {
      const res = await run('py', 'fail');
      assert.equal(res.status, 500, res.text);
      assert.equal(res.json.error.code, 'FERRY_FUNCTION_ERROR');
      assert.equal(res.json.error.type, 'ValueError');
      assert.match(res.json.error.message, /bad input/);
      assert.doesNotMatch(res.text, /Traceback|File "/);
      const lines = (await logs('py', res.json.run_id)).map((l) => l.line);
      assert.ok(lines.includes('Traceback (most recent call last):'), lines.join('\n'));
      assert.ok(
        lines.some((l) => /File ".*main\.py", line \d+, in fail/.test(l)),
        lines.join('\n'),
      );
      assert.ok(!lines.some((l) => l.includes('bootstrap.py')), `no bootstrap frames: ${lines.join('\n')}`);
      assert.equal(lines.at(-1), 'ValueError: bad input');

      const custom = await run('py', 'fail_async');
      assert.equal(custom.status, 500);
      assert.equal(custom.json.error.type, 'QuotaError');
      assert.match(custom.json.error.message, /over quota/);
    });

    it('imports main.py once per replica', async () => {
      const seen = [];
      for (let i = 0; i < 3; i++) seen.push((await run('py', 'loaded')).json.result);
      assert.ok(
        seen.every((r) => r.loads === 1),
        JSON.stringify(seen),
      );
      assert.deepEqual(
        seen.map((r) => r.calls),
        [seen[0].calls, seen[0].calls + 1, seen[0].calls + 2],
      );
    });

    it("gives replicas the app's env and Ferry's variables, nothing of the server's", async () => {
      process.env.FERRY_TEST_SERVER_SECRET = 'leak';
      const keys: string[] = (await run('py', 'env')).json.result;
      for (const k of ['APP_NAME', 'PROJECT_ID', 'BUILD_ID', 'FERRY_PROTOCOL', 'GREETING']) {
        assert.ok(keys.includes(k), k);
      }
      assert.ok(!keys.includes('FERRY_TEST_SERVER_SECRET'));
    });

    it('runs inside the sandbox: /root is out of reach', async (t) => {
      if ((await detectSandbox()).bwrap === null) {
        t.skip('bubblewrap is not available here');
        return;
      }
      const res = await run('py', 'read_root');
      assert.equal(res.status, 200, res.text);
      assert.ok(res.json.result.error, `listed /root: ${res.text}`);
      const who = await run('py', 'whoami');
      assert.deepEqual(who.json.result, { uid: 65534, cwd: '/app' });
    });
  });

  describe('streaming', () => {
    before(async () => {
      await deployFiles(server, auth, 'pystream', {
        'ferry.toml': toml('pystream', '[scaling]\nmax_replicas = 1\nreplica_concurrency = 1\n'),
        'main.py': `
import asyncio
import time

CLOSED = []


def count(n: int = 4, ms: int = 250):
    for i in range(n):
        time.sleep(ms / 1000)
        yield {"i": i}


async def acount(n: int = 4, ms: int = 250):
    for i in range(n):
        await asyncio.sleep(ms / 1000)
        yield {"i": i}


def words():
    yield "plain text"
    yield "two\\nlines"
    yield 42


async def failing():
    yield "first"
    await asyncio.sleep(0.05)
    raise TypeError("broke mid-stream")


async def forever():
    # Waiting far longer than the test does: only being cancelled where it waits ends it in time.
    try:
        yield 0
        while True:
            await asyncio.sleep(30)
            yield 1
    finally:
        CLOSED.append("async")


KEPT = []


def _forever_sync():
    i = 0
    try:
        while True:
            time.sleep(0.05)
            yield i
            i += 1
    finally:
        CLOSED.append("sync")


def forever_sync():
    gen = _forever_sync()
    # Referenced from here, the generator is never garbage-collected: only the bootstrap closing it runs
    # its finally block.
    KEPT.append(gen)
    return gen


def closed():
    return CLOSED
`,
      });
    });

    for (const fn of ['count', 'acount']) {
      it(`sends each item of ${fn === 'count' ? 'a generator' : 'an async generator'} as it is yielded`, async () => {
        // Items 400 ms apart (1.2 s from first to last): buffered, they would arrive together. Checking for
        // half that spread leaves room for a test process kept off the CPU on a busy machine.
        const res = await streamRequest(url('pystream', fn), auth.token, { n: 4, ms: 400 });
        assert.equal(res.status, 200);
        assert.equal(res.headers['content-type'], 'text/event-stream; charset=utf-8');
        const runId = String(res.headers['x-request-id']);
        const text = res.arrivals.map((a) => a.text).join('');
        assert.equal(text, streamWire(runId, ['{"i":0}', '{"i":1}', '{"i":2}', '{"i":3}', endEvent(runId)]));
        const times = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
        assert.ok(times.length >= 3, `events arrived in ${times.length} chunks: progressive delivery`);
        assert.ok(times.at(-1)! - times[0]! >= 600, `arrivals spread with the generator's sleeps: ${times}`);
      });
    }

    it('answers a generator called without Accept: text/event-stream with its items as a JSON array', async () => {
      const res = await run('pystream', 'words');
      assert.equal(res.status, 200, res.text);
      assert.deepEqual(res.json.result, ['plain text', 'two\nlines', 42]);
      const counted = await run('pystream', 'acount', { n: 3, ms: 1 });
      assert.deepEqual(counted.json.result, [{ i: 0 }, { i: 1 }, { i: 2 }]);
    });

    it('ends the stream with an error comment when the generator raises', async () => {
      const res = await streamRequest(url('pystream', 'failing'), auth.token, {});
      const runId = String(res.headers['x-request-id']);
      const text = res.arrivals.map((a) => a.text).join('');
      const match = /^retry: 1000\n\nid: \S+\ndata: first\n\n: error (.*)\n\n: end \{.*\}\n\n$/.exec(text);
      assert.ok(match, text);
      const payload = JSON.parse(match[1]!);
      assert.equal(payload.error.code, 'FERRY_FUNCTION_ERROR');
      assert.match(payload.error.message, /TypeError: broke mid-stream/);
      assert.equal(text, streamWire(runId, ['first', { event: 'error', data: match[1]! }, endEvent(runId, 'failure')]));
    });

    for (const [fn, kind] of [
      ['forever', 'async'],
      ['forever_sync', 'sync'],
    ] as const) {
      it(`closes ${kind === 'async' ? 'an async' : 'a'} generator when the client disconnects and does not resume, freeing the slot`, async () => {
        const runId = await disconnectAfterFirstItem(url('pystream', fn), auth.token);
        // One replica, one slot: this call gets through only if the endless generator let go of it. Not let go,
        // it would hold the slot for the app's grace period (900 s); idle, it lets go at once, so the bound of
        // the wait below is generous and still fails a generator that is never closed.
        const closed = await waitFor(
          async () => {
            const res = await run('pystream', 'closed');
            return res.status === 200 && res.json.result.includes(kind) ? res.json.result : undefined;
          },
          20_000,
          `the ${kind} generator to close`,
        );
        assert.ok(closed.includes(kind));
        const saved = await waitFor(async () => {
          const r = await record('pystream', runId);
          return r.json.state !== 'running' && r.json.state !== 'queued' ? r.json : undefined;
        });
        assert.equal(saved.state, 'cancelled');
        assert.equal(saved.reason, 'client_disconnected');
      });
    }
  });

  describe('logs and concurrency', () => {
    before(async () => {
      await deployFiles(server, auth, 'pychatty', {
        'ferry.toml': toml('pychatty', '[scaling]\nmax_replicas = 1\nreplica_concurrency = 4\n'),
        'main.py': `
import asyncio
import sys
import time

print("loading pychatty")


def run(tag: str):
    for i in range(5):
        print(f"{tag} line {i}")
        print(f"{tag} err {i}", file=sys.stderr)
        time.sleep(0.02)
    return tag


async def arun(tag: str):
    for i in range(5):
        sys.stdout.write(f"{tag} ")
        await asyncio.sleep(0.01)
        sys.stdout.write(f"line {i}\\n")
        sys.stderr.buffer.write(f"{tag} err {i}\\n".encode())
        await asyncio.to_thread(time.sleep, 0.01)
    return tag


def nap(ms: int):
    start = time.time()
    time.sleep(ms / 1000)
    return {"start": start, "end": time.time()}


async def anap(ms: int):
    start = time.time()
    await asyncio.sleep(ms / 1000)
    return {"start": start, "end": time.time()}
`,
      });
    });

    for (const fn of ['run', 'arun']) {
      it(`keeps each run's output apart with several runs on one replica (${fn === 'run' ? 'def' : 'async def'})`, async () => {
        const tags = ['alpha', 'beta', 'gamma', 'delta'];
        const results = await Promise.all(tags.map((tag) => run('pychatty', fn, { tag })));
        assert.equal(new Set(results.map((r) => r.json.run_id)).size, 4);
        for (const [i, res] of results.entries()) {
          assert.equal(res.status, 200, res.text);
          const lines = (await logs('pychatty', res.json.run_id)).filter((l) => l.stream !== 'system');
          assert.equal(lines.length, 10, JSON.stringify(lines));
          for (const line of lines) assert.ok(line.line.startsWith(`${tags[i]} `), `${tags[i]} got "${line.line}"`);
          assert.deepEqual(
            lines.filter((l) => l.stream === 'stdout').map((l) => l.line),
            [0, 1, 2, 3, 4].map((n) => `${tags[i]} line ${n}`),
          );
          assert.equal(lines.filter((l) => l.stream === 'stderr').length, 5);
        }
      });
    }

    it('runs def functions in threads and async ones on the loop, so neither blocks the other runs', async () => {
      for (const fn of ['nap', 'anap']) {
        await run('pychatty', fn, { ms: 1 }); // warm
        const results = await Promise.all([1, 2, 3, 4].map(() => run('pychatty', fn, { ms: 1500 })));
        for (const res of results) assert.equal(res.status, 200, res.text);
        // Proved by order, not by a stopwatch: all four were running at once when every one started before
        // any ended. Had one blocked the others, each would start only after the one before it ended. The
        // 1.5 s naps leave room for calls that reach the replica slowly on a busy machine.
        const spans = results.map((res) => res.json.result as { start: number; end: number });
        const lastStart = Math.max(...spans.map((span) => span.start));
        const firstEnd = Math.min(...spans.map((span) => span.end));
        assert.ok(lastStart < firstEnd, `${fn}: the runs did not overlap on one replica: ${JSON.stringify(spans)}`);
      }
    });
  });

  describe('run modes and limits', () => {
    before(async () => {
      await deployFiles(server, auth, 'pyslow', {
        'ferry.toml': toml(
          'pyslow',
          // The grace period also covers a cold start (these tests replace the replica twice): 5 s leaves
          // room for a Python replica starting on a busy machine.
          '[scaling]\nmax_replicas = 1\nresponse_grace_period = 5\n[resources]\nmemory = 128\n',
        ),
        'main.py': `
import time


def sleepy(seconds: float = 3):
    time.sleep(seconds)
    return "late"


def quick(value: int = 1):
    print("quick ran")
    return {"doubled": value * 2}


def boom():
    raise RuntimeError("async failure")


def hog(mib: int = 1024):
    data = b"x" * (mib * 1024 * 1024)
    return len(data)
`,
      });
    });

    it('answers 504 past response_grace_period, and the app still runs', async () => {
      const res = await run('pyslow', 'sleepy', { seconds: 60 });
      assert.equal(res.status, 504, res.text);
      assert.equal(res.json.error.code, 'FERRY_RUN_TIMEOUT');
      assert.equal((await record('pyslow', res.json.run_id)).json.state, 'timeout');
      const next = await run('pyslow', 'quick');
      assert.equal(next.status, 200, next.text);
    });

    it('runs async calls to success and failure, and forwards them to a webhook', async () => {
      const accepted = await run('pyslow', 'quick', { value: 21 }, 'async=true');
      assert.equal(accepted.status, 202, accepted.text);
      const done = await waitFor(async () => {
        const r = await record('pyslow', accepted.json.run_id);
        return ['success', 'failure', 'timeout'].includes(r.json.state) ? r.json : undefined;
      });
      assert.equal(done.state, 'success');
      assert.deepEqual(done.result, { doubled: 42 });
      assert.ok((await logs('pyslow', accepted.json.run_id)).some((l) => l.line === 'quick ran'));

      const hook = encodeURIComponent(`${receiver.url}/py-hook`);
      const failed = await run('pyslow', 'boom', {}, `async=true&webhookEndpoint=${hook}`);
      assert.equal(failed.status, 202, failed.text);
      const [delivery] = await receiver.waitForRequests(1, 20_000);
      assert.ok(delivery);
      assert.equal(delivery.path, '/py-hook');
      const payload = JSON.parse(delivery.body.toString('utf8'));
      assert.equal(payload.run_id, failed.json.run_id);
      assert.equal(payload.status_code, 500);
      assert.equal(payload.error.code, 'FERRY_FUNCTION_ERROR');
      assert.match(payload.error.message, /RuntimeError: async failure/);
    });

    it('answers 502 FERRY_OUT_OF_MEMORY past the memory limit, and replaces the replica', async (t) => {
      const caps = await detectSandbox();
      if (caps.cgroup === null && caps.prlimit === null) {
        t.skip('no memory limit is available here');
        return;
      }
      const res = await run('pyslow', 'hog', { mib: 1024 });
      assert.equal(res.status, 502, res.text);
      assert.equal(res.json.error.code, 'FERRY_OUT_OF_MEMORY');
      const next = await run('pyslow', 'quick');
      assert.equal(next.status, 200, next.text);
    });
  });

  describe('examples', () => {
    /** Deploys an example folder with the files `ferry deploy` would pack. */
    async function deployExample(name: string): Promise<string> {
      const dir = path.join(REPO_ROOT, 'examples', name);
      const config = parseAppConfig(await fs.readFile(path.join(dir, 'ferry.toml'), 'utf8'));
      const files: Record<string, string> = {};
      for (const file of await selectFiles(dir, config)) {
        files[file.path] = await fs.readFile(path.join(dir, file.path), 'utf8');
      }
      await deployFiles(server, auth, config.app.name, files);
      return config.app.name;
    }

    it('deploys and runs examples/python-hello', async () => {
      const app = await deployExample('python-hello');
      const res = await run(app, 'run', { name: 'Ferry' });
      assert.equal(res.status, 200, res.text);
      assert.deepEqual(res.json.result, { message: 'Hello, Ferry!' });
      assert.equal((await run(app, '_helper')).status, 404);
    });

    it('deploys and streams examples/python-stream', async () => {
      const app = await deployExample('python-stream');
      // Tokens 0.5 s apart (1 s from first to last); half that spread leaves room for a busy machine.
      const res = await streamRequest(url(app, 'generate'), auth.token, { max_tokens: 3, delay: 0.5 });
      assert.equal(res.status, 200);
      const streamId = String(res.headers['x-request-id']);
      const text = res.arrivals.map((a) => a.text).join('');
      assert.equal(
        text,
        streamWire(streamId, [
          '{"index":0,"token":"Once"}',
          '{"index":1,"token":"upon"}',
          '{"index":2,"token":"a"}',
          endEvent(streamId),
        ]),
      );
      const times = res.arrivals.filter((a) => a.text.includes('data:')).map((a) => a.at);
      assert.ok(times.at(-1)! - times[0]! >= 500, `arrivals spread with the generator's sleeps: ${times}`);
      const runId = String(res.headers['x-request-id']);
      const lines = (await logs(app, runId)).map((l) => l.line);
      assert.ok(lines.includes("generating up to 3 tokens for ''"), lines.join('\n'));
      const countdown = await run(app, 'countdown', { start: 3, delay: 0.01 });
      assert.deepEqual(countdown.json.result, [3, 2, 1, 'liftoff']);
    });
  });

  describe('loading', () => {
    it('answers 502 FERRY_REPLICA_START_FAILED with the error when main.py fails to import', async () => {
      await deployFiles(server, auth, 'pybroken', {
        'ferry.toml': toml('pybroken'),
        'main.py': 'raise RuntimeError("cannot load the model")\n\ndef run():\n    return 1\n',
      });
      const res = await run('pybroken', 'run');
      assert.equal(res.status, 502, res.text);
      assert.equal(res.json.error.code, 'FERRY_REPLICA_START_FAILED');
      assert.match(res.json.error.message, /exit code 3/);
      assert.match(res.json.error.message, /RuntimeError: cannot load the model/);
    });

    it('imports the dependencies requirements.txt installed from a wheel in the app folder', async () => {
      const wheel = await leftpadWheel();
      const zip = await zipFiles({
        'ferry.toml': toml('pydeps'),
        'requirements.txt': `./wheels/${LEFTPAD_WHEEL}\n`,
        [`wheels/${LEFTPAD_WHEEL}`]: wheel,
        'main.py':
          'import leftpad\n\ndef run(text: str, width: int = 6):\n    return {"padded": leftpad.leftpad(text, width, "."), "from": leftpad.__file__}\n',
      });
      const upload = await call(`${server.url}/v2/projects/${auth.projectId}/apps/pydeps/builds`, {
        method: 'POST',
        token: auth.token,
        body: zip,
        headers: { 'content-type': 'application/zip' },
      });
      assert.equal(upload.status, 201, upload.text);
      const build = await waitFor(async () => {
        const b = await call(`${server.url}/v2/projects/${auth.projectId}/apps/pydeps/builds/${upload.json.id}`, {
          token: auth.token,
        });
        return ['ready', 'failed', 'cancelled'].includes(b.json.state) ? b.json : undefined;
      });
      assert.equal(build.state, 'ready', build.error);
      const res = await run('pydeps', 'run', { text: 'ab' });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json.result.padded, '....ab');
      assert.match(res.json.result.from, /\/out\/site-packages\/leftpad\/__init__\.py$/);
    });
  });
});
