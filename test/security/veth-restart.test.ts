/**
 * A server restarted on its data directory after SIGKILL, while another server on the same host starts:
 * the other server's sweep of dead servers (src/sandbox/veth-network.ts, found by the owner file under
 * /run/ferry-egress/<tag>) must never take what the restarted server has just set up. Before the sweep
 * and a server's claim of its tag were serialized, the other server could read the killed server's owner,
 * then delete the restarted server's new resolv.conf folder, nftables table (its sandboxes' egress rules)
 * and namespaces: the full suite of 2026-11-27 ended accepted runs in FERRY_INTERNAL that way
 * (test/durability, "ENOENT ... /run/ferry-egress/<tag>/<slot>.conf").
 *
 * Each round: a network on directory A whose owner file then names a dead process (as a killed server
 * leaves it), then, at the same moment, a new network on A (the restart) and one on B (the other server).
 * The restarted one must keep its folder, its owner, its table, and give a lease.
 *
 * Needs root, iproute2, nftables and util-linux (scripts/setup-system.sh --runtime); CI runs as root.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, describe, it } from 'node:test';
import { pino } from 'pino';
import { createDnsForwarder } from '../../src/sandbox/dns-forwarder.js';
import { DEFAULT_EGRESS_POOL, parseEgressPolicy } from '../../src/sandbox/egress-policy.js';
import type { SandboxNetwork } from '../../src/sandbox/network.js';
import { createVethNetwork, findVethTools } from '../../src/sandbox/veth-network.js';
import { tempDir } from '../helpers/ferry.js';

const ROUNDS = 12;

function tagOf(dataDir: string): string {
  return createHash('sha256').update(path.resolve(dataDir)).digest('hex').slice(0, 8);
}

function tableExists(tag: string): boolean {
  return spawnSync('nft', ['list', 'table', 'inet', `ferry_${tag}`], { encoding: 'utf8' }).status === 0;
}

/** The identity (`<pid> <start time>`) of a process that has exited: what a killed server's owner file says. */
function deadIdentity(): string {
  const child = spawnSync('sh', ['-c', 'echo $$; cut -d" " -f22 /proc/$$/stat'], { encoding: 'utf8' });
  const [pid, start] = child.stdout.trim().split('\n');
  return `${pid} ${start}`;
}

describe('a server restarted after SIGKILL while another starts', { timeout: 300_000 }, () => {
  const open = new Set<SandboxNetwork>();
  /** The "killed" ones: closed last, once nothing of theirs on the host is left to remove, so that this
   * process ends (their DNS listeners and spare namespaces' timers keep it alive). */
  const killed: SandboxNetwork[] = [];
  let root = '';

  after(async () => {
    for (const network of open) await network.close().catch(() => {});
    for (const network of killed) await network.close().catch(() => {});
    if (root) await fs.rm(root, { recursive: true, force: true });
  });

  it('keeps its resolv.conf folder, its nftables table and its leases', { timeout: 240_000 }, async () => {
    const found = findVethTools();
    assert.ok('tools' in found, `the veth network is required: ${'reasons' in found ? found.reasons.join('; ') : ''}`);
    root = await tempDir('ferry-veth-restart-');
    const make = async (name: string) => {
      const dataDir = path.join(root, name);
      await fs.mkdir(dataDir, { recursive: true });
      const network = await createVethNetwork({
        tools: found.tools,
        policy: parseEgressPolicy('', ''),
        pool: DEFAULT_EGRESS_POOL,
        dataDir,
        runDir: path.join(dataDir, 'run'),
        dns: createDnsForwarder([]),
        logger: pino({ level: 'silent' }),
      });
      open.add(network);
      return network;
    };
    const tagA = tagOf(path.join(root, 'a'));
    const ownerA = path.join('/run/ferry-egress', tagA, 'owner');
    const mine = (await fs.readFile(`/proc/${process.pid}/stat`, 'utf8')).split(') ')[1]!.split(' ')[19];
    for (let round = 0; round < ROUNDS; round++) {
      // A server on A, killed: its owner file names a process that is gone, and nothing is closed.
      const dead = await make('a');
      open.delete(dead);
      killed.push(dead);
      await fs.writeFile(ownerA, deadIdentity());
      // Its restart and another server start together.
      const [restarted, other] = await Promise.all([make('a'), make(`b${round}`)]);
      const owner = await fs.readFile(ownerA, 'utf8').catch((err: Error) => `none: ${err.message}`);
      assert.equal(owner, `${process.pid} ${mine}`, `round ${round}: the restarted server's owner file`);
      assert.ok(tableExists(tagA), `round ${round}: the restarted server's nftables table`);
      const lease = await restarted.acquire(`round-${round}`);
      assert.ok(lease.resolvConf, `round ${round}: a lease with a resolv.conf`);
      await fs.access(lease.resolvConf);
      await lease.release();
      await other.close();
      open.delete(other);
      await restarted.close();
      open.delete(restarted);
    }
  });
});
