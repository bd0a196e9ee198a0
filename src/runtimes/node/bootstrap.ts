/**
 * The Node replica bootstrap (cortex runtime): the program every Node replica runs. It imports the app's
 * bundle once, then serves replica protocol version 1 (docs/replica-protocol.md) over HTTP/1.1 on a Unix
 * socket.
 *
 * The sandbox binds this one compiled file and nothing else, so it imports only `node:` built-ins. No
 * package.json sits beside it there, so Node recognises it as an ES module by its syntax (module syntax
 * detection, on by default since Node 20.19).
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import { unlinkSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import { pathToFileURL } from 'node:url';

const PROTOCOL = 1;
const HEALTH_PATH = '/_ferry/health';
const CALL_PREFIX = '/_ferry/call/';
/** `POST /_ferry/cancel/<run id>`: the run's AbortSignal fires (POST .../runs/{run_id}/cancel). */
const CANCEL_PREFIX = '/_ferry/cancel/';
/**
 * `POST /_ferry/load` (warm sandboxes only, once): the body `{"entry", "env"}` names the app's module and its
 * environment; the bootstrap takes that environment as its own and imports the module.
 */
const LOAD_PATH = '/_ferry/load';
/** The gateway sends an entry path and an environment: bounded so a broken request cannot fill memory. */
const MAX_LOAD_BYTES = 4 * 1024 * 1024;
// Longer than the gateway's keep-alive, so the replica never closes a connection the gateway is about to reuse.
const KEEP_ALIVE_TIMEOUT_MS = 65_000;
// The gateway is local and sends a request's headers at once; a connection stuck inside them is broken.
const HEADERS_TIMEOUT_MS = 10_000;

const END_FRAME = '{"type":"end"}';
const FALLBACK_ERROR_FRAME =
  '{"type":"error","error":{"type":"Error","message":"The function threw a value that cannot be described","stack":""}}';
const STREAM_NAMES = ['stdout', 'stderr'] as const;

type StreamIndex = 0 | 1;
/** What a function gets besides its arguments: `signal` aborts when the run is cancelled. */
interface RunContext {
  signal: AbortSignal;
  runId: string;
}
type PublicFunction = (args: Record<string, unknown>, context: RunContext) => unknown;

interface AnyIterator {
  next(): unknown;
  return?(): unknown;
}

/** One call in progress; the AsyncLocalStorage store, so output made anywhere inside the call finds it. */
interface Run {
  readonly res: ServerResponse;
  /** Until the final frame is written or the gateway goes away; after that the run sends nothing. */
  open: boolean;
  /** The unfinished last line of stdout and of stderr. */
  readonly partial: [string, string];
  /** Made on the first binary write only, so a multi-byte character split across writes survives. */
  readonly decoders: [TextDecoder | undefined, TextDecoder | undefined];
  /** The generator being streamed, until it is finished or has been told to return. */
  iterator: AnyIterator | undefined;
  /** Aborted when the run is cancelled (its signal is the function's `context.signal`). */
  readonly controller: AbortController;
  readonly runId: string;
}

/**
 * Runs in progress by run id (the gateway's `x-ferry-run-id`), for cancellation. A null-prototype object,
 * not a Map: with one run in and one out per call, a Map rebuilds its table every few dozen calls and the
 * tables it leaves behind keep the runs of that moment alive (see runs/invoke.ts in the server).
 */
const active: Record<string, Run> = Object.create(null);

class SerializationError extends Error {
  override name = 'SerializationError';
}

const runs = new AsyncLocalStorage<Run>();
const writeOut = patchStream(process.stdout, 0);
const writeErr = patchStream(process.stderr, 1);

const socketPath = process.env.FERRY_SOCKET;
/**
 * FERRY_WARM=1: a generic sandbox started before any app needs it (src/replicas/warm-pool.ts). It knows no
 * app: it listens at once and loads the app named by its one `POST /_ferry/load`.
 */
const warm = process.env.FERRY_WARM === '1';
const startEntry = process.env.FERRY_ENTRY;
if (!socketPath || (!startEntry && !warm)) {
  writeErr('ferry bootstrap: FERRY_SOCKET and FERRY_ENTRY must both be set\n');
  process.exit(2);
}

// Node exits on these by default. A replica serves many runs at once, so one run's stray timer or forgotten
// promise would kill every other run in flight; logging them (into the run's log when the run is still on,
// since the patched stderr attributes by async context) keeps the rest going.
process.on('uncaughtException', (err) => {
  process.stderr.write(`ferry bootstrap: uncaught exception: ${formatForLog(err)}\n`);
});
process.on('unhandledRejection', (reason) => {
  process.stderr.write(`ferry bootstrap: unhandled promise rejection: ${formatForLog(reason)}\n`);
});

/**
 * Before its app, a warm sandbox has one function, `_warm`, which the gateway calls once (Replica.warmUp) so
 * the whole call path has run before an app's first run needs it; the load replaces it with the app's.
 */
let functions = new Map<string, PublicFunction>(warm ? [['_warm', () => null]] : []);
let healthBody = JSON.stringify({ protocol: PROTOCOL, functions: [] });
/** Whether an app was loaded (or a load began): a warm sandbox takes one app, once, for its whole life. */
let loaded = false;

/** Imports the app's module and finds its public functions; on failure reports why and exits 3. */
async function loadEntry(entry: string): Promise<boolean> {
  loaded = true;
  let moduleNamespace: Record<string, unknown>;
  try {
    moduleNamespace = (await import(pathToFileURL(entry).href)) as Record<string, unknown>;
  } catch (err) {
    // A Node stack names the error first and ends with frames, but the gateway reports a start failure by
    // the last lines the replica printed; so the error itself comes again last, as Python's traceback does.
    writeErr(`ferry bootstrap: failed to load ${entry}: ${formatForLog(err)}\n`);
    writeErr(`ferry bootstrap: ${summarize(err)}\n`);
    return false;
  }
  // Named exports only: `default` is not callable by name (an app wanting a function public exports it by
  // name). Classes are typeof 'function' too, but cannot be called without `new`, so they are left out.
  const found = new Map<string, PublicFunction>();
  for (const name of Object.keys(moduleNamespace)) {
    if (name === 'default' || name.startsWith('_')) continue;
    const value = moduleNamespace[name];
    if (typeof value === 'function' && !isClass(value)) found.set(name, value as PublicFunction);
  }
  functions = found;
  healthBody = JSON.stringify({ protocol: PROTOCOL, functions: [...functions.keys()] });
  return true;
}

if (!warm && !(await loadEntry(startEntry!))) process.exit(3);
if (warm) {
  // A first dynamic import compiles much of Node's module loader; done now, the app's import is quicker. The
  // module is what Ferry's bundles start with (src/runtimes/node/builder.ts), from a data: URL: no file.
  const warmModule =
    "data:text/javascript,import { createRequire } from 'node:module'; import { fileURLToPath } from 'node:url'; import { dirname } from 'node:path'; createRequire('file:///ferry/warm.mjs'); dirname(fileURLToPath('file:///ferry/warm.mjs'));";
  await import(warmModule);
  // The module loader reads files on libuv's thread pool, whose threads start on first use: started now.
  await readFile(new URL(import.meta.url));
}

let inFlight = 0;
let stopping = false;

const server = createServer(
  { keepAliveTimeout: KEEP_ALIVE_TIMEOUT_MS, headersTimeout: HEADERS_TIMEOUT_MS, requestTimeout: 0 },
  handleRequest,
);
server.on('error', (err) => {
  writeErr(`ferry bootstrap: cannot listen on ${socketPath}: ${err.message}\n`);
  process.exit(1);
});
try {
  unlinkSync(socketPath);
} catch {
  // No stale socket; anything else (a folder in the way) makes listen() fail with a clear message.
}
server.listen(socketPath);

const stop = () => {
  if (stopping) return;
  stopping = true;
  server.close();
  server.closeIdleConnections();
  exitWhenIdle();
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);

function exitWhenIdle(): void {
  if (!stopping || inFlight !== 0) return;
  // After the other 'close' listeners, so a generator abandoned at the same moment is still told to return().
  setImmediate(() => {
    if (inFlight === 0) process.exit(0);
  });
}

function handleRequest(req: IncomingMessage, res: ServerResponse): void {
  inFlight += 1;
  res.on('close', () => {
    inFlight -= 1;
    exitWhenIdle();
  });
  try {
    route(req, res);
  } catch (err) {
    writeErr(`ferry bootstrap: internal error: ${formatForLog(err)}\n`);
    if (!res.headersSent) sendJson(res, 500, errorBody('InternalError', 'The replica bootstrap failed'));
    else res.destroy();
  }
}

function route(req: IncomingMessage, res: ServerResponse): void {
  const url = req.url ?? '/';
  const query = url.indexOf('?');
  const pathname = query === -1 ? url : url.slice(0, query);
  if (req.method === 'POST' && pathname.startsWith(CALL_PREFIX)) {
    handleCall(req, res, pathname.slice(CALL_PREFIX.length));
    return;
  }
  if (req.method === 'POST' && pathname === LOAD_PATH) {
    handleLoad(req, res);
    return;
  }
  req.resume();
  if (req.method === 'POST' && pathname.startsWith(CANCEL_PREFIX)) {
    const run = active[decodeURIComponent(pathname.slice(CANCEL_PREFIX.length))];
    let cancelled = false;
    if (run?.open && !run.controller.signal.aborted) {
      cancelled = true;
      // In the run's own context: what its abort listeners print goes to the run's log.
      runs.run(run, () => run.controller.abort(new DOMException('The run was cancelled', 'AbortError')));
    }
    sendJson(res, 200, JSON.stringify({ cancelled }));
    return;
  }
  if (req.method === 'GET' && pathname === HEALTH_PATH) {
    sendJson(res, 200, healthBody);
    return;
  }
  sendJson(res, 404, errorBody('NotFound', `No route ${req.method} ${pathname}`));
}

function handleCall(req: IncomingMessage, res: ServerResponse, rawName: string): void {
  let name = rawName;
  try {
    name = decodeURIComponent(rawName);
  } catch {
    // Not valid percent-encoding: no function has that name either.
  }
  const fn = functions.get(name);
  if (fn === undefined) {
    req.resume();
    sendJson(res, 404, errorBody('FunctionNotFound', `No public function named ${JSON.stringify(name)}`));
    return;
  }
  const chunks: Buffer[] = [];
  req.on('data', (chunk: Buffer) => chunks.push(chunk));
  // The gateway going away mid-body also closes `res`, which is all the cleanup there is.
  req.on('error', () => {});
  req.on('end', () => {
    if (res.destroyed) return;
    const parsed = parseArgs(chunks);
    if (typeof parsed === 'string') {
      sendJson(res, 400, errorBody('BadRequest', parsed));
      return;
    }
    const runId = req.headers['x-ferry-run-id'];
    startRun(res, fn, parsed, typeof runId === 'string' ? runId : '');
  });
}

/**
 * A warm sandbox's one load: replaces the environment with the app's (as a cold replica would have had it
 * from the start, PWD kept), imports the entry, answers like /_ferry/health. A second load is refused: the
 * sandbox belongs to the first app for life. A failed load exits 3 once the answer is written, as a cold
 * replica whose module throws does.
 */
function handleLoad(req: IncomingMessage, res: ServerResponse): void {
  if (!warm || loaded) {
    req.resume();
    sendJson(res, 409, errorBody('AlreadyLoaded', 'This replica has loaded its app already'));
    return;
  }
  loaded = true;
  const chunks: Buffer[] = [];
  let size = 0;
  req.on('data', (chunk: Buffer) => {
    size += chunk.length;
    if (size <= MAX_LOAD_BYTES) chunks.push(chunk);
  });
  req.on('error', () => process.exit(3));
  req.on('end', () => {
    void load(Buffer.concat(chunks), size).then((ok) => {
      if (ok) {
        sendJson(res, 200, healthBody);
        return;
      }
      res.on('close', () => process.exit(3));
      sendJson(res, 500, errorBody('LoadFailed', 'The app could not be loaded'));
    });
  });
}

async function load(body: Buffer, size: number): Promise<boolean> {
  let request: { entry?: unknown; env?: unknown };
  try {
    if (size > MAX_LOAD_BYTES) throw new Error(`the load request is over ${MAX_LOAD_BYTES} bytes`);
    request = JSON.parse(body.toString('utf8')) as { entry?: unknown; env?: unknown };
  } catch (err) {
    writeErr(`ferry bootstrap: bad load request: ${formatForLog(err)}\n`);
    return false;
  }
  const { entry, env } = request;
  if (typeof entry !== 'string' || env === null || typeof env !== 'object' || Array.isArray(env)) {
    writeErr('ferry bootstrap: bad load request: it needs "entry" (a path) and "env" (an object)\n');
    return false;
  }
  const pwd = process.env.PWD;
  for (const name of Object.keys(process.env)) delete process.env[name];
  if (pwd !== undefined) process.env.PWD = pwd;
  for (const [name, value] of Object.entries(env as Record<string, unknown>)) {
    if (typeof value === 'string') process.env[name] = value;
  }
  return loadEntry(entry);
}

/** The arguments object, or why the body is not one (the gateway validates first; this is a second line). */
function parseArgs(chunks: Buffer[]): Record<string, unknown> | string {
  if (chunks.length === 0) return {};
  const body = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks);
  if (body.length === 0) return {};
  let value: unknown;
  try {
    value = JSON.parse(body.toString('utf8'));
  } catch (err) {
    return `The body is not valid JSON: ${err instanceof Error ? err.message : String(err)}`;
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value)) return 'The body must be a JSON object';
  return value as Record<string, unknown>;
}

function startRun(res: ServerResponse, fn: PublicFunction, args: Record<string, unknown>, runId: string): void {
  const run: Run = {
    res,
    open: true,
    partial: ['', ''],
    decoders: [undefined, undefined],
    iterator: undefined,
    controller: new AbortController(),
    runId,
  };
  if (runId !== '') active[runId] = run;
  res.on('close', () => {
    if (active[runId] === run) delete active[runId];
    if (run.open) abandon(run);
  });
  res.writeHead(200, { 'content-type': 'application/x-ndjson' });
  // Now rather than with the first frame: a long silent call must not look like a replica that hangs.
  res.flushHeaders();
  runs.run(run, execute, run, fn, args).catch((err: unknown) => {
    writeErr(`ferry bootstrap: internal error: ${formatForLog(err)}\n`);
    finish(run, errorFrame(err));
  });
}

async function execute(run: Run, fn: PublicFunction, args: Record<string, unknown>): Promise<void> {
  let value: unknown;
  try {
    value = fn(args, { signal: run.controller.signal, runId: run.runId });
    // By shape rather than by constructor, so generators transpiled to plain iterator objects stream too.
    if (isIterator(value)) {
      await stream(run, value);
      return;
    }
    value = await value;
  } catch (err) {
    finish(run, errorFrame(err));
    return;
  }
  const frame = serialize('result', value, 'The return value');
  finish(run, frame instanceof Error ? errorFrame(frame) : frame);
}

async function stream(run: Run, it: AnyIterator): Promise<void> {
  run.iterator = it;
  let index = 0;
  try {
    for (;;) {
      let step: IteratorResult<unknown>;
      try {
        step = (await it.next()) as IteratorResult<unknown>;
      } catch (err) {
        // A generator that threw has finished: there is nothing left to return() from.
        run.iterator = undefined;
        throw err;
      }
      if (!run.open) return;
      if (step.done) {
        run.iterator = undefined;
        finish(run, END_FRAME);
        return;
      }
      const frame = serialize('item', await step.value, `Item ${index}`);
      index += 1;
      if (!run.open) return;
      if (frame instanceof Error) throw frame;
      // Pulls the next item only once the gateway has taken this one, so a fast generator cannot fill memory.
      if (!run.res.write(`${frame}\n`)) await drained(run.res);
      if (!run.open) return;
    }
  } catch (err) {
    await closeIterator(run);
    finish(run, errorFrame(err));
  }
}

/** Runs the generator's `finally` blocks; an error from them is logged, never sent in place of the first one. */
async function closeIterator(run: Run): Promise<void> {
  const it = run.iterator;
  if (it === undefined) return;
  run.iterator = undefined;
  try {
    await it.return?.();
  } catch (err) {
    process.stderr.write(`ferry bootstrap: error while closing a generator: ${formatForLog(err)}\n`);
  }
}

/** The gateway went away before the final frame (client gone, timeout). */
function abandon(run: Run): void {
  run.open = false;
  // Output still to come from this run has nowhere to go but the replica log; so have its unfinished lines.
  for (const index of [0, 1] as const) {
    const tail = takeTail(run, index);
    if (tail !== '') (index === 0 ? writeOut : writeErr)(`${tail}\n`);
  }
  // The function is told too: its caller is gone (or the run timed out), nothing it returns is heard.
  if (!run.controller.signal.aborted) {
    runs.run(run, () => run.controller.abort(new DOMException('The run was abandoned', 'AbortError')));
  }
  void runs.run(run, closeIterator, run);
}

function drained(res: ServerResponse): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      res.off('drain', done);
      res.off('close', done);
      resolve();
    };
    res.on('drain', done);
    res.on('close', done);
  });
}

function finish(run: Run, frame: string): void {
  if (!run.open) return;
  for (const index of [0, 1] as const) {
    const tail = takeTail(run, index);
    if (tail !== '') sendLog(run, index, tail);
  }
  run.open = false;
  run.iterator = undefined;
  run.res.end(`${frame}\n`);
}

function takeTail(run: Run, index: StreamIndex): string {
  const tail = run.partial[index] + (run.decoders[index]?.decode() ?? '');
  run.partial[index] = '';
  return tail;
}

function sendLog(run: Run, index: StreamIndex, line: string): void {
  const text = line.endsWith('\r') ? line.slice(0, -1) : line;
  run.res.write(`{"type":"log","stream":"${STREAM_NAMES[index]}","line":${JSON.stringify(text)}}\n`);
}

/** Routes a stream's writes made inside a run into that run's log frames; returns the stream's own write. */
function patchStream(stream: NodeJS.WriteStream, index: StreamIndex): (text: string) => void {
  const original = stream.write;
  const write = (...args: unknown[]): boolean => {
    const run = runs.getStore();
    if (run === undefined || !run.open) return Reflect.apply(original, stream, args) as boolean;
    const [chunk, encodingOrCallback, callback] = args;
    const encoding = typeof encodingOrCallback === 'string' ? encodingOrCallback : undefined;
    addOutput(run, index, toText(run, index, chunk, encoding));
    const done = typeof encodingOrCallback === 'function' ? encodingOrCallback : callback;
    if (typeof done === 'function') process.nextTick(done as () => void);
    return true;
  };
  stream.write = write as typeof stream.write;
  // With the log pipe gone there is nowhere left to report to; unheard, the 'error' would become an uncaught
  // exception whose report goes to the broken pipe again.
  stream.on('error', () => {});
  return (text) => {
    original.call(stream, text);
  };
}

function toText(run: Run, index: StreamIndex, chunk: unknown, encoding: string | undefined): string {
  if (typeof chunk === 'string') {
    if (encoding === undefined || encoding === 'utf8' || encoding === 'utf-8') return chunk;
    return Buffer.from(chunk, encoding as BufferEncoding).toString('utf8');
  }
  if (chunk instanceof Uint8Array) {
    let decoder = run.decoders[index];
    if (decoder === undefined) {
      decoder = new TextDecoder();
      run.decoders[index] = decoder;
    }
    return decoder.decode(chunk, { stream: true });
  }
  return String(chunk);
}

function addOutput(run: Run, index: StreamIndex, text: string): void {
  let newline = text.indexOf('\n');
  if (newline === -1) {
    run.partial[index] += text;
    return;
  }
  sendLog(run, index, run.partial[index] + text.slice(0, newline));
  let start = newline + 1;
  newline = text.indexOf('\n', start);
  while (newline !== -1) {
    sendLog(run, index, text.slice(start, newline));
    start = newline + 1;
    newline = text.indexOf('\n', start);
  }
  run.partial[index] = text.slice(start);
}

/** The frame, or a SerializationError when the value is not JSON (BigInt, cycles, a throwing toJSON). */
function serialize(type: 'item' | 'result', value: unknown, what: string): string | SerializationError {
  let json: string | undefined;
  try {
    json = JSON.stringify(value);
  } catch (err) {
    const reason = err instanceof Error ? err.message : String(err);
    const error = new SerializationError(`${what} cannot be serialized as JSON: ${reason}`, { cause: err });
    // The stack would only show this file, not the app's code.
    error.stack = `${error.name}: ${error.message}`;
    return error;
  }
  // undefined, functions and symbols have no JSON form; they become null like undefined.
  return `{"type":"${type}","data":${json ?? 'null'}}`;
}

function errorFrame(thrown: unknown): string {
  try {
    const err = toError(thrown);
    const message = String(err.message);
    const type = errorType(err);
    const stack = typeof err.stack === 'string' ? err.stack : `${type}: ${message}`;
    return JSON.stringify({ type: 'error', error: { type, message, stack } });
  } catch {
    // A getter on the thrown value threw; the run still needs its final frame.
    return FALLBACK_ERROR_FRAME;
  }
}

function isErrorLike(value: unknown): value is Error {
  // The tag check also catches errors from other realms (node:vm), which fail instanceof.
  return value instanceof Error || Object.prototype.toString.call(value) === '[object Error]';
}

function toError(thrown: unknown): Error {
  if (isErrorLike(thrown)) return thrown;
  const err = new Error(describe(thrown), { cause: thrown });
  // A stack made here would point at this file, not at the code that threw.
  err.stack = `Error: ${err.message}`;
  return err;
}

/** `err.name`, unless it is the generic 'Error' a subclass inherits without setting its own: then the class name. */
function errorType(err: Error): string {
  const name: unknown = err.name;
  if (typeof name === 'string' && name !== '' && name !== 'Error') return name;
  const ctorName: unknown = (err.constructor as { name?: unknown } | undefined)?.name;
  if (typeof ctorName === 'string' && ctorName !== '') return ctorName;
  return 'Error';
}

function describe(value: unknown): string {
  if (typeof value === 'string') return value;
  if (typeof value === 'function') return `[function ${value.name || 'anonymous'}]`;
  if (value === null || typeof value !== 'object') return String(value);
  try {
    const json = JSON.stringify(value);
    if (json !== undefined) return json;
  } catch {
    // Cycles or BigInts inside: fall back to the tag.
  }
  return Object.prototype.toString.call(value);
}

function formatForLog(value: unknown): string {
  if (isErrorLike(value)) return typeof value.stack === 'string' ? value.stack : `${value.name}: ${value.message}`;
  try {
    return describe(value);
  } catch {
    return 'a value that cannot be described';
  }
}

/** The error's type and message on one line (what a person needs first when the app did not load). */
function summarize(value: unknown): string {
  try {
    const err = toError(value);
    return `${errorType(err)}: ${String(err.message)}`.replace(/\s*\n\s*/g, ' ').slice(0, 400);
  } catch {
    return 'a value that cannot be described';
  }
}

function isIterator(value: unknown): value is AnyIterator {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) return false;
  const candidate = value as Record<PropertyKey, unknown>;
  return (
    typeof candidate.next === 'function' &&
    (typeof candidate[Symbol.asyncIterator] === 'function' || typeof candidate[Symbol.iterator] === 'function')
  );
}

function isClass(fn: unknown): boolean {
  return /^class\b/.test(Function.prototype.toString.call(fn));
}

function errorBody(type: string, message: string): string {
  return JSON.stringify({ error: { type, message } });
}

function sendJson(res: ServerResponse, status: number, body: string): void {
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
  res.end(body);
}
