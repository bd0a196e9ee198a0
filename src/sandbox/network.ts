/**
 * A network of each sandbox's own (issue 10, item 2): the contract between the sandbox launcher
 * (sandbox/launch.ts, builds) and whatever gives a sandbox its network.
 *
 * Every sandbox (a replica of either runtime, every build step) gets its own network namespace. The
 * provider decides what is in it:
 *   - `veth`: a network namespace made by Ferry (root), with loopback and one veth pair to the host,
 *     egress NATed through the host under a policy enforced by nftables outside the sandbox, and a DNS
 *     resolver the sandbox can reach;
 *   - `user`: the same for a Ferry that is not root: a user and network namespace per sandbox, egress
 *     through slirp4netns, the policy in nftables inside that namespace (user-network.ts);
 *   - `none`: loopback only (FERRY_EGRESS=off, or no way to give egress on this machine);
 *   - `host`: no sandbox at all (bwrap missing); the process shares the host's network. Ferry says so loudly.
 *
 * The launcher asks for a lease per sandbox and releases it when the sandbox has exited.
 */

export type SandboxNetworkMode = 'veth' | 'user' | 'none' | 'host';

export interface SandboxNetworkLease {
  /**
   * A network namespace to join before starting bwrap (`nsenter --net=<path>`; bwrap then runs with
   * `--share-net`), or null for a fresh namespace with loopback only (bwrap `--unshare-net`).
   */
  readonly netnsPath: string | null;
  /**
   * The user namespace that owns `netnsPath`, to join with it (`nsenter --user --preserve-credentials`)
   * when Ferry is not root and so has no capability over the network namespace otherwise; null for root.
   */
  readonly usernsPath?: string | null;
  /** A host file to bind read-only at /etc/resolv.conf inside the sandbox, or null to leave /etc's own. */
  readonly resolvConf: string | null;
  /** Gives the namespace (and its addresses) back. Call once the sandbox has exited; safe to call twice. */
  release(): Promise<void>;
}

export interface SandboxNetwork {
  readonly mode: SandboxNetworkMode;
  /** One line for `ferry doctor` and the start-up log: the mechanism and the policy in force. */
  describe(): string;
  /** A network for one sandbox; `id` names it (letters, digits, `-`, `_`). */
  acquire(id: string): Promise<SandboxNetworkLease>;
  /** Removes everything the provider made on the host (namespaces, links, nftables table). */
  close(): Promise<void>;
}

/** Loopback only: every sandbox gets a fresh, empty network namespace from bwrap itself. */
export function createLoopbackOnlyNetwork(): SandboxNetwork {
  const lease: SandboxNetworkLease = { netnsPath: null, resolvConf: null, release: async () => {} };
  return {
    mode: 'none',
    describe: () => 'none: sandboxes have loopback only (no egress)',
    acquire: async () => lease,
    close: async () => {},
  };
}

/** No sandbox at all (bwrap missing or off): replicas are plain processes on the host's network. */
export function createHostNetwork(): SandboxNetwork {
  const lease: SandboxNetworkLease = { netnsPath: null, resolvConf: null, release: async () => {} };
  return {
    mode: 'host',
    describe: () => "host: NO SANDBOX, replicas share the host's network (they reach everything the server reaches)",
    acquire: async () => lease,
    close: async () => {},
  };
}

/**
 * nsenter's arguments (before the command) that join a lease's namespaces. bwrap then makes its own
 * user namespace inside with every capability dropped, so the sandbox holds none over the joined ones.
 */
export function joinNetworkArgs(lease: Pick<SandboxNetworkLease, 'netnsPath' | 'usernsPath'>): string[] {
  if (!lease.netnsPath) return [];
  return [
    ...(lease.usernsPath ? [`--user=${lease.usernsPath}`, '--preserve-credentials'] : []),
    `--net=${lease.netnsPath}`,
    '--',
  ];
}
