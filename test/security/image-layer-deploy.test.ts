/**
 * Issue 43, point 1, end to end, as it was found: Ferry as root, a registry on loopback serving a base
 * image whose last layer plants links over folders it made (`a/`, `a/.wh..wh..opq`, `a -> <host folder>`,
 * `b/` 0777, `b -> <another>`), deployed as an app's `[image] base`; and a Dockerfile on a harmless base
 * whose two RUN lines make `/a` 0777 and then replace it with a link to a host folder, whose built image is
 * then unpacked into the node's cache. Before the fix the first emptied the host folder and chmodded the
 * other 0777, the second chmodded its host folder 0777. Now the canary tree is unchanged whatever the
 * builds' outcome. Also: a step that swaps /etc for a link to a host folder does not make the step's
 * clean-up (the resolv.conf Ferry made for it) remove a file there.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { after, before, describe, it } from 'node:test';
import { canaryState, makeCanary } from '../helpers/canary.js';
import { deployFiles, startServer, type TestServer, tempDir } from '../helpers/ferry.js';
import {
  type BaseImage,
  makeBaseImage,
  requireImageTools,
  startRegistry,
  type TestRegistry,
} from '../helpers/registry.js';
import { layer, linksOverFolders } from '../helpers/tar-layer.js';

const sha = (bytes: Buffer) => `sha256:${createHash('sha256').update(bytes).digest('hex')}`;

/** A copy of `image`'s layout tagged `tag`, with `extra` (an uncompressed tar) as one more layer on top. */
async function withLayer(image: BaseImage, extra: Buffer, tag: string): Promise<BaseImage> {
  const blobs = path.join(image.layout, 'blobs', 'sha256');
  const write = async (bytes: Buffer) => {
    await fs.writeFile(path.join(blobs, sha(bytes).slice(7)), bytes);
    return sha(bytes);
  };
  const index = JSON.parse(await fs.readFile(path.join(image.layout, 'index.json'), 'utf8'));
  const entry = index.manifests.find(
    (m: { annotations?: Record<string, string> }) => m.annotations?.['org.opencontainers.image.ref.name'] === image.tag,
  );
  const manifest = JSON.parse(await fs.readFile(path.join(blobs, entry.digest.slice(7)), 'utf8'));
  const config = JSON.parse(await fs.readFile(path.join(blobs, manifest.config.digest.slice(7)), 'utf8'));
  const layerDigest = await write(extra);
  config.rootfs.diff_ids.push(layerDigest);
  const configBytes = Buffer.from(JSON.stringify(config));
  manifest.config = { ...manifest.config, digest: await write(configBytes), size: configBytes.length };
  manifest.layers.push({
    mediaType: 'application/vnd.oci.image.layer.v1.tar',
    digest: layerDigest,
    size: extra.length,
  });
  const manifestBytes = Buffer.from(JSON.stringify(manifest));
  index.manifests.push({
    mediaType: 'application/vnd.oci.image.manifest.v1+json',
    digest: await write(manifestBytes),
    size: manifestBytes.length,
    annotations: { 'org.opencontainers.image.ref.name': tag },
  });
  await fs.writeFile(path.join(image.layout, 'index.json'), JSON.stringify(index));
  return { layout: image.layout, tag, source: `oci:${image.layout}:${tag}` };
}

describe('security: hostile images deployed end to end leave the host alone', { timeout: 300_000 }, () => {
  let registry: TestRegistry;
  let server: TestServer;
  let auth: { projectId: string; token: string };
  let work: string;
  let canary: string;
  let base: string;

  before(async () => {
    await requireImageTools();
    work = await tempDir('ferry-hostile-image-');
    canary = await makeCanary(path.join(work, 'canary'));
    const image = await makeBaseImage(path.join(work, 'image'));
    const hostile = await withLayer(image, await layer(linksOverFolders(canary)), 'hostile');
    registry = await startRegistry();
    await registry.push(image, 'ferry-test/busy:1');
    await registry.push(
      await makeBaseImage(path.join(work, 'image-etc'), { files: { 'etc/os-release': 'ID=ferry-test' } }),
      'ferry-test/busy-etc:1',
    );
    await registry.push(hostile, 'ferry-test/hostile:1');
    base = `${registry.host}/ferry-test/busy:1`;
    server = await startServer({ env: { FERRY_INSECURE_REGISTRIES: registry.host } });
    auth = await server.bootstrap();
  });

  after(async () => {
    await server?.close();
    await registry?.stop();
    await fs.rm(work, { recursive: true, force: true });
  });

  /** Deploys and waits for the build to end, whichever way; its end state. */
  async function deployAndWait(name: string, files: Record<string, string>): Promise<string> {
    try {
      await deployFiles(server, auth, name, files, { timeoutMs: 120_000 });
      return 'ready';
    } catch (err) {
      const ended = /ended (\w+)/.exec(String(err));
      if (!ended) throw err;
      return ended[1]!;
    }
  }

  it('a base image planting links over its own folders empties and chmods nothing of the host', async () => {
    const before = await canaryState(canary);
    await deployAndWait('hostile-base', {
      'ferry.toml': `[app]\nname = "hostile-base"\n\n[image]\nbase = "${registry.host}/ferry-test/hostile:1"\n`,
      'main.ts': 'export function run() { return 1; }\n',
    });
    assert.equal(await canaryState(canary), before, 'the canary tree is unchanged');
  });

  it("a Dockerfile's RUN lines that swap a 0777 folder for a link to the host chmod nothing of the host", async () => {
    // A canary of its own: on the old code the base image's case emptied the first one.
    const canary = await makeCanary(path.join(work, 'canary-dockerfile'));
    const before = await canaryState(canary);
    const dockerfile = [
      `FROM ${base}`,
      'RUN /bin/busybox mkdir /a && /bin/busybox chmod 777 /a',
      `RUN /bin/busybox rm -rf /a && /bin/busybox ln -s ${path.join(canary, 'd')} /a`,
      'CMD ["/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/"]',
    ].join('\n');
    const state = await deployAndWait('hostile-df', {
      'ferry.toml': `[app]\nname = "hostile-df"\nruntime = "custom"\n\n[image]\ndockerfile = "Dockerfile"\n\n[runtime.custom]\n`,
      Dockerfile: dockerfile,
    });
    assert.equal(state, 'ready', 'the image builds: its layers are legal, only what they point at is not ours');
    assert.equal(await canaryState(canary), before, 'the canary tree is unchanged');
  });

  it('a RUN line that swaps /etc for a link to a host folder removes nothing there when the step is cleaned up', async () => {
    // Ferry made /etc/resolv.conf (empty) for the step's DNS; the step moves /etc away and links a host
    // folder holding an empty resolv.conf in its place. The clean-up must not remove that file.
    const hostEtc = path.join(work, 'host-etc');
    await fs.mkdir(hostEtc);
    await fs.writeFile(path.join(hostEtc, 'resolv.conf'), '');
    const dockerfile = [
      `FROM ${registry.host}/ferry-test/busy-etc:1`,
      `RUN /bin/busybox mv /etc /etc.old && /bin/busybox ln -s ${hostEtc} /etc`,
      'CMD ["/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/"]',
    ].join('\n');
    await deployAndWait('hostile-etc', {
      'ferry.toml': `[app]\nname = "hostile-etc"\nruntime = "custom"\n\n[image]\ndockerfile = "Dockerfile"\n\n[runtime.custom]\n`,
      Dockerfile: dockerfile,
    });
    assert.deepEqual(await fs.readdir(hostEtc), ['resolv.conf'], 'the host folder keeps its file');
  });
});
