/**
 * Issue 10, item 2, for a Ferry that does not run as root: a real `ferry serve` child process as an
 * unprivileged user (`ferrytest`, created here when missing), whose sandboxes each get a user and network
 * namespace of their own with egress through slirp4netns and the policy in nftables inside that
 * namespace (src/sandbox/user-network.ts). The outside network is a namespace this test makes (veth pair,
 * a /30 in 10.214.0.0/16, allowed with FERRY_EGRESS_ALLOW; test/helpers/netns.ts).
 *
 * A TypeScript function, a Python function and a custom server each reach the allowed outside address and not the host's loopback services, its other
 * addresses or 169.254.169.254; it cannot flush the rules or take the link down from inside the sandbox;
 * `ferry doctor` and the start-up log, as that user, name the mechanism. Needs root (to create the user
 * and the outside namespace), bubblewrap, unprivileged user namespaces, slirp4netns and nftables
 * (scripts/setup-system.sh --runtime); CI runs as root.
 */
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { pickUpstream, userNftRuleset } from '../../src/sandbox/user-network.js';
import {
  deployFiles,
  FERRY_BIN,
  http,
  REPO_ROOT,
  type RunAs,
  runCli,
  type ServeProcess,
  spawnServe,
} from '../helpers/ferry.js';
import {
  createOutsideNetwork,
  hostIpv4Addresses,
  type Outcome,
  type OutsideNetwork,
  startHostListener,
  type Target,
} from '../helpers/netns.js';

const FIXTURES = path.join(REPO_ROOT, 'test/fixtures/security');
const TIMEOUT = 240_000;
const USER = 'ferrytest';
/** How long a probe waits for a target it should not reach; the assertions are on failure, not timing. */
const DENIED_TIMEOUT_MS = 4000;
const ALLOWED_TIMEOUT_MS = 15_000;

/** The unprivileged user Ferry runs as, created (system user, no login) when this machine has none. */
function ensureUser(): RunAs {
  const lookup = () => spawnSync('id', ['-u', USER], { encoding: 'utf8' });
  if (lookup().status !== 0) {
    const made = spawnSync(
      'useradd',
      ['--system', '--user-group', '--no-create-home', '--shell', '/usr/sbin/nologin', USER],
      {
        encoding: 'utf8',
      },
    );
    assert.equal(made.status, 0, `useradd ${USER}: ${made.stderr}`);
  }
  const uid = Number(lookup().stdout.trim());
  const gid = Number(spawnSync('id', ['-g', USER], { encoding: 'utf8' }).stdout.trim());
  assert.ok(uid > 0 && gid > 0, `${USER} is not root`);
  return { uid, gid };
}

async function fixtureFiles(name: string): Promise<Record<string, string>> {
  const dir = path.join(FIXTURES, name);
  const files: Record<string, string> = {};
  for (const file of await fs.readdir(dir)) files[file] = await fs.readFile(path.join(dir, file), 'utf8');
  return files;
}

type Auth = { projectId: string; token: string };

const APPS = ['egress-ts', 'egress-py', 'egress-custom'] as const;

/** Calls `fn` of a function app, or POSTs to `/fn` of the custom server (which answers with the result). */
async function run(serve: ServeProcess, auth: Auth, app: string, fn: string, body: unknown) {
  const res = await http(`${serve.url}/v4/${auth.projectId}/${app}/${fn}`, { method: 'POST', token: auth.token, body });
  assert.equal(res.status, 200, `${app}/${fn}: ${res.text}`);
  return app === 'egress-custom' ? res.json : res.json.result;
}

async function probe(serve: ServeProcess, auth: Auth, app: string, targets: Target[], timeoutMs = DENIED_TIMEOUT_MS) {
  const outcomes = (await run(serve, auth, app, 'connect', { targets, timeoutMs })) as Outcome[];
  assert.equal(outcomes.length, targets.length);
  return outcomes;
}

describe('sandbox egress when Ferry is not root (slirp4netns)', { timeout: TIMEOUT }, () => {
  let as: RunAs;
  let repoMount: string | undefined;
  let home: string;
  let dataDir: string;
  let outside: OutsideNetwork;
  let outsideLines: string[];
  let hostListener: Awaited<ReturnType<typeof startHostListener>>;
  let serve: ServeProcess;
  let auth: Auth;

  before(async () => {
    as = ensureUser();
    // The checkout must be readable by that user. Where a folder above it is not (a clone under a 0700
    // home), the same checkout is bind-mounted at a path it can reach, for this test only.
    const canRead = (bin: string) =>
      spawnSync(process.execPath, ['-e', `require('fs').readFileSync(${JSON.stringify(bin)})`], {
        uid: as.uid,
        gid: as.gid,
        encoding: 'utf8',
      });
    if (canRead(FERRY_BIN).status !== 0) {
      repoMount = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-rootless-repo-'));
      await fs.chmod(repoMount, 0o755);
      const mounted = spawnSync('mount', ['--bind', REPO_ROOT, repoMount], { encoding: 'utf8' });
      assert.equal(mounted.status, 0, `mount --bind ${REPO_ROOT}: ${mounted.stderr}`);
      as = { ...as, bin: path.join(repoMount, path.relative(REPO_ROOT, FERRY_BIN)) };
    }
    const readable = canRead(as.bin ?? FERRY_BIN);
    assert.equal(readable.status, 0, `${USER} cannot read ${as.bin ?? FERRY_BIN}: ${readable.stderr}`);
    home = await fs.mkdtemp(path.join(os.tmpdir(), 'ferry-rootless-'));
    dataDir = path.join(home, 'data');
    await fs.mkdir(dataDir);
    await fs.chown(home, as.uid, as.gid);
    await fs.chown(dataDir, as.uid, as.gid);
    hostListener = await startHostListener();
    outside = await createOutsideNetwork();
    const started = await outside.start([process.execPath, path.join(FIXTURES, 'outside-server.mjs'), outside.address]);
    outsideLines = started.lines;
    serve = await spawnServe(
      dataDir,
      { HOME: home, FERRY_EGRESS_ALLOW: outside.cidr, FERRY_EGRESS_DNS: outside.address },
      as,
    );
    const boot = await runCli(['admin', 'bootstrap', '--data-dir', dataDir, '--json'], { HOME: home }, 60_000, as);
    assert.equal(boot.code, 0, boot.stderr);
    const out = JSON.parse(boot.stdout) as { project_id: string; token: string };
    auth = { projectId: out.project_id, token: out.token };
    for (const app of APPS) await deployFiles(serve, auth, app, await fixtureFiles(app));
    await deployFiles(serve, auth, 'egress-tamper', await fixtureFiles('egress-tamper'));
  });

  after(async () => {
    await serve?.stop();
    await outside?.close();
    await hostListener?.close();
    if (home) await fs.rm(home, { recursive: true, force: true });
    if (repoMount) {
      spawnSync('umount', [repoMount]);
      await fs.rmdir(repoMount).catch(() => {});
    }
  });

  it('ferry serve runs as the unprivileged user and says the sandboxes use the user network', () => {
    const pid = serve.child.pid!;
    const status = spawnSync('ps', ['-o', 'uid=', '-p', String(pid)], { encoding: 'utf8' }).stdout.trim();
    assert.equal(Number(status), as.uid, 'the server process runs as the unprivileged user');
    assert.match(serve.output(), /Sandbox network: user: each sandbox has its own user and network namespace/);
  });

  it('ferry doctor, as that user, reports the mechanism', async () => {
    const res = await runCli(['doctor'], { HOME: home }, 60_000, as);
    assert.equal(res.code, 0, `${res.stdout}\n${res.stderr}`);
    assert.match(
      res.stdout,
      /Network\s+user: each sandbox has its own user and network namespace with egress through slirp4netns/,
    );
    const json = await runCli(['doctor', '--json'], { HOME: home }, 60_000, as);
    assert.equal(JSON.parse(json.stdout).network.mode, 'user', json.stdout);
  });

  for (const app of APPS) {
    it(`${app}: reaches the allowed outside address, and nothing of the host`, async () => {
      const allowed = await probe(serve, auth, app, [{ host: outside.address, port: 7000 }], ALLOWED_TIMEOUT_MS);
      assert.equal(allowed[0]!.ok, true, `the allowed outside address: ${JSON.stringify(allowed)}`);
      assert.equal(allowed[0]!.echoed, 'match');

      const ferryPort = Number(new URL(serve.url).port);
      const denied: Target[] = [
        { host: '127.0.0.1', port: 5432 },
        { host: '127.0.0.1', port: ferryPort },
        { host: '169.254.169.254', port: 80 },
        // slirp4netns's gateway is the host itself.
        { host: '10.0.2.2', port: 5432 },
        { host: '10.0.2.2', port: hostListener.port },
      ];
      for (const address of hostIpv4Addresses()) {
        denied.push(
          { host: address, port: hostListener.port },
          { host: address, port: 5432 },
          { host: address, port: ferryPort },
        );
      }
      for (const outcome of await probe(serve, auth, app, denied)) {
        assert.equal(
          outcome.connected,
          false,
          `${app} reached ${outcome.host}:${outcome.port}: ${JSON.stringify(outcome)}`,
        );
      }
    });
  }

  it("resolves names through the host's nameserver (FERRY_EGRESS_DNS), via slirp4netns's DNS address", async () => {
    const conf = (await run(serve, auth, 'egress-ts', 'resolvConf', {})) as string;
    assert.match(conf, /^nameserver 10\.0\.2\.3$/m, conf);
    const name = `rootless-${Date.now()}.egress.test`;
    const found = await run(serve, auth, 'egress-ts', 'resolve', { name });
    assert.deepEqual(found, { ok: true, address: outside.address });
    assert.ok(
      outsideLines.some((line) => line === `dns-query ${name}`),
      `the query reached the outside responder: ${outsideLines.join('\n')}`,
    );
  });

  it('the sandbox cannot flush the rules or take its link down; the policy still holds after trying', async () => {
    const targets: Target[] = [
      { host: outside.address, port: 7000 },
      { host: '127.0.0.1', port: 5432 },
      ...hostIpv4Addresses().map((host) => ({ host, port: hostListener.port })),
    ];
    const result = (await run(serve, auth, 'egress-tamper', 'tamper', { targets })) as {
      attempts: Array<{ name: string; status: number | null; output: string }>;
      after: Array<Target & { connected: boolean; error?: string }>;
    };
    assert.equal(result.attempts.length, 4);
    for (const attempt of result.attempts) {
      assert.notEqual(attempt.status, 0, `${attempt.name} succeeded inside the sandbox: ${attempt.output}`);
      assert.match(attempt.output, /Operation not permitted/, `${attempt.name}: ${attempt.output}`);
    }
    // From the same namespace, after the attempts: the link is up and the rules are all there.
    const [allowed, ...denied] = result.after;
    assert.equal(allowed!.connected, true, `the allowed outside address after tampering: ${JSON.stringify(allowed)}`);
    for (const outcome of denied) assert.equal(outcome.connected, false, JSON.stringify(outcome));
  });
});

describe('user network rules', () => {
  it("sends DNS to the first IPv4 nameserver off loopback, else leaves it to slirp4netns's forwarder", () => {
    assert.deepEqual(
      pickUpstream([
        { host: '127.0.0.53', port: 53 },
        { host: '2001:db8::53', port: 53 },
        { host: '192.0.2.53', port: 5353 },
      ]),
      { host: '192.0.2.53', port: 5353 },
    );
    assert.equal(pickUpstream([{ host: '127.0.0.53', port: 53 }]), null);
    const policy = { allow: { v4: ['10.214.0.0/30'], v6: [] }, deny: { v4: ['10.214.0.2/32'], v6: [] } };
    const withUpstream = userNftRuleset(policy, ['192.0.2.2/32'], { host: '192.0.2.53', port: 5353 });
    assert.match(withUpstream, /ip daddr 10\.0\.2\.3 udp dport 53 dnat ip to 192\.0\.2\.53:5353/);
    assert.doesNotMatch(withUpstream, /ip daddr 10\.0\.2\.3 udp dport 53 accept/);
    const own = userNftRuleset(policy, ['192.0.2.2/32'], null);
    assert.doesNotMatch(own, /dnat/);
    // Order matters (first match wins): deny, then the host's addresses, then allow, then the deny-list.
    const order = ['@deny jump refuse', '@host jump refuse', '@allow accept', '@blocked jump refuse'].map((rule) =>
      own.indexOf(`ip daddr ${rule}`),
    );
    assert.ok(
      order.every((at, i) => at > 0 && (i === 0 || at > order[i - 1]!)),
      own,
    );
  });
});
