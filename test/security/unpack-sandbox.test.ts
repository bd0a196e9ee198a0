/**
 * The second wall around the layer unpacker (issue 43, point 1): the server never unpacks untrusted layers
 * in its own process. src/images/unpack-sandbox.ts runs the unpacker in a sandbox (src/sandbox/tree-sandbox.ts)
 * as an unprivileged id that sees the host's /usr read-only, the root it fills at /tree, and nothing else.
 *
 * - Both reproductions of the issue, through the sandboxed unpacker the server uses: the canary tree is
 *   unchanged, and what is unpacked belongs to the unpacker's id range, not to root.
 * - A hostile tool in the same sandbox, standing for the next unpacker bug: it follows a link the root
 *   holds to a host folder, writes, removes and chmods through it, writes beside the root and into the
 *   host's system folders, and climbs out through its input descriptors. None of it reaches the host.
 */
import assert from 'node:assert/strict';
import fsSync from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { acquireIds, releaseIds } from '../../src/images/build-ids.js';
import { unpackInSandbox } from '../../src/images/layer-sandbox.js';
import { blobPath, sha256 } from '../../src/images/oci-layout.js';
import { detectSandbox, type SandboxCapabilities } from '../../src/sandbox/launch.js';
import { FIRST_INPUT_FD, runTreeTool } from '../../src/sandbox/tree-sandbox.js';
import { canaryState, makeCanary } from '../helpers/canary.js';
import { tempDir } from '../helpers/ferry.js';
import { layer, linksOverFolders } from '../helpers/tar-layer.js';

describe('security: layers are unpacked in a sandbox that can write nothing but the root', () => {
  let work: string;
  let caps: SandboxCapabilities;
  let n = 0;
  before(async () => {
    caps = await detectSandbox();
    assert.ok(caps.bwrap, 'these tests need bubblewrap (bash scripts/setup-system.sh installs it)');
    work = await tempDir('ferry-unpack-sandbox-');
    // As root the unpacker's uid binds the root itself: the way there must be searchable by others.
    await fs.chmod(work, 0o711);
  });
  after(async () => {
    await fs.rm(work, { recursive: true, force: true });
  });

  async function fresh() {
    const dir = path.join(work, `case-${++n}`);
    await fs.mkdir(path.join(dir, 'root'), { recursive: true, mode: 0o711 });
    await fs.chmod(dir, 0o711);
    const canary = await makeCanary(path.join(dir, 'canary'));
    const layout = path.join(dir, 'layout');
    await fs.mkdir(path.join(layout, 'blobs', 'sha256'), { recursive: true });
    return { dir, root: path.join(dir, 'root'), canary, layout };
  }

  async function blob(layout: string, bytes: Buffer): Promise<{ layout: string; digest: string }> {
    const digest = sha256(bytes);
    await fs.writeFile(blobPath(layout, digest), bytes);
    return { layout, digest };
  }

  for (const reproduction of ['base image', 'Dockerfile'] as const) {
    it(`the ${reproduction} reproduction changes nothing outside the root, unpacked by a stranger id`, async () => {
      const c = await fresh();
      const before = await canaryState(c.canary);
      const layers =
        reproduction === 'base image'
          ? [
              await layer([
                ...linksOverFolders(c.canary),
                { name: 'etc/', type: 'directory' },
                { name: 'etc/owned-by-1000', content: 'x', uid: 1000, gid: 1000 },
              ]),
            ]
          : [
              await layer([
                { name: 'a/', type: 'directory', mode: 0o777 },
                { name: 'etc/', type: 'directory' },
                { name: 'etc/owned-by-1000', content: 'x', uid: 1000, gid: 1000 },
              ]),
              await layer([
                { name: '.wh.a', content: '' },
                { name: 'a', type: 'symlink', linkname: path.join(c.canary, 'd') },
              ]),
            ];
      const held = acquireIds(caps);
      try {
        await unpackInSandbox({
          caps,
          root: c.root,
          layers: await Promise.all(layers.map((bytes) => blob(c.layout, bytes))),
          limits: { maxBytes: 1 << 24, maxEntries: 1000 },
          ids: held.ids,
          mapRange: held.mapRange,
          resolvConf: true,
        });
      } finally {
        releaseIds(held.slot);
      }
      assert.equal(await canaryState(c.canary), before, 'the canary tree is unchanged');
      assert.deepEqual((await fs.readdir(c.dir)).sort(), ['canary', 'layout', 'root']);
      const owned = await fs.lstat(path.join(c.root, 'etc', 'owned-by-1000'));
      if (held.mapRange) {
        assert.equal(owned.uid, held.ids.first + 1000, "an entry's owner is shifted into the unpacker's range");
        assert.equal((await fs.lstat(path.join(c.root, 'etc'))).uid, held.ids.first, 'never host root');
      } else assert.equal(owned.uid, process.getuid?.());
      assert.ok((await fs.lstat(path.join(c.root, 'etc', 'resolv.conf'))).isFile(), 'resolv.conf made for replicas');
    });
  }

  it('a hostile tool in the sandbox reaches nothing of the host: links, folders beside the root, /usr, descriptors', async () => {
    const c = await fresh();
    await fs.symlink(c.canary, path.join(c.root, 'to-canary'));
    await fs.symlink('../../..', path.join(c.root, 'up'));
    const before = await canaryState(c.canary);
    const input = fsSync.openSync(path.join(c.canary, 'f'), 'r');
    const hostile = `
      const fs = require('fs');
      const tried = {};
      const attempt = (name, fn) => { try { fn(); tried[name] = 'done'; } catch (e) { tried[name] = e.code || String(e); } };
      attempt('write through a link', () => fs.writeFileSync('/tree/to-canary/new', 'x'));
      attempt('remove through a link', () => fs.rmSync('/tree/to-canary/f'));
      attempt('chmod through a link', () => fs.chmodSync('/tree/to-canary', 0o777));
      attempt('climb with ..', () => fs.writeFileSync('/tree/up/' + ${JSON.stringify(path.relative('/', c.canary))} + '/new', 'x'));
      attempt('the host path', () => fs.writeFileSync(${JSON.stringify(path.join(c.canary, 'new'))}, 'x'));
      attempt('beside the root', () => fs.writeFileSync('/tree/../beside', 'x'));
      attempt('the host /usr', () => fs.writeFileSync('/usr/ferry-owned', 'x'));
      attempt('the host /etc', () => fs.readFileSync('/etc/hostname'));
      attempt('out through an input descriptor', () => fs.readdirSync('/proc/self/fd/${FIRST_INPUT_FD}/..'));
      fs.writeFileSync('/tree/made-inside', 'x');
      console.log(JSON.stringify(tried));
    `;
    const held = acquireIds(caps);
    let result: Awaited<ReturnType<typeof runTreeTool>>;
    try {
      await fs.lchown(c.root, held.ids.first, held.ids.first);
      result = await runTreeTool({
        caps,
        script: Buffer.from(hostile),
        args: [],
        root: c.root,
        inputs: [input],
        ids: held.ids,
        mapRange: held.mapRange,
        keepCaps: ['CAP_CHOWN', 'CAP_DAC_OVERRIDE', 'CAP_FOWNER'],
        timeoutMs: 60_000,
      });
    } finally {
      releaseIds(held.slot);
      fsSync.closeSync(input);
    }
    assert.equal(result.code, 0, result.stderr);
    const tried = JSON.parse(result.stdout.trim().split('\n').pop()!) as Record<string, string>;
    for (const [what, outcome] of Object.entries(tried)) assert.notEqual(outcome, 'done', `${what} worked`);
    assert.equal(Object.keys(tried).length, 9);
    assert.equal(await canaryState(c.canary), before, 'the canary tree is unchanged');
    assert.deepEqual((await fs.readdir(c.dir)).sort(), ['canary', 'layout', 'root']);
    assert.ok(
      await fs.readFile('/usr/ferry-owned').then(
        () => false,
        () => true,
      ),
      'nothing written to /usr',
    );
    const made = await fs.lstat(path.join(c.root, 'made-inside'));
    assert.equal(made.uid, held.mapRange ? held.ids.first : process.getuid?.(), 'the tool is not host root');
  });
});
