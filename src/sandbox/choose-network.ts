/**
 * Chooses the sandbox network once, at start (services.ts): `veth` when Ferry can build one (root, ip,
 * nft, nsenter, egress on), `user` when Ferry is not root but has slirp4netns, unshare, nsenter and nft,
 * else loopback only, else (no bubblewrap) the host's own network. What it
 * chose and why is said loudly: a sandbox without egress breaks apps, one on the host's network is open
 * to the host's services.
 */
import path from 'node:path';
import type { Logger } from 'pino';
import type { EgressConfig } from '../config.js';
import { createDnsForwarder } from './dns-forwarder.js';
import { describePolicy } from './egress-policy.js';
import type { SandboxCapabilities } from './launch.js';
import {
  createHostNetwork,
  createLoopbackOnlyNetwork,
  type SandboxNetwork,
  type SandboxNetworkMode,
} from './network.js';
import { createUserNetwork, findUserNetTools, type UserNetTools } from './user-network.js';
import { createVethNetwork, findVethTools, type VethTools } from './veth-network.js';

export interface NetworkPlan {
  mode: SandboxNetworkMode;
  /** One line: the mechanism and the policy (for `ferry doctor` and the start-up log). */
  description: string;
  /** Set when sandboxes get less (or more) than the veth network, and why: to be logged at warn level. */
  warning: string | null;
  tools: VethTools | null;
  /** Set for `user`: the tools of the non-root mechanism. */
  userTools?: UserNetTools;
}

/** What `createSandboxNetwork` would choose on this machine, without changing anything. */
export function planSandboxNetwork(egress: EgressConfig, caps: SandboxCapabilities): NetworkPlan {
  if (!caps.bwrap) {
    return {
      mode: 'host',
      description: createHostNetwork().describe(),
      warning:
        "NO SANDBOX NETWORK: without bubblewrap, replicas share the host's network and reach every service on it (databases on 127.0.0.1, cloud metadata, the private network).",
      tools: null,
    };
  }
  if (!egress.enabled) {
    return {
      mode: 'none',
      description: 'none: FERRY_EGRESS=off, sandboxes have loopback only',
      warning: null,
      tools: null,
    };
  }
  const found = findVethTools();
  const isRoot = typeof process.getuid === 'function' && process.getuid() === 0;
  if ('reasons' in found && !isRoot) {
    const user = findUserNetTools();
    if ('tools' in user) {
      return {
        mode: 'user',
        description: `user: each sandbox has its own user and network namespace with egress through slirp4netns (Ferry is not root); ${describePolicy(egress.policy)}`,
        warning: null,
        tools: null,
        userTools: user.tools,
      };
    }
    found.reasons.push(...user.reasons);
  }
  if ('reasons' in found) {
    return {
      mode: 'none',
      description: 'none: sandboxes have loopback only (no egress)',
      warning: `NO EGRESS: sandboxes have loopback only (no internet, no DNS) because ${found.reasons.join('; ')}. Run Ferry as root with iproute2 and nftables, or as any user with slirp4netns (scripts/setup-system.sh --runtime), for a network of each sandbox's own, or set FERRY_EGRESS=off to say this is intended.`,
      tools: null,
    };
  }
  return {
    mode: 'veth',
    description: `veth: each sandbox has its own network namespace with egress through the host (pool ${egress.pool}); ${describePolicy(egress.policy)}`,
    warning:
      egress.nameservers.length === 0
        ? 'No nameserver in /etc/resolv.conf (or FERRY_EGRESS_DNS): names do not resolve inside sandboxes.'
        : null,
    tools: found.tools,
  };
}

export interface CreateNetworkOptions {
  egress: EgressConfig;
  sandbox: SandboxCapabilities;
  dataDir: string;
  runDir: string;
  logger: Logger;
}

/** Chooses and builds the provider, and logs what sandboxes get. */
export async function createSandboxNetwork(options: CreateNetworkOptions): Promise<SandboxNetwork> {
  const { egress, logger } = options;
  const plan = planSandboxNetwork(egress, options.sandbox);
  let network: SandboxNetwork;
  if (plan.mode === 'host') network = createHostNetwork();
  else if (plan.mode === 'user' && plan.userTools) {
    const tools = plan.userTools;
    network = await orLoopbackOnly(logger, () =>
      createUserNetwork({
        tools,
        policy: egress.policy,
        nameservers: egress.nameservers,
        runDir: path.join(options.runDir, 'network'),
        logger,
      }),
    );
  } else if (plan.mode === 'none' || !plan.tools) network = createLoopbackOnlyNetwork();
  else {
    const tools = plan.tools;
    network = await orLoopbackOnly(logger, () =>
      createVethNetwork({
        tools,
        policy: egress.policy,
        pool: egress.pool,
        dataDir: options.dataDir,
        runDir: path.join(options.runDir, 'network'),
        dns: createDnsForwarder(egress.nameservers),
        logger,
      }),
    );
  }
  if (plan.warning) logger.warn(plan.warning);
  // The plan says why (FERRY_EGRESS=off, no bwrap); the veth provider knows its table and nameservers.
  const description =
    network.mode !== 'veth' && network.mode !== 'user' && network.mode === plan.mode
      ? plan.description
      : network.describe();
  logger.info({ network: network.mode }, `Sandbox network: ${description}`);
  return network;
}

/** A provider that could not be set up leaves sandboxes loopback only, said loudly, rather than failing the start. */
async function orLoopbackOnly(logger: Logger, create: () => Promise<SandboxNetwork>): Promise<SandboxNetwork> {
  try {
    return await create();
  } catch (err) {
    logger.warn(
      { err },
      `NO EGRESS: sandboxes have loopback only (no internet, no DNS): setting up their network failed: ${(err as Error).message}`,
    );
    return createLoopbackOnlyNetwork();
  }
}
