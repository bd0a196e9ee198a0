/**
 * The sandbox network's settings and lifecycle (docs/operations.md, "The sandbox network"): CIDR lists are
 * validated at start with the setting's name, `ferry serve` says what sandboxes get (loudly when it is
 * less or more than their own network), `ferry doctor` reports it, and a server removes its nftables
 * table and namespaces when it stops. Needs root, iproute2 and nftables (CI runs as root).
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { describe, it } from 'node:test';
import { resolveServerConfig } from '../../src/config.js';
import { normalizeCidr } from '../../src/sandbox/egress-policy.js';
import { runCli, spawnServe, startServer, tempDir } from '../helpers/ferry.js';
import { hostIpv4Addresses } from '../helpers/netns.js';

const TIMEOUT = 120_000;

function nftTables(): string {
  return spawnSync('nft', ['list', 'tables'], { encoding: 'utf8' }).stdout ?? '';
}

async function namespacesOf(tag: string): Promise<string[]> {
  return (await fs.readdir('/run/netns').catch(() => [] as string[])).filter((name) =>
    name.startsWith(`ferry-${tag}-`),
  );
}

describe('egress settings', () => {
  it('normalizes CIDRs and refuses malformed ones naming the setting', () => {
    assert.equal(normalizeCidr('10.1.2.3/8', 'X'), '10.0.0.0/8');
    assert.equal(normalizeCidr('203.0.113.7', 'X'), '203.0.113.7/32');
    assert.equal(normalizeCidr('2001:db8::1/32', 'X'), '2001:db8::/32');
    for (const [env, pattern] of [
      [{ FERRY_EGRESS_ALLOW: '10.0.0.0/33' }, /FERRY_EGRESS_ALLOW.*"10\.0\.0\.0\/33"/],
      [{ FERRY_EGRESS_ALLOW: '10.0.0.0/8,example.com' }, /FERRY_EGRESS_ALLOW.*"example\.com"/],
      [{ FERRY_EGRESS_DENY: '1.2.3.4/x' }, /FERRY_EGRESS_DENY.*"1\.2\.3\.4\/x"/],
      [{ FERRY_EGRESS: 'maybe' }, /FERRY_EGRESS must be "on" or "off"/],
      [{ FERRY_EGRESS_POOL: '10.213.0.0/31' }, /FERRY_EGRESS_POOL/],
      [{ FERRY_EGRESS_POOL: 'fd00::/64' }, /FERRY_EGRESS_POOL/],
      [{ FERRY_EGRESS_DNS: 'resolver.local' }, /FERRY_EGRESS_DNS.*"resolver\.local"/],
    ] as const) {
      assert.throws(() => resolveServerConfig({}, env), pattern, JSON.stringify(env));
    }
    const config = resolveServerConfig(
      { egressAllow: '192.168.1.0/24' },
      { FERRY_EGRESS_ALLOW: '10.0.0.0/8', FERRY_EGRESS_DENY: '192.168.1.7', FERRY_EGRESS_DNS: '192.0.2.53:5353' },
    );
    assert.deepEqual(config.egress.policy.allow.v4, ['192.168.1.0/24'], 'the flag wins over the variable');
    assert.deepEqual(config.egress.policy.deny.v4, ['192.168.1.7/32']);
    assert.deepEqual(config.egress.nameservers, [{ host: '192.0.2.53', port: 5353 }]);
    assert.equal(config.egress.enabled, true);
  });

  it('ferry serve refuses a bad --egress-deny with exit code 2 and the entry', { timeout: TIMEOUT }, async () => {
    const dataDir = await tempDir();
    const res = await runCli(['serve', '--port', '0', '--data-dir', dataDir, '--egress-deny', 'nope']);
    assert.equal(res.code, 2, res.stderr);
    assert.match(res.stderr, /FERRY_EGRESS_DENY \(--egress-deny\): "nope" is not a CIDR range/);
  });

  it('ferry doctor reports the mechanism and the policy', { timeout: TIMEOUT }, async () => {
    const res = await runCli(['doctor', '--json'], { FERRY_EGRESS_ALLOW: '10.20.0.0/16' });
    assert.equal(res.code, 0, res.stderr);
    const report = JSON.parse(res.stdout);
    assert.equal(report.network.mode, 'veth', report.network.description);
    assert.match(report.network.description, /10\.20\.0\.0\/16/);
    const off = JSON.parse((await runCli(['doctor', '--json'], { FERRY_EGRESS: 'off' })).stdout);
    assert.equal(off.network.mode, 'none');
    const text = await runCli(['doctor'], { FERRY_SANDBOX: 'off' });
    assert.match(text.stdout, /Network +host: NO SANDBOX/);
    assert.match(text.stdout, /NO SANDBOX NETWORK/);
  });

  it('ferry serve says what sandboxes get, and removes its rules and namespaces when it stops', {
    timeout: TIMEOUT,
  }, async () => {
    const dataDir = await tempDir();
    const tag = createHash('sha256').update(path.resolve(dataDir)).digest('hex').slice(0, 8);
    const serve = await spawnServe(dataDir, { FERRY_EGRESS_ALLOW: '10.20.0.0/16' });
    try {
      assert.match(serve.output(), /Sandbox network: veth: .*extra allow: 10\.20\.0\.0\/16/);
      assert.match(nftTables(), new RegExp(`table inet ferry_${tag}\\b`));
      // The spare namespaces set up ahead of cold starts.
      const deadline = Date.now() + 30_000;
      while ((await namespacesOf(tag)).length === 0 && Date.now() < deadline) {
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      assert.ok((await namespacesOf(tag)).length > 0, 'spare namespaces exist while the server runs');
    } finally {
      assert.equal(await serve.stop('SIGTERM'), 0, serve.output());
    }
    assert.doesNotMatch(nftTables(), new RegExp(`ferry_${tag}\\b`));
    assert.deepEqual(await namespacesOf(tag), []);
    await assert.rejects(fs.stat(`/run/ferry-egress/${tag}`), { code: 'ENOENT' });
  });

  it('a server killed hard leaves rules and namespaces that the next server to start removes', {
    timeout: TIMEOUT,
  }, async () => {
    const dataDir = await tempDir();
    const tag = createHash('sha256').update(path.resolve(dataDir)).digest('hex').slice(0, 8);
    const serve = await spawnServe(dataDir);
    const deadline = Date.now() + 30_000;
    while ((await namespacesOf(tag)).length === 0 && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    await serve.stop('SIGKILL');
    assert.ok((await namespacesOf(tag)).length > 0, 'the killed server could not clean up');
    assert.match(nftTables(), new RegExp(`ferry_${tag}\\b`));
    const next = await startServer();
    try {
      assert.deepEqual(await namespacesOf(tag), []);
      assert.doesNotMatch(nftTables(), new RegExp(`ferry_${tag}\\b`));
      await assert.rejects(fs.stat(`/run/ferry-egress/${tag}`), { code: 'ENOENT' });
    } finally {
      await next.close();
    }
  });

  it("leaves alone the folder of a server still writing its owner file (an empty owner is not a dead server's)", {
    timeout: TIMEOUT,
  }, async () => {
    // What another server starting at the same moment shows: its folder made, its owner file not yet
    // written whole. Taking that for a dead server removed a live server's files mid-build.
    const tag = createHash('sha256').update(`pending-${process.pid}-${Date.now()}`).digest('hex').slice(0, 8);
    const folder = `/run/ferry-egress/${tag}`;
    await fs.mkdir(folder, { recursive: true });
    await fs.writeFile(path.join(folder, 'owner'), '');
    await fs.writeFile(path.join(folder, '7.conf'), 'nameserver 10.0.0.1\n');
    try {
      const server = await startServer();
      await server.close();
      assert.deepEqual((await fs.readdir(folder)).sort(), ['7.conf', 'owner']);
    } finally {
      await fs.rm(folder, { recursive: true, force: true });
    }
  });

  it("falls back to loopback only when the pool holds one of the host's addresses", { timeout: TIMEOUT }, async () => {
    const address = hostIpv4Addresses().find((a) => !a.startsWith('127.') && !a.startsWith('10.21'));
    assert.ok(address, 'the host has a non-loopback address');
    const server = await startServer({ env: { FERRY_EGRESS_POOL: `${address}/30` } });
    try {
      assert.equal(server.services.network.mode, 'none');
    } finally {
      await server.close();
    }
  });

  it('ferry serve warns loudly when sandboxes would share the host network', { timeout: TIMEOUT }, async () => {
    const serve = await spawnServe(await tempDir(), { FERRY_SANDBOX: 'off' });
    try {
      assert.match(serve.output(), /NO SANDBOX NETWORK: without bubblewrap, replicas share the host's network/);
    } finally {
      await serve.stop('SIGTERM');
    }
    const off = await spawnServe(await tempDir(), { FERRY_EGRESS: 'off' });
    try {
      assert.match(off.output(), /Sandbox network: none: FERRY_EGRESS=off/);
    } finally {
      await off.stop('SIGTERM');
    }
  });
});
