/**
 * Issue 10, item 2: a network of each sandbox's own. Real server, real sandboxed replicas of each runtime
 * (TypeScript, Python, custom), and an "outside" network namespace this test makes itself (veth pair to
 * the host, a /30 in 10.214.0.0/16) with a TCP echo server, a minimal npm registry and a DNS responder.
 * Ferry runs with FERRY_EGRESS_ALLOW=<that /30> and FERRY_EGRESS_DNS=<the responder>.
 *
 * A function can reach the allowed outside address; it cannot reach the host's loopback services
 * (PostgreSQL on 127.0.0.1:5432), Ferry's own port, any of the host's addresses, or the cloud metadata
 * address; with FERRY_EGRESS=off it reaches nothing. Names resolve through Ferry's resolver, proven by
 * the query arriving at the outside responder. Needs root, bubblewrap, iproute2 and nftables
 * (scripts/setup-system.sh --runtime); CI runs as root.
 */
import assert from 'node:assert/strict';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { deployFiles, http, REPO_ROOT, startServer, type TestServer, tempDir } from '../helpers/ferry.js';
import {
  createOutsideNetwork,
  hostIpv4Addresses,
  type Outcome,
  type OutsideNetwork,
  startHostListener,
  type Target,
} from '../helpers/netns.js';
import { buildWheel } from '../helpers/python-wheel.js';

const FIXTURES = path.join(REPO_ROOT, 'test/fixtures/security');
const TIMEOUT = 240_000;
/**
 * How long a probe waits for a target it should not reach (the probes run at once, so this is about the
 * time one test waits); the assertions are on failure, never on timing. A target that is reachable
 * connects in milliseconds, so even a slow machine shows it as `connected` well within this.
 */
const DENIED_TIMEOUT_MS = 4000;
/** A target the sandbox should reach gets all the time a busy machine may need. */
const ALLOWED_TIMEOUT_MS = 15_000;

/** Whether this process (on the host) can open a TCP connection to `host`:`port`. */
function reachableFromHost(host: string, port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect({ host, port, timeout: 5000 });
    socket.once('connect', () => {
      socket.destroy();
      resolve(true);
    });
    socket.once('timeout', () => {
      socket.destroy();
      resolve(false);
    });
    socket.once('error', () => resolve(false));
  });
}

async function fixtureFiles(name: string): Promise<Record<string, string>> {
  const dir = path.join(FIXTURES, name);
  const files: Record<string, string> = {};
  for (const file of await fs.readdir(dir)) files[file] = await fs.readFile(path.join(dir, file), 'utf8');
  return files;
}

type Auth = { projectId: string; token: string };

/** Asks one app (by runtime) to try `targets`; returns one outcome per target. */
async function probe(
  server: TestServer,
  auth: Auth,
  app: string,
  targets: Target[],
  timeoutMs = DENIED_TIMEOUT_MS,
): Promise<Outcome[]> {
  const body = { targets, timeoutMs };
  const res = await http(`${server.url}/v4/${auth.projectId}/${app}/connect`, {
    method: 'POST',
    token: auth.token,
    body,
  });
  assert.equal(res.status, 200, `${app}: ${res.text}`);
  const outcomes = (app === 'egress-custom' ? res.json : res.json.result) as Outcome[];
  assert.equal(outcomes.length, targets.length);
  return outcomes;
}

async function lookup(server: TestServer, auth: Auth, app: string, name: string) {
  const res =
    app === 'egress-custom'
      ? await http(`${server.url}/v4/${auth.projectId}/${app}/resolve?name=${encodeURIComponent(name)}`, {
          token: auth.token,
        })
      : await http(`${server.url}/v4/${auth.projectId}/${app}/resolve`, {
          method: 'POST',
          token: auth.token,
          body: { name },
        });
  assert.equal(res.status, 200, `${app}: ${res.text}`);
  return (app === 'egress-custom' ? res.json : res.json.result) as { ok: boolean; address?: string; error?: string };
}

const APPS = ['egress-ts', 'egress-py', 'egress-custom'] as const;
const WHEEL = 'egress_pydep-1.0.0-py3-none-any.whl';

describe('sandbox egress', { timeout: TIMEOUT }, () => {
  let outside: OutsideNetwork;
  let outsideLines: string[];
  let integrity: string;
  let server: TestServer;
  let auth: Auth;
  let hostListener: Awaited<ReturnType<typeof startHostListener>>;
  let wheelSource: string | undefined;
  let wheelDir: string | undefined;

  before(async () => {
    hostListener = await startHostListener();
    // A wheel for the outside registry to serve (the Python build installs it from there).
    wheelSource = await tempDir('ferry-egress-wheel-');
    await fs.mkdir(path.join(wheelSource, 'egress_pydep'));
    await fs.writeFile(
      path.join(wheelSource, 'egress_pydep', '__init__.py'),
      "WHERE = 'installed from the outside index'\n",
    );
    wheelDir = await tempDir('ferry-egress-files-');
    await fs.writeFile(path.join(wheelDir, WHEEL), await buildWheel(wheelSource, 'egress_pydep', '1.0.0'));
    outside = await createOutsideNetwork();
    const started = await outside.start([
      process.execPath,
      path.join(FIXTURES, 'outside-server.mjs'),
      outside.address,
      wheelDir,
    ]);
    outsideLines = started.lines;
    integrity = outsideLines.find((line) => line.startsWith('integrity '))!.slice('integrity '.length);
    server = await startServer({
      env: { FERRY_EGRESS_ALLOW: outside.cidr, FERRY_EGRESS_DNS: outside.address },
    });
    assert.ok(server.services.sandbox.bwrap, `bubblewrap is required: ${server.services.sandbox.reasons.join('; ')}`);
    assert.equal(server.services.network.mode, 'veth', server.services.network.describe());
    auth = await server.bootstrap();
    for (const app of APPS) await deployFiles(server, auth, app, await fixtureFiles(app));
  });

  after(async () => {
    await server?.close();
    await outside?.close();
    await hostListener?.close();
    for (const dir of [wheelSource, wheelDir]) if (dir) await fs.rm(dir, { recursive: true, force: true });
  });

  for (const app of APPS) {
    it(`${app}: reaches the allowed outside address, and nothing of the host`, async () => {
      const allowed = await probe(server, auth, app, [{ host: outside.address, port: 7000 }], ALLOWED_TIMEOUT_MS);
      assert.equal(allowed[0]!.ok, true, `the allowed outside address: ${JSON.stringify(allowed)}`);
      assert.equal(allowed[0]!.echoed, 'match');

      const ferryPort = Number(new URL(server.url).port);
      const denied: Target[] = [
        { host: '127.0.0.1', port: 5432 },
        { host: '127.0.0.1', port: ferryPort },
        { host: '169.254.169.254', port: 80 },
      ];
      for (const address of hostIpv4Addresses()) {
        // The control: the listener does answer on this address, from the host. Other servers on this
        // machine (tests running beside this one) add and remove their sandboxes' links all the time: an
        // address that is gone by now is no longer the host's, and is left out, not failed.
        if (!(await reachableFromHost(address, hostListener.port))) {
          assert.ok(!hostIpv4Addresses().includes(address), `host listener on ${address}`);
          continue;
        }
        denied.push(
          { host: address, port: hostListener.port },
          { host: address, port: 5432 },
          { host: address, port: ferryPort },
        );
      }
      const outcomes = await probe(server, auth, app, denied);
      for (const outcome of outcomes) {
        assert.equal(
          outcome.connected,
          false,
          `${app} reached ${outcome.host}:${outcome.port}: ${JSON.stringify(outcome)}`,
        );
      }
    });

    it(`${app}: resolves names through Ferry's resolver`, async () => {
      const name = `${app}-${Date.now()}.egress.test`;
      const found = await lookup(server, auth, app, name);
      assert.deepEqual(found, { ok: true, address: outside.address });
      assert.ok(
        outsideLines.some((line) => line === `dns-query ${name}`),
        `the query reached the outside responder: ${outsideLines.join('\n')}`,
      );
    });
  }

  it("binds the lease's resolv.conf, pointing at the host end of the sandbox's own link", async () => {
    const res = await http(`${server.url}/v4/${auth.projectId}/egress-ts/resolvConf`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    const nameserver = /^nameserver (\S+)$/m.exec(res.json.result)?.[1];
    assert.ok(nameserver?.startsWith('10.213.'), res.json.result);
  });

  it('installs npm dependencies from a registry in the allowed outside network (the deploy path)', async () => {
    // Builds run in the sandbox (and so behind this policy) once issue 10 item 1 lands; until then this
    // proves the deploy path works against the outside registry. The lockfile names the tarball URL.
    const tarball = `http://${outside.address}:8080/egress-dep/-/egress-dep-1.0.0.tgz`;
    const files = {
      'ferry.toml': '[app]\nname = "egress-npm"\n',
      'main.js': "import dep from 'egress-dep';\nexport const run = () => dep;\n",
      'package.json': JSON.stringify({ name: 'egress-npm', version: '1.0.0', dependencies: { 'egress-dep': '1.0.0' } }),
      'package-lock.json': JSON.stringify({
        name: 'egress-npm',
        version: '1.0.0',
        lockfileVersion: 3,
        requires: true,
        packages: {
          '': { name: 'egress-npm', version: '1.0.0', dependencies: { 'egress-dep': '1.0.0' } },
          'node_modules/egress-dep': { version: '1.0.0', resolved: tarball, integrity },
        },
      }),
    };
    await deployFiles(server, auth, 'egress-npm', files);
    const res = await http(`${server.url}/v4/${auth.projectId}/egress-npm/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.result, 'installed from the outside registry');
    assert.ok(outsideLines.some((line) => line.startsWith('http GET /egress-dep/-/egress-dep-1.0.0.tgz')));
  });

  it('installs a pip requirement from the allowed outside network (the deploy path)', async () => {
    // Like the npm case: behind the sandbox's policy once builds run in the sandbox (issue 10 item 1).
    const files = {
      'ferry.toml': '[app]\nname = "egress-pip"\n',
      'main.py': 'import egress_pydep\n\n\ndef run() -> str:\n    return egress_pydep.WHERE\n',
      'requirements.txt': `egress-pydep @ http://${outside.address}:8080/files/${WHEEL}\n`,
    };
    await deployFiles(server, auth, 'egress-pip', files);
    const res = await http(`${server.url}/v4/${auth.projectId}/egress-pip/run`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json.result, 'installed from the outside index');
    assert.ok(outsideLines.some((line) => line.startsWith(`http GET /files/${WHEEL}`)));
  });
});

describe('sandbox egress policy precedence', { timeout: TIMEOUT }, () => {
  let outside: OutsideNetwork;

  before(async () => {
    outside = await createOutsideNetwork();
    await outside.start([process.execPath, path.join(FIXTURES, 'outside-server.mjs'), outside.address]);
  });

  after(async () => {
    await outside?.close();
  });

  /** Starts a server with `env`, deploys the TS probe, and returns whether it reached the outside echo. */
  async function reachesOutside(env: NodeJS.ProcessEnv): Promise<Outcome> {
    const server = await startServer({ env });
    try {
      assert.equal(server.services.network.mode, 'veth', server.services.network.describe());
      const auth = await server.bootstrap();
      await deployFiles(server, auth, 'egress-ts', await fixtureFiles('egress-ts'));
      const [outcome] = await probe(server, auth, 'egress-ts', [{ host: outside.address, port: 7000 }]);
      return outcome!;
    } finally {
      await server.close();
    }
  }

  it('a private address is denied unless FERRY_EGRESS_ALLOW lists it', async () => {
    const outcome = await reachesOutside({});
    assert.equal(outcome.connected, false, JSON.stringify(outcome));
  });

  it('FERRY_EGRESS_DENY wins over FERRY_EGRESS_ALLOW', async () => {
    const outcome = await reachesOutside({
      FERRY_EGRESS_ALLOW: outside.cidr,
      FERRY_EGRESS_DENY: `${outside.address}/32`,
    });
    assert.equal(outcome.connected, false, JSON.stringify(outcome));
  });
});

describe('sandbox egress off', { timeout: TIMEOUT }, () => {
  let outside: OutsideNetwork;
  let server: TestServer;
  let auth: Auth;

  before(async () => {
    outside = await createOutsideNetwork();
    await outside.start([process.execPath, path.join(FIXTURES, 'outside-server.mjs'), outside.address]);
    server = await startServer({ env: { FERRY_EGRESS: 'off', FERRY_EGRESS_ALLOW: outside.cidr } });
    assert.equal(server.services.network.mode, 'none', server.services.network.describe());
    auth = await server.bootstrap();
    await deployFiles(server, auth, 'egress-ts', await fixtureFiles('egress-ts'));
    await deployFiles(server, auth, 'egress-custom', await fixtureFiles('egress-custom'));
  });

  after(async () => {
    await server?.close();
    await outside?.close();
  });

  it('FERRY_EGRESS=off: even the allowed address is unreachable, for functions and custom servers', async () => {
    for (const app of ['egress-ts', 'egress-custom']) {
      const outcomes = await probe(server, auth, app, [
        { host: outside.address, port: 7000 },
        { host: '127.0.0.1', port: 5432 },
      ]);
      for (const outcome of outcomes) {
        assert.equal(
          outcome.connected,
          false,
          `${app} reached ${outcome.host}:${outcome.port}: ${JSON.stringify(outcome)}`,
        );
      }
    }
  });
});
