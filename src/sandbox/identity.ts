/**
 * Who a sandbox is on the host: the host uid/gid its user namespace maps to.
 *
 * bubblewrap maps the sandbox's uid 65534 to the uid of whoever starts bwrap. When Ferry runs as an
 * ordinary user, that is Ferry's own unprivileged uid, and nothing here is needed. When Ferry runs as
 * root, it would be host uid 0: the kernel then lets the function write the host-wide settings under
 * /proc/sys (kernel.core_pattern, vm.panic_on_oom, ...) and read what only root may. So as root every
 * sandbox (replica, warm sandbox, build step) is started as a host uid of its own, taken from a range
 * that nothing else uses: the wrapper chain joins the cgroup and the network namespace as root, then
 * `setpriv` drops to that uid (no supplementary groups, no capabilities) and execs bwrap, which makes an
 * unprivileged user namespace mapping 65534 to it. The sandbox is then an ordinary user to every kernel
 * check, and two sandboxes never share a uid within one server (per-uid kernel quotas such as inotify
 * instances or keyrings are not shared across tenants either).
 *
 * The range: `FERRY_SANDBOX_UIDS=<first>:<count>` when set; else the `ferry-sandbox` line of /etc/subuid
 * (and the same first id for groups), which `scripts/setup-system.sh` writes so that other tools that
 * hand out subordinate ids see the range as taken; else 1879048192:65536 (0x70000000, above systemd's
 * container range, unassigned). The ids need no passwd entry.
 *
 * API:
 *   probeIdentity(env?): { identity, reasons }   null identity when Ferry is not root
 *   acquireSandboxUid(identity): number          a free uid of the range (this process's sandboxes)
 *   releaseSandboxUid(identity, uid)
 *   dropPrivilegesArgs(identity, uid): string[]  `setpriv ... --` to put before bwrap
 *   unreachableByOthers(path): Promise<string|null> the first folder on the way a sandbox uid cannot enter
 */
import { randomInt } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';

export interface SandboxIdentity {
  /** The first host uid (and gid) of the range. */
  first: number;
  count: number;
  /** Where the range came from, for `ferry doctor`. */
  source: 'FERRY_SANDBOX_UIDS' | '/etc/subuid' | 'default';
  /** util-linux setpriv, which drops from root to the sandbox's uid before bwrap. */
  setpriv: string;
}

export const DEFAULT_SANDBOX_UIDS = { first: 1_879_048_192, count: 65_536 } as const;
const SUBUID_NAME = 'ferry-sandbox';

/**
 * The identity sandboxes take: null when Ferry is not root (bwrap then maps them to Ferry's own,
 * unprivileged, uid). Throws nothing: what is wrong goes to `reasons`, and a root server with no way to
 * drop privileges gets `identity: null` with `unusable: true`, so the caller refuses to sandbox as root.
 */
export async function probeIdentity(
  env: NodeJS.ProcessEnv,
  findSetpriv: () => Promise<string | null>,
): Promise<{ identity: SandboxIdentity | null; unusable: boolean; reasons: string[] }> {
  const reasons: string[] = [];
  if (typeof process.getuid !== 'function' || process.getuid() !== 0)
    return { identity: null, unusable: false, reasons };
  const setpriv = await findSetpriv();
  if (!setpriv) {
    reasons.push(
      'Ferry runs as root and setpriv (util-linux) was not found: sandboxes would map to host root, so bubblewrap is not used',
    );
    return { identity: null, unusable: true, reasons };
  }
  let range: { first: number; count: number } | null = null;
  let source: SandboxIdentity['source'] = 'default';
  if (env.FERRY_SANDBOX_UIDS) {
    range = parseRange(env.FERRY_SANDBOX_UIDS);
    if (range) source = 'FERRY_SANDBOX_UIDS';
    else
      reasons.push(
        `FERRY_SANDBOX_UIDS=${env.FERRY_SANDBOX_UIDS} is not <first>:<count> of unprivileged ids; using the default`,
      );
  }
  if (!range) {
    const line = (await fs.readFile('/etc/subuid', 'utf8').catch(() => ''))
      .split('\n')
      .find((l) => l.startsWith(`${SUBUID_NAME}:`));
    range = line ? parseRange(line.slice(SUBUID_NAME.length + 1)) : null;
    if (range) source = '/etc/subuid';
  }
  range ??= { ...DEFAULT_SANDBOX_UIDS };
  return { identity: { ...range, source, setpriv }, unusable: false, reasons };
}

function parseRange(text: string): { first: number; count: number } | null {
  const match = /^\s*(\d{1,10}):(\d{1,10})\s*$/.exec(text);
  if (!match) return null;
  const first = Number(match[1]);
  const count = Number(match[2]);
  // Never 0 (root) nor 65534 (nobody, shared by daemons), and within 32 bits less the invalid (uid_t)-1.
  if (first < 1000 || count < 1 || first + count > 0xffff_ffff) return null;
  if (first <= 65_534 && 65_534 < first + count) return null;
  return { first, count };
}

const inUse = new Set<number>();

/** A uid of the range that no other sandbox of this process has now. */
export function acquireSandboxUid(identity: SandboxIdentity): number {
  if (inUse.size >= identity.count) throw new Error(`all ${identity.count} sandbox uids are in use`);
  // Random rather than sequential: two servers on one host (a local cluster) rarely pick the same one.
  for (;;) {
    const uid = identity.first + randomInt(identity.count);
    if (!inUse.has(uid)) {
      inUse.add(uid);
      return uid;
    }
  }
}

export function releaseSandboxUid(uid: number | null): void {
  if (uid !== null) inUse.delete(uid);
}

/**
 * `setpriv` with the options that make the rest of the command run as `uid` and nothing more; `groups`:
 * supplementary groups it keeps (a replica's volumes, whose files belong to each volume's group).
 */
export function dropPrivilegesArgs(identity: SandboxIdentity, uid: number, groups: readonly number[] = []): string[] {
  return [
    identity.setpriv,
    `--reuid=${uid}`,
    `--regid=${uid}`,
    groups.length > 0 ? `--groups=${groups.join(',')}` : '--clear-groups',
    '--inh-caps=-all',
    '--bounding-set=-all',
    '--',
  ];
}

/**
 * bwrap, started as a sandbox uid, opens every host path it binds itself: each folder on the way must
 * be searchable by others. Returns the first one that is not (for a clear error), or null.
 */
export async function unreachableByOthers(target: string): Promise<string | null> {
  let dir = path.dirname(path.resolve(target));
  const chain: string[] = [];
  for (;;) {
    chain.unshift(dir);
    const parent = path.dirname(dir);
    if (parent === dir) break;
    dir = parent;
  }
  for (const folder of chain) {
    const stat = await fs.stat(folder).catch(() => null);
    if (!stat) return folder;
    if ((stat.mode & 0o001) === 0) return folder;
  }
  return null;
}
