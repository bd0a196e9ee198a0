/**
 * Writes one image layer (a gzip tar) into an OCI layout as it is produced: the tar's SHA-256 is the
 * layer's diff id (the config's `rootfs.diff_ids`), the gzip's SHA-256 and size its descriptor. The blob
 * goes to a temporary name first and is renamed to its digest when complete, so a layout never holds a
 * partial blob under a digest.
 *
 * Entries are added in order; a file's bytes come from a stream the caller opened (never by path here).
 * Names are relative (`usr/bin/x`), folders end without `/`; tar-stream writes PAX headers for long names.
 */
import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import { PassThrough, type Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { createGzip } from 'node:zlib';
import tar from 'tar-stream';
import { blobPath, type Descriptor } from './oci-layout.js';

export const LAYER_MEDIA_TYPE = 'application/vnd.oci.image.layer.v1.tar+gzip';

export interface LayerEntry {
  name: string;
  type: 'file' | 'directory' | 'symlink' | 'link';
  mode: number;
  uid: number;
  gid: number;
  mtime: Date;
  /** Files: the byte count the body must have. */
  size?: number;
  /** Symbolic links: the target text; hard links: the name of the earlier entry. */
  linkname?: string;
}

export interface WrittenLayer {
  descriptor: Descriptor;
  diffId: string;
  entries: number;
}

export class LayerWriter {
  private readonly pack = tar.pack();
  private readonly done: Promise<void>;
  private readonly tarHash = createHash('sha256');
  private readonly gzHash = createHash('sha256');
  private gzBytes = 0;
  private count = 0;

  private constructor(private readonly temp: string) {
    const tarHash = this.tarHash;
    const gzHash = this.gzHash;
    const self = this;
    this.done = pipeline(
      this.pack,
      new Transform({
        transform(chunk: Buffer, _enc, cb) {
          tarHash.update(chunk);
          cb(null, chunk);
        },
      }),
      createGzip({ level: 6 }),
      new Transform({
        transform(chunk: Buffer, _enc, cb) {
          gzHash.update(chunk);
          self.gzBytes += chunk.length;
          cb(null, chunk);
        },
      }),
      createWriteStream(temp, { flags: 'wx', mode: 0o600 }),
    );
    this.done.catch(() => {}); // observed in finish()/abort()
  }

  /** A writer of a new blob in `layout` (its blobs folder must exist). */
  static open(layout: string): LayerWriter {
    return new LayerWriter(`${blobPath(layout, 'sha256:tmp')}.${randomBytes(8).toString('hex')}.part`);
  }

  get entries(): number {
    return this.count;
  }

  /** Adds an entry; a file's `body` must yield exactly `size` bytes. */
  async add(entry: LayerEntry, body?: Readable | Buffer): Promise<void> {
    this.count += 1;
    await addTarEntry(this.pack, entry, body);
  }

  /** Ends the tar and moves the blob to its digest's name. */
  async finish(layout: string): Promise<WrittenLayer> {
    this.pack.finalize();
    await this.done;
    const digest = `sha256:${this.gzHash.digest('hex')}`;
    await fs.rename(this.temp, blobPath(layout, digest));
    return {
      descriptor: { mediaType: LAYER_MEDIA_TYPE, digest, size: this.gzBytes },
      diffId: `sha256:${this.tarHash.digest('hex')}`,
      entries: this.count,
    };
  }

  async abort(): Promise<void> {
    this.pack.destroy();
    await this.done.catch(() => {});
    await fs.rm(this.temp, { force: true });
  }
}

/** Writes one entry to a tar-stream pack; a file's `body` must yield exactly `size` bytes. */
export async function addTarEntry(
  pack: ReturnType<typeof tar.pack>,
  entry: LayerEntry,
  body?: Readable | Buffer,
): Promise<void> {
  const header: Parameters<typeof pack.entry>[0] = {
    name: entry.type === 'directory' ? `${entry.name}/` : entry.name,
    type: entry.type,
    mode: entry.mode,
    uid: entry.uid,
    gid: entry.gid,
    mtime: entry.mtime,
    ...(entry.type === 'file' ? { size: entry.size ?? 0 } : {}),
    ...(entry.linkname !== undefined ? { linkname: entry.linkname } : {}),
  };
  if (entry.type !== 'file' || body === undefined || (entry.size ?? 0) === 0) {
    await new Promise<void>((resolve, reject) => {
      const done = (err?: Error | null) => (err ? reject(err) : resolve());
      // A file entry without a buffer waits for its body to be written and ended, even at size 0
      // (tar-stream 3): an empty file or a whiteout gets an empty buffer, or it would never complete.
      if (entry.type === 'file') pack.entry(header, Buffer.alloc(0), done);
      else pack.entry(header, done);
    });
    if (body !== undefined && !Buffer.isBuffer(body)) body.destroy();
    return;
  }
  if (Buffer.isBuffer(body)) {
    await new Promise<void>((resolve, reject) => {
      pack.entry(header, body, (err) => (err ? reject(err) : resolve()));
    });
    return;
  }
  let sink!: ReturnType<typeof pack.entry>;
  const written = new Promise<void>((resolve, reject) => {
    sink = pack.entry(header, (err) => (err ? reject(err) : resolve()));
  });
  await pipeline(body, new PassThrough(), sink);
  await written;
}
