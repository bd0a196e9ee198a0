/**
 * A GlusterFS volume for tests of `quota-dir` volumes on a filesystem several machines share: this machine's
 * glusterd (started for the test when it is not running, and stopped again by `close`), one brick in a
 * temporary folder, directory quotas on, and the volume mounted twice through FUSE, as two machines would
 * mount it. All traffic stays on loopback: the brick's host is this machine's name, which must resolve to a
 * 127.x address (glusterd refuses `localhost` and `127.0.0.1` as a brick's host). Needs root and Debian's
 * glusterfs-server and glusterfs-client (scripts/setup-system.sh).
 */
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import dns from 'node:dns/promises';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { tempDir } from './ferry.js';

export interface GlusterVolume {
  /** The GlusterFS volume's name. */
  name: string;
  /** The two mount points of the one volume: what two machines see. */
  mounts: [string, string];
  close(): Promise<void>;
}

export interface GlusterOptions {
  /** Mount with `-o acl` (default true). */
  acl?: boolean;
  /** Set the quota timeouts to 0 (default true); false keeps GlusterFS's lazy defaults. */
  strictQuota?: boolean;
}

function run(args: string[], timeout = 60_000): { ok: boolean; out: string } {
  const r = spawnSync(args[0]!, args.slice(1), { encoding: 'utf8', timeout });
  return { ok: r.status === 0, out: `${r.stdout ?? ''}${r.stderr ?? ''}`.trim() };
}

const gluster = (...args: string[]) => run(['gluster', '--mode=script', ...args]);

function installed(): string | null {
  for (const tool of ['gluster', 'glusterd', 'mount.glusterfs']) {
    if (!run(['sh', '-c', `command -v ${tool} || test -x /sbin/${tool} || test -x /usr/sbin/${tool}`]).ok) {
      return `${tool} is missing (apt-get install glusterfs-server glusterfs-client; scripts/setup-system.sh)`;
    }
  }
  return null;
}

/** glusterd answers the CLI. */
const glusterdUp = () => gluster('pool', 'list').ok;

async function waitUntil(check: () => boolean, ms: number, what: string): Promise<void> {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

/** Makes, starts and mounts the volume; a string says why it cannot be had here. */
export async function makeGlusterVolume(options: GlusterOptions = {}): Promise<GlusterVolume | string> {
  const missing = installed();
  if (missing) return missing;
  const host = os.hostname();
  const address = await dns.lookup(host, { family: 4 }).catch(() => null);
  if (!address?.address.startsWith('127.')) {
    return `this machine's name ${host} resolves to ${address?.address ?? 'nothing'}, not a loopback address`;
  }
  const root = await tempDir('ferry-gluster-');
  await fs.chmod(root, 0o711);
  let started = false;
  if (!glusterdUp()) {
    const daemon = run(['glusterd', `--log-file=${path.join(root, 'glusterd.log')}`]);
    if (!daemon.ok) return `glusterd did not start: ${daemon.out}`;
    started = true;
    await waitUntil(glusterdUp, 30_000, 'glusterd');
  }
  const name = `ferryt${randomBytes(4).toString('hex')}`;
  const brick = path.join(root, 'brick');
  const mounts: [string, string] = [path.join(root, 'a'), path.join(root, 'b')];
  await fs.mkdir(brick, { mode: 0o755 });
  for (const m of mounts) await fs.mkdir(m);

  const close = async () => {
    for (const m of [...mounts, `/run/gluster/${name}_quota_limit`]) {
      for (let i = 0; i < 20 && run(['mountpoint', '-q', m]).ok; i++) {
        if (run(['umount', m]).ok) break;
        await new Promise((r) => setTimeout(r, 250));
      }
      if (run(['mountpoint', '-q', m]).ok) run(['umount', '-l', m]);
    }
    gluster('volume', 'stop', name, 'force');
    gluster('volume', 'delete', name);
    if (started) {
      run(['pkill', '-x', 'glusterd']);
      await waitUntil(() => !run(['pgrep', '-x', 'glusterd']).ok, 30_000, 'glusterd to stop').catch(() => {});
      // What glusterd started for the volume (its brick, the quota daemon) and may have left.
      run(['pkill', '-f', `/run/gluster/.*${name}|--volfile-id ${name}\\.|gluster/quotad`]);
    }
    await fs.rm(root, { recursive: true, force: true });
  };

  try {
    const steps: string[][] = [
      ['volume', 'create', name, `${host}:${brick}`, 'force'],
      ['volume', 'start', name],
      ['volume', 'quota', name, 'enable'],
      ...(options.strictQuota === false
        ? []
        : [
            ['volume', 'quota', name, 'hard-timeout', '0'],
            ['volume', 'quota', name, 'soft-timeout', '0'],
          ]),
    ];
    for (const step of steps) {
      const r = gluster(...step);
      if (!r.ok) throw new Error(`gluster ${step.join(' ')}: ${r.out}`);
    }
    const mountOptions = ['nodev', 'nosuid', ...(options.acl === false ? [] : ['acl'])].join(',');
    for (const m of mounts) {
      const r = run(['mount', '-t', 'glusterfs', '-o', mountOptions, `${host}:/${name}`, m]);
      if (!r.ok) throw new Error(`mount ${m}: ${r.out}`);
    }
    await waitUntil(() => mounts.every((m) => run(['mountpoint', '-q', m]).ok), 30_000, 'the mounts');
  } catch (err) {
    await close();
    throw err;
  }
  return { name, mounts, close };
}
