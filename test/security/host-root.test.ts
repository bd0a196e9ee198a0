/**
 * Issue 30, point 1: no sandbox runs as, or maps to, host uid 0, and none can write host-wide kernel
 * settings or read host-root-only parts of /proc, even when Ferry runs as root (CI does). The attack, as
 * it was reproduced: a function wrote `kernel.printk_ratelimit` under /proc/sys and the host's value
 * changed, because bubblewrap started by root mapped the sandbox's uid 65534 to host uid 0.
 *
 * Every probe writes a harmless setting: `kernel.printk_ratelimit`, with its own current value. Each
 * runtime is tried through the real server (TypeScript, Python, a custom server, and a build step, where
 * npm runs an app's `git`), and the host side checks the uid of every process of the sandbox. The first
 * suite also runs the same probe in a sandbox made the old way (bwrap started by root with the old
 * arguments) and sees it succeed: the probe detects the attack when the defence is off.
 */
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import {
  baseBwrapArgs,
  PROC_MASKED,
  prepareLaunch,
  probeSandbox,
  type SandboxCapabilities,
} from '../../src/sandbox/launch.js';
import { zipFiles } from '../helpers/app-zip.js';
import { http, startServer, type TestServer, tempDir, waitFor } from '../helpers/ferry.js';

const TIMEOUT = 120_000;
const SETTING = '/proc/sys/kernel/printk_ratelimit';
const isRoot = process.getuid?.() === 0;
/**
 * Names of the host's private files that must not show in a sandbox's mountinfo either: as root, a
 * sandbox's own uid cannot read them anyway, so they are not masked one by one (which listed them).
 */
const hostFiles = isRoot ? [' /etc/shadow '] : [];

/** The probe, in sh: one `FERRY-PROBE key=value` line per finding. Ends by sleeping if asked. */
const PROBE_SH = `
v=$(cat ${SETTING})
if (echo "$v" > ${SETTING}) 2>/dev/null; then echo "FERRY-PROBE write=ok"; else echo "FERRY-PROBE write=denied"; fi
for f in ${PROC_MASKED.join(' ')}; do
  if [ -e "$f" ] && head -c 1 "$f" >/dev/null 2>&1; then echo "FERRY-PROBE readable=$f"; fi
done
echo "FERRY-PROBE mountinfo=$(tr '\\n' '|' < /proc/self/mountinfo)"
`;

interface Findings {
  write: string;
  readable: string[];
  mountinfo: string;
}

function parseFindings(text: string): Findings {
  const findings: Findings = { write: 'missing', readable: [], mountinfo: '' };
  for (const match of text.matchAll(/FERRY-PROBE (\w+)=([^\n]*)/g)) {
    const [, key, value] = match;
    if (key === 'write') findings.write = value!;
    else if (key === 'readable') findings.readable.push(value!);
    else if (key === 'mountinfo') findings.mountinfo = value!;
  }
  return findings;
}

/** The uid (host view) and the user namespace's outside uid of every process whose argv has `marker`. */
async function hostIdentities(marker: string): Promise<Array<{ pid: number; uid: number; mapsTo: number | null }>> {
  const found: Array<{ pid: number; uid: number; mapsTo: number | null }> = [];
  for (const name of await fs.readdir('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    const cmdline = await fs.readFile(`/proc/${name}/cmdline`, 'utf8').catch(() => '');
    if (!cmdline.includes(marker) || !(await descendsFromUs(Number(name)))) continue;
    const status = await fs.readFile(`/proc/${name}/status`, 'utf8').catch(() => '');
    const uidLine = /^Uid:\s+(\d+)/m.exec(status);
    if (!uidLine) continue;
    const map = (await fs.readFile(`/proc/${name}/uid_map`, 'utf8').catch(() => '')).trim().split(/\s+/);
    // The init namespace's own map is `0 0 4294967295`; a sandbox's is `65534 <host uid> 1`.
    const mapsTo = map[0] === '65534' ? Number(map[1]) : null;
    found.push({ pid: Number(name), uid: Number(uidLine[1]), mapsTo });
  }
  return found;
}

/** Whether `pid` is a descendant of this test process (other servers on the machine are not ours). */
async function descendsFromUs(pid: number): Promise<boolean> {
  for (let current = pid, hops = 0; current > 1 && hops < 64; hops++) {
    const stat = await fs.readFile(`/proc/${current}/stat`, 'utf8').catch(() => '');
    const parent = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
    if (!Number.isInteger(parent)) return false;
    if (parent === process.pid) return true;
    current = parent;
  }
  return false;
}

function assertUnprivileged(ids: Array<{ pid: number; uid: number; mapsTo: number | null }>, what: string) {
  assert.ok(ids.length > 0, `no process of ${what} was found on the host`);
  for (const id of ids) {
    assert.notEqual(id.uid, 0, `${what}: process ${id.pid} runs as host root`);
    if (id.mapsTo !== null) assert.notEqual(id.mapsTo, 0, `${what}: process ${id.pid}'s uid 65534 maps to host root`);
  }
  assert.ok(
    ids.some((id) => id.mapsTo !== null),
    `${what}: no process in a user namespace mapping 65534 (found ${JSON.stringify(ids)})`,
  );
}

function assertContained(findings: Findings, what: string, hostPaths: string[]) {
  assert.equal(findings.write, 'denied', `${what} wrote ${SETTING}`);
  assert.deepEqual(findings.readable, [], `${what} read host-wide /proc entries`);
  assert.ok(findings.mountinfo.length > 0, `${what}: no mountinfo came back`);
  for (const hostPath of hostPaths) {
    assert.ok(!findings.mountinfo.includes(hostPath), `${what}'s mountinfo names ${hostPath}: ${findings.mountinfo}`);
  }
}

/** Runs sh with the probe as `argv` under `file`, collecting stdout; resolves when it exits. */
function collect(child: ReturnType<typeof spawn>): Promise<string> {
  return new Promise((resolve, reject) => {
    let out = '';
    child.stdout?.setEncoding('utf8').on('data', (chunk: string) => {
      out += chunk;
    });
    child.stderr?.resume();
    child.once('error', reject);
    child.once('close', () => resolve(out));
  });
}

describe('the sandbox never maps to host root (issue 30, 1)', () => {
  let caps: SandboxCapabilities;
  let work: string;

  before(async () => {
    caps = await probeSandbox();
    assert.ok(caps.bwrap, `bubblewrap is needed: ${caps.reasons.join('; ')}`);
    work = await tempDir('ferry-host-root-');
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  it('as root, sandboxes take an unprivileged uid of their own range', () => {
    if (isRoot) {
      assert.ok(caps.identity, `Ferry is root: sandboxes need an identity (${caps.reasons.join('; ')})`);
      assert.ok(caps.identity.first > 65_534, 'the range is above the system and nobody ids');
    } else {
      assert.equal(caps.identity, null, 'not root: sandboxes map to the server’s own, unprivileged, uid');
    }
  });

  it('a launched sandbox cannot write /proc/sys nor read host-wide /proc, and maps to a non-root uid', {
    timeout: TIMEOUT,
  }, async () => {
    const buildDir = path.join(work, 'data', 'builds', 'probe');
    await fs.mkdir(buildDir, { recursive: true });
    const prepared = await prepareLaunch(
      {
        replicaId: `host-root-${process.pid}`,
        buildDir,
        socketDir: path.join(work, 'sock'),
        runtimeFiles: [],
        command: ['/bin/sh', '-c', `${PROBE_SH}\nexec sleep 20 # ferry-host-root-probe`],
        env: { PATH: '/usr/bin:/bin' },
        memoryMiB: 128,
      },
      caps,
    );
    const replica = prepared.spawn(['ignore', 'pipe', 'pipe']);
    try {
      let out = '';
      replica.child.stdout?.setEncoding('utf8').on('data', (chunk: string) => {
        out += chunk;
      });
      replica.child.stderr?.resume();
      await waitFor(async () => out.includes('mountinfo='), 30_000, 'the probe');
      const ids = await waitFor(
        async () => {
          const found = await hostIdentities('ferry-host-root-probe');
          return found.some((id) => id.mapsTo !== null) ? found : undefined;
        },
        10_000,
        'the sandbox processes',
      );
      assertUnprivileged(ids, 'the sandbox');
      if (isRoot) assert.equal(prepared.hostUid, ids.find((id) => id.mapsTo !== null)?.mapsTo);
      assertContained(parseFindings(out), 'the sandbox', [work]);
    } finally {
      replica.kill('SIGKILL');
      await new Promise((resolve) => replica.child.once('close', resolve));
      await prepared.cleanup();
    }
  });

  it('the probe does see the attack in a sandbox made the old way (defence off)', { timeout: TIMEOUT }, async () => {
    // bwrap started by this process, with the arguments of before the fix: no /proc/sys bind, no masks,
    // no drop to a sandbox uid. As root this is the reproduced attack; as an ordinary user it is harmless.
    const args = await baseBwrapArgs(caps.bwrapFeatures, 'isolated');
    const procSys = args.indexOf('/proc/sys');
    assert.ok(procSys > 0, 'the defence binds /proc/sys read-only');
    const old = args.slice(0, args.indexOf('--proc') + 4);
    const child = spawn(caps.bwrap!, [...old, '--', '/bin/sh', '-c', PROBE_SH], { stdio: ['ignore', 'pipe', 'pipe'] });
    const findings = parseFindings(await collect(child));
    if (isRoot) {
      assert.equal(findings.write, 'ok', 'as root, the old sandbox could write a host kernel setting');
      assert.ok(findings.readable.includes('/proc/keys'), 'as root, the old sandbox read /proc/keys');
    } else {
      assert.equal(findings.write, 'denied');
    }
  });
});

describe('replicas and build steps of a real server (issue 30, 1)', () => {
  let server: TestServer;
  let auth: { projectId: string; token: string };

  before(async () => {
    server = await startServer({ env: { FERRY_WARM_POOL: '0' } });
    auth = await server.bootstrap();
    assert.ok(server.services.sandbox.bwrap, `bubblewrap is needed: ${server.services.sandbox.reasons.join('; ')}`);
  });
  after(async () => {
    await server?.close();
  });

  async function deploy(
    name: string,
    files: Record<string, string>,
    executable: string[] = [],
    whileBuilding: () => Promise<void> = async () => {},
  ) {
    const res = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds`, {
      method: 'POST',
      token: auth.token,
      body: await zipFiles(files, executable),
      headers: { 'content-type': 'application/zip' },
    });
    assert.equal(res.status, 201, res.text);
    await whileBuilding();
    const build = await waitFor(
      async () => {
        const b = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${res.json.id}`, {
          token: auth.token,
        });
        return ['ready', 'failed', 'cancelled'].includes(b.json.state) ? b.json : undefined;
      },
      TIMEOUT - 20_000,
      `build of ${name}`,
    );
    const logs = await http(`${server.url}/v2/projects/${auth.projectId}/apps/${name}/builds/${build.id}/logs`, {
      token: auth.token,
    });
    return {
      state: build.state as string,
      log: (logs.json.lines as Array<{ line: string }>).map((l) => l.line).join('\n'),
    };
  }

  /** Calls the app while the host looks at its processes; returns the function's findings. */
  async function callAndLook(app: string, fn: string, marker: string): Promise<Findings> {
    const call = http(`${server.url}/v4/${auth.projectId}/${app}/${fn}`, {
      method: 'POST',
      token: auth.token,
      body: {},
    });
    const ids = await waitFor(
      async () => {
        const found = await hostIdentities(marker);
        return found.some((id) => id.mapsTo !== null) ? found : undefined;
      },
      60_000,
      `the processes of ${app}`,
    );
    assertUnprivileged(ids, app);
    const res = await call;
    assert.equal(res.status, 200, res.text);
    const result = res.json.result ?? res.json;
    return parseFindings(typeof result === 'string' ? result : (result.probe as string));
  }

  it('a TypeScript replica', { timeout: TIMEOUT }, async () => {
    const build = await deploy('probe-ts', {
      'ferry.toml': '[app]\nname = "probe-ts"\n',
      'main.ts': `import { execFileSync } from 'node:child_process';
export function probe() {
  return { probe: execFileSync('/bin/sh', ['-c', ${JSON.stringify(PROBE_SH)}], { encoding: 'utf8' }) };
}
`,
    });
    assert.equal(build.state, 'ready', build.log);
    const findings = await callAndLook('probe-ts', 'probe', '/ferry/bootstrap.mjs');
    assertContained(findings, 'the TypeScript replica', [server.dataDir, '/run/ferry-egress', ...hostFiles]);
  });

  it('a Python replica', { timeout: TIMEOUT }, async () => {
    const build = await deploy('probe-py', {
      'ferry.toml': '[app]\nname = "probe-py"\n',
      'main.py': `import subprocess

def probe():
    return {"probe": subprocess.run(["/bin/sh", "-c", ${JSON.stringify(PROBE_SH)}], capture_output=True, text=True).stdout}
`,
    });
    assert.equal(build.state, 'ready', build.log);
    const findings = await callAndLook('probe-py', 'probe', '/ferry/bootstrap.py');
    assertContained(findings, 'the Python replica', [server.dataDir, '/run/ferry-egress', ...hostFiles]);
  });

  it('a custom server replica', { timeout: TIMEOUT }, async () => {
    const build = await deploy('probe-custom', {
      'ferry.toml': `[app]
name = "probe-custom"
runtime = "custom"

[runtime.custom]
entrypoint = ["node", "server.mjs"]
port = 8080
healthcheck_endpoint = "/health"
readycheck_endpoint = "/ready"
`,
      'server.mjs': `import http from 'node:http';
import { execFileSync } from 'node:child_process';
http.createServer((req, res) => {
  if (req.url === '/health' || req.url === '/ready') return res.end('ok');
  const probe = execFileSync('/bin/sh', ['-c', ${JSON.stringify(PROBE_SH)}], { encoding: 'utf8' });
  res.writeHead(200, { 'content-type': 'application/json' });
  res.end(JSON.stringify({ probe }));
}).listen(Number(process.env.PORT));
`,
    });
    assert.equal(build.state, 'ready', build.log);
    const call = http(`${server.url}/v4/${auth.projectId}/probe-custom/probe`, { token: auth.token });
    const ids = await waitFor(
      async () => {
        const found = await hostIdentities('/ferry/supervisor.mjs');
        return found.some((id) => id.mapsTo !== null) ? found : undefined;
      },
      60_000,
      'the custom replica',
    );
    assertUnprivileged(ids, 'the custom replica');
    const res = await call;
    assert.equal(res.status, 200, res.text);
    assertContained(parseFindings(res.json.probe), 'the custom replica', [
      server.dataDir,
      '/run/ferry-egress',
      ...hostFiles,
    ]);
  });

  it('a build step (npm runs the app’s own git)', { timeout: TIMEOUT }, async () => {
    const build = await deploy(
      'probe-build',
      {
        'ferry.toml': '[app]\nname = "probe-build"\n',
        'main.js': 'export function run() { return 1; }\n',
        'package.json': JSON.stringify({
          name: 'probe-build',
          version: '1.0.0',
          private: true,
          dependencies: { dep: 'git+ssh://git@example.invalid/dep.git' },
        }),
        '.npmrc': 'git=./gitwrap\n',
        // npm shows what its git wrote to stderr; the sleep lets the host look at the step's processes.
        gitwrap: `#!/bin/sh\nexec 1>&2\n${PROBE_SH.replaceAll('FERRY-PROBE', 'FERRY-BUILD-PROBE')}\nsleep 3\nexit 1\n`,
      },
      ['gitwrap'],
      async () => {
        const ids = await waitFor(
          async () => {
            const found = await hostIdentities('gitwrap');
            return found.some((id) => id.mapsTo !== null) ? found : undefined;
          },
          60_000,
          'the build step',
        );
        assertUnprivileged(ids, 'the build step');
      },
    );
    const text = build.log.replaceAll('FERRY-BUILD-PROBE', 'FERRY-PROBE');
    const findings = parseFindings(text);
    assert.notEqual(findings.write, 'missing', `npm never ran the app's git; log:\n${build.log}`);
    assertContained(findings, 'the build step', [server.dataDir, '/run/ferry-egress', ...hostFiles]);
  });
});
