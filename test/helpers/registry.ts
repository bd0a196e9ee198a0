/**
 * Images for tests, offline: a small base image made here from the machine's own bits (busybox-static's
 * binary, as `/bin/busybox` with `/bin/sh` linked to it) into an OCI layout with umoci, rootless, and a
 * real registry on loopback (Debian's docker-registry, on a free port with a storage folder of its own,
 * optionally behind htpasswd authentication), stopped by the test. skopeo pushes layouts into it.
 *
 * Each registry answers with a header carrying a random token, so a test that lost the race for its free
 * port to another process fails saying so instead of talking to a stranger.
 */
import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import { tempDir, waitFor } from './ferry.js';
import { freePort } from './nats.js';

const run = promisify(execFile);

const TOOLS = {
  umoci: '/usr/bin/umoci',
  skopeo: '/usr/bin/skopeo',
  registry: '/usr/bin/docker-registry',
  htpasswd: '/usr/bin/htpasswd',
  busybox: '/bin/busybox',
} as const;

/** Fails (never skips) naming the package when a tool the image tests use is missing. */
export async function requireImageTools(): Promise<void> {
  const packages: Record<keyof typeof TOOLS, string> = {
    umoci: 'umoci',
    skopeo: 'skopeo',
    registry: 'docker-registry',
    htpasswd: 'apache2-utils',
    busybox: 'busybox-static',
  };
  const missing: string[] = [];
  for (const [name, file] of Object.entries(TOOLS) as Array<[keyof typeof TOOLS, string]>) {
    if (
      !(await fs.access(file).then(
        () => true,
        () => false,
      ))
    )
      missing.push(packages[name]);
  }
  if (missing.length > 0) {
    throw new Error(`the image tests need ${missing.join(', ')}: bash scripts/setup-system.sh installs them`);
  }
}

export interface BaseImage {
  /** The OCI layout folder. */
  layout: string;
  /** The tag inside the layout. */
  tag: string;
  /** `oci:<layout>:<tag>`, for skopeo. */
  source: string;
}

/** An image config for makeBaseImage; by default Cmd /bin/sh, Env GREETING=hello, WorkingDir /srv, EXPOSE 8080. */
export interface BaseImageConfig {
  cmd?: string[];
  env?: string[];
  workingdir?: string;
  exposedPorts?: string[];
  user?: string;
}

/**
 * Writes a base image: busybox as /bin/busybox and /bin/sh, `files` (path in the image → content; the
 * ones in `executable` mode 0755) on top, with `Cmd`, `Env`, `WorkingDir` and `ExposedPorts` set, into a
 * fresh OCI layout under `dir`.
 */
export async function makeBaseImage(
  dir: string,
  options: {
    files?: Record<string, string>;
    executable?: string[];
    /** Host files or folders copied in (links followed), with a filter on the host paths of a folder's entries. */
    copy?: Array<{ from: string; to: string; filter?: (source: string) => boolean }>;
    /** Symbolic links made in the image: path → target. */
    links?: Record<string, string>;
    tag?: string;
    config?: BaseImageConfig;
  } = {},
): Promise<BaseImage> {
  await fs.mkdir(dir, { recursive: true });
  const layout = path.join(dir, 'oci');
  const bundle = path.join(dir, `bundle-${randomBytes(4).toString('hex')}`);
  const tag = options.tag ?? 'base';
  const image = `${layout}:${tag}`;
  await run(TOOLS.umoci, ['init', '--layout', layout]).catch(async (err) => {
    if (
      !(await fs.access(path.join(layout, 'index.json')).then(
        () => true,
        () => false,
      ))
    )
      throw err;
  });
  await run(TOOLS.umoci, ['new', '--image', image]);
  await run(TOOLS.umoci, ['unpack', '--rootless', '--image', image, bundle]);
  const rootfs = path.join(bundle, 'rootfs');
  await fs.mkdir(path.join(rootfs, 'bin'), { recursive: true });
  await fs.copyFile(TOOLS.busybox, path.join(rootfs, 'bin', 'busybox'));
  await fs.chmod(path.join(rootfs, 'bin', 'busybox'), 0o755);
  await fs.symlink('busybox', path.join(rootfs, 'bin', 'sh'));
  for (const [file, content] of Object.entries(options.files ?? {})) {
    const target = path.join(rootfs, file);
    await fs.mkdir(path.dirname(target), { recursive: true });
    await fs.writeFile(target, content, { mode: options.executable?.includes(file) ? 0o755 : 0o644 });
  }
  for (const { from, to, filter } of options.copy ?? []) {
    const target = path.join(rootfs, to);
    await fs.mkdir(path.dirname(target), { recursive: true });
    await fs.cp(from, target, { recursive: true, dereference: true, ...(filter ? { filter } : {}) });
  }
  for (const [file, target] of Object.entries(options.links ?? {})) {
    await fs.mkdir(path.dirname(path.join(rootfs, file)), { recursive: true });
    await fs.symlink(target, path.join(rootfs, file));
  }
  await run(TOOLS.umoci, ['repack', '--image', image, bundle]);
  const config = options.config ?? {};
  const repeat = (flag: string, values: string[]) => values.flatMap((value) => [flag, value]);
  await run(TOOLS.umoci, [
    'config',
    '--image',
    image,
    ...repeat('--config.cmd', config.cmd ?? ['/bin/sh']),
    ...repeat('--config.env', config.env ?? ['GREETING=hello']),
    '--config.workingdir',
    config.workingdir ?? '/srv',
    ...repeat('--config.exposedports', config.exposedPorts ?? ['8080/tcp']),
    ...(config.user !== undefined ? ['--config.user', config.user] : []),
  ]);
  await fs.rm(bundle, { recursive: true, force: true });
  return { layout, tag, source: `oci:${layout}:${tag}` };
}

export interface TestRegistry {
  /** `127.0.0.1:<port>`, as an image reference's registry part. */
  host: string;
  /** The registry's storage folder (tests corrupt blobs in it). */
  storage: string;
  /** The credentials, when it was started with them. */
  credentials?: { username: string; password: string };
  /** Pushes an image (skopeo) as `<host>/<name>` (`test/base:1`); returns the manifest digest. */
  push(image: BaseImage, name: string): Promise<string>;
  /** The file a blob of `<repository>` is stored in. */
  blobFile(digest: string): string;
  stop(): Promise<void>;
}

/** Starts docker-registry on a free loopback port; with `auth`, behind htpasswd (bcrypt) Basic auth. */
export async function startRegistry(
  options: { auth?: { username: string; password: string } } = {},
): Promise<TestRegistry> {
  const dir = await tempDir('ferry-registry-');
  const storage = path.join(dir, 'data');
  await fs.mkdir(storage);
  const port = await freePort();
  const token = randomBytes(8).toString('hex');
  let authBlock = '';
  if (options.auth) {
    const { stdout } = await run(TOOLS.htpasswd, ['-Bbn', options.auth.username, options.auth.password]);
    await fs.writeFile(path.join(dir, 'htpasswd'), stdout);
    authBlock = `auth:\n  htpasswd:\n    realm: ferry-test\n    path: ${path.join(dir, 'htpasswd')}\n`;
  }
  const config = [
    'version: 0.1',
    'log:',
    '  level: error',
    '  accesslog:',
    '    disabled: true',
    'storage:',
    '  filesystem:',
    `    rootdirectory: ${storage}`,
    '  delete:',
    '    enabled: true',
    'http:',
    `  addr: 127.0.0.1:${port}`,
    '  headers:',
    `    X-Ferry-Test-Registry: [${token}]`,
    authBlock,
  ].join('\n');
  await fs.writeFile(path.join(dir, 'config.yml'), config);
  const child: ChildProcess = spawn(TOOLS.registry, ['serve', path.join(dir, 'config.yml')], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let stderr = '';
  child.stderr?.on('data', (d: Buffer) => {
    stderr = (stderr + d.toString()).slice(-4000);
  });
  let exited = false;
  child.once('exit', () => {
    exited = true;
  });
  const host = `127.0.0.1:${port}`;
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      const gone = new Promise((r) => child.once('exit', r));
      child.kill('SIGKILL');
      await gone;
    }
    await fs.rm(dir, { recursive: true, force: true });
  };
  try {
    await waitFor(
      async () => {
        if (exited) throw new Error(`docker-registry exited at start: ${stderr}`);
        const res = await fetch(`http://${host}/v2/`).catch(() => undefined);
        if (!res) return undefined;
        await res.arrayBuffer();
        if (res.headers.get('x-ferry-test-registry') !== token) {
          throw new Error(`another server answers on ${host}: the test registry lost its port`);
        }
        return true;
      },
      20_000,
      'the test registry to listen',
    );
  } catch (err) {
    await stop();
    throw err;
  }
  return {
    host,
    storage,
    ...(options.auth ? { credentials: options.auth } : {}),
    async push(image, name) {
      const digestFile = path.join(dir, `digest-${randomBytes(4).toString('hex')}`);
      const args = [
        '--insecure-policy',
        'copy',
        '--quiet',
        '--dest-tls-verify=false',
        '--digestfile',
        digestFile,
        ...(options.auth ? ['--dest-creds', `${options.auth.username}:${options.auth.password}`] : []),
        image.source,
        `docker://${host}/${name}`,
      ];
      await run(TOOLS.skopeo, args, { env: { ...process.env, HOME: dir } });
      return (await fs.readFile(digestFile, 'utf8')).trim();
    },
    blobFile(digest) {
      const hex = digest.replace(/^sha256:/, '');
      return path.join(storage, 'docker', 'registry', 'v2', 'blobs', 'sha256', hex.slice(0, 2), hex, 'data');
    },
    stop,
  };
}

/** Writes a `config.json` auth file (`{"auths": {...}}`) for the registries given, in `dir`. */
export async function writeAuthFile(
  dir: string,
  entries: Record<string, { username: string; password: string }>,
): Promise<string> {
  const auths: Record<string, { auth: string }> = {};
  for (const [registry, c] of Object.entries(entries)) {
    auths[registry] = { auth: Buffer.from(`${c.username}:${c.password}`).toString('base64') };
  }
  const file = path.join(dir, `auth-${randomBytes(4).toString('hex')}.json`);
  await fs.writeFile(file, JSON.stringify({ auths }), { mode: 0o600 });
  return file;
}
