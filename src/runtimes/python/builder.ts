/**
 * The Python builder (cortex runtime, `main.py`): checks the entry's syntax and finds its public functions
 * without running it (Python's own compiler and `ast`, in a subprocess), then, when `requirements.txt`
 * exists, installs the dependencies with pip into `<outputDir>/site-packages`, where the Python bootstrap
 * (src/runtimes/python/bootstrap.py) puts them on `sys.path`.
 *
 * Builds use the interpreter replicas run (`findPython()`), so compiled extensions and the bytecode pip
 * writes match it.
 *
 * On an image (`[image]`) both use the image's python3 instead, never the server's: `requirements.txt` is
 * installed into the image itself by two steps of the image's build (`imageSteps`: a COPY of the file and
 * of the app's files it names, then `python3 -m pip install -r requirements.txt` as the image's root, in the
 * image build sandbox, cached like the app's own steps), where source distributions are allowed (that
 * sandbox runs the app's code anyway); and the syntax check runs the image's python3 in the build sandbox
 * with the image's root as `/`.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { BuildFailedError, noEntryError } from '../../builds/build-failed.js';
import type { BuildContext, Builder, BuildResult } from '../../builds/builder.js';
import { isFile, PROXY_ENV, throwIfAborted } from '../../builds/run-child.js';
import { ImageBuildError, type ImplicitStep } from '../../images/image-steps.js';
import { describeStepExit, runBuildStep, stepPaths, toolMounts } from '../../sandbox/build-step.js';
import { findImagePython, findPython } from './interpreter.js';
import { PIP_TAIL_LINES, pipFailure, pipRetryOptions } from './pip-failure.js';
import { requirementsLocalPaths, requirementsProblem } from './requirements.js';

export const PYTHON_ENTRY = 'main.py';
/** The oldest Python the bootstrap runs on. */
export const MIN_PYTHON_VERSION: readonly [number, number] = [3, 9];
/** Where pip installs the app's dependencies, inside the build's output folder. */
export const SITE_PACKAGES_DIR = 'site-packages';
/** Where the image steps copy requirements.txt and what it names, and run pip (hidden from replicas: /ferry is Ferry's). */
export const IMAGE_REQUIREMENTS_DIR = '/ferry/requirements';

/** pip's network timeout in seconds, per attempt. */
const PIP_TIMEOUT_SECONDS = 15;

/**
 * Server variables pip may need to reach an index: proxies, and an operator's index or certificates.
 * Everything else in the server's environment stays out.
 */
const PASSED_ENV = [
  ...PROXY_ENV,
  'PIP_INDEX_URL',
  'PIP_EXTRA_INDEX_URL',
  'PIP_TRUSTED_HOST',
  'PIP_CERT',
  'SSL_CERT_FILE',
  'SSL_CERT_DIR',
];

/**
 * Run by the build's interpreter with `-I` on `main.py`: compiles it (a syntax check that runs none of
 * it) and lists the public functions from its syntax tree. Prints one JSON line:
 * `{"version": [3, 11, 2], "functions": [...] | null}` or `{"version": ..., "error": {...}}`.
 *
 * The list must not miss a function the bootstrap will serve (the run endpoint answers 404 for names
 * outside it), so `functions` is null, "unknown", whenever a public name might be bound to a callable
 * of the module other than by `def`: a lambda, a value computed from the module's own functions or
 * classes, a star import, `globals()` and the like. Listing a name the bootstrap then leaves out (a
 * decorator that returns something else) only moves the 404 to the replica. (A template literal: keep
 * backslashes and `${` out of the script.)
 */
const ANALYZE_SCRIPT = `
import ast, json, sys

def main(file):
    out = {"version": list(sys.version_info[:3])}
    if sys.version_info < (3, 9):
        print(json.dumps(out))
        return
    with open(file, "rb") as f:
        source = f.read()
    try:
        compile(source, file, "exec", dont_inherit=True)
    except SyntaxError as e:
        out["error"] = {"type": type(e).__name__, "message": e.msg, "line": e.lineno, "column": e.offset,
                        "text": (e.text or "").rstrip()}
    except (ValueError, RecursionError, MemoryError) as e:
        out["error"] = {"type": type(e).__name__, "message": str(e), "line": None, "column": None, "text": ""}
    else:
        out["functions"] = public_functions(ast.parse(source, file))
    print(json.dumps(out))

NOT_CALLABLE = (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp,
                ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Compare)
DYNAMIC = {"globals", "vars", "locals", "exec", "eval", "__import__"}

def public_functions(tree):
    defs, classes, bindings = [], set(), []
    unknown = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.append(node.name)
                bindings.append((node.name, None, "def"))
            elif isinstance(node, ast.ClassDef):
                classes.add(node.name)
                bindings.append((node.name, None, "decorated class" if node.decorator_list else "class"))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        unknown.append("star import")
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, node.value, direct=isinstance(target, ast.Name))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                if node.value is not None:
                    bind(node.target, node.value, direct=isinstance(node, ast.AnnAssign))
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                bind(node.target, node.iter, direct=False)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars, item.context_expr, direct=False)
            for field in ("body", "orelse", "finalbody"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, field, None) or [])
            for handler in getattr(node, "handlers", None) or []:
                visit(handler.body)
            for case in getattr(node, "cases", None) or []:
                visit(case.body)
                for sub in ast.walk(case.pattern):
                    name = getattr(sub, "name", None)
                    if isinstance(name, str):
                        bindings.append((name, None, "unknown"))

    def bind(target, value, direct):
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                bindings.append((sub.id, value, "assign" if direct else "unpack"))

    def bind_globals(function):
        # Assignments in a function to names it declares global bind module attributes when it runs.
        names = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                names.update(node.names)
        if not names:
            return
        for node in ast.walk(function):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets = [(node.target, node.value)]
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                targets = [(node.target, node.iter)]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                targets = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars is not None]
            elif isinstance(node, ast.NamedExpr):
                targets = [(node.target, node.value)]
            for target, value in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and sub.id in names:
                        bindings.append((sub.id, value, "unpack"))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                if node is not function:
                    for name in [getattr(node, "name", None)] + [a.asname or a.name for a in getattr(node, "names", [])]:
                        if name in names:
                            bindings.append((name, None, "unknown"))

    visit(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            bindings.append((node.target.id, node.value, "unpack"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bind_globals(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DYNAMIC:
            unknown.append(node.func.id)
        elif (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
              and node.value.id == "sys"):
            unknown.append("sys.modules")
    if unknown:
        return None

    # Names that may hold a callable of the module's own: its functions and classes, lambdas, and
    # whatever is computed from them.
    own = set(defs) | classes

    def may_be_own(value):
        if value is None:
            return True
        if isinstance(value, NOT_CALLABLE):
            return False
        return any(isinstance(n, ast.Lambda) or (isinstance(n, ast.Name) and n.id in own) for n in ast.walk(value))

    changed = True
    while changed:
        changed = False
        for name, value, kind in bindings:
            if kind in ("assign", "unpack", "unknown") and name not in own and may_be_own(value):
                own.add(name)
                changed = True

    found = []
    for name, value, kind in bindings:
        if name.startswith("_"):
            continue
        if kind == "def":
            found.append(name)
        elif kind == "decorated class":
            return None
        elif kind in ("assign", "unpack", "unknown") and may_be_own(value):
            if kind == "assign" and (isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in defs)):
                found.append(name)
            else:
                return None
    return sorted(set(found))

main(sys.argv[1])
`;

interface Analysis {
  version: [number, number, number];
  functions?: string[] | null;
  error?: { type: string; message: string; line: number | null; column: number | null; text: string };
}

export interface PythonBuilderOptions {
  /** The interpreter (default: `findPython()`, the one replicas run). */
  python?: string;
}

export function createPythonBuilder(options: PythonBuilderOptions = {}): Builder {
  return {
    name: 'python',
    imageSteps: ({ sourceDir }) => requirementsImageSteps(sourceDir),
    async build(ctx: BuildContext): Promise<BuildResult> {
      throwIfAborted(ctx.signal);
      const entry = await findEntry(ctx);
      ctx.log(`Entry: ${entry}`);
      const removed = await removeBytecode(ctx.sourceDir);
      if (removed > 0) {
        ctx.log(
          `Removed ${removed} compiled Python file${removed === 1 ? '' : 's'} (__pycache__, .pyc) from the upload: replicas run the .py files shipped`,
        );
      }
      const imagePython = ctx.image ? await checkImagePython(ctx, ctx.image) : undefined;
      // On an image, the image's python3 checks the source, in the build sandbox on the image's root.
      const python = imagePython ?? options.python ?? (await findPython());
      if (python === null) {
        throw new BuildFailedError('Python apps cannot be built on this server: no python3 interpreter was found');
      }
      const analysis = await analyze(ctx, python, entry, ctx.image && imagePython ? ctx.image : undefined);
      const version = analysis.version.join('.');
      ctx.log(`Python ${version} (${python}${imagePython ? ', the image’s' : ''})`);
      const [major, minor] = MIN_PYTHON_VERSION;
      if (analysis.version[0] < major || (analysis.version[0] === major && analysis.version[1] < minor)) {
        if (imagePython) {
          throw new ImageBuildError(
            'FERRY_IMAGE_NO_PYTHON',
            'checking main.py with the image’s python3',
            `the image's python3 is ${version}; the bootstrap needs ${major}.${minor} or newer`,
          );
        }
        throw new BuildFailedError(`Python ${major}.${minor} or newer is needed; this server has ${version}`);
      }
      if (analysis.error) {
        const { type, message, line, column, text } = analysis.error;
        const where = line === null ? entry : `${entry}:${line}${column === null ? '' : `:${column}`}`;
        ctx.log(`${where}: ${type}: ${message}`);
        if (text) {
          ctx.log(`    ${text}`);
          if (column !== null && column > 0) ctx.log(`    ${' '.repeat(column - 1)}^`);
        }
        throw new BuildFailedError(`Syntax check failed: ${where}: ${message}`);
      }
      const functions = analysis.functions ?? undefined;
      if (await isFile(path.join(ctx.sourceDir, 'requirements.txt'))) {
        // On an image, the image's build installed it (imageSteps, in the log above).
        if (imagePython) ctx.log("requirements.txt: installed into the image by its build, with the image's pip");
        else await installRequirements(ctx, python);
      }
      throwIfAborted(ctx.signal);
      ctx.log(
        functions === undefined
          ? 'Public functions: decided when a replica loads main.py (they cannot be told from its source alone)'
          : `Public functions: ${functions.length > 0 ? functions.join(', ') : '(none)'}`,
      );
      const result: BuildResult = { runtime: 'python', entry: `${path.basename(ctx.sourceDir)}/${entry}` };
      if (functions !== undefined) result.functions = functions;
      if (imagePython) result.image = { python: imagePython };
      return result;
    },
  };
}

/** The image's python3 (FERRY_IMAGE_NO_PYTHON when it has none, or one older than MIN_PYTHON_VERSION). */
async function checkImagePython(ctx: BuildContext, image: NonNullable<BuildContext['image']>): Promise<string> {
  const step = 'finding python3 in the image';
  const found = await findImagePython(image.rootfs, image.record.searchPath);
  if (!found) {
    throw new ImageBuildError(
      'FERRY_IMAGE_NO_PYTHON',
      step,
      `the image has no python3 on its PATH (${image.record.searchPath.join(':')}); use a base with Python ${MIN_PYTHON_VERSION.join('.')} or newer`,
    );
  }
  const [major, minor] = MIN_PYTHON_VERSION;
  if (found.version && (found.version[0] < major || (found.version[0] === major && found.version[1] < minor))) {
    throw new ImageBuildError(
      'FERRY_IMAGE_NO_PYTHON',
      step,
      `the image's python3 is ${found.version.join('.')}; the bootstrap needs ${major}.${minor} or newer`,
    );
  }
  ctx.log(
    `Image Python: ${found.path}${found.version ? ` (${found.version.join('.')})` : ' (version not told by its files)'}`,
  );
  return found.path;
}

/**
 * Removes every `__pycache__` folder and `.pyc`/`.pyo` file of the upload and counts the files. Python
 * prefers bytecode to source: an unchecked-hash `__pycache__/main.cpython-311.pyc` runs instead of
 * main.py whatever main.py says, and a `helper.pyc` without `helper.py` is imported as is. So what a
 * replica runs is the source shipped (the checks above read it). Nothing is followed: an archive holds no
 * links, and a link would only be removed, never entered.
 */
async function removeBytecode(sourceDir: string): Promise<number> {
  let count = 0;
  const walk = async (dir: string): Promise<void> => {
    for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
      const file = path.join(dir, entry.name);
      if (entry.isDirectory() && entry.name === '__pycache__') {
        count += (await fs.readdir(file, { recursive: true })).length;
        await fs.rm(file, { recursive: true, force: true });
      } else if (entry.isDirectory()) {
        await walk(file);
      } else if (/\.py[co]$/i.test(entry.name)) {
        count += 1;
        await fs.rm(file, { force: true });
      }
    }
  };
  await walk(sourceDir);
  return count;
}

async function findEntry(ctx: BuildContext): Promise<string> {
  const configured = ctx.config.app.entry;
  if (configured !== undefined && configured !== PYTHON_ENTRY) {
    throw new BuildFailedError(`The Python builder runs ${PYTHON_ENTRY}, not ${configured} (app.entry in ferry.toml)`);
  }
  if (!(await isFile(path.join(ctx.sourceDir, PYTHON_ENTRY)))) {
    if (configured === undefined) throw noEntryError();
    throw new BuildFailedError(`Entry file ${PYTHON_ENTRY} (app.entry in ferry.toml) is not at the archive root`);
  }
  return PYTHON_ENTRY;
}

/**
 * The syntax check, in the sandbox: Python's own compiler reads the app's file, so it is app input. With
 * `image`, `python` is the image's and runs on the image's root (its PATH, none of the host's folders).
 */
async function analyze(
  ctx: BuildContext,
  python: string,
  entry: string,
  image?: NonNullable<BuildContext['image']>,
): Promise<Analysis> {
  const stdout: string[] = [];
  const stderr: string[] = [];
  const paths = stepPaths(ctx);
  const exit = await runBuildStep(ctx, {
    label: 'syntax check',
    command: [python, '-I', '-c', ANALYZE_SCRIPT, path.posix.join(paths.source, entry)],
    env: { PATH: image ? image.record.searchPath.join(':') : paths.searchPath, PYTHONDONTWRITEBYTECODE: '1' },
    cwd: paths.out,
    ...(image ? { imageRoot: image.rootfs } : { readOnly: toolMounts(paths, python) }),
    onLine: (stream, line) => (stream === 'stdout' ? stdout : stderr).push(line),
  });
  const last = stdout.at(-1);
  if (exit.code !== 0 || last === undefined) {
    for (const line of stderr) ctx.log(line);
    const how = describeStepExit(exit, ctx.sandbox.limits);
    if (exit.oomKilled) throw new BuildFailedError(`Checking ${entry} ${how}`);
    throw new Error(`Checking ${entry} with ${python} ${how}`);
  }
  return JSON.parse(last) as Analysis;
}

/**
 * The image steps that install `requirements.txt` into the image (none without one): a COPY of the file
 * and of each path of the app it names (wheels, source archives, `--find-links` folders, nested files; the
 * whole folder for `.`), keeping their places relative to it, then pip with the image's python3 in that
 * folder. Only what is copied is visible to pip, so the step's cache key (the copies' digests) covers every
 * input: a deploy that changes only main.py re-runs none of it. Source distributions are allowed: the
 * image build sandbox runs the app's code anyway.
 */
export async function requirementsImageSteps(sourceDir: string): Promise<ImplicitStep[]> {
  const file = path.join(sourceDir, 'requirements.txt');
  if (!(await isFile(file))) return [];
  const named = requirementsLocalPaths(await fs.readFile(file), sourceDir);
  const steps: ImplicitStep[] = [];
  if (named.includes('.')) steps.push({ kind: 'copy', source: '.', dest: `${IMAGE_REQUIREMENTS_DIR}/` });
  else {
    for (const source of ['requirements.txt', ...named.filter((p) => p !== 'requirements.txt')]) {
      const folder = await fs
        .stat(path.join(sourceDir, source))
        .then((st) => st.isDirectory())
        .catch(() => false);
      steps.push({ kind: 'copy', source, dest: `${IMAGE_REQUIREMENTS_DIR}/${source}${folder ? '/' : ''}` });
    }
  }
  const env: Record<string, string> = {
    PIP_DISABLE_PIP_VERSION_CHECK: '1',
    PIP_NO_INPUT: '1',
    PIP_ROOT_USER_ACTION: 'ignore',
    // A Debian or Ubuntu python3 is "externally managed" (PEP 668): this image is the app's own.
    PIP_BREAK_SYSTEM_PACKAGES: '1',
    PYTHONUNBUFFERED: '1',
  };
  for (const name of PASSED_ENV) {
    const value = process.env[name];
    if (value !== undefined) env[name] = value;
  }
  const command = [
    'command -v python3 >/dev/null 2>&1 || { echo "the image has no python3 on its PATH ($PATH): requirements.txt is installed with the image’s python3" >&2; exit 127; }',
    'python3 -m pip --version >/dev/null 2>&1 || { echo "the image’s python3 has no pip (python3 -m pip): add it to the image (apt = [python3-pip]) or use a base that has it" >&2; exit 1; }',
    'exec python3 -m pip install --no-cache-dir -r requirements.txt',
  ].join('\n');
  steps.push({
    kind: 'run',
    label: 'python3 -m pip install --no-cache-dir -r requirements.txt',
    command,
    cwd: IMAGE_REQUIREMENTS_DIR,
    env,
  });
  return steps;
}

async function installRequirements(ctx: BuildContext, python: string): Promise<void> {
  const problem = requirementsProblem(await fs.readFile(path.join(ctx.sourceDir, 'requirements.txt')), ctx.sourceDir);
  if (problem) {
    const where = `requirements.txt line ${problem.line}${problem.text === '' ? '' : `: "${problem.text}"`}`;
    ctx.log(`${where}: ${problem.reason}`);
    throw new BuildFailedError(
      `${where}: ${problem.reason}; Ferry installs wheels only (a source package runs its build code as part of the build) and reads no file requirements.txt names but wheels: ship a wheel instead (pip wheel --no-deps <folder> -w wheels/)`,
    );
  }
  const paths = stepPaths(ctx);
  const target = path.posix.join(paths.out, SITE_PACKAGES_DIR);
  const args = [
    // -I: neither the working folder nor PYTHON* variables reach sys.path, so an app's pip.py is not pip.
    '-I',
    '-m',
    'pip',
    'install',
    '--no-input',
    '--disable-pip-version-check',
    '--no-cache-dir',
    '--timeout',
    String(PIP_TIMEOUT_SECONDS),
    // No retries of an index no connection can reach (pip-failure.ts).
    ...pipRetryOptions(ctx.sandbox.network.mode),
    // Wheels only: a source package's build code would run as part of the build. (It would run in the
    // sandbox, but wheels keep builds predictable; see requirements.ts.)
    '--only-binary=:all:',
    '--target',
    target,
    '-r',
    'requirements.txt',
  ];
  ctx.log(`Running pip install -r requirements.txt --target ${path.basename(ctx.outputDir)}/${SITE_PACKAGES_DIR}`);
  ctx.log('Installing wheels only: source packages are refused');

  const env: Record<string, string> = {
    PATH: paths.searchPath,
    HOME: path.posix.join(paths.cache, 'home'),
    PIP_DISABLE_PIP_VERSION_CHECK: '1',
    PIP_NO_INPUT: '1',
    PIP_ROOT_USER_ACTION: 'ignore',
    PYTHONUNBUFFERED: '1',
  };
  for (const name of PASSED_ENV) {
    const value = process.env[name];
    if (value !== undefined) env[name] = value;
  }
  const started = Date.now();
  // The end of pip's output, for the error (its conclusion is there).
  const tail: string[] = [];
  // The working folder is the app folder, as the sandbox shows it read-only, so `./wheels/x.whl` lines
  // in requirements.txt resolve; -I keeps it off sys.path.
  const exit = await runBuildStep(ctx, {
    label: 'pip install',
    command: [python, ...args],
    env,
    cwd: paths.source,
    readOnly: toolMounts(paths, python),
    onLine: (_stream, line) => {
      ctx.log(line);
      tail.push(line);
      if (tail.length > PIP_TAIL_LINES) tail.shift();
    },
  });
  if (exit.code !== 0) {
    throw pipFailure(describeStepExit(exit, ctx.sandbox.limits), tail, ctx.sandbox.network.mode);
  }
  ctx.log(`pip install finished in ${((Date.now() - started) / 1000).toFixed(1)} s`);
}
