/**
 * Cortex Python apps on their own image with a `requirements.txt` (issue 26: "requirements.txt is installed
 * into the image, source distributions allowed there"), deployed and called end to end, offline. The test
 * writes an image holding the machine's own Debian python3 with its pip, setuptools and wheel (from
 * /usr/lib/python3/dist-packages: a Debian python3, "externally managed" under PEP 668), serves it from a
 * real registry on loopback and deploys through the real API:
 *
 * - requirements.txt names a source distribution in the app folder (`./pkgs/hello-0.1.tar.gz`, whose
 *   setup.py runs in the image build sandbox and writes a module saying which Python built it) and a wheel
 *   found with `--no-index --find-links ./wheels`: both are installed into the image with the image's pip
 *   (two image steps, COPY and RUN), and a function imports them;
 * - a second deploy changing only main.py re-runs none of the image steps (`cached`, the same image), and
 *   one changing a file requirements.txt names re-runs the install;
 * - a failing install is FERRY_IMAGE_STEP_FAILED naming the pip step, never a host path;
 * - the syntax check runs the image's python3, in the build sandbox on the image's root: an image whose
 *   python3 is a script that answers for it decides the version and the functions the build reports;
 * - examples/image-app deploys and answers, with its `base` rewritten to this image (the test reaches no
 *   Docker Hub), its PyPI requirement served by a stand-in wheel (`--no-index --find-links ./wheels` put
 *   before its lines: no PyPI either), and `apt` served by the image's stand-in `apt-get` (no Debian
 *   mirror: it installs a stand-in `file`). Its `run` and `env` lines and its main.py are as shipped.
 */
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { promisify } from 'node:util';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { HOST_PYTHON, hostPythonFiles } from './helpers/python-image.js';
import { makeBaseImage, requireImageTools, startRegistry, type TestRegistry } from './helpers/registry.js';

const run = promisify(execFile);

/** Debian's pip, setuptools and wheel, beside the machine's own Python. */
const DIST_PACKAGES = '/usr/lib/python3/dist-packages';
/**
 * How long each build here may take: an image build with pip takes 30 s alone on a slow 2-core machine, and
 * more than 120 s when the suite starts it beside the other image and volume tests (a failed CI run); the
 * builds of one server wait for each other, so one late build made the next test's time out too.
 */
const BUILD_MS = 360_000;
/** What of dist-packages the image gets: pip and what it builds a setup.py source distribution with. */
const DIST_PACKAGES_KEPT =
  /^(pip|setuptools|pkg_resources|wheel|_distutils_hack)([-.].*)?$|^distutils-precedence\.pth$/;
/** A source distribution whose setup.py writes a module at build time (so the import proves it was built). */
async function makeSdist(dir: string, greeting: string): Promise<Buffer> {
  const top = path.join(dir, 'hello-0.1');
  await fs.mkdir(top, { recursive: true });
  await fs.writeFile(
    path.join(top, 'setup.py'),
    `import sys
from setuptools import setup

with open("hello_built.py", "w") as f:
    f.write("BUILT_WITH = %r\\n" % (list(sys.version_info[:2]),))

setup(name="hello", version="0.1", py_modules=["hello", "hello_built"])
`,
  );
  await fs.writeFile(path.join(top, 'hello.py'), `def greeting():\n    return ${JSON.stringify(greeting)}\n`);
  await fs.writeFile(path.join(top, 'PKG-INFO'), 'Metadata-Version: 1.0\nName: hello\nVersion: 0.1\n');
  const archive = path.join(dir, 'hello-0.1.tar.gz');
  await run('tar', ['-czf', archive, '-C', dir, 'hello-0.1']);
  return fs.readFile(archive);
}

/**
 * A pure-Python wheel of one package `name` (its `__init__.py` is `source`), written by the host's Python
 * (zipfile, RECORD with hashes).
 */
async function makeWheel(dir: string, name = 'greet', version = '0.1', source?: string): Promise<Buffer> {
  const file = path.join(dir, `${name}-${version}-py3-none-any.whl`);
  const init = source ?? "def greet(name):\n    return 'greetings, ' + name + ', from a wheel'\n";
  const script = `
import base64, hashlib, json, sys, zipfile
name, version, init = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
info = "%s-%s.dist-info" % (name, version)
files = {
    name + "/__init__.py": init,
    info + "/METADATA": "Metadata-Version: 2.1\\nName: %s\\nVersion: %s\\n" % (name, version),
    info + "/WHEEL": "Wheel-Version: 1.0\\nGenerator: ferry-test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
}
record = []
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for path, text in files.items():
        data = text.encode()
        z.writestr(path, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
    record.append(info + "/RECORD,,")
    z.writestr(info + "/RECORD", "\\n".join(record) + "\\n")
`;
  await run(HOST_PYTHON, ['-I', '-c', script, file, name, version, JSON.stringify(init)]);
  return fs.readFile(file);
}

/**
 * A stand-in for apt-get in the test's image (no Debian mirror is reachable): `update` and `clean` succeed, `install`
 * knows one package, `file`, which it installs as a script answering like file(1).
 */
const STAND_IN_APT_GET = `#!/bin/sh
case "$1" in
  update) echo "stand-in apt-get: update (DEBIAN_FRONTEND=$DEBIAN_FRONTEND)"; exit 0 ;;
  clean) exit 0 ;;
  install) shift ;;
  *) echo "stand-in apt-get: $1 is not known" >&2; exit 100 ;;
esac
for package in "$@"; do
  case "$package" in
    -*) ;;
    file)
      printf '#!/bin/sh\\n/bin/busybox cat >/dev/null\\necho "ASCII text (stand-in file)"\\n' >/usr/bin/file
      /bin/busybox chmod 755 /usr/bin/file
      echo "stand-in apt-get: installed file" ;;
    *) echo "E: Unable to locate package $package" >&2; exit 100 ;;
  esac
done
`;

describe('images: Python apps with requirements.txt installed into their image', () => {
  let registry: TestRegistry;
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let pyBase: string;
  let version: string;
  let work: string;
  const api = (rest: string) => `${server.url}/v2/projects/${auth.projectId}${rest}`;
  /** The build's log as text, a line each. */
  const logOf = async (app: string, id: string) => {
    const res = await http(api(`/apps/${app}/builds/${id}/logs`), { token: auth.token });
    return `${(res.json.lines as Array<{ line: string }>).map((l) => l.line).join('\n')}\n`;
  };
  const call = async (app: string) => {
    const res = await http(`${server.url}/v4/${auth.projectId}/${app}/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    return res.json.result ?? res.json;
  };

  const dump = async (app: string) => {
    const list = await http(api(`/apps/${app}/builds`), { token: auth.token });
    for (const b of list.json.builds ?? []) process.stderr.write(`DUMP ${b.id}\n${await logOf(app, b.id)}\n`);
  };
  /** Deploys `files` as `app` and waits for its build (BUILD_MS at most); its builds' logs go to stderr if not. */
  const deploy = (app: string, files: Record<string, string | Buffer>, expect?: 'failed') =>
    deployFiles(server, auth, app, files, { timeoutMs: BUILD_MS, ...(expect ? { expect } : {}) }).catch(
      async (err: unknown) => {
        await dump(app);
        throw err;
      },
    );

  before(async () => {
    await requireImageTools();
    work = await tempDir('pyimg-images-');
    const python = await hostPythonFiles();
    version = python.version; // python3.11
    const kept = (await fs.readdir(DIST_PACKAGES)).filter((name) => DIST_PACKAGES_KEPT.test(name));
    assert.ok(
      kept.some((n) => n === 'pip') && kept.some((n) => n === 'setuptools'),
      `the test needs Debian's python3-pip and python3-setuptools (found in ${DIST_PACKAGES}: ${kept.join(', ')})`,
    );
    const image = await makeBaseImage(path.join(work, 'py'), {
      files: { 'etc/os-release': 'ID=ferry-python-pip-image', 'usr/bin/apt-get': STAND_IN_APT_GET },
      executable: ['usr/bin/apt-get'],
      copy: [
        ...python.copy,
        ...kept.map((name) => ({
          from: path.join(DIST_PACKAGES, name),
          to: path.join(DIST_PACKAGES, name).slice(1),
          filter: (source: string) => path.basename(source) !== '__pycache__',
        })),
      ],
      links: python.links,
      config: { cmd: ['/usr/bin/python3'], env: ['PATH=/usr/local/bin:/usr/bin:/bin'], workingdir: '/' },
    });
    // An image whose python3 is a script answering the syntax check for it: what the build reports must
    // come from the image, not from the server's Python.
    const fake = await makeBaseImage(path.join(work, 'fake'), {
      files: {
        'usr/bin/python3': `#!/bin/sh\necho '{"version": [3, 42, 0], "functions": ["answered_by_the_image"]}'\n`,
      },
      executable: ['usr/bin/python3'],
      config: { cmd: ['/bin/sh'], env: ['PATH=/usr/bin:/bin'], workingdir: '/' },
    });
    registry = await startRegistry();
    await registry.push(image, 'ferry-test/py-pip:1');
    await registry.push(fake, 'ferry-test/fake-python:1');
    pyBase = `${registry.host}/ferry-test/py-pip:1`;
    server = await startServer({
      env: { FERRY_INSECURE_REGISTRIES: registry.host },
      log: { level: 'error', destination: { write: (line: string) => process.stderr.write(`SERVER ${line}`) } },
    });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
    await registry?.stop();
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  it('installs a source distribution and a wheel from requirements.txt into the image, cached by what pip reads', async () => {
    const sdist = await makeSdist(path.join(work, 'sdist'), 'hello from an sdist');
    const wheel = await makeWheel(work);
    const mainPy = (tag: string) => `import greet, hello, hello_built

def run():
    return {
        "tag": ${JSON.stringify(tag)},
        "hello": hello.greeting(),
        "built_with": hello_built.BUILT_WITH,
        "hello_file": hello.__file__,
        "greet": greet.greet("ferry"),
    }
`;
    const files = {
      'ferry.toml': `[app]\nname = "pyimg-reqs"\n\n[image]\nbase = "${pyBase}"\n`,
      'requirements.txt': '--no-index\n--find-links ./wheels\n./pkgs/hello-0.1.tar.gz\ngreet==0.1\n',
      'pkgs/hello-0.1.tar.gz': sdist,
      'wheels/greet-0.1-py3-none-any.whl': wheel,
      'unrelated.txt': 'not named by requirements.txt\n',
    };
    const first = await deploy('pyimg-reqs', { ...files, 'main.py': mainPy('first') });
    const log1 = await logOf('pyimg-reqs', first.id);
    assert.match(log1, /step \d+\/\d+: COPY requirements\.txt \/ferry\/requirements\/requirements\.txt\n/);
    assert.match(
      log1,
      /step \d+\/\d+: COPY pkgs\/hello-0\.1\.tar\.gz \/ferry\/requirements\/pkgs\/hello-0\.1\.tar\.gz\n/,
    );
    assert.match(log1, /step \d+\/\d+: COPY wheels \/ferry\/requirements\/wheels\/\n/);
    assert.doesNotMatch(log1, /unrelated\.txt/);
    assert.match(log1, /step 4\/4: python3 -m pip install --no-cache-dir -r requirements\.txt\n/);
    assert.match(log1, /Successfully installed .*greet-0\.1/);
    assert.match(log1, /Successfully installed .*hello-0\.1/);
    assert.match(log1, /\(4 steps ran, 0 cached\)/);
    assert.match(log1, /Python 3\.\d+\.\d+ \(\/usr\/bin\/python3, the image’s\)/);
    assert.match(log1, /requirements\.txt: installed into the image by its build/);
    assert.doesNotMatch(log1, /Installing wheels only/);
    const r1 = await call('pyimg-reqs');
    assert.equal(r1.tag, 'first');
    assert.equal(r1.hello, 'hello from an sdist');
    assert.deepEqual(r1.built_with, version.slice('python'.length).split('.').map(Number));
    // Installed into the image's own Python (Debian's python3 puts root's installs in /usr/local).
    assert.match(r1.hello_file, /^\/usr\/local\/lib\/python3[.\d]*\/dist-packages\/hello\.py$/);
    assert.equal(r1.greet, 'greetings, ferry, from a wheel');

    // Only main.py changed: every image step is found in the cache, and the image is the same.
    const second = await deploy('pyimg-reqs', { ...files, 'main.py': mainPy('second') });
    const log2 = await logOf('pyimg-reqs', second.id);
    assert.match(log2, /step 4\/4: python3 -m pip install --no-cache-dir -r requirements\.txt: cached/);
    assert.match(log2, /\(0 steps ran, 4 cached\)/);
    assert.doesNotMatch(log2, /Successfully installed/);
    const builds = await http(api('/apps/pyimg-reqs/builds'), { token: auth.token });
    const digestOf = (id: string) =>
      (builds.json.builds as Array<{ id: string; image: { digest: string } | null }>).find((b) => b.id === id)?.image
        ?.digest;
    assert.match(String(digestOf(first.id)), /^sha256:[a-f0-9]{64}$/);
    assert.equal(digestOf(second.id), digestOf(first.id));
    assert.equal((await call('pyimg-reqs')).tag, 'second');

    // A file requirements.txt names changed: its COPY and the install run again.
    const changed = await makeSdist(path.join(work, 'sdist2'), 'hello again from an sdist');
    const third = await deploy('pyimg-reqs', {
      ...files,
      'pkgs/hello-0.1.tar.gz': changed,
      'main.py': mainPy('third'),
    });
    const log3 = await logOf('pyimg-reqs', third.id);
    assert.match(log3, /\(3 steps ran, 1 cached\)/);
    assert.match(log3, /Successfully installed .*hello-0\.1/);
    assert.equal((await call('pyimg-reqs')).hello, 'hello again from an sdist');
  });

  it('fails a failing install as FERRY_IMAGE_STEP_FAILED naming the pip step', async () => {
    const build = await deploy(
      'pyimg-badreq',
      {
        'ferry.toml': `[app]\nname = "pyimg-badreq"\n\n[image]\nbase = "${pyBase}"\n`,
        'requirements.txt': '--no-index\nnot-anywhere==1.0\n',
        'main.py': 'def run():\n    return 1\n',
      },
      'failed',
    );
    const error = String((build as { error?: string }).error);
    assert.match(
      error,
      /^FERRY_IMAGE_STEP_FAILED: building the image: step 2\/2 \(python3 -m pip install --no-cache-dir -r requirements\.txt\) failed with exit code 1;.*not-anywhere/s,
    );
    assert.ok(!error.includes(server.dataDir), error);
    assert.doesNotMatch(error, /\n\s+at /);
  });

  it("checks main.py with the image's python3, not the server's", async () => {
    const build = await deploy('pyimg-check', {
      'ferry.toml': `[app]\nname = "pyimg-check"\n\n[image]\nbase = "${registry.host}/ferry-test/fake-python:1"\n`,
      'main.py': 'def run():\n    return 1\n',
    });
    const log = await logOf('pyimg-check', build.id);
    assert.match(log, /Python 3\.42\.0 \(\/usr\/bin\/python3, the image’s\)/);
    assert.match(log, /Public functions: answered_by_the_image/);
  });

  it('deploys examples/image-app (base, PyPI and apt served by stand-ins) and runs its function', async () => {
    const dir = path.join(REPO_ROOT, 'examples', 'image-app');
    const shipped: Record<string, string | Buffer> = {};
    for (const name of await fs.readdir(dir)) shipped[name] = await fs.readFile(path.join(dir, name), 'utf8');
    const toml = String(shipped['ferry.toml']);
    assert.match(toml, /^base = "docker\.io\/library\/python:3\.12-slim"$/m);
    assert.match(String(shipped['requirements.txt']), /^humanize==4\.9\.0$/m);
    const humanize = await makeWheel(
      work,
      'humanize',
      '4.9.0',
      "def naturalsize(n):\n    return '%d Bytes (stand-in humanize)' % n\n",
    );
    const build = await deploy('image-app', {
      ...shipped,
      'ferry.toml': toml.replace(/^base = ".*"$/m, `base = "${pyBase}"`),
      'requirements.txt': `--no-index\n--find-links ./wheels\n${shipped['requirements.txt']}`,
      'wheels/humanize-4.9.0-py3-none-any.whl': humanize,
    });
    const log = await logOf('image-app', build.id);
    assert.match(log, /step 1\/5: apt-get install file\n/);
    assert.match(log, /stand-in apt-get: update \(DEBIAN_FRONTEND=noninteractive\)/);
    assert.match(log, /step 2\/5: mkdir -p \/opt\/image-app && echo 'baked in by a run step'/);
    assert.match(log, /step 5\/5: python3 -m pip install --no-cache-dir -r requirements\.txt\n/);
    assert.match(log, /Successfully installed humanize-4\.9\.0/);
    const result = await call('image-app');
    assert.deepEqual(result, {
      python: result.python,
      file_says: 'ASCII text (stand-in file)',
      size: '24 Bytes (stand-in humanize)',
      banner: 'baked in by a run step',
    });
    assert.match(result.python, /^3\.\d+\.\d+$/);
  });
});
