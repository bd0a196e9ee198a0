/**
 * Image builds (src/images/image-builder.ts), offline: a base image the test writes itself (busybox-static
 * as /bin/busybox, test/helpers/registry.ts), `[image]` `run`/`env` steps and Dockerfiles built on it in
 * Ferry's real bwrap sandbox, with the layers read back from the built OCI layout.
 *
 * Covered: a `run` step's file ends up in a layer of its own (owned as the step made it), an empty file
 * and a removed one (a whiteout) too; `env` is in the config and seen by the steps; a failing step is FERRY_IMAGE_STEP_FAILED naming the step, its command,
 * exit code and output tail, and no host path; the build time limit; a second build runs nothing (each
 * step `cached`) while another project's build runs everything; a Dockerfile with COPY/ENV/WORKDIR/CMD/
 * EXPOSE/USER; the `apt` step's command. Attacks (each fails when its defence is switched off):
 * `COPY /etc/shadow`, `COPY ../x`, a context symlink to /etc/shadow (named, and inside a copied folder),
 * `ADD http://127.0.0.1:<port>/x` (no request reaches the server), and a RUN that tries the host's
 * loopback and addresses from the build sandbox's network (veth, the replicas' egress policy).
 *
 * Needs root, bubblewrap, umoci (for the base), busybox-static, iproute2 and nftables: CI runs as root.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, it } from 'node:test';
import { gunzipSync } from 'node:zlib';
import pino from 'pino';
import tar from 'tar-stream';
import {
  aptCommand,
  type BuildImageOptions,
  buildImage,
  DEFAULT_IMAGE_BUILD_LIMITS,
  readDockerfileBase,
} from '../src/images/image-builder.js';
import { parseImageTable } from '../src/images/image-spec.js';
import { blobPath, parseManifest, readIndexEntry, readJsonBlob } from '../src/images/oci-layout.js';
import { createDnsForwarder } from '../src/sandbox/dns-forwarder.js';
import { DEFAULT_EGRESS_POOL, parseEgressPolicy } from '../src/sandbox/egress-policy.js';
import { detectSandbox, type SandboxCapabilities } from '../src/sandbox/launch.js';
import { createLoopbackOnlyNetwork, type SandboxNetwork } from '../src/sandbox/network.js';
import { createVethNetwork, findVethTools } from '../src/sandbox/veth-network.js';
import { rejectsWithCode } from './helpers/coded-error.js';
import { tempDir } from './helpers/ferry.js';
import { hostIpv4Addresses, startHostListener } from './helpers/netns.js';
import { type BaseImage, makeBaseImage, requireImageTools } from './helpers/registry.js';

const TIMEOUT = 180_000;

interface LayerFile {
  type: string;
  mode: number;
  uid: number;
  gid: number;
  content: string;
  linkname?: string;
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
        uid: h.uid ?? 0,
        gid: h.gid ?? 0,
        content: Buffer.concat(chunks).toString('utf8'),
        ...(h.linkname ? { linkname: h.linkname } : {}),
      });
    }
  })();
  Readable.from([bytes]).pipe(extract);
  await done;
  return out;
}

async function imageOf(layout: string, digest: string) {
  const manifest = parseManifest(await readJsonBlob(layout, digest));
  const config = JSON.parse((await readJsonBlob(layout, manifest.config.digest)).toString('utf8'));
  return { manifest, config };
}

describe('images: building apt/run/env steps and Dockerfiles', { timeout: TIMEOUT * 4 }, () => {
  let work: string;
  let base: BaseImage;
  let baseDigest: string;
  let caps: SandboxCapabilities;
  let loopbackOnly: SandboxNetwork;
  let n = 0;

  before(async () => {
    await requireImageTools();
    caps = await detectSandbox();
    assert.ok(caps.bwrap, `image builds need bwrap: ${caps.reasons.join('; ')}`);
    work = await tempDir('imgsteps-build-');
    base = await makeBaseImage(path.join(work, 'base'));
    baseDigest = (await readIndexEntry(base.layout, base.tag)).digest;
    loopbackOnly = createLoopbackOnlyNetwork();
  });
  after(async () => {
    if (work) await fs.rm(work, { recursive: true, force: true });
  });

  /** A build of `toml` ([image] table as an object) with the app folder's `files`. */
  async function build(
    image: Record<string, unknown>,
    opts: {
      files?: Record<string, string>;
      projectId?: string;
      cacheDir?: string;
      network?: SandboxNetwork;
      timeoutMs?: number;
      context?: string;
    } = {},
  ) {
    n += 1;
    const context = opts.context ?? path.join(work, `app-${n}`);
    if (!opts.context) {
      await fs.mkdir(context, { recursive: true });
      for (const [name, content] of Object.entries(opts.files ?? {})) {
        await fs.mkdir(path.dirname(path.join(context, name)), { recursive: true });
        await fs.writeFile(path.join(context, name), content);
      }
    }
    const spec = parseImageTable(image.dockerfile ? image : { base: 'example.org/base:1', ...image })!;
    const lines: string[] = [];
    const options: BuildImageOptions = {
      spec,
      baseLayoutDir: base.layout,
      baseDigest,
      contextDir: context,
      projectId: opts.projectId ?? 'proj-a',
      cacheDir: opts.cacheDir ?? path.join(work, 'cache'),
      outDir: path.join(work, `out-${n}`),
      sandbox: { caps, network: opts.network ?? loopbackOnly },
      limits: { ...DEFAULT_IMAGE_BUILD_LIMITS, memoryMiB: 256, timeoutMs: opts.timeoutMs ?? TIMEOUT },
      log: (line) => lines.push(line),
      signal: new AbortController().signal,
    };
    return { lines, promise: buildImage(options), context };
  }

  it('a run step that writes a file ends up in a layer of its own; env is in the config and seen by steps', {
    timeout: TIMEOUT,
  }, async () => {
    const { lines, promise } = await build({
      run: [
        'mkdir -p /srv/data && echo "made by run, HF_HOME=$HF_HOME" > /srv/data/out.txt && chown 1234:99 /srv/data/out.txt',
      ],
      env: { HF_HOME: '/models' },
    });
    const built = await promise;
    assert.ok(
      lines.includes(
        'step 1/1: mkdir -p /srv/data && echo "made by run, HF_HOME=$HF_HOME" > /srv/data/out.txt && chown 1234:99 /srv/data/out.txt',
      ),
      lines.join('\n'),
    );
    const { manifest, config } = await imageOf(built.layoutDir, built.digest);
    assert.equal(manifest.layers.length, 2, 'the base layer and one for the step');
    assert.equal(config.rootfs.diff_ids.length, 2);
    const layer = await readLayer(built.layoutDir, manifest.layers[1]!.digest);
    const file = layer.get('srv/data/out.txt');
    assert.ok(file, `the layer has the file: ${[...layer.keys()].join(', ')}`);
    assert.equal(file.content, 'made by run, HF_HOME=/models\n');
    assert.equal(file.uid, 1234, 'owned as the step chowned it, inside its user namespace');
    assert.equal(file.gid, 99);
    assert.ok(!layer.has('proc') && !layer.has('dev'), 'the sandbox mount points are not in the layer');
    assert.ok(![...layer.keys()].some((k) => k.startsWith('bin/')), 'unchanged base files are not in the layer');
    assert.ok(config.config.Env.includes('HF_HOME=/models'));
    assert.ok(config.config.Env.includes('GREETING=hello'), "the base's env is kept");
    assert.deepEqual(
      built.config.env.find(([k]) => k === 'HF_HOME'),
      ['HF_HOME', '/models'],
    );
    // The base's own layer is the same blob.
    const baseManifest = parseManifest(await readJsonBlob(base.layout, baseDigest));
    assert.equal(manifest.layers[0]!.digest, baseManifest.layers[0]!.digest);
  });

  it('an empty file and a removed file: an empty entry and a whiteout in their layers', {
    timeout: TIMEOUT,
  }, async () => {
    const { promise } = await build({ run: ['touch /empty.txt && echo bye > /gone.txt', 'rm /gone.txt'] });
    const built = await promise;
    const { manifest } = await imageOf(built.layoutDir, built.digest);
    const made = await readLayer(built.layoutDir, manifest.layers[1]!.digest);
    assert.equal(made.get('empty.txt')?.type, 'file');
    assert.equal(made.get('empty.txt')?.content, '');
    const removed = await readLayer(built.layoutDir, manifest.layers[2]!.digest);
    assert.equal(removed.get('.wh.gone.txt')?.content, '', `a whiteout: ${[...removed.keys()].join(', ')}`);
  });

  it('a failing run step is FERRY_IMAGE_STEP_FAILED naming the step, command, exit code and output, no host path', {
    timeout: TIMEOUT,
  }, async () => {
    const { promise } = await build({ run: ['echo fine', 'echo "about to fail" >&2; exit 7', 'echo never'] });
    const err = await rejectsWithCode(promise, 'FERRY_IMAGE_STEP_FAILED');
    assert.match(err.message, /^step 2\/3 \(echo "about to fail" >&2; exit 7\) failed with exit code 7/);
    assert.match(err.message, /about to fail/);
    assert.doesNotMatch(err.message, new RegExp(work.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')));
    assert.doesNotMatch(err.message, /\/tmp\//);
  });

  it('a second build runs nothing (each step cached); another project with the same steps runs everything', {
    timeout: TIMEOUT,
  }, async () => {
    const cacheDir = path.join(work, 'cache-shared');
    const image = { run: ['echo one > /one.txt', 'echo two > /two.txt'], env: { MODE: 'cache' } };
    const first = await build(image, { projectId: 'proj-cache', cacheDir });
    const built = await first.promise;
    assert.equal(built.ran, 2);
    assert.ok(!first.lines.some((l) => l.endsWith(': cached')), first.lines.join('\n'));

    const second = await build(image, { projectId: 'proj-cache', cacheDir });
    const again = await second.promise;
    assert.deepEqual(
      second.lines.filter((l) => l.startsWith('step ')),
      ['step 1/2: echo one > /one.txt: cached', 'step 2/2: echo two > /two.txt: cached'],
    );
    assert.equal(again.ran, 0);
    assert.equal(again.digest, built.digest, 'the same image');

    // A changed second step reruns only that one.
    const third = await build(
      { ...image, run: ['echo one > /one.txt', 'echo three > /two.txt'] },
      { projectId: 'proj-cache', cacheDir },
    );
    const changed = await third.promise;
    assert.equal(changed.ran, 1);
    assert.ok(third.lines.includes('step 1/2: echo one > /one.txt: cached'), third.lines.join('\n'));
    const { manifest } = await imageOf(changed.layoutDir, changed.digest);
    const layer = await readLayer(changed.layoutDir, manifest.layers[2]!.digest);
    assert.equal(layer.get('two.txt')?.content, 'three\n');

    // Changed env: every step runs again (the steps see it).
    const fourth = await build({ ...image, env: { MODE: 'other' } }, { projectId: 'proj-cache', cacheDir });
    assert.equal((await fourth.promise).ran, 2);

    const other = await build(image, { projectId: 'proj-other', cacheDir });
    const theirs = await other.promise;
    assert.equal(theirs.ran, 2, "another project's build never takes this project's layers");
    assert.ok(!other.lines.some((l) => l.endsWith(': cached')), other.lines.join('\n'));
  });

  it('the build time limit stops a step: FERRY_IMAGE_BUILD_TIMEOUT naming it', { timeout: TIMEOUT }, async () => {
    const started = Date.now();
    const { promise } = await build({ run: ['sleep 120'] }, { timeoutMs: 3000 });
    const err = await rejectsWithCode(promise, 'FERRY_IMAGE_BUILD_TIMEOUT');
    assert.match(err.message, /step 1\/1 \(sleep 120\)/);
    assert.ok(Date.now() - started < 60_000, 'the sleeping step was killed, not waited for');
  });

  it('apt becomes one step: apt-get update and install, no recommends, downloads and lists removed', () => {
    assert.deepEqual(aptCommand(['ffmpeg', 'libgl1']), [
      '/bin/sh',
      '-c',
      'apt-get update && apt-get install -y --no-install-recommends ffmpeg libgl1 && apt-get clean && rm -rf /var/lib/apt/lists/*',
    ]);
  });

  it('a Dockerfile with ARG, ENV, WORKDIR, COPY, RUN, USER, CMD, EXPOSE and LABEL', { timeout: TIMEOUT }, async () => {
    const dockerfile = [
      '# a comment',
      'ARG BASE=example.org/base:1',
      // biome-ignore lint/suspicious/noTemplateCurlyInString: Dockerfile syntax, not a template
      'FROM ${BASE}',
      'ARG GREETING_FILE=greeting.txt',
      'ENV APP_HOME=/app \\',
      '    MODE="docker file"',
      'WORKDIR $APP_HOME',
      // biome-ignore lint/suspicious/noTemplateCurlyInString: Dockerfile syntax, not a template
      'COPY ${GREETING_FILE} ./',
      'COPY src/ lib/',
      'RUN cat greeting.txt lib/pkg/mod.py > made.txt && echo "$MODE $GREETING_FILE" >> made.txt',
      'RUN ["/bin/sh", "-c", "pwd > where.txt"]',
      'USER 1000:1000',
      'CMD ["/bin/sh", "-c", "echo hi"]',
      'EXPOSE 9090/tcp 7000',
      'LABEL org.example.name="ferry test"',
      'VOLUME /data',
    ].join('\n');
    const files = {
      Dockerfile: dockerfile,
      'greeting.txt': 'hello from the context\n',
      'src/pkg/mod.py': 'print(1)\n',
    };
    const context = path.join(work, 'df-context');
    await fs.mkdir(path.join(context, 'src', 'pkg'), { recursive: true });
    for (const [name, content] of Object.entries(files)) await fs.writeFile(path.join(context, name), content);
    assert.equal(await readDockerfileBase(context, 'Dockerfile'), 'example.org/base:1');
    const { promise, lines } = await build({ dockerfile: 'Dockerfile' }, { context });
    const built = await promise;
    const { manifest, config } = await imageOf(built.layoutDir, built.digest);
    assert.equal(manifest.layers.length, 1 + 5, 'WORKDIR, two COPY and two RUN layers on the base');
    const [workdirLayer, copy1, copy2, run1, run2] = await Promise.all(
      manifest.layers.slice(1).map((l) => readLayer(built.layoutDir, l.digest)),
    );
    assert.equal(workdirLayer!.get('app')?.type, 'directory');
    assert.equal(copy1!.get('app/greeting.txt')?.content, 'hello from the context\n');
    assert.equal(copy1!.get('app/greeting.txt')?.uid, 0);
    assert.equal(copy2!.get('app/lib/pkg/mod.py')?.content, 'print(1)\n');
    assert.equal(run1!.get('app/made.txt')?.content, 'hello from the context\nprint(1)\ndocker file greeting.txt\n');
    assert.equal(run2!.get('app/where.txt')?.content, '/app\n');
    assert.equal(config.config.WorkingDir, '/app');
    assert.equal(config.config.User, '1000:1000');
    assert.deepEqual(config.config.Cmd, ['/bin/sh', '-c', 'echo hi']);
    assert.ok(config.config.Env.includes('APP_HOME=/app'));
    assert.ok(config.config.Env.includes('MODE=docker file'));
    assert.ok(!config.config.Env.some((e: string) => e.startsWith('GREETING_FILE=')), 'ARGs are not baked in');
    assert.deepEqual(Object.keys(config.config.ExposedPorts).sort(), ['7000/tcp', '8080/tcp', '9090/tcp']);
    assert.equal(config.config.Labels['org.example.name'], 'ferry test');
    assert.deepEqual(built.config.exposedPorts, [7000, 8080, 9090]);
    assert.ok(
      lines.some((l) => /^step 12\/12: VOLUME \/data \(VOLUME is ignored by Ferry\)$/.test(l)),
      lines.join('\n'),
    );
  });

  it('a missing Dockerfile, or one that is a symbolic link, is FERRY_IMAGE_DOCKERFILE_NOT_FOUND', {
    timeout: TIMEOUT,
  }, async () => {
    const missing = await build({ dockerfile: 'Dockerfile' }, { files: { 'main.py': '' } });
    await rejectsWithCode(missing.promise, 'FERRY_IMAGE_DOCKERFILE_NOT_FOUND');
    const context = path.join(work, 'df-link');
    await fs.mkdir(context, { recursive: true });
    await fs.writeFile(path.join(work, 'elsewhere-Dockerfile'), 'FROM example.org/base:1\n');
    await fs.symlink(path.join(work, 'elsewhere-Dockerfile'), path.join(context, 'Dockerfile'));
    const linked = await build({ dockerfile: 'Dockerfile' }, { context });
    await rejectsWithCode(linked.promise, 'FERRY_IMAGE_DOCKERFILE_NOT_FOUND');
    const bad = await build(
      { dockerfile: 'Dockerfile' },
      { files: { Dockerfile: 'FROM example.org/base:1\nFROBNICATE x\n' } },
    );
    const err = await rejectsWithCode(bad.promise, 'FERRY_IMAGE_DOCKERFILE_INVALID');
    assert.match(err.message, /line 2: unknown instruction FROBNICATE/);
    const multi = await build({ dockerfile: 'Dockerfile' }, { files: { Dockerfile: 'FROM a:1 AS x\nFROM b:2\n' } });
    assert.match((await rejectsWithCode(multi.promise, 'FERRY_IMAGE_DOCKERFILE_INVALID')).message, /multi-stage/);
  });

  describe('attacks on the build', () => {
    /** Builds `dockerfile` in a context with `files` and a link `shadow -> /etc/shadow`. */
    async function attack(dockerfile: string) {
      const context = path.join(work, `attack-${++n}`);
      await fs.mkdir(path.join(context, 'dir'), { recursive: true });
      await fs.writeFile(path.join(context, 'Dockerfile'), dockerfile);
      await fs.writeFile(path.join(context, 'dir', 'ok.txt'), 'ok');
      await fs.symlink('/etc/shadow', path.join(context, 'shadow'));
      await fs.symlink('/etc', path.join(context, 'etc-link'));
      await fs.writeFile(path.join(work, 'outside.txt'), 'outside the context');
      return build({ dockerfile: 'Dockerfile' }, { context });
    }
    const shadow = () => fs.readFile('/etc/shadow', 'utf8');

    /** No layer of the image holds `text`. */
    async function notInImage(layoutDir: string, digest: string, text: string) {
      const { manifest } = await imageOf(layoutDir, digest);
      for (const l of manifest.layers) {
        for (const [name, entry] of await readLayer(layoutDir, l.digest)) {
          assert.ok(!entry.content.includes(text), `${name} holds the host file`);
        }
      }
    }

    it('COPY /etc/shadow is refused: FERRY_IMAGE_CONTEXT_ESCAPE', { timeout: TIMEOUT }, async () => {
      const { promise } = await attack('FROM example.org/base:1\nCOPY /etc/shadow /stolen\n');
      const err = await rejectsWithCode(promise, 'FERRY_IMAGE_CONTEXT_ESCAPE');
      assert.match(err.message, /absolute path/);
    });

    it('COPY ../outside.txt is refused: FERRY_IMAGE_CONTEXT_ESCAPE', { timeout: TIMEOUT }, async () => {
      const { promise } = await attack('FROM example.org/base:1\nCOPY ../outside.txt /stolen\n');
      await rejectsWithCode(promise, 'FERRY_IMAGE_CONTEXT_ESCAPE');
    });

    it('a context symlink to /etc/shadow, named or on the way, is refused; inside a copied folder it stays a link', {
      timeout: TIMEOUT,
    }, async () => {
      const named = await attack('FROM example.org/base:1\nCOPY shadow /stolen\n');
      assert.match((await rejectsWithCode(named.promise, 'FERRY_IMAGE_CONTEXT_ESCAPE')).message, /symbolic link/);
      const through = await attack('FROM example.org/base:1\nCOPY etc-link/shadow /stolen\n');
      await rejectsWithCode(through.promise, 'FERRY_IMAGE_CONTEXT_ESCAPE');
      const whole = await attack('FROM example.org/base:1\nCOPY . /app/\n');
      const built = await whole.promise;
      const { manifest } = await imageOf(built.layoutDir, built.digest);
      const layer = await readLayer(built.layoutDir, manifest.layers[1]!.digest);
      assert.equal(layer.get('app/shadow')?.type, 'symlink');
      assert.equal(layer.get('app/shadow')?.linkname, '/etc/shadow', 'a link, resolved inside the image at run time');
      assert.equal(layer.get('app/dir/ok.txt')?.content, 'ok');
      const secret = (await shadow()).split('\n')[0]!;
      await notInImage(built.layoutDir, built.digest, secret);
    });

    it('ADD http://127.0.0.1:<port>/x is refused, and no request reaches the server', {
      timeout: TIMEOUT,
    }, async () => {
      let requests = 0;
      const server = http.createServer((_req, res) => {
        requests += 1;
        res.end('payload from the host');
      });
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      const port = (server.address() as AddressInfo).port;
      try {
        const { promise } = await attack(`FROM example.org/base:1\nADD http://127.0.0.1:${port}/x /x\n`);
        const err = await rejectsWithCode(promise, 'FERRY_IMAGE_ADD_URL_REFUSED');
        assert.match(err.message, /RUN step/);
        assert.equal(requests, 0);
      } finally {
        server.close();
      }
    });

    it("a RUN cannot reach the host's loopback or addresses (veth network, the replicas' egress policy)", {
      timeout: TIMEOUT,
    }, async () => {
      const found = findVethTools();
      assert.ok(
        'tools' in found,
        `the veth network is required: ${'reasons' in found ? found.reasons.join('; ') : ''}`,
      );
      const netDir = path.join(work, 'net');
      await fs.mkdir(netDir, { recursive: true });
      const network = await createVethNetwork({
        tools: found.tools,
        policy: parseEgressPolicy('', ''),
        pool: DEFAULT_EGRESS_POOL,
        dataDir: netDir,
        runDir: path.join(netDir, 'run'),
        dns: createDnsForwarder([]),
        logger: pino({ level: 'silent' }),
      });
      const listener = await startHostListener();
      // Loopback and (bounded) the host's other addresses, other sandboxes' veth ends included.
      const targets = [
        '127.0.0.1',
        ...hostIpv4Addresses()
          .filter((a) => !a.startsWith('127.'))
          .slice(0, 8),
      ];
      try {
        const probe = targets
          .map(
            (t) =>
              `if echo ping | nc -w 3 ${t} ${listener.port}; then echo "REACHED ${t}"; else echo "BLOCKED ${t}"; fi`,
          )
          .join('; ');
        const { promise, lines } = await build({ run: [probe] }, { network });
        await promise;
        for (const t of targets) assert.ok(lines.includes(`BLOCKED ${t}`), `${t}: ${lines.join('\n')}`);
        assert.ok(!lines.some((l) => l.startsWith('REACHED') || l === 'ping'), lines.join('\n'));
      } finally {
        await listener.close();
        await network.close();
      }
    });
  });
});
