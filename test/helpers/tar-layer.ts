/**
 * Image layers made in a test, entry by entry, with tar-stream: what a hostile registry or Dockerfile
 * build could hand the unpacker (src/images/unpack.ts), in exactly the order a test names.
 */
import { PassThrough } from 'node:stream';
import tar from 'tar-stream';

export type LayerEntry = {
  name: string;
  type?: NonNullable<Parameters<ReturnType<typeof tar.pack>['entry']>[0]['type']>;
  content?: string;
  mode?: number;
  linkname?: string;
  uid?: number;
  gid?: number;
};

/** A layer (uncompressed tar bytes) with the entries in order. */
export async function layer(entries: LayerEntry[]): Promise<Buffer> {
  const pack = tar.pack();
  const out = new PassThrough();
  const chunks: Buffer[] = [];
  out.on('data', (c: Buffer) => chunks.push(c));
  const done = new Promise((r) => out.on('end', r));
  pack.pipe(out);
  for (const e of entries) {
    const type = e.type ?? 'file';
    await new Promise<void>((resolve, reject) => {
      const header: Parameters<typeof pack.entry>[0] = {
        name: e.name,
        type,
        mode: e.mode ?? (type === 'directory' ? 0o755 : 0o644),
        ...(e.linkname !== undefined ? { linkname: e.linkname } : {}),
        ...(e.uid !== undefined ? { uid: e.uid } : {}),
        ...(e.gid !== undefined ? { gid: e.gid } : {}),
        ...(type === 'character-device' || type === 'block-device' ? { devmajor: 1, devminor: 3 } : {}),
      };
      const body = type === 'file' ? (e.content ?? '') : null;
      pack.entry(header, body as string, (err) => (err ? reject(err) : resolve()));
    });
  }
  pack.finalize();
  await done;
  return Buffer.concat(chunks);
}

/**
 * Issue 43's base image: a layer that makes folders, then plants links to host folders in their place,
 * so that deferred work (the opaque whiteout's emptying, the folders' modes) would act through them on
 * `host` and `host/d`.
 */
export function linksOverFolders(host: string): LayerEntry[] {
  return [
    { name: 'a/', type: 'directory' },
    { name: 'a/.wh..wh..opq', content: '' },
    { name: 'a', type: 'symlink', linkname: host },
    { name: 'b/', type: 'directory', mode: 0o777 },
    { name: 'b', type: 'symlink', linkname: `${host}/d` },
  ];
}
