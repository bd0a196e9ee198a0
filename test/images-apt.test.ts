/**
 * `[image] apt = [...]` really installing a package, offline, at the builder level (buildImage, as
 * test/images-build.test.ts calls it): a Debian base image made from this machine's own apt and dpkg
 * (test/helpers/debian-image.ts), a `.deb` the test makes (`ferry-hello`, holding /usr/bin/ferry-hello)
 * indexed by dpkg-scanpackages, and a plain HTTP server for that repository in a network namespace the
 * test makes (test/helpers/netns.ts). The build steps run in Ferry's real bwrap sandbox on the veth
 * network, under the replicas' egress policy with the namespace's /30 allowed, as an operator's
 * FERRY_EGRESS_ALLOW would: the built-in deny list drops private ranges, which the test's address is in.
 * The image's sources.list marks the repository `[trusted=yes]` because it is unsigned; real repositories
 * are signed, and apt checks them with the keyring in the image.
 *
 * Covered: the apt step installs the package (its layer holds the binary, dpkg's status lists it, its
 * postinst ran) and a later `run` step calls the binary; the log names the apt step; a second build runs
 * nothing (`cached`) and fetches nothing; `apt = ["no-such-package"]` is FERRY_IMAGE_STEP_FAILED naming
 * the apt step and apt's words; without the allow, the egress policy keeps the apt step from the
 * repository (no request reaches it) and the step fails.
 *
 * Needs root, bubblewrap, umoci, busybox-static, dpkg-dev, iproute2 and nftables: CI runs as root.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { gunzipSync } from 'node:zlib';
import pino from 'pino';
import tar from 'tar-stream';
import { type BuildImageOptions, buildImage, DEFAULT_IMAGE_BUILD_LIMITS } from '../src/images/image-builder.js';
import { parseImageTable } from '../src/images/image-spec.js';
import { blobPath, parseManifest, readIndexEntry, readJsonBlob } from '../src/images/oci-layout.js';
import { createDnsForwarder } from '../src/sandbox/dns-forwarder.js';
import { DEFAULT_EGRESS_POOL, parseEgressPolicy } from '../src/sandbox/egress-policy.js';
import { detectSandbox, type SandboxCapabilities } from '../src/sandbox/launch.js';
import type { SandboxNetwork } from '../src/sandbox/network.js';
import { createVethNetwork, findVethTools, type VethTools } from '../src/sandbox/veth-network.js';
import { rejectsWithCode } from './helpers/coded-error.js';
import {
  type AptRepository,
  makeAptRepository,
  makeDebianBaseImage,
  requireAptTools,
  STATIC_SERVER_SCRIPT,
} from './helpers/debian-image.js';
import { deployFiles, http, startServer, type TestServer, tempDir } from './helpers/ferry.js';
import { createOutsideNetwork, type OutsideNetwork } from './helpers/netns.js';
import { hostPythonFiles } from './helpers/python-image.js';
import { type BaseImage, requireImageTools, startRegistry, type TestRegistry } from './helpers/registry.js';

const TIMEOUT = 300_000;
/** Where the repository's server listens, inside the test's own namespace. */
const REPO_PORT = 47601;
const MARKER = 'ferry-hello says hi from the test apt repository';

interface LayerFile {
  type: string;
  mode: number;
  content: string;
}

/** Every entry of a layer blob. */
async function readLayer(layout: string, digest: string): Promise<Map<string, LayerFile>> {
  const bytes = gunzipSync(await fs.readFile(blobPath(layout, digest)));
  const extract = tar.extract();
  const out = new Map<string, LayerFile>();
  const done = (async () => {
    for await (const entry of extract) {
      const chunks: Buffer[] = [];
      for await (const c of entry) chunks.push(c as Buffer);
      const h = entry.header;
      out.set(h.name.replace(/\/$/, ''), {
        type: h.type ?? 'file',
        mode: h.mode ?? 0,
        content: Buffer.concat(chunks).toString('utf8'),
      });
    }
  })();
  Readable.from([bytes]).pipe(extract);
  await done;
  return out;
}

describe('images: apt installs a package from a repository the test serves', { timeout: TIMEOUT * 4 }, () => {
  let work: string;
  let base: BaseImage;
  let baseDigest: string;
  let caps: SandboxCapabilities;
  let tools: VethTools;
  let outside: OutsideNetwork;
  let repo: AptRepository;
  /** The repository server's output: `ready`, then `GET <path> <status>` per request. */
  let served: string[];
  let allowed: SandboxNetwork;
  let n = 0;

  async function vethNetwork(name: string, allow: string): Promise<SandboxNetwork> {
    const dir = path.join(work, name);
    await fs.mkdir(dir, { recursive: true });
    return createVethNetwork({
      tools,
      policy: parseEgressPolicy(allow, ''),
      pool: DEFAULT_EGRESS_POOL,
      dataDir: dir,
      runDir: path.join(dir, 'run'),
      dns: createDnsForwarder([]),
      logger: pino({ level: 'silent' }),
    });
  }

  before(async () => {
    await requireAptTools();
    caps = await detectSandbox();
    assert.ok(caps.bwrap, `image builds need bwrap: ${caps.reasons.join('; ')}`);
    const found = findVethTools();
    assert.ok('tools' in found, `the veth network is required: ${'reasons' in found ? found.reasons.join('; ') : ''}`);
    tools = found.tools;
    work = await tempDir('apt-images-');
    repo = await makeAptRepository(path.join(work, 'apt'), 'ferry-hello', MARKER);
    outside = await createOutsideNetwork({ prefix: 'fapt' });
    served = (
      await outside.start([process.execPath, '-e', STATIC_SERVER_SCRIPT, repo.dir, outside.address, String(REPO_PORT)])
    ).lines;
    base = await makeDebianBaseImage(path.join(work, 'base'), {
      sourcesList: `deb [trusted=yes] http://${outside.address}:${REPO_PORT}/ ./\n`,
    });
    baseDigest = (await readIndexEntry(base.layout, base.tag)).digest;
    allowed = await vethNetwork('net-allowed', outside.cidr);
  });
  after(async () => {
    await allowed?.close();
    await outside?.close();
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  function build(image: Record<string, unknown>, opts: { projectId?: string; network?: SandboxNetwork } = {}) {
    n += 1;
    const spec = parseImageTable({ base: 'example.org/debian:12', ...image })!;
    const lines: string[] = [];
    const options: BuildImageOptions = {
      spec,
      baseLayoutDir: base.layout,
      baseDigest,
      contextDir: work,
      projectId: opts.projectId ?? 'proj-apt',
      cacheDir: path.join(work, 'cache'),
      outDir: path.join(work, `out-${n}`),
      sandbox: { caps, network: opts.network ?? allowed },
      limits: { ...DEFAULT_IMAGE_BUILD_LIMITS, memoryMiB: 512, timeoutMs: TIMEOUT },
      log: (line) => lines.push(line),
      signal: new AbortController().signal,
    };
    return { lines, promise: buildImage(options) };
  }

  it('apt installs the package in a layer of its own, a run step calls it, and a second build is cached', {
    timeout: TIMEOUT,
  }, async () => {
    const image = { apt: ['ferry-hello'], run: ['ferry-hello'] };
    const first = build(image);
    const built = await first.promise.catch((err: Error) => {
      throw new Error(`${err.message}\n--- log:\n${first.lines.join('\n')}\n--- served:\n${served.join('\n')}`);
    });
    const log = first.lines;
    assert.equal(built.ran, 2, log.join('\n'));
    assert.ok(log.includes('step 1/2: apt-get install ferry-hello'), log.join('\n'));
    assert.ok(log.includes('installed ferry-hello'), `the package's postinst ran:\n${log.join('\n')}`);
    const runAt = log.indexOf('step 2/2: ferry-hello');
    assert.ok(runAt > log.indexOf('step 1/2: apt-get install ferry-hello'), log.join('\n'));
    assert.ok(log.slice(runAt).includes(MARKER), `the run step called the binary:\n${log.join('\n')}`);
    assert.ok(served.includes(`GET /${repo.debFile} 200`), `apt fetched the .deb:\n${served.join('\n')}`);

    const manifest = parseManifest(await readJsonBlob(built.layoutDir, built.digest));
    assert.equal(manifest.layers.length, 3, 'the base layer, the apt layer and the run layer');
    const layer = await readLayer(built.layoutDir, manifest.layers[1]!.digest);
    const binary = layer.get('usr/bin/ferry-hello');
    assert.ok(binary, `the apt layer holds /usr/bin/ferry-hello: ${[...layer.keys()].join(', ')}`);
    assert.equal(binary.mode & 0o777, 0o755);
    assert.match(binary.content, new RegExp(MARKER));
    const status = layer.get('var/lib/dpkg/status')?.content ?? '';
    assert.match(status, /^Package: ferry-hello\nStatus: install ok installed$/m, status);
    assert.ok(layer.has('var/lib/dpkg/info/ferry-hello.list'), "dpkg's file list for the package");
    const names = [...layer.keys()];
    assert.ok(
      !names.some((k) => k.startsWith('var/lib/apt/lists/') && !path.posix.basename(k).startsWith('.wh.')),
      `the package lists are removed: ${names.filter((k) => k.startsWith('var/lib/apt/lists/')).join(', ')}`,
    );
    assert.ok(
      !names.some((k) => k.endsWith('.deb')),
      `the downloaded .deb is not kept: ${names.filter((k) => k.startsWith('var/cache/')).join(', ')}`,
    );

    const requests = served.length;
    const second = build(image);
    const again = await second.promise;
    assert.deepEqual(
      second.lines.filter((l) => l.startsWith('step ')),
      ['step 1/2: apt-get install ferry-hello: cached', 'step 2/2: ferry-hello: cached'],
    );
    assert.equal(again.ran, 0);
    assert.equal(again.cached, 2);
    assert.equal(again.digest, built.digest, 'the same image');
    assert.equal(served.length, requests, 'a cached build fetches nothing from the repository');
  });

  it('apt = ["no-such-package"] is FERRY_IMAGE_STEP_FAILED naming the apt step and what apt said', {
    timeout: TIMEOUT,
  }, async () => {
    const { promise } = build({ apt: ['no-such-package'] });
    const err = await rejectsWithCode(promise, 'FERRY_IMAGE_STEP_FAILED');
    assert.match(err.message, /^step 1\/1 \(apt-get install no-such-package\) failed with exit code 100/);
    assert.match(err.message, /Unable to locate package no-such-package/);
    assert.doesNotMatch(err.message, /\/tmp\//, 'no host path');
  });

  it("without the allow, the replicas' egress policy keeps the apt step from the repository", {
    timeout: TIMEOUT,
  }, async () => {
    const denied = await vethNetwork('net-denied', '');
    try {
      const requests = served.length;
      const { promise } = build({ apt: ['ferry-hello'] }, { projectId: 'proj-denied', network: denied });
      const err = await rejectsWithCode(promise, 'FERRY_IMAGE_STEP_FAILED');
      assert.match(err.message, /^step 1\/1 \(apt-get install ferry-hello\) failed/);
      assert.equal(served.length, requests, `no request reached the repository:\n${served.join('\n')}`);
      // apt-get update only warns about a source it cannot fetch (as in a Dockerfile); the install then
      // fails, and the error's output tail names both.
      assert.match(err.message, new RegExp(`Failed to fetch http://${outside.address.replace(/\./g, '\\.')}`));
      assert.match(err.message, /Unable to locate package ferry-hello/);
    } finally {
      await denied.close();
    }
  });
});

describe('images: a deployed Python function calls a program apt installed from the test’s repository', {
  timeout: TIMEOUT * 2,
}, () => {
  const PY_MARKER = 'ferry-hello-py says hi to a Python function';
  let work: string;
  let outside: OutsideNetwork;
  let repo: AptRepository;
  let served: string[];
  let registry: TestRegistry;
  let server: TestServer;
  let auth: { projectId: string; token: string };

  before(async () => {
    await requireAptTools();
    await requireImageTools();
    work = await tempDir('apt-deploy-');
    repo = await makeAptRepository(path.join(work, 'apt'), 'ferry-hello-py', PY_MARKER);
    outside = await createOutsideNetwork({ prefix: 'fapd' });
    served = (
      await outside.start([process.execPath, '-e', STATIC_SERVER_SCRIPT, repo.dir, outside.address, String(REPO_PORT)])
    ).lines;
    // Debian's apt and dpkg with the machine's own python3 beside them.
    const python = await hostPythonFiles(['lib2to3', 'distutils']);
    const image = await makeDebianBaseImage(path.join(work, 'base'), {
      sourcesList: `deb [trusted=yes] http://${outside.address}:${REPO_PORT}/ ./\n`,
      copy: python.copy,
      links: python.links,
    });
    registry = await startRegistry();
    await registry.push(image, 'ferry-test/debian-python:1');
    // The repository's address is private: the egress policy drops it unless the operator allows it.
    server = await startServer({
      env: { FERRY_INSECURE_REGISTRIES: registry.host, FERRY_EGRESS_ALLOW: outside.cidr },
    });
    auth = await server.bootstrap();
  });
  after(async () => {
    await server?.close();
    await registry?.stop();
    await outside?.close();
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  it('builds the image with the package, and the function runs its binary', { timeout: TIMEOUT }, async () => {
    const app = 'py-apt';
    const build = await deployFiles(
      server,
      auth,
      app,
      {
        'ferry.toml': `[app]\nname = "${app}"\n\n[image]\nbase = "${registry.host}/ferry-test/debian-python:1"\napt = ["ferry-hello-py"]\n`,
        'main.py': `import shutil, subprocess

def run():
    done = subprocess.run(["ferry-hello-py"], capture_output=True, text=True, check=True)
    return {"out": done.stdout.strip(), "where": shutil.which("ferry-hello-py")}
`,
      },
      { timeoutMs: TIMEOUT },
    ).catch(async (err: Error) => {
      const list = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds`, { token: auth.token });
      const id = list.json.builds?.[0]?.id;
      const log = id
        ? (
            await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds/${id}/logs`, {
              token: auth.token,
            })
          ).text
        : '';
      throw new Error(`${err.message}\n--- log:\n${log}\n--- served:\n${served.join('\n')}`);
    });
    const log = (
      await http(`${server.url}/v2/projects/${auth.projectId}/apps/${app}/builds/${build.id}/logs`, {
        token: auth.token,
      })
    ).json.lines.map((l: { line: string }) => l.line) as string[];
    assert.ok(log.includes('step 1/1: apt-get install ferry-hello-py'), log.join('\n'));
    assert.ok(log.includes('installed ferry-hello-py'), `the package's postinst ran:\n${log.join('\n')}`);
    assert.ok(
      log.some((l) => /Python 3\.\d+\.\d+ \(\/usr\/bin\/python3, the image’s\)/.test(l)),
      log.join('\n'),
    );
    assert.ok(served.includes(`GET /${repo.debFile} 200`), `apt fetched the .deb:\n${served.join('\n')}`);
    const res = await http(`${server.url}/v4/${auth.projectId}/${app}/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json.result, { out: PY_MARKER, where: '/usr/bin/ferry-hello-py' });
  });
});
