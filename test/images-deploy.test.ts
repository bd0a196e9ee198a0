/**
 * Apps on their own image (`[image] base = "…"`, issue 26), deployed and called end to end, offline: the
 * test writes a busybox image (busybox-static's binary, a marker /etc/os-release, a CGI script), serves it
 * from a real registry on loopback (Debian's docker-registry, listed in FERRY_INSECURE_REGISTRIES) and
 * deploys through the real API to a real server whose replicas run sandboxed on the image's root:
 *
 * - a custom app with no entrypoint of its own runs the image's CMD (busybox httpd, started in the
 *   image's WORKDIR, on the port of its EXPOSE): the image's ENV and `[image].env` apply, `/` is the
 *   image (its marker file is there, the host's /usr is not) and read-only, and the server is not root;
 * - a TypeScript function runs on the same image, on Ferry's own Node bound in;
 * - the build records the image's digest (the one the registry gave), and the builds list shows it;
 * - a Python app on an image without python3 fails FERRY_IMAGE_NO_PYTHON; a base the registry does not
 *   have fails FERRY_IMAGE_NOT_FOUND; a failing `run` step FERRY_IMAGE_STEP_FAILED naming it; a bad
 *   `[image]` table is refused at upload with its 400 code. Each failure names the step, not a host path;
 * - `[image].run` steps are built into the image, and a second deploy changing only the source re-runs none
 *   (`cached`, the same image digest); a custom app built from a Dockerfile (RUN, COPY from the context,
 *   WORKDIR, ENV, EXPOSE, CMD) serves from what its steps made.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { zipFiles } from './helpers/app-zip.js';
import { deployFiles, http, runCli, startServer, type TestServer, tempDir, waitFor } from './helpers/ferry.js';
import { hostPythonFiles } from './helpers/python-image.js';
import { makeBaseImage, requireImageTools, startRegistry, type TestRegistry } from './helpers/registry.js';

// A body of known length: Ferry's proxy wants a framed answer, and httpd frames CGI output by closing.
const CGI = `#!/bin/sh
if [ -e /usr/bin/node ]; then host_usr=visible; else host_usr=hidden; fi
if /bin/busybox touch /written 2>/dev/null; then root=writable; else root=read-only; fi
if /bin/busybox touch /tmp/written 2>/dev/null; then tmp=writable; else tmp=read-only; fi
body="greeting=$GREETING
baked=$BAKED
app_env=$FROM_APP
cwd=$(/bin/busybox pwd)
uid=$(/bin/busybox id -u)
os=$(/bin/busybox cat /etc/os-release)
host_usr=$host_usr
root=$root
tmp=$tmp
"
printf 'Content-Type: text/plain\\r\\nContent-Length: %s\\r\\n\\r\\n%s' "\${#body}" "$body"
`;

/** The views of the image `hex` that servers keep for their replicas (`ferry-view-*` folders). */
async function imageViews(hex: string): Promise<string[]> {
  const found: string[] = [];
  for (const root of new Set([os.tmpdir(), '/tmp'])) {
    for (const name of await fs.readdir(root).catch(() => [] as string[])) {
      if (!name.startsWith('ferry-view-')) continue;
      for (const view of await fs.readdir(path.join(root, name)).catch(() => [] as string[])) {
        if (view.startsWith(`image-${hex.slice(0, 12)}-`)) found.push(path.join(root, name, view));
      }
    }
  }
  return found;
}

function fields(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of text.split('\n')) {
    const eq = line.indexOf('=');
    if (eq > 0) out[line.slice(0, eq)] = line.slice(eq + 1);
  }
  return out;
}

describe('images: apps deployed on their own image', () => {
  let registry: TestRegistry;
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let digest: string;
  let base: string;
  const api = (rest: string) => `${server.url}/v2/projects/${auth.projectId}${rest}`;
  /** Folders the test made, removed at the end. */
  const made: string[] = [];
  const scratch = async (prefix: string) => {
    const dir = await tempDir(prefix);
    made.push(dir);
    return dir;
  };
  const cliEnv = async () => ({
    HOME: await scratch('imgrun-home-'),
    FERRY_URL: server.url,
    FERRY_TOKEN: auth.token,
    FERRY_PROJECT: auth.projectId,
  });

  before(async () => {
    await requireImageTools();
    const work = await scratch('imgrun-images-');
    const image = await makeBaseImage(work, {
      files: {
        'etc/os-release': 'ID=ferry-test-image',
        'srv/www/index.html': 'served from the image\n',
        'srv/www/cgi-bin/info': CGI,
      },
      executable: ['srv/www/cgi-bin/info'],
      config: {
        // `-h .`: httpd serves its working folder, so a page answers only if WORKDIR applied.
        cmd: ['/bin/busybox', 'httpd', '-f', '-p', '8080', '-h', '.'],
        env: ['GREETING=hello from ENV', 'PATH=/bin'],
        workingdir: '/srv/www',
        exposedPorts: ['8080/tcp'],
        user: 'root',
      },
    });
    registry = await startRegistry();
    digest = await registry.push(image, 'ferry-test/busy:1');
    base = `${registry.host}/ferry-test/busy:1`;
    server = await startServer({ env: { FERRY_INSECURE_REGISTRIES: registry.host } });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
    await registry?.stop();
    for (const dir of made) await fs.rm(dir, { recursive: true, force: true });
  });

  it("runs a custom app's image CMD in its WORKDIR with its ENV, on the image's read-only root, not as root", async () => {
    const build = await deployFiles(server, auth, 'img-custom', {
      'ferry.toml': `[app]\nname = "img-custom"\nruntime = "custom"\n\n[image]\nbase = "${base}"\nenv = { BAKED = "from [image].env" }\n\n[env]\nFROM_APP = "app env"\n\n[runtime.custom]\nreadycheck_endpoint = "/index.html"\n`,
    });
    const log = await http(api(`/apps/img-custom/builds/${build.id}/logs`), { token: auth.token });
    assert.match(log.text, /Image: base 127\.0\.0\.1:\d+\/ferry-test\/busy:1/);
    assert.match(log.text, /the image's ENTRYPOINT\/CMD/);
    assert.match(log.text, /Port: 8080 \(given to your server as PORT; the image's EXPOSE\)/);

    const page = await http(`${server.url}/v4/${auth.projectId}/img-custom/index.html`, { token: auth.token });
    const appLog = async () => JSON.stringify((await http(api('/apps/img-custom/logs'), { token: auth.token })).json);
    assert.equal(page.status, 200, `${page.text} ${await appLog()}`);
    assert.equal(page.text, 'served from the image\n');

    const info = await http(`${server.url}/v4/${auth.projectId}/img-custom/cgi-bin/info`, { token: auth.token });
    assert.equal(info.status, 200, `${info.text} ${await appLog()}`);
    const seen = fields(info.text);
    assert.equal(seen.greeting, 'hello from ENV');
    assert.equal(seen.baked, 'from [image].env');
    assert.equal(seen.app_env, 'app env');
    assert.match(seen.cwd ?? '', /^\/srv\/www/);
    assert.notEqual(seen.uid, '0');
    assert.match(seen.uid ?? '', /^\d+$/);
    assert.equal(seen.os, 'ID=ferry-test-image');
    assert.equal(seen.host_usr, 'hidden');
    assert.equal(seen.root, 'read-only');
    assert.equal(seen.tmp, 'writable');

    const list = await http(api('/apps/img-custom/builds'), { token: auth.token });
    const listed = list.json.builds.find((b: { id: string }) => b.id === build.id);
    assert.deepEqual(listed.image, { reference: `${registry.host}/ferry-test/busy@${digest}`, digest });
    const cli = await runCli(['builds', 'list', 'img-custom'], await cliEnv());
    assert.equal(cli.code, 0, cli.stderr);
    assert.ok(cli.stdout.includes(digest.slice(0, 'sha256:'.length + 12)), cli.stdout);
  });

  it("runs a TypeScript function on the image, on Ferry's Node bound in", async () => {
    await deployFiles(server, auth, 'img-node', {
      'ferry.toml': `[app]\nname = "img-node"\n\n[image]\nbase = "${base}"\n`,
      'main.ts': `import fs from 'node:fs';
export function run() {
  return {
    uid: process.getuid?.(),
    os: fs.readFileSync('/etc/os-release', 'utf8'),
    hostUsr: fs.existsSync('/usr/bin'),
    greeting: process.env.GREETING,
    cwd: process.cwd(),
  };
}
`,
    });
    const res = await http(`${server.url}/v4/${auth.projectId}/img-node/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    const result = res.json.result ?? res.json;
    assert.equal(result.os, 'ID=ferry-test-image');
    assert.equal(result.hostUsr, false);
    assert.equal(result.greeting, 'hello from ENV');
    assert.notEqual(result.uid, 0);
    assert.equal(result.cwd, '/srv/www');
    // One unpacked copy of the image on the node, shared by both apps' builds and replicas.
    const unpacked = await fs.readdir(path.join(server.dataDir, 'images', 'unpacked'));
    assert.deepEqual(
      unpacked.filter((name) => !name.startsWith('.')),
      [digest.slice('sha256:'.length)],
    );
  });

  it("runs a Python function with the image's python3", async () => {
    const python = await hostPythonFiles(['lib2to3', 'distutils']);
    const version = python.version; // python3.11
    const work = await scratch('imgrun-python-');
    const image = await makeBaseImage(work, {
      files: { 'etc/os-release': 'ID=ferry-python-image' },
      copy: python.copy,
      links: python.links,
      config: { cmd: ['/usr/bin/python3'], env: ['PATH=/usr/bin:/bin', 'GREETING=hello from ENV'], workingdir: '/' },
    });
    await registry.push(image, 'ferry-test/py:1');
    const build = await deployFiles(server, auth, 'img-python-ok', {
      'ferry.toml': `[app]\nname = "img-python-ok"\n\n[image]\nbase = "${registry.host}/ferry-test/py:1"\n`,
      'main.py': `import os, sys

def run():
    return {
        "executable": sys.executable,
        "version": list(sys.version_info[:2]),
        "uid": os.getuid(),
        "os": open("/etc/os-release").read(),
        "host_usr_local": os.path.exists("/usr/local/bin"),
        "greeting": os.environ.get("GREETING"),
    }
`,
    });
    const log = await http(api(`/apps/img-python-ok/builds/${build.id}/logs`), { token: auth.token });
    assert.match(
      log.text,
      new RegExp(`Image Python: /usr/bin/python3 \\(${version.slice('python'.length).replace('.', '\\.')}\\)`),
    );
    const res = await http(`${server.url}/v4/${auth.projectId}/img-python-ok/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    const result = res.json.result ?? res.json;
    assert.equal(result.executable, '/usr/bin/python3');
    assert.equal(result.os, 'ID=ferry-python-image');
    assert.equal(result.host_usr_local, false);
    assert.equal(result.greeting, 'hello from ENV');
    assert.notEqual(result.uid, 0);
  });

  it('fails builds with coded image errors that name the step', async () => {
    const failed = async (name: string, toml: string, files: Record<string, string> = {}) => {
      const build = await deployFiles(
        server,
        auth,
        name,
        { 'ferry.toml': `[app]\nname = "${name}"\n${toml}`, ...files },
        { expect: 'failed' },
      );
      const error = String((build as { error?: string }).error);
      assert.ok(!error.includes(server.dataDir), error);
      assert.doesNotMatch(error, /\n\s+at /);
      return error;
    };
    assert.match(
      await failed('img-missing', `\n[image]\nbase = "${registry.host}/ferry-test/nope:1"\n`, {
        'main.ts': 'export const run = () => 1;\n',
      }),
      /^FERRY_IMAGE_NOT_FOUND: pulling the base image 127\.0\.0\.1:\d+\/ferry-test\/nope:1: /,
    );
    assert.match(
      await failed('img-python', `entry = "main.py"\n\n[image]\nbase = "${base}"\n`, {
        'main.py': 'def run():\n    return 1\n',
      }),
      /^FERRY_IMAGE_NO_PYTHON: finding python3 in the image: the image has no python3 on its PATH \(\/bin\)/,
    );
    assert.match(
      await failed('img-step', `\n[image]\nbase = "${base}"\nrun = ["echo about to fail", "exit 7"]\n`, {
        'main.ts': 'export const run = () => 1;\n',
      }),
      /^FERRY_IMAGE_STEP_FAILED: building the image: .*step 2\/2.*exit 7.*exit code 7/s,
    );
    assert.match(
      await failed('img-nodockerfile', '\n[image]\ndockerfile = "Dockerfile"\n', {
        'main.ts': 'export const run = () => 1;\n',
      }),
      /^FERRY_IMAGE_DOCKERFILE_NOT_FOUND: reading Dockerfile: /,
    );
  });

  it('builds [image].run steps into the image, and a deploy that changes only the source re-runs none', async () => {
    const toml = `[app]\nname = "img-steps"\n\n[image]\nbase = "${base}"\nrun = ["mkdir -p /opt/made && echo made-by-a-step > /opt/made/marker", "echo second > /opt/made/two"]\n`;
    const source = (n: number) =>
      `import fs from 'node:fs';\nexport function run() { return { n: ${n}, marker: fs.readFileSync('/opt/made/marker', 'utf8').trim(), two: fs.readFileSync('/opt/made/two', 'utf8').trim() }; }\n`;
    const first = await deployFiles(server, auth, 'img-steps', { 'ferry.toml': toml, 'main.ts': source(1) });
    const log1 = (await http(api(`/apps/img-steps/builds/${first.id}/logs`), { token: auth.token })).text;
    assert.match(log1, /step 1\/2: mkdir -p \/opt\/made/);
    assert.doesNotMatch(log1, /step \d\/2: .*: cached/);
    const call = async () =>
      http(`${server.url}/v4/${auth.projectId}/img-steps/run`, { method: 'POST', token: auth.token, body: {} });
    const res1 = await call();
    assert.equal(res1.status, 200, res1.text);
    assert.deepEqual(res1.json.result, { n: 1, marker: 'made-by-a-step', two: 'second' });

    const second = await deployFiles(server, auth, 'img-steps', { 'ferry.toml': toml, 'main.ts': source(2) });
    const log2 = (await http(api(`/apps/img-steps/builds/${second.id}/logs`), { token: auth.token })).text;
    assert.match(log2, /step 1\/2: .*: cached/);
    assert.match(log2, /step 2\/2: .*: cached/);
    assert.match(log2, /\(0 steps ran, 2 cached\)/);
    // Nothing ran, and the node has the image those layers make: it is not written or unpacked again.
    assert.match(log2, /2 cached; already on this node\)/);
    // The base's tag is resolved at the registry again, but its layers are not fetched: the node has them.
    assert.match(log2, /layer 1\/1 sha256:\S+ already on this node/);
    assert.doesNotMatch(log2, /pulling layer/);
    const res2 = await waitFor(
      async () => {
        const r = await call();
        return r.status === 200 && r.json.result.n === 2 ? r : undefined;
      },
      30_000,
      'the second build answering',
    );
    assert.equal(res2.json.result.marker, 'made-by-a-step');
    // The same steps on the same base make the same image.
    const list = await http(api('/apps/img-steps/builds'), { token: auth.token });
    const images = list.json.builds.map((b: { image: { digest: string } }) => b.image.digest);
    assert.equal(images.length, 2);
    assert.equal(images[0], images[1]);
  });

  it('removes the image of deleted builds from the node and the image shelf once no build uses it', async () => {
    const list = await http(api('/apps/img-steps/builds'), { token: auth.token });
    const built = list.json.builds[0].image.digest as string;
    const hex = built.slice('sha256:'.length);
    const unpacked = path.join(server.dataDir, 'images', 'unpacked', hex);
    const shelved = path.join(server.services.config.artifactsDir, 'images', 'blobs', 'sha256', hex);
    await fs.stat(unpacked);
    await fs.stat(shelved);
    // The base stays: other apps' builds use it.
    const baseShelved = path.join(server.services.config.artifactsDir, 'images', 'blobs', 'sha256', digest.slice(7));
    await fs.stat(baseShelved);
    // The replicas that ran it have a view of it, kept between replicas (made again at no cold start).
    assert.ok((await imageViews(hex)).length > 0, 'a view of the image is kept');
    const deleted = await http(api('/apps/img-steps'), { method: 'DELETE', token: auth.token });
    assert.equal(deleted.status, 200, deleted.text);
    await assert.rejects(fs.stat(shelved), { code: 'ENOENT' });
    // The replica that ran it stops first (after its runs), then the unpacked copy goes.
    await waitFor(
      async () =>
        !(await fs.stat(unpacked).then(
          () => true,
          () => false,
        )),
      60_000,
      'the unpacked image removed',
    );
    // Its view went with it: no hard link keeps the removed image's files on disk.
    assert.deepEqual(await imageViews(hex), []);
    await fs.stat(baseShelved);
  });

  it("runs a custom app built from its Dockerfile, with the image's CMD and EXPOSE", async () => {
    const dockerfile = [
      `FROM ${base}`,
      'RUN mkdir -p /srv/site && echo from-the-dockerfile > /srv/site/index.html',
      'COPY extra.txt /srv/site/extra.txt',
      'WORKDIR /srv/site',
      'ENV FROM_DOCKERFILE=yes',
      'EXPOSE 8081',
      'CMD ["/bin/busybox", "httpd", "-f", "-p", "8081", "-h", "."]',
      '',
    ].join('\n');
    const build = await deployFiles(server, auth, 'img-docker', {
      'ferry.toml':
        '[app]\nname = "img-docker"\nruntime = "custom"\n\n[image]\ndockerfile = "Dockerfile"\n\n[runtime.custom]\nreadycheck_endpoint = "/index.html"\n',
      Dockerfile: dockerfile,
      'extra.txt': 'copied from the context\n',
    });
    const log = (await http(api(`/apps/img-docker/builds/${build.id}/logs`), { token: auth.token })).text;
    assert.match(log, /Port: 8081 \(given to your server as PORT; the image's EXPOSE\)/);
    const page = await http(`${server.url}/v4/${auth.projectId}/img-docker/index.html`, { token: auth.token });
    assert.equal(page.status, 200, page.text);
    assert.equal(page.text, 'from-the-dockerfile\n');
    const extra = await http(`${server.url}/v4/${auth.projectId}/img-docker/extra.txt`, { token: auth.token });
    assert.equal(extra.text, 'copied from the context\n');
    const listed = (await http(api('/apps/img-docker/builds'), { token: auth.token })).json.builds[0];
    assert.match(listed.image.digest, /^sha256:[a-f0-9]{64}$/);
    assert.notEqual(listed.image.digest, digest);
  });

  it('refuses a bad [image] table at upload with its own 400 code, naming the key', async () => {
    const zip = await zipFiles({
      'ferry.toml': '[app]\nname = "img-bad"\n\n[image]\nbase = "x"\nbogus = 1\n',
      'main.ts': 'export const run = () => 1;\n',
    });
    const res = await http(api('/apps/img-bad/builds'), {
      method: 'POST',
      token: auth.token,
      body: zip,
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 400, res.text);
    assert.equal(res.json.error.code, 'FERRY_IMAGE_CONFIG_INVALID');
    assert.match(res.json.error.message, /image\.bogus: unknown key/);

    // ferry deploy refuses it before uploading, with the same words.
    const dir = await scratch('imgrun-bad-');
    await fs.writeFile(path.join(dir, 'ferry.toml'), '[app]\nname = "img-bad"\n\n[image]\nbase = "Bad"\n');
    await fs.writeFile(path.join(dir, 'main.ts'), 'export const run = () => 1;\n');
    const cli = await runCli(['deploy', dir], await cliEnv());
    assert.notEqual(cli.code, 0);
    assert.match(cli.stderr, /image\.base: "Bad" is not an image reference/);
    const builds = await http(api('/apps/img-bad/builds'), { token: auth.token });
    assert.equal(builds.status, 404, 'nothing was uploaded');
  });
});
