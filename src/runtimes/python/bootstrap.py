"""
The Python replica bootstrap (cortex runtime): the program every Python replica runs. It imports the
app's ``main.py`` once, then serves replica protocol version 1 (docs/replica-protocol.md) over HTTP/1.1
on a Unix socket, as the Node bootstrap (src/runtimes/node/bootstrap.ts) does.

Standard library only; needs Python 3.9 or newer. The sandbox binds this one file and nothing else.

- The public functions are the module's own callables (``__module__`` is the app's module, so imported
  functions are left out) whose names do not start with ``_``; classes are not callable by name.
- A call's JSON object is passed as keyword arguments, checked against the function's signature first:
  a missing or unexpected argument is an ``ArgumentError`` frame naming it (the gateway answers 400).
- ``def`` functions run in a worker thread, ``async def`` ones on the event loop; generators and async
  generators stream ``item`` frames (a sync generator's ``next()`` runs in a thread too).
- Output printed during a run (``print``, ``sys.stdout``, ``sys.stderr``, also from ``asyncio.to_thread``)
  is attributed to that run through a context variable and sent as ``log`` frames, whole lines.
- The app's dependencies, installed by the builder with ``pip install --target``, are in
  ``<build>/out/site-packages`` (the entry is ``<build>/source/main.py``); they go on ``sys.path``
  after the app's folder and the standard library, before the system's site-packages.
"""

import sys

if sys.version_info < (3, 9):
    sys.stderr.write("ferry bootstrap: Python 3.9 or newer is needed, this is %s\n" % sys.version.split()[0])
    sys.exit(2)

import asyncio  # noqa: E402
import codecs  # noqa: E402
import collections.abc  # noqa: E402
import contextvars  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import site  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from urllib.parse import unquote  # noqa: E402

PROTOCOL = 1
HEALTH_PATH = "/_ferry/health"
CALL_PREFIX = "/_ferry/call/"
# POST /_ferry/cancel/<run id>: an async function's task is cancelled (asyncio.CancelledError where it awaits).
CANCEL_PREFIX = "/_ferry/cancel/"
# POST /_ferry/load (warm sandboxes only, once): {"entry", "env"} names the app's module and its environment.
LOAD_PATH = "/_ferry/load"
# Longer than the gateway's keep-alive, so the replica never closes a connection the gateway is about to reuse.
KEEP_ALIVE_TIMEOUT = 65.0
# The gateway is local and sends a request's headers at once; a connection stuck inside them is broken.
HEADERS_TIMEOUT = 10.0
MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 64 * 1024
# Threads are made only when needed; the cap is above any replica_concurrency, so runs never queue here.
MAX_THREADS = 1024
# How long a stopping replica waits for runs the gateway abandoned (generators running their finally blocks).
STOP_CLEANUP_TIMEOUT = 2.0

END_FRAME = '{"type":"end"}'
FALLBACK_ERROR_FRAME = (
    '{"type":"error","error":{"type":"Error","message":"The function raised an error that cannot be described",'
    '"stack":""}}'
)
STREAM_NAMES = ("stdout", "stderr")
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}

BOOTSTRAP_FILE = os.path.abspath(__file__)
# Frames of these files, at the start of a traceback, are the bootstrap's plumbing, not the app's code.
PLUMBING_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (asyncio, sys.modules["concurrent.futures"])
)

REAL_STDOUT = sys.stdout
REAL_STDERR = sys.stderr

current_run = contextvars.ContextVar("ferry_run", default=None)


class ArgumentError(Exception):
    """The call's arguments do not fit the function's signature."""


class SerializationError(Exception):
    """A return value or item that is not JSON."""


def write_real(index, text):
    stream = REAL_STDOUT if index == 0 else REAL_STDERR
    try:
        stream.write(text)
        stream.flush()
    except Exception:
        # With the log pipe gone there is nowhere left to report to.
        pass


def log_error(text):
    write_real(1, "ferry bootstrap: %s\n" % text)


# ---- per-run output ----


class RunOutput:
    """Stands in for sys.stdout or sys.stderr: text written during a run becomes that run's log frames."""

    def __init__(self, real, index):
        self._real = real
        self._index = index
        self.buffer = RunBinaryOutput(self)

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        run = current_run.get()
        if run is None or not run.open:
            try:
                return self._real.write(text)
            except OSError:
                # The replica's log pipe is gone: nowhere left to write to, and no reason to fail the app.
                return len(text)
        deliver(run, self._index, text)
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        if current_run.get() is None:
            try:
                self._real.flush()
            except Exception:
                pass

    def isatty(self):
        return False

    def readable(self):
        return False

    def writable(self):
        return True

    def seekable(self):
        return False

    @property
    def closed(self):
        return False

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return "strict"

    def fileno(self):
        return self._real.fileno()

    def __getattr__(self, name):
        return getattr(self._real, name)


class RunBinaryOutput:
    """`sys.stdout.buffer`: bytes written during a run are decoded as UTF-8 (per run) into its log frames."""

    def __init__(self, text_output):
        self._text = text_output

    def write(self, data):
        run = current_run.get()
        if run is None or not run.open:
            real = self._text._real
            raw = getattr(real, "buffer", None)
            if raw is not None:
                return raw.write(data)
            real.write(bytes(data).decode("utf-8", "replace"))
            return len(data)
        data = bytes(data)
        deliver(run, self._text._index, data)
        return len(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        self._text.flush()

    def isatty(self):
        return False

    def writable(self):
        return True

    def fileno(self):
        return self._text.fileno()


loop = None
loop_thread = None


def deliver(run, index, chunk):
    """Hands output to the run on the event loop's thread, which owns its connection."""
    if threading.get_ident() == loop_thread:
        run.add_output(index, chunk)
        return
    try:
        loop.call_soon_threadsafe(run.add_output, index, chunk)
    except RuntimeError:
        # The loop is closed: the replica is exiting.
        write_real(index, chunk if isinstance(chunk, str) else chunk.decode("utf-8", "replace"))


# ---- the connection ----


class Connection:
    """One connection from the gateway: a request at a time (keep-alive, no pipelining)."""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()
        self.closed = False
        self.idle = True

    async def fill(self):
        try:
            data = await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.closed = True
            return False
        self.buffer += data
        return True

    async def read_request(self):
        """The next request as (method, path, headers, body, keep_alive), or None when the connection ends."""
        if not self.buffer:
            try:
                if not await asyncio.wait_for(self.fill(), KEEP_ALIVE_TIMEOUT):
                    return None
            except asyncio.TimeoutError:
                return None
        deadline = loop.time() + HEADERS_TIMEOUT
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buffer) > MAX_HEAD_BYTES:
                return None
            left = deadline - loop.time()
            try:
                if left <= 0 or not await asyncio.wait_for(self.fill(), left):
                    return None
            except asyncio.TimeoutError:
                return None
        head = bytes(self.buffer[:end]).decode("latin-1")
        del self.buffer[: end + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return None
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return None
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self.read_chunked()
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                return None
            body = await self.read_exactly(length)
        if body is None:
            return None
        path = target.split("?", 1)[0]
        return method, path, headers, body, keep_alive

    async def read_exactly(self, length):
        while len(self.buffer) < length:
            if not await self.fill():
                return None
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    async def read_line(self):
        while True:
            end = self.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 2]
                return line
            if len(self.buffer) > MAX_HEAD_BYTES or not await self.fill():
                return None

    async def read_chunked(self):
        body = bytearray()
        while True:
            line = await self.read_line()
            if line is None:
                return None
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                return None
            if size == 0:
                # Trailers, up to the empty line.
                while True:
                    trailer = await self.read_line()
                    if trailer is None:
                        return None
                    if trailer == b"":
                        return bytes(body)
            chunk = await self.read_exactly(size + 2)
            if chunk is None:
                return None
            body += chunk[:size]

    def write(self, data):
        if self.closed:
            return
        try:
            self.writer.write(data)
        except Exception:
            self.closed = True

    async def drain(self):
        if self.closed:
            return
        try:
            await self.writer.drain()
        except Exception:
            self.closed = True

    def send_json(self, status, body, keep_alive):
        data = body.encode("utf-8")
        head = "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
            status,
            REASONS.get(status, "Unknown"),
            len(data),
            "" if keep_alive else "connection: close\r\n",
        )
        self.write(head.encode("latin-1") + data)

    def close(self):
        self.closed = True
        try:
            self.writer.close()
        except Exception:
            pass


def chunk(text):
    data = text.encode("utf-8")
    return b"%x\r\n%s\r\n" % (len(data), data)


# ---- runs ----


class Run:
    """One call in progress: the context variable's value, so output made anywhere inside the call finds it."""

    def __init__(self, conn):
        self.conn = conn
        # Until the final frame is written or the gateway goes away; after that the run sends nothing.
        self.open = True
        # The unfinished last line of stdout and of stderr.
        self.partial = ["", ""]
        # Made on the first binary write only, so a multi-byte character split across writes survives.
        self.decoders = [None, None]
        # The step of an async generator in progress, cancelled when the gateway goes away.
        self.step = None
        # Set while a generator is being streamed: a stopping replica lets it close.
        self.streaming = False
        self.settled = asyncio.Event()
        # The task running the function, and whether cancelling it reaches the function (async functions and
        # async generators only: a plain function runs in a thread, which nothing can interrupt).
        self.task = None
        self.cancellable = False
        # Set when the run is cancelled or its caller goes away: what a plain `def` function (in a thread,
        # which nothing can interrupt) can look at through `ferry_run.context()`.
        self.cancel_event = threading.Event()
        self.run_id = ""

    def add_output(self, index, text):
        if isinstance(text, bytes):
            decoder = self.decoders[index]
            if decoder is None:
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                self.decoders[index] = decoder
            text = decoder.decode(text)
        if not self.open:
            # Output still to come from an abandoned run has nowhere to go but the replica log.
            write_real(index, text)
            return
        lines = text.split("\n")
        if len(lines) == 1:
            self.partial[index] += text
            return
        self.send_log(index, self.partial[index] + lines[0])
        for line in lines[1:-1]:
            self.send_log(index, line)
        self.partial[index] = lines[-1]

    def take_tail(self, index):
        tail = self.partial[index]
        decoder = self.decoders[index]
        if decoder is not None:
            tail += decoder.decode(b"", True)
        self.partial[index] = ""
        return tail

    def send_log(self, index, line):
        if line.endswith("\r"):
            line = line[:-1]
        self.conn.write(chunk('{"type":"log","stream":"%s","line":%s}\n' % (STREAM_NAMES[index], json.dumps(line))))

    def send_frame(self, frame):
        self.conn.write(chunk(frame + "\n"))

    async def drain(self):
        await self.conn.drain()
        if self.conn.closed:
            abandon(self)

    def finish(self, frame):
        if not self.open:
            return
        for index in (0, 1):
            tail = self.take_tail(index)
            if tail:
                self.send_log(index, tail)
        self.open = False
        self.conn.write(chunk(frame + "\n") + b"0\r\n\r\n")
        self.settled.set()


def abandon(run):
    """The gateway went away before the final frame (client gone, timeout)."""
    if not run.open:
        return
    run.open = False
    run.cancel_event.set()
    for index in (0, 1):
        tail = run.take_tail(index)
        if tail:
            write_real(index, tail + "\n")
    step = run.step
    if step is not None and not step.done():
        # Throws CancelledError into the async generator where it waits, so its finally blocks run now.
        step.cancel()
    run.settled.set()


def in_thread(fn, *args, **kwargs):
    """Runs fn in a worker thread, in (a copy of) the current context, so its output finds the run."""
    context = contextvars.copy_context()
    return loop.run_in_executor(None, functools.partial(context.run, fn, *args, **kwargs))


def is_async_callable(fn):
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def bind_arguments(fn, args):
    """The JSON object as (positional, keyword) arguments for fn; ArgumentError names what does not fit."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return (), dict(args)
    positional = []
    keywords = {}
    missing = []
    known = set()
    takes_any = False
    for param in sig.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            takes_any = True
            continue
        if param.kind is param.VAR_POSITIONAL:
            continue
        known.add(param.name)
        if param.name in args:
            if param.kind is param.POSITIONAL_ONLY:
                positional.append(args[param.name])
            else:
                keywords[param.name] = args[param.name]
        elif param.default is param.empty:
            missing.append(param.name)
        elif param.kind is param.POSITIONAL_ONLY:
            # Keeps the positional-only arguments after it in their places.
            positional.append(param.default)
    unexpected = [name for name in args if name not in known]
    if takes_any:
        for name in unexpected:
            keywords[name] = args[name]
        unexpected = []
    if missing:
        raise ArgumentError("missing required argument%s %s" % ("s" if len(missing) > 1 else "", quote_all(missing)))
    if unexpected:
        raise ArgumentError("unexpected argument%s %s" % ("s" if len(unexpected) > 1 else "", quote_all(unexpected)))
    try:
        sig.bind(*positional, **keywords)
    except TypeError as err:
        raise ArgumentError(str(err)) from None
    return positional, keywords


def quote_all(names):
    return ", ".join("'%s'" % name for name in names)


async def execute(run, fn, args):
    try:
        positional, keywords = bind_arguments(fn, args)
    except ArgumentError as err:
        run.finish(error_frame(err, with_traceback=False))
        return
    try:
        if is_async_callable(fn) or inspect.isgeneratorfunction(fn):
            # Calling these only makes the coroutine or generator: none of the app's code runs yet.
            value = fn(*positional, **keywords)
        else:
            value = await in_thread(fn, *positional, **keywords)
        if isinstance(value, collections.abc.AsyncIterator):
            await stream_async(run, value)
            return
        if isinstance(value, collections.abc.Iterator):
            await stream_sync(run, value)
            return
        if inspect.isawaitable(value):
            value = await value
    except BaseException as err:  # noqa: B036 - anything the app raises ends the run, not the replica
        if isinstance(err, MemoryError):
            out_of_memory(err)
        run.finish(error_frame(err))
        return
    frame = serialize("result", value, "The return value")
    run.finish(error_frame(frame, with_traceback=False) if isinstance(frame, SerializationError) else frame)


async def stream_async(run, it):
    run.streaming = True
    index = 0
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            run.step = step
            try:
                value = await step
            except StopAsyncIteration:
                run.finish(END_FRAME)
                return
            except asyncio.CancelledError:
                if run.open:
                    raise
                break
            finally:
                run.step = None
            if not run.open:
                break
            frame = serialize("item", value, "Item %d" % index)
            index += 1
            if isinstance(frame, SerializationError):
                raise frame
            run.send_frame(frame)
            # Pulls the next item only once the gateway has taken this one, so a fast generator cannot fill memory.
            await run.drain()
            if not run.open:
                break
    except BaseException as err:  # noqa: B036
        await close_async(it)
        if isinstance(err, MemoryError):
            out_of_memory(err)
        run.finish(error_frame(err, with_traceback=not isinstance(err, SerializationError)))
        return
    await close_async(it)


async def stream_sync(run, it):
    run.streaming = True
    index = 0
    try:
        while True:
            done, value = await in_thread(next_step, it)
            if not run.open:
                break
            if done:
                run.finish(END_FRAME)
                return
            frame = serialize("item", value, "Item %d" % index)
            index += 1
            if isinstance(frame, SerializationError):
                raise frame
            run.send_frame(frame)
            await run.drain()
            if not run.open:
                break
    except BaseException as err:  # noqa: B036
        await in_thread(close_sync, it)
        if isinstance(err, MemoryError):
            out_of_memory(err)
        run.finish(error_frame(err, with_traceback=not isinstance(err, SerializationError)))
        return
    await in_thread(close_sync, it)


def next_step(it):
    try:
        return False, next(it)
    except StopIteration:
        return True, None


def close_sync(it):
    """Runs the generator's finally blocks; an error from them is logged, never sent in place of the first one."""
    close = getattr(it, "close", None)
    if close is None:
        return
    try:
        close()
    except BaseException:  # noqa: B036
        log_error("error while closing a generator:\n%s" % format_traceback(sys.exc_info()[1]).rstrip())


async def close_async(it):
    close = getattr(it, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except BaseException:  # noqa: B036
        log_error("error while closing a generator:\n%s" % format_traceback(sys.exc_info()[1]).rstrip())


def out_of_memory(err):
    """Like Node's heap running out: the replica is in no state to go on; the gateway sees why it ended."""
    detail = describe(err)
    log_error("MemoryError: the replica ran out of memory%s; exiting" % (" (%s)" % detail if detail else ""))
    exit_now(1)


def serialize(kind, value, what):
    """The frame, or a SerializationError when the value is not JSON (sets, bytes, NaN, cycles)."""
    try:
        data = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except Exception as err:
        return SerializationError("%s cannot be serialized as JSON: %s" % (what, describe(err)))
    return '{"type":"%s","data":%s}' % (kind, data)


def error_frame(err, with_traceback=True):
    try:
        kind = type(err).__name__
        message = describe(err)
        stack = format_traceback(err) if with_traceback else "%s: %s" % (kind, message)
        return json.dumps(
            {"type": "error", "error": {"type": kind, "message": message, "stack": stack.rstrip("\n")}},
            separators=(",", ":"),
        )
    except Exception:
        return FALLBACK_ERROR_FRAME


def describe(err):
    try:
        return str(err)
    except Exception:
        return "(the error cannot be described)"


def format_traceback(err):
    """The traceback without the bootstrap's own frames before the app's first one (chained errors too)."""
    te = traceback.TracebackException(type(err), err, err.__traceback__)
    seen = set()
    pending = [te]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        frames = list(current.stack)
        while frames and is_plumbing(frames[0].filename):
            frames.pop(0)
        current.stack = traceback.StackSummary.from_list(frames)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    return "".join(te.format())


def is_plumbing(filename):
    return filename == BOOTSTRAP_FILE or filename.startswith(PLUMBING_DIRS) or filename.startswith("<frozen ")


# ---- the server ----

functions = {}
health_body = ""
connections = set()
# The task of every run still going, with its run (an abandoned run goes on until its function returns).
background = {}
inflight = 0
stopping = False
stop_event = None


def keep(task, run):
    background[task] = run
    task.add_done_callback(lambda done: background.pop(done, None))
    return task


async def on_connection(reader, writer):
    conn = Connection(reader, writer)
    connections.add(conn)
    try:
        while not stopping and not conn.closed:
            conn.idle = True
            request = await conn.read_request()
            conn.idle = False
            if request is None:
                break
            if not await handle_request(conn, *request) or stopping:
                break
            await conn.drain()
    except Exception:
        log_error("internal error:\n%s" % traceback.format_exc().rstrip())
    finally:
        connections.discard(conn)
        conn.close()


async def handle_request(conn, method, path, headers, body, keep_alive):
    """Answers one request; returns whether the connection may take another."""
    global inflight
    inflight += 1
    try:
        if method == "POST" and path.startswith(CALL_PREFIX):
            return await handle_call(conn, path[len(CALL_PREFIX) :], body, keep_alive, headers.get("x-ferry-run-id", ""))
        if method == "POST" and path == LOAD_PATH:
            return await handle_load(conn, body, keep_alive)
        if method == "POST" and path.startswith(CANCEL_PREFIX):
            run = active_runs.get(unquote(path[len(CANCEL_PREFIX) :]))
            cancelled = run is not None and run.open and run.task is not None and not run.task.done()
            if cancelled:
                # Every function can see it (ferry_run.context().cancelled); async ones are also interrupted.
                run.cancel_event.set()
                if run.cancellable:
                    run.task.cancel()
            conn.send_json(200, json.dumps({"cancelled": cancelled}), keep_alive)
            return keep_alive
        if method == "GET" and path == HEALTH_PATH:
            conn.send_json(200, health_body, keep_alive)
        else:
            conn.send_json(404, error_body("NotFound", "No route %s %s" % (method, path)), keep_alive)
        return keep_alive
    except Exception:
        log_error("internal error:\n%s" % traceback.format_exc().rstrip())
        return False
    finally:
        inflight -= 1
        exit_when_idle()


# Runs in progress by run id (the gateway's x-ferry-run-id), for cancellation.
active_runs = {}


async def handle_call(conn, raw_name, body, keep_alive, run_id=""):
    name = raw_name
    try:
        name = unquote(raw_name, errors="strict")
    except UnicodeDecodeError:
        # Not valid percent-encoding: no function has that name either.
        pass
    fn = functions.get(name)
    if fn is None:
        conn.send_json(404, error_body("FunctionNotFound", "No public function named %s" % json.dumps(name)), keep_alive)
        return keep_alive
    args = parse_args(body)
    if isinstance(args, str):
        conn.send_json(400, error_body("BadRequest", args), keep_alive)
        return keep_alive
    conn.write(
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n%s\r\n"
            % ("" if keep_alive else "connection: close\r\n")
        ).encode("latin-1")
    )
    # Now rather than with the first frame: a long silent call must not look like a replica that hangs.
    await conn.drain()
    run = Run(conn)
    if conn.closed:
        abandon(run)
        return False
    context = contextvars.copy_context()
    context.run(current_run.set, run)
    # The task copies the current context, which is `context` here: the run is set for all it does.
    run.cancellable = is_async_callable(fn)
    run.run_id = run_id
    run.task = context.run(loop.create_task, guarded_execute(run, fn, args))
    keep(run.task, run)
    if run_id:
        active_runs[run_id] = run
    watcher = loop.create_task(watch_connection(conn, run))
    try:
        await run.settled.wait()
    finally:
        if active_runs.get(run_id) is run:
            del active_runs[run_id]
        watcher.cancel()
        # Until the watcher has really stopped reading, the next request cannot be read (Python 3.12+ checks).
        await asyncio.wait([watcher])
    return not conn.closed


async def guarded_execute(run, fn, args):
    try:
        await execute(run, fn, args)
    except Exception as err:
        log_error("internal error:\n%s" % traceback.format_exc().rstrip())
        run.finish(error_frame(err))


async def watch_connection(conn, run):
    """Notices the gateway closing the connection during a call (it sends nothing else meanwhile)."""
    while run.open:
        if not await conn.fill():
            abandon(run)
            return


def parse_args(body):
    """The arguments object, or why the body is not one (the gateway validates first; this is a second line)."""
    if not body:
        return {}
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        return "The body is not valid JSON: %s" % err
    if not isinstance(value, dict):
        return "The body must be a JSON object"
    return value


def error_body(kind, message):
    return json.dumps({"error": {"type": kind, "message": message}})


def exit_when_idle():
    if stopping and inflight == 0:
        loop.call_soon(lambda: stop_event.set() if inflight == 0 else None)


def stop():
    global stopping
    if stopping:
        return
    stopping = True
    server.close()
    for conn in list(connections):
        if conn.idle:
            conn.close()
    exit_when_idle()


def exit_now(code):
    for stream in (REAL_STDOUT, REAL_STDERR):
        try:
            stream.flush()
        except Exception:
            pass
    # Not sys.exit: threads of runs the gateway gave up on would keep the process alive.
    os._exit(code)


def on_loop_exception(_loop, context):
    err = context.get("exception")
    message = context.get("message", "error")
    if err is not None:
        log_error("%s:\n%s" % (message, format_traceback(err).rstrip()))
    else:
        log_error(message)


server = None


async def listen(socket_path):
    global server
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    except OSError:
        # A folder in the way: listening fails below with a clear message.
        pass
    try:
        server = await asyncio.start_unix_server(on_connection, path=socket_path)
    except OSError as err:
        log_error("cannot listen on %s: %s" % (socket_path, err))
        exit_now(1)


async def serve(socket_path, listening=False):
    global stop_event
    stop_event = asyncio.Event()
    if not listening:
        await listen(socket_path)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
    await stop_event.wait()
    # Runs the gateway gave up on are not waited for (it stopped waiting too), but a generator being
    # closed gets a moment to run its finally blocks.
    closing = [task for task, run in background.items() if run.streaming]
    if closing:
        await asyncio.wait(closing, timeout=STOP_CLEANUP_TIMEOUT)
    try:
        os.unlink(socket_path)
    except OSError:
        pass


# ---- the ferry_run module: what a function may ask about the run it is in ----


class RunContext:
    """The run a function is performing, as `ferry_run.context()` gives it."""

    __slots__ = ("_run",)

    def __init__(self, run):
        self._run = run

    @property
    def run_id(self):
        """The run's id (as the API names it)."""
        return self._run.run_id

    @property
    def cancelled(self):
        """True once the run was cancelled, or its caller went away: stop and return."""
        return self._run.cancel_event.is_set()

    def wait_cancelled(self, timeout=None):
        """Sleeps up to `timeout` seconds (None: for ever), waking early when cancelled; returns `cancelled`."""
        return self._run.cancel_event.wait(timeout)


def run_context():
    """The run being performed where this is called (its thread or task); LookupError outside a run."""
    run = current_run.get()
    if run is None:
        raise LookupError("ferry_run.context() is called outside a run")
    return RunContext(run)


def install_run_module():
    module = types.ModuleType("ferry_run", "What a function may ask about the run it performs (Ferry).")
    module.context = run_context
    module.RunContext = RunContext
    sys.modules["ferry_run"] = module


# ---- loading the app ----


def load_module(entry):
    app_dir = os.path.dirname(os.path.abspath(entry))
    # The app's folder instead of this file's, so `import helper` finds the app's own modules.
    if sys.path and sys.path[0] == os.path.dirname(BOOTSTRAP_FILE):
        sys.path[0] = app_dir
    else:
        sys.path.insert(0, app_dir)
    site_packages = os.path.join(os.path.dirname(app_dir), "out", "site-packages")
    if os.path.isdir(site_packages):
        add_site_packages(site_packages)
    name = os.path.splitext(os.path.basename(entry))[0]
    spec = importlib.util.spec_from_file_location(name, entry)
    if spec is None or spec.loader is None:
        raise ImportError("cannot load %s" % entry)
    module = importlib.util.module_from_spec(spec)
    # Registered first, so the app's modules can `import main` without loading it twice.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def add_site_packages(folder):
    """The builder's site-packages (with its .pth files) before the system's, after the standard library."""
    before = list(sys.path)
    site.addsitedir(folder)
    added = [p for p in sys.path if p not in before]
    rest = [p for p in sys.path if p not in added]
    at = len(rest)
    for i, entry in enumerate(rest):
        if i > 0 and ("site-packages" in entry or "dist-packages" in entry):
            at = i
            break
    sys.path[:] = rest[:at] + added + rest[at:]


def public_functions(module):
    found = {}
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.isclass(value) or inspect.ismodule(value) or not callable(value):
            continue
        # Only the module's own: `from os.path import join` does not make `join` callable from outside.
        if getattr(value, "__module__", None) != module.__name__:
            continue
        found[name] = value
    return found


# ---- warm sandboxes ----

# FERRY_WARM=1: a generic sandbox started before any app needs it (src/replicas/warm-pool.ts). Its server
# runs at once; the one POST /_ferry/load stops the event loop, the app is imported with the loop stopped
# (as in a replica started for it, so asyncio.run() at import works), and the loop goes on serving it.
warm = False
load_started = False
# Set by the load request: (entry, env); then main() sets load_done to whether the app loaded.
load_request = None
load_done = None


async def handle_load(conn, body, keep_alive):
    global load_started
    if not warm or load_started:
        conn.send_json(409, error_body("AlreadyLoaded", "This replica has loaded its app already"), keep_alive)
        return keep_alive
    load_started = True
    try:
        value = json.loads(body.decode("utf-8"))
        entry = value["entry"]
        env = value["env"]
        if not isinstance(entry, str) or not isinstance(env, dict):
            raise ValueError('it needs "entry" (a path) and "env" (an object)')
    except Exception as err:
        log_error("bad load request: %s" % describe(err))
        load_request.set_result(None)
        return False
    load_request.set_result((entry, env))
    loaded = await load_done
    if loaded:
        conn.send_json(200, health_body, keep_alive)
        await conn.drain()
        return keep_alive
    conn.send_json(500, error_body("LoadFailed", "The app could not be loaded"), False)
    try:
        await conn.drain()
    finally:
        # As a replica started for the app whose module raised: exit 3 (main() printed why).
        exit_now(3)


def take_environment(env):
    """The app's environment, as a replica started for it would have had it from the start (PWD kept)."""
    pwd = os.environ.get("PWD")
    os.environ.clear()
    if pwd is not None:
        os.environ["PWD"] = pwd
    for name, value in env.items():
        if isinstance(name, str) and isinstance(value, str):
            os.environ[name] = value


def main():
    global loop, loop_thread, health_body, functions, warm, load_request, load_done
    socket_path = os.environ.get("FERRY_SOCKET")
    entry = os.environ.get("FERRY_ENTRY")
    warm = os.environ.get("FERRY_WARM") == "1"
    if not socket_path or (not entry and not warm):
        log_error("FERRY_SOCKET and FERRY_ENTRY must both be set")
        exit_now(2)

    # Made before the app loads, so asyncio objects it makes at import time belong to the loop that runs it.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop_thread = threading.get_ident()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="ferry-run"))
    loop.set_exception_handler(on_loop_exception)
    sys.stdout = RunOutput(REAL_STDOUT, 0)
    sys.stderr = RunOutput(REAL_STDERR, 1)

    if warm:
        # Everything above is done while the sandbox waits, and its server has served (the gateway warms it
        # up): only the app's own import is left for the load.
        health_body = json.dumps({"protocol": PROTOCOL, "functions": []})
        # Until the load, one function the gateway calls once (Replica.warmUp): the call path, and the
        # thread a plain function runs in, are ready before an app's first run needs them.
        functions = {"_warm": lambda: None}
        load_request = loop.create_future()
        load_done = loop.create_future()
        loop.run_until_complete(listen(socket_path))
        request = loop.run_until_complete(load_request)
        if request is None:
            exit_now(3)
        entry, env = request
        take_environment(env)

    try:
        install_run_module()
        module = load_module(entry)
    except BaseException as err:  # noqa: B036 - SystemExit and KeyboardInterrupt at import fail the start too
        log_error("failed to load %s:\n%s" % (entry, format_traceback(err).rstrip()))
        if warm:
            # The load request is answered, then the process exits (handle_load); at most a second for it.
            asyncio.set_event_loop(loop)
            load_done.set_result(False)
            loop.run_until_complete(asyncio.sleep(1.0))
        exit_now(3)
    # The app may have run asyncio.run() at import, which unsets the current loop.
    asyncio.set_event_loop(loop)

    functions = public_functions(module)
    health_body = json.dumps({"protocol": PROTOCOL, "functions": list(functions)})
    if warm:
        load_done.set_result(True)
    try:
        loop.run_until_complete(serve(socket_path, listening=warm))
    except BaseException:  # noqa: B036
        log_error("internal error:\n%s" % traceback.format_exc().rstrip())
        exit_now(1)
    exit_now(0)


if __name__ == "__main__":
    main()
