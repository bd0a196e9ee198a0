/**
 * A Debian base image for tests, offline, made from this machine's own Debian bits: what `apt-get` and
 * `dpkg` need to install a package, copied from the host (their binaries, apt's download methods, and the
 * shared libraries `ldd` names for them), busybox-static's binary as `/bin/busybox` with its applets
 * linked (the shell, rm, tar, ... that dpkg and maintainer scripts call), and apt's and dpkg's config and
 * state folders, empty: a `/var/lib/dpkg/status` with no package, `/etc/apt` with no source, an `_apt`
 * user in `/etc/passwd` (apt drops to it for downloads, as in Debian's own images). Written into an OCI
 * layout with umoci, as test/helpers/registry.ts writes its busybox base (about 10 MiB compressed).
 *
 * Also a test apt repository: a `.deb` made with `dpkg-deb --build`, indexed by `dpkg-scanpackages`
 * (dpkg-dev) as a flat repository (`deb [trusted=yes] http://host/ ./`), with an unsigned Release file.
 * Real repositories are signed, and apt checks them with the keyring in the image (`/etc/apt/trusted.gpg.d`,
 * `/usr/share/keyrings`); the test's is unsigned, so the image's sources.list marks it `[trusted=yes]`.
 *
 * Needs a Debian host with apt and dpkg (this is one), umoci, busybox-static and dpkg-dev
 * (scripts/setup-system.sh installs them): fails naming the package when one is missing.
 */
import { execFile } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import { gzipSync } from 'node:zlib';
import type { BaseImage } from './registry.js';

const run = promisify(execFile);

/** Host programs copied into the image, at the same path. */
const PROGRAMS = [
  '/usr/bin/apt-get',
  '/usr/bin/apt-config',
  '/usr/bin/apt-cache',
  '/usr/bin/dpkg',
  '/usr/bin/dpkg-deb',
  '/usr/bin/dpkg-query',
  '/usr/bin/dpkg-split',
  '/usr/bin/dpkg-divert',
  '/usr/bin/dpkg-trigger',
  '/usr/bin/update-alternatives',
  '/usr/sbin/start-stop-daemon',
  '/sbin/ldconfig',
  // GNU tar: dpkg-deb passes it options busybox's tar does not know (--warning=no-timestamp).
  '/usr/bin/tar',
];
/** dpkg's architecture tables (apt reads them to know the machine's architecture). */
const DATA_FILES = ['/usr/share/dpkg/cputable', '/usr/share/dpkg/ostable', '/usr/share/dpkg/tupletable'];
/** apt's download and decompression methods (http for the repository, store to unpack its index). */
const APT_METHODS = '/usr/lib/apt/methods';
/** busybox applets not linked: the image has the real ones (dpkg's own) from the host. */
const NOT_BUSYBOX = new Set(['dpkg', 'dpkg-deb', 'start-stop-daemon', 'busybox', 'linuxrc', 'init']);

const REQUIRED: Record<string, string> = {
  '/usr/bin/umoci': 'umoci',
  '/bin/busybox': 'busybox-static',
  '/usr/bin/dpkg-scanpackages': 'dpkg-dev',
  '/usr/bin/dpkg-deb': 'dpkg',
  '/usr/bin/apt-get': 'apt',
  '/usr/bin/ldd': 'libc-bin',
};

/** Fails (never skips) naming the packages when a tool the apt tests use is missing. */
export async function requireAptTools(): Promise<void> {
  const missing: string[] = [];
  for (const [file, pkg] of Object.entries(REQUIRED)) {
    if (!(await exists(file))) missing.push(pkg);
  }
  if (missing.length > 0) {
    throw new Error(`the apt image tests need ${missing.join(', ')}: bash scripts/setup-system.sh installs them`);
  }
}

async function exists(file: string): Promise<boolean> {
  return fs.access(file).then(
    () => true,
    () => false,
  );
}

/** The libraries `ldd` names for `file` (the loader included), as the paths it found them at. */
async function librariesOf(file: string): Promise<string[]> {
  const { stdout } = await run('/usr/bin/ldd', [file]);
  const out: string[] = [];
  for (const line of stdout.split('\n')) {
    const found = /=>\s+(\/\S+)/.exec(line) ?? /^\s*(\/\S+)\s+\(/.exec(line);
    if (found) out.push(found[1]!);
  }
  return out;
}

/** Copies a host file (following links) to the same path under `rootfs`, keeping its mode. */
async function copyIn(rootfs: string, file: string): Promise<void> {
  const target = path.join(rootfs, file);
  await fs.mkdir(path.dirname(target), { recursive: true });
  await fs.copyFile(file, target);
  await fs.chmod(target, (await fs.stat(file)).mode & 0o7777);
}

async function write(rootfs: string, file: string, content: string, mode = 0o644): Promise<void> {
  const target = path.join(rootfs, file);
  await fs.mkdir(path.dirname(target), { recursive: true });
  await fs.writeFile(target, content, { mode });
}

/**
 * Writes the Debian base image into a fresh OCI layout under `dir` (tag `debian`); `sourcesList` is its
 * `/etc/apt/sources.list` (none by default); `copy` and `links` add host files and links as makeBaseImage's
 * do (test/helpers/python-image.ts gives the host's python3 this way).
 */
export async function makeDebianBaseImage(
  dir: string,
  options: {
    sourcesList?: string;
    copy?: Array<{ from: string; to: string; filter?: (source: string) => boolean }>;
    links?: Record<string, string>;
  } = {},
): Promise<BaseImage> {
  await fs.mkdir(dir, { recursive: true });
  const layout = path.join(dir, 'oci');
  const bundle = path.join(dir, `bundle-${randomBytes(4).toString('hex')}`);
  const tag = 'debian';
  const image = `${layout}:${tag}`;
  await run('umoci', ['init', '--layout', layout]);
  await run('umoci', ['new', '--image', image]);
  await run('umoci', ['unpack', '--rootless', '--image', image, bundle]);
  const rootfs = path.join(bundle, 'rootfs');

  const programs = [...PROGRAMS];
  for (const entry of await fs.readdir(APT_METHODS, { withFileTypes: true })) {
    const file = path.join(APT_METHODS, entry.name);
    if (entry.isSymbolicLink()) {
      await fs.mkdir(path.join(rootfs, APT_METHODS), { recursive: true });
      await fs.symlink(await fs.readlink(file), path.join(rootfs, file));
    } else if (entry.isFile()) programs.push(file);
  }
  const libraries = new Set<string>();
  for (const program of programs) {
    await copyIn(rootfs, program);
    // ldconfig is static: ldd says so and exits 1.
    for (const lib of await librariesOf(program).catch(() => [])) libraries.add(lib);
  }
  for (const lib of libraries) await copyIn(rootfs, lib);
  for (const file of DATA_FILES) await copyIn(rootfs, file);
  for (const { from, to, filter } of options.copy ?? []) {
    await fs.mkdir(path.dirname(path.join(rootfs, to)), { recursive: true });
    await fs.cp(from, path.join(rootfs, to), { recursive: true, dereference: true, ...(filter ? { filter } : {}) });
  }
  for (const [file, target] of Object.entries(options.links ?? {})) {
    await fs.mkdir(path.dirname(path.join(rootfs, file)), { recursive: true });
    await fs.symlink(target, path.join(rootfs, file));
  }

  await fs.mkdir(path.join(rootfs, 'bin'), { recursive: true });
  await fs.copyFile('/bin/busybox', path.join(rootfs, 'bin', 'busybox'));
  await fs.chmod(path.join(rootfs, 'bin', 'busybox'), 0o755);
  const { stdout: applets } = await run('/bin/busybox', ['--list']);
  for (const applet of applets.split('\n').filter((a) => /^[a-z0-9_.[-]+$/.test(a))) {
    if (NOT_BUSYBOX.has(applet)) continue;
    if (await exists(path.join(rootfs, 'usr', 'bin', applet))) continue;
    await fs.symlink('busybox', path.join(rootfs, 'bin', applet)).catch(() => {});
  }

  // Users: apt fetches as _apt (it drops root for downloads when the user exists).
  await write(rootfs, 'etc/passwd', 'root:x:0:0:root:/root:/bin/sh\n_apt:x:42:65534::/nonexistent:/bin/false\n');
  await write(rootfs, 'etc/group', 'root:x:0:\nnogroup:x:65534:\n');
  // dpkg's state, with no package installed, and its config.
  await write(rootfs, 'var/lib/dpkg/status', '');
  await write(rootfs, 'var/lib/dpkg/available', '');
  for (const folder of [
    'var/lib/dpkg/info',
    'var/lib/dpkg/updates',
    'var/lib/dpkg/triggers',
    'var/lib/dpkg/alternatives',
    'etc/dpkg/dpkg.cfg.d',
    'etc/apt/apt.conf.d',
    'etc/apt/preferences.d',
    'etc/apt/sources.list.d',
    'etc/apt/trusted.gpg.d',
    'var/lib/apt/lists/partial',
    'var/cache/apt/archives/partial',
    'var/log/apt',
    'root',
  ]) {
    await fs.mkdir(path.join(rootfs, folder), { recursive: true });
  }
  await fs.mkdir(path.join(rootfs, 'tmp'), { recursive: true });
  await fs.chmod(path.join(rootfs, 'tmp'), 0o1777);
  await write(rootfs, 'etc/apt/sources.list', options.sourcesList ?? '');

  await run('umoci', ['repack', '--image', image, bundle]);
  await run('umoci', [
    'config',
    '--image',
    image,
    '--config.cmd',
    '/bin/sh',
    '--config.env',
    'PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
  ]);
  await fs.rm(bundle, { recursive: true, force: true });
  return { layout, tag, source: `oci:${layout}:${tag}` };
}

export interface AptRepository {
  /** The folder to serve: the .deb, Packages, Packages.gz and Release. */
  dir: string;
  /** The .deb's file name in it. */
  debFile: string;
}

/**
 * Makes a flat apt repository in `dir` with one package, `name` (architecture all, version 1.0),
 * holding `/usr/bin/<name>`: a shell script that prints `output`. Its postinst prints `installed <name>`.
 */
export async function makeAptRepository(dir: string, name: string, output: string): Promise<AptRepository> {
  const build = path.join(dir, `build-${randomBytes(4).toString('hex')}`);
  const repo = path.join(dir, 'repo');
  await fs.mkdir(repo, { recursive: true });
  await write(
    build,
    'DEBIAN/control',
    [
      `Package: ${name}`,
      'Version: 1.0',
      'Architecture: all',
      'Maintainer: Ferry tests <tests@ferry.invalid>',
      'Section: misc',
      'Priority: optional',
      `Description: a package made by Ferry's apt test`,
      ' It holds one shell script that prints a marker.',
      '',
    ].join('\n'),
  );
  await write(build, 'DEBIAN/postinst', `#!/bin/sh\nset -e\necho "installed ${name}"\n`, 0o755);
  await write(build, `usr/bin/${name}`, `#!/bin/sh\necho '${output}'\n`, 0o755);
  const debFile = `${name}_1.0_all.deb`;
  await run('dpkg-deb', ['--root-owner-group', '--build', build, path.join(repo, debFile)]);
  await fs.rm(build, { recursive: true, force: true });

  const { stdout: packages } = await run('dpkg-scanpackages', ['--multiversion', '.', '/dev/null'], { cwd: repo });
  const packagesGz = gzipSync(packages);
  await fs.writeFile(path.join(repo, 'Packages'), packages);
  await fs.writeFile(path.join(repo, 'Packages.gz'), packagesGz);
  // An unsigned Release file naming the indexes and their hashes (apt-ftparchive would write the same).
  const entry = (bytes: Buffer | string, file: string, algorithm: string) =>
    ` ${createHash(algorithm).update(bytes).digest('hex')} ${Buffer.byteLength(bytes)} ${file}`;
  const release = [
    'Origin: ferry-test',
    'Label: ferry-test',
    `Date: ${new Date().toUTCString()}`,
    'MD5Sum:',
    entry(packages, 'Packages', 'md5'),
    entry(packagesGz, 'Packages.gz', 'md5'),
    'SHA256:',
    entry(packages, 'Packages', 'sha256'),
    entry(packagesGz, 'Packages.gz', 'sha256'),
    '',
  ].join('\n');
  await fs.writeFile(path.join(repo, 'Release'), release);
  return { dir: repo, debFile };
}

/**
 * A plain HTTP server for a folder, as a Node script to run inside a test's network namespace
 * (`node -e <script> <folder> <address> <port>`): GET and HEAD of files in the folder, 404 for anything
 * else; prints `ready` once listening and `GET <path> <status>` for each request.
 */
export const STATIC_SERVER_SCRIPT = `
const http = require('node:http');
const fs = require('node:fs');
const path = require('node:path');
const [root, host, port] = process.argv.slice(1);
const server = http.createServer((req, res) => {
  const name = decodeURIComponent(new URL(req.url, 'http://x').pathname).replace(/^\\/+/, '').replace(/^\\.\\//, '');
  const file = path.join(root, name);
  let st = null;
  try { st = name !== '' && !name.includes('..') ? fs.statSync(file) : null; } catch {}
  if (!st || !st.isFile()) {
    console.log(req.method + ' /' + name + ' 404');
    res.writeHead(404).end();
    return;
  }
  console.log(req.method + ' /' + name + ' 200');
  res.writeHead(200, { 'content-length': st.size, 'content-type': 'application/octet-stream' });
  if (req.method === 'HEAD') res.end();
  else fs.createReadStream(file).pipe(res);
});
server.listen(Number(port), host, () => console.log('ready'));
`;
