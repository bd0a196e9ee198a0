/**
 * The filesystem quotas that bound a `quota-dir` volume (FERRY_VOLUMES_BACKEND=quota-dir, quota-dirs.ts): one
 * mechanism per kind of filesystem, found from the filesystem FERRY_VOLUMES_DIR is on. Each makes a volume's
 * folder bounded by a quota id of its own (chosen like the volume's gid, on the volume's row), tells its
 * use, and removes the folder's quota. A write past the bound fails inside the function: ENOSPC on XFS,
 * EDQUOT on btrfs (the API's uploads answer 413 FERRY_VOLUME_FULL for both, volume-files.ts).
 *
 * - `btrfs-squota`: btrfs with simple quotas (`btrfs quota enable --simple`, kernel 6.7 or later). The
 *   volume is a subvolume in the level-1 qgroup `1/<id>`, which holds the limit. Simple quotas are required,
 *   not only tolerated: with full qgroups a function escapes its limit by making a subvolume of its own in
 *   the volume (no privilege needed); with simple quotas the new subvolume joins `1/<id>` by itself (test:
 *   test/volumes-quota-dir.test.ts).
 * - `xfs-project`: XFS mounted with `prjquota`. The volume's folder gets project id `<id>` with the inherit
 *   flag (everything made in it gets the id; a sandbox cannot change it, that needs root of the first user
 *   namespace) and a hard block limit; statfs on the folder reports the project's limit and use. Not run on
 *   CI: its kernel lacks XFS quotas (CONFIG_XFS_QUOTA), so only the refusal without `prjquota` is tested.
 *
 * - `gluster-quota`: a GlusterFS volume mounted (FUSE, `-o acl`) at FERRY_VOLUMES_DIR on every node, the one
 *   mechanism here shared by several machines. The volume's folder gets a directory quota (`gluster volume
 *   quota <vol> limit-usage <path> <bytes>`), which every client enforces together (EDQUOT); with
 *   `quota-deem-statfs` (on with quotas), statfs on the folder reports its limit and use, so any node reads
 *   the use without the CLI. Setting and removing a quota needs a glusterd of the trusted pool on the node
 *   (the CLI's --remote-host is read-only): volumes are created and deleted on nodes that are peers of the
 *   pool (gateways, or every node); the settings are read from the mount's server with --remote-host. The
 *   volume's quota timeouts must be 0: with the defaults (5 s and 60 s) writes run past the limit by what
 *   is written in that time (40 MiB into a 20 MiB folder, here); with 0, by the client's write-behind (about
 *   1.6 MiB here).
 *
 * Next (not shipped): CephFS (`setfattr -n ceph.quota.max_bytes -v <bytes> <folder>`, use from
 * `ceph.dir.rbytes`) and JuiceFS (`juicefs quota set <meta-url> --path <folder> --capacity <GiB>`), whose
 * quotas any client node can set, unlike XFS and btrfs, whose tools work on the machine that has the disk.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { findExecutable } from '../sandbox/launch.js';
import { runQuiet, WRAPPER_ENV } from '../sandbox/run-quiet.js';

const TOOL_TIMEOUT_MS = 120_000;

/** A step of a quota mechanism failed; `code` is the tool's exit code. */
export class QuotaError extends Error {
  constructor(
    message: string,
    readonly code: number | null = null,
  ) {
    super(message);
    this.name = 'QuotaError';
  }
}

export interface QuotaUse {
  used_bytes: number;
  limit_bytes: number;
}

export interface QuotaMechanism {
  readonly name: 'btrfs-squota' | 'xfs-project' | 'gluster-quota';
  /** For `ferry doctor` and the logs: what bounds the volumes, and on which mount. */
  readonly description: string;
  /** Makes `folder` (absent; its parent exists) bounded to `bytes` by quota `id`. Root-owned, mode 0700. */
  make(folder: string, id: number, bytes: number): Promise<void>;
  /** The use and limit of the volume at `folder`, as its quota counts them. */
  usage(folder: string): Promise<QuotaUse>;
  /** Removes the emptied `folder` and quota `id` (either may be gone already). */
  remove(folder: string, id: number): Promise<void>;
}

export interface QuotaDetection {
  mechanism: QuotaMechanism | null;
  /** Why there is none, in words (the 503 answer, `ferry doctor`). */
  reasons: string[];
}

export async function runTool(file: string, args: string[], what: string): Promise<string> {
  const result = await runQuiet(file, args, TOOL_TIMEOUT_MS);
  if (result.code !== 0) {
    const why = result.timedOut ? 'timed out' : result.stderr.trim() || result.error || `exit code ${result.code}`;
    throw new QuotaError(`${what}: ${why}`, result.code);
  }
  return result.stdout;
}

interface MountInfo {
  fstype: string;
  options: string[];
  target: string;
  uuid: string;
  source: string;
}

/** The mount `dir` is on (findmnt -T), or null. */
async function mountOf(findmnt: string, dir: string): Promise<MountInfo | null> {
  const result = await runQuiet(
    findmnt,
    ['-P', '-no', 'FSTYPE,OPTIONS,TARGET,UUID,SOURCE', '-T', dir],
    TOOL_TIMEOUT_MS,
  );
  if (result.code !== 0) return null;
  const fields: Record<string, string> = {};
  for (const m of result.stdout.matchAll(/(\w+)="([^"]*)"/g)) {
    fields[m[1]!] = m[2]!.replace(/\\x([0-9a-f]{2})/gi, (_, h: string) => String.fromCharCode(Number.parseInt(h, 16)));
  }
  if (!fields.FSTYPE || !fields.TARGET) return null;
  return {
    fstype: fields.FSTYPE,
    options: (fields.OPTIONS ?? '').split(','),
    target: fields.TARGET,
    uuid: fields.UUID ?? '',
    source: fields.SOURCE ?? '',
  };
}

/** The quota mechanism of the filesystem `dir` (which exists) is on, or why there is none. */
export async function detectQuotaMechanism(dir: string, setfacl: string | null): Promise<QuotaDetection> {
  const findmnt = await findExecutable('findmnt', WRAPPER_ENV);
  if (!findmnt) return { mechanism: null, reasons: ['missing findmnt (apt-get install util-linux)'] };
  const mount = await mountOf(findmnt, dir);
  if (!mount) return { mechanism: null, reasons: [`findmnt cannot tell which filesystem ${dir} is on`] };
  if (mount.fstype === 'btrfs') return detectBtrfs(dir, mount);
  if (mount.fstype === 'xfs') return detectXfs(dir, mount);
  if (mount.fstype === 'fuse.glusterfs') return detectGluster(dir, mount, setfacl);
  return {
    mechanism: null,
    reasons: [
      `FERRY_VOLUMES_DIR (${dir}) is on ${mount.fstype} (${mount.target}), which has no folder quota Ferry can set: the quota-dir backend needs btrfs with simple quotas, XFS mounted with prjquota, or a GlusterFS volume with quotas (docs/scaling-out.md, "Volumes")`,
    ],
  };
}

// ---- btrfs, simple quotas ----

async function detectBtrfs(dir: string, mount: MountInfo): Promise<QuotaDetection> {
  const btrfs = await findExecutable('btrfs', WRAPPER_ENV);
  if (!btrfs) return { mechanism: null, reasons: ['missing btrfs (apt-get install btrfs-progs)'] };
  let uuid = mount.uuid;
  if (!uuid) {
    const shown = await runQuiet(btrfs, ['filesystem', 'show', mount.target], TOOL_TIMEOUT_MS);
    uuid = /uuid:\s*([0-9a-f-]{36})/i.exec(shown.stdout)?.[1] ?? '';
  }
  // undefined: the filesystem is not found; null: it has no qgroups (quotas off).
  let mode: string | null | undefined;
  if (uuid && (await fs.stat(`/sys/fs/btrfs/${uuid}`).catch(() => null))) {
    const text = await fs.readFile(`/sys/fs/btrfs/${uuid}/qgroups/mode`, 'utf8').catch(() => null);
    mode = text === null ? null : text.trim();
  }
  const where = `the btrfs filesystem of FERRY_VOLUMES_DIR (${dir}, mounted at ${mount.target})`;
  if (mode === 'squota') return { mechanism: btrfsSquota(btrfs, mount.target), reasons: [] };
  if (mode === undefined) return { mechanism: null, reasons: [`cannot find ${where} in /sys/fs/btrfs`] };
  if (mode === null) {
    return {
      mechanism: null,
      reasons: [`quotas are off on ${where}: btrfs quota enable --simple ${mount.target} (kernel 6.7 or later)`],
    };
  }
  return {
    mechanism: null,
    reasons: [
      `${where} has full qgroups (${mode}), under which a function escapes its volume's limit by making a subvolume: use simple quotas (btrfs quota disable ${mount.target}; btrfs quota enable --simple ${mount.target})`,
    ],
  };
}

function btrfsSquota(btrfs: string, target: string): QuotaMechanism {
  const group = (id: number) => `1/${id}`;
  /** The level-1 qgroup bounding `folder`: the `1/` line of `qgroup show -F` (the qgroups above the path). */
  async function usage(folder: string): Promise<QuotaUse> {
    const out = await runTool(btrfs, ['qgroup', 'show', '--raw', '-re', '--sync', '-F', folder], 'btrfs qgroup show');
    for (const line of out.split('\n')) {
      const cols = line.trim().split(/\s+/);
      if (!cols[0]?.startsWith('1/')) continue;
      const limit = Number(cols[3]);
      if (!Number.isFinite(limit)) throw new QuotaError(`the qgroup ${cols[0]} of ${folder} has no limit`);
      return { used_bytes: Number(cols[1]), limit_bytes: limit };
    }
    throw new QuotaError(`${folder} is in no limited qgroup`);
  }
  return {
    name: 'btrfs-squota',
    description: `btrfs simple quotas on ${target} (a subvolume per volume; writes past the size fail with EDQUOT)`,
    async make(folder, id, bytes) {
      // A qgroup left by an earlier delete (destroyed once its subvolume is cleaned) is taken over.
      await runTool(btrfs, ['qgroup', 'create', group(id), target], 'btrfs qgroup create').catch((err: Error) => {
        if (!/exists/i.test(err.message)) throw err;
      });
      await runTool(btrfs, ['qgroup', 'limit', String(bytes), group(id), target], 'btrfs qgroup limit');
      await runTool(btrfs, ['subvolume', 'create', '-i', group(id), folder], 'btrfs subvolume create');
      await fs.chmod(folder, 0o700);
      const use = await usage(folder);
      if (use.limit_bytes !== bytes)
        throw new QuotaError(`the qgroup of ${folder} limits it to ${use.limit_bytes} bytes`);
    },
    usage,
    async remove(folder, id) {
      // An empty subvolume goes with rmdir, as a folder does.
      await fs.rmdir(folder).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
      // The qgroup can go once the subvolume's own is cleaned, which a commit starts: a few tries. One left
      // behind has nothing in it and no member; a volume given the same id later takes it over.
      for (let attempt = 0; attempt < 40; attempt++) {
        await runTool(btrfs, ['filesystem', 'sync', target], 'btrfs filesystem sync').catch(() => {});
        const done = await runTool(btrfs, ['qgroup', 'destroy', group(id), target], 'btrfs qgroup destroy').then(
          () => true,
          (err: Error) => /no such file|not found|ENOENT/i.test(err.message),
        );
        if (done) return;
        await new Promise((r) => setTimeout(r, 250));
      }
    },
  };
}

// ---- XFS, project quotas ----

async function detectXfs(dir: string, mount: MountInfo): Promise<QuotaDetection> {
  const where = `FERRY_VOLUMES_DIR (${dir}) is on XFS (${mount.target})`;
  const enforced = mount.options.some((o) => o === 'prjquota' || o === 'pquota' || o === 'pqenforce');
  if (!enforced) {
    return {
      mechanism: null,
      reasons: [
        `${where} mounted without project quotas: mount it with -o prjquota (in /etc/fstab; XFS takes it at mount time, not on remount)`,
      ],
    };
  }
  const xfsQuota = await findExecutable('xfs_quota', WRAPPER_ENV);
  if (!xfsQuota) return { mechanism: null, reasons: ['missing xfs_quota (apt-get install xfsprogs)'] };
  // xfs_quota takes the folder inside its command text, which it splits at blanks.
  if (/[\s"'\\]/.test(dir)) return { mechanism: null, reasons: [`${where}, whose path has blanks or quotes`] };
  return { mechanism: xfsProject(xfsQuota, mount.target), reasons: [] };
}

function xfsProject(xfsQuota: string, target: string): QuotaMechanism {
  const quota = (commands: string[], what: string) =>
    runTool(xfsQuota, ['-x', ...commands.flatMap((c) => ['-c', c]), target], what);
  /** statfs on a folder of a project reports the project's limit and use (XFS, with the inherit flag). */
  async function usage(folder: string): Promise<QuotaUse> {
    const s = await fs.statfs(folder);
    return { used_bytes: (s.blocks - s.bfree) * s.bsize, limit_bytes: s.blocks * s.bsize };
  }
  return {
    name: 'xfs-project',
    description: `XFS project quotas on ${target} (a project per volume; writes past the size fail with ENOSPC)`,
    async make(folder, id, bytes) {
      await fs.mkdir(folder, 0o700);
      const mib = Math.floor(bytes / (1024 * 1024));
      await quota([`project -s -p ${folder} ${id}`, `limit -p bhard=${mib}m ${id}`], 'xfs_quota');
      const use = await usage(folder);
      if (use.limit_bytes !== mib * 1024 * 1024) {
        throw new QuotaError(`statfs on ${folder} does not show its project's limit: the quota is not in force`);
      }
    },
    usage,
    async remove(folder, id) {
      await fs.rmdir(folder).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
      await quota([`limit -p bsoft=0 bhard=0 ${id}`], 'xfs_quota');
    },
  };
}

// ---- GlusterFS, directory quotas ----

/** `host:/volume[/subdir]` or `host:volume`, the source of a glusterfs mount; null when it is not one. */
export function parseGlusterSource(source: string): { host: string; volume: string; subdir: string } | null {
  const m = /^([A-Za-z0-9_.[\]:-]+?)(?:,[^:/]*)?:\/?([A-Za-z0-9_.-]+)((?:\/[^/\s]+)*)\/?$/.exec(source);
  if (!m) return null;
  return { host: m[1]!.replace(/^\[|\]$/g, ''), volume: m[2]!, subdir: m[3] ?? '' };
}

/** The options a `gluster volume info --xml` answer lists as set, by name. */
export function glusterOptions(xml: string): Map<string, string> {
  const out = new Map<string, string>();
  for (const m of xml.matchAll(/<option>\s*<name>([^<]+)<\/name>\s*<value>([^<]*)<\/value>\s*<\/option>/g)) {
    out.set(m[1]!, m[2]!);
  }
  return out;
}

async function detectGluster(dir: string, mount: MountInfo, setfacl: string | null): Promise<QuotaDetection> {
  const where = `FERRY_VOLUMES_DIR (${dir}) is on GlusterFS (${mount.source} at ${mount.target})`;
  const gluster = await findExecutable('gluster', WRAPPER_ENV);
  if (!gluster) return { mechanism: null, reasons: ['missing gluster (apt-get install glusterfs-cli)'] };
  const source = parseGlusterSource(mount.source);
  if (!source) return { mechanism: null, reasons: [`${where}, whose source Ferry cannot read as host:/volume`] };
  // The quota CLI takes the folder as one argument; keep it plain.
  if (/[\s"'\\]/.test(dir)) return { mechanism: null, reasons: [`${where}, whose path has blanks or quotes`] };
  const reasons: string[] = [];
  if (!mount.options.includes('allow_other')) {
    reasons.push(`${where} without allow_other, so sandboxes (other uids) cannot reach it`);
  }
  const info = await runQuiet(
    gluster,
    ['--mode=script', `--remote-host=${source.host}`, 'volume', 'info', source.volume, '--xml'],
    TOOL_TIMEOUT_MS,
  );
  const failed = /<opRet>0<\/opRet>/.test(info.stdout)
    ? null
    : /<opErrstr>([^<]*)<\/opErrstr>/.exec(info.stdout)?.[1] || info.stderr.trim() || info.error || 'no answer';
  if (info.code !== 0 || failed) {
    reasons.push(`${where}: cannot read the volume's settings from ${source.host} (gluster volume info): ${failed}`);
    return { mechanism: null, reasons };
  }
  const options = glusterOptions(info.stdout);
  const v = source.volume;
  if (options.get('features.quota') !== 'on') {
    reasons.push(`${where}, whose volume ${v} has quotas off: gluster volume quota ${v} enable`);
  } else if (options.get('features.quota-deem-statfs') === 'off') {
    reasons.push(`${where}, whose volume ${v} has quota-deem-statfs off: gluster volume set ${v} quota-deem-statfs on`);
  }
  const lax = ['hard-timeout', 'soft-timeout'].filter((o) => options.get(`features.${o}`) !== '0');
  if (lax.length > 0) {
    reasons.push(
      `${where}, whose volume ${v} checks its quotas lazily (${lax.join(', ')} not 0), so writes would run past a volume's size: ${lax.map((o) => `gluster volume quota ${v} ${o} 0`).join('; ')}`,
    );
  }
  const acl = setfacl ? await aclProbe(dir, setfacl) : null; // no setfacl: said by quota-dirs.ts
  if (acl) reasons.push(`${where} without ACLs (${acl}): mount it with -o acl`);
  if (reasons.length > 0) return { mechanism: null, reasons };
  return { mechanism: glusterQuota(gluster, mount.target, source.host, v, source.subdir), reasons: [] };
}

/**
 * Whether a default ACL can be set on a folder in `dir` (a glusterfs mount without `-o acl` cannot): null
 * when it can, or when it cannot be tried here (no right to make a folder, as `ferry doctor` by a user).
 */
async function aclProbe(dir: string, setfacl: string): Promise<string | null> {
  const probe = await fs.mkdtemp(path.join(dir, '.ferry-acl-probe-')).catch(() => null);
  if (!probe) return null;
  try {
    const result = await runQuiet(setfacl, ['-d', '-m', 'u::rwx,g::rwx,m::rwx,o::-', probe], TOOL_TIMEOUT_MS);
    return result.code === 0 ? null : result.stderr.trim() || `setfacl exit code ${result.code}`;
  } finally {
    await fs.rm(probe, { recursive: true, force: true }).catch(() => {});
  }
}

function glusterQuota(gluster: string, target: string, host: string, volume: string, subdir: string): QuotaMechanism {
  /** The folder's path as the volume names it (from its root, through a subdirectory mount). */
  const inVolume = (folder: string) => `${subdir}/${path.relative(target, folder)}`.replace(/\/+/g, '/');
  /** A management command; it needs this node's glusterd (the CLI's --remote-host is read-only). */
  const manage = (args: string[], what: string) =>
    runTool(gluster, ['--mode=script', 'volume', 'quota', volume, ...args], what).catch((err: QuotaError) => {
      if (/connection failed|daemon is operational|not connected/i.test(err.message)) {
        throw new QuotaError(
          `${what}: this node runs no glusterd of the pool serving ${volume}, and only a peer can set quotas: create and delete volumes through a node that is one (gluster peer probe <this node> from ${host}; docs/scaling-out.md, "Volumes"). ${err.message}`,
          err.code,
        );
      }
      throw err;
    });
  /** With quota-deem-statfs, statfs on a folder with a limit reports the limit and its use. */
  async function usage(folder: string): Promise<QuotaUse> {
    const s = await fs.statfs(folder);
    return { used_bytes: (s.blocks - s.bfree) * s.bsize, limit_bytes: s.blocks * s.bsize };
  }
  return {
    name: 'gluster-quota',
    description: `GlusterFS directory quotas on volume ${volume} (${host}, mounted at ${target}; a quota per volume folder; writes past the size fail with EDQUOT)`,
    async make(folder, _id, bytes) {
      await fs.mkdir(folder, 0o700);
      await manage(['limit-usage', inVolume(folder), String(bytes)], 'gluster volume quota limit-usage');
      // The limit is an attribute of the folder on the bricks; statfs through this mount shows it once set.
      for (let attempt = 0; ; attempt++) {
        const use = await usage(folder);
        if (use.limit_bytes === bytes) return;
        if (attempt >= 20) {
          throw new QuotaError(
            `statfs on ${folder} shows ${use.limit_bytes} bytes, not its quota's ${bytes}: the quota is not in force (quota-deem-statfs?)`,
          );
        }
        await new Promise((r) => setTimeout(r, 100));
      }
    },
    usage,
    async remove(folder) {
      // The limit first (the CLI finds the folder by path), then the emptied folder.
      await manage(['remove', inVolume(folder)], 'gluster volume quota remove').catch((err: QuotaError) => {
        if (!/no such file|not present|no limit|does not exist/i.test(err.message)) throw err;
      });
      await fs.rmdir(folder).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== 'ENOENT') throw err;
      });
    },
  };
}
