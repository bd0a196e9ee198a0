/**
 * A build folder as one tar stream, and back, for the object store (nats-build-output.ts).
 *
 * Packing walks the folder without following anything: folders, regular files and symbolic links (as
 * links: their target text, never what they point to) with their permission bits and modification
 * times; anything else (sockets, FIFOs, devices) is left out, as the artifacts-folder copy leaves it out.
 *
 * Unpacking trusts nothing in the tar: the build output was made by untrusted code, so it is read like an
 * upload. Only folders, files and symbolic links are taken; a name that is absolute, has a `..` part or a
 * NUL, repeats an earlier entry or sits below a file or link of the same tar is refused, and every file is
 * created new (`wx`, never through a link) inside the destination. Setuid, setgid and sticky bits are
 * dropped. Folder modes are applied last, so a read-only folder can still be filled.
 */
import { createReadStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { PassThrough, type Readable } from 'node:stream';
import tar from 'tar-stream';

/** A tar of a build that cannot be unpacked safely: what is wrong, with the entry named. */
export class UnsafeTarError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'UnsafeTarError';
  }
}

const MAX_LABEL_CHARS = 200;

/** Quotes an entry name for a message: control characters escaped so a hostile name cannot forge log lines. */
function quote(name: string): string {
  const short = name.length > MAX_LABEL_CHARS ? `${name.slice(0, MAX_LABEL_CHARS)}…` : name;
  return JSON.stringify(short);
}

/**
 * The tar of the folder `root` (entries named relative to it, folders first). Errors (a file vanishing
 * while it is read) end the stream with that error.
 */
export function packFolder(root: string): Readable {
  const pack = tar.pack();
  const out = new PassThrough();
  pack.on('error', (err: Error) => out.destroy(err));
  pack.pipe(out);

  type EntryHeader = Parameters<typeof pack.entry>[0];
  async function add(header: EntryHeader, body?: Readable): Promise<void> {
    let sink!: ReturnType<typeof pack.entry>;
    const written = new Promise<void>((done, fail) => {
      sink = pack.entry(header, (err) => (err ? fail(err) : done()));
    });
    if (body) {
      for await (const chunk of body) {
        // tar-stream's sinks are streamx streams: their back-pressure is kept by hand.
        if (!sink.write(chunk)) await new Promise<void>((resolve) => sink.once('drain', () => resolve()));
      }
      sink.end(undefined);
    }
    await written;
  }

  async function walk(dir: string, prefix: string): Promise<void> {
    for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
      const file = path.join(dir, entry.name);
      const name = prefix === '' ? entry.name : `${prefix}/${entry.name}`;
      // lstat: a link is packed as a link, whatever it points to.
      const stat = await fs.lstat(file);
      const common = { name, mode: stat.mode & 0o777, mtime: stat.mtime };
      if (stat.isDirectory()) {
        await add({ ...common, type: 'directory' });
        await walk(file, name);
      } else if (stat.isSymbolicLink()) {
        await add({ ...common, type: 'symlink', linkname: await fs.readlink(file) });
      } else if (stat.isFile()) {
        const handle = await fs.open(file, 'r');
        try {
          await add({ ...common, type: 'file', size: stat.size }, handle.createReadStream({ autoClose: false }));
        } finally {
          await handle.close();
        }
      }
    }
  }

  void (async () => {
    const stat = await fs.lstat(root);
    if (!stat.isDirectory()) throw new Error(`${root} is not a folder`);
    await walk(root, '');
    pack.finalize();
  })().catch((err: unknown) => {
    const error = err instanceof Error ? err : new Error(String(err));
    pack.destroy(error);
    out.destroy(error);
  });
  return out;
}

type Kind = 'directory' | 'file' | 'symlink';

/** The checked, normalized path of an entry (`a/b/c`), or an UnsafeTarError. */
function checkName(name: string): string {
  const label = quote(name);
  if (name.includes('\0')) throw new UnsafeTarError(`Entry ${label} has a NUL character in its name`);
  if (name.startsWith('/') || name.includes('\\'))
    throw new UnsafeTarError(`Entry ${label} has an absolute path or a backslash`);
  const parts = name.split('/').filter((part) => part !== '' && part !== '.');
  if (parts.includes('..')) throw new UnsafeTarError(`Entry ${label} leaves the build folder`);
  if (parts.length === 0) throw new UnsafeTarError(`Entry ${label} has no name`);
  return parts.join('/');
}

/**
 * Unpacks the tar in `file` into `dest` (an existing, empty folder only this call writes to). On failure
 * the caller removes `dest`; nothing is ever written outside it.
 */
export async function unpackTar(file: string, dest: string): Promise<{ entries: number; bytes: number }> {
  const root = path.resolve(dest);
  const inside = root + path.sep;
  const seen = new Map<string, Kind>();
  const folderModes: Array<{ target: string; mode: number }> = [];
  let entries = 0;
  let bytes = 0;

  const extract = tar.extract();
  const input = createReadStream(file);
  // A read error ends the entries loop below with that error.
  input.on('error', (err) => extract.destroy(err));
  input.pipe(extract as unknown as NodeJS.WritableStream);

  /** Makes the folders above `entryPath` that no entry made (tar writers may omit them). */
  async function parents(entryPath: string, label: string): Promise<void> {
    const parts = entryPath.split('/');
    for (let i = 1; i < parts.length; i++) {
      const folder = parts.slice(0, i).join('/');
      const kind = seen.get(folder);
      if (kind === 'directory') continue;
      if (kind)
        throw new UnsafeTarError(`Entry ${label} is below ${quote(folder)}, which is a ${kind} in the same tar`);
      await fs.mkdir(path.join(root, ...folder.split('/')), { mode: 0o700 });
      seen.set(folder, 'directory');
    }
  }

  try {
    for await (const entry of extract) {
      const { header } = entry;
      const entryPath = checkName(header.name);
      const label = quote(header.name);
      const target = path.resolve(root, ...entryPath.split('/'));
      if (!target.startsWith(inside)) throw new UnsafeTarError(`Entry ${label} leaves the build folder`);
      if (seen.has(entryPath)) throw new UnsafeTarError(`Entry ${label} has the same path as an earlier entry`);
      const mode = (header.mode ?? 0o644) & 0o777;
      await parents(entryPath, label);
      entries++;
      switch (header.type) {
        case 'directory':
          await fs.mkdir(target, { mode: 0o700 });
          seen.set(entryPath, 'directory');
          folderModes.push({ target, mode });
          entry.resume();
          break;
        case 'file':
        case 'contiguous-file': {
          seen.set(entryPath, 'file');
          // 'wx': a new file, never through a link or over a file that is there.
          const handle = await fs.open(target, 'wx', 0o600);
          try {
            for await (const chunk of entry) {
              const data = chunk as Uint8Array;
              // A write may take less than it was given.
              for (let done = 0; done < data.length; ) done += (await handle.write(data, done)).bytesWritten;
            }
            await handle.chmod(mode); // the umask must not decide the mode
          } finally {
            await handle.close();
          }
          bytes += header.size ?? 0;
          if (header.mtime) await fs.utimes(target, header.mtime, header.mtime);
          break;
        }
        case 'symlink': {
          const link = header.linkname ?? '';
          if (link === '' || link.includes('\0'))
            throw new UnsafeTarError(`Symbolic link ${label} has no valid target`);
          seen.set(entryPath, 'symlink');
          // Recreated as it was: it is never followed here, and what it points to is the replica's business.
          await fs.symlink(link, target);
          if (header.mtime) await fs.lutimes(target, header.mtime, header.mtime);
          entry.resume();
          break;
        }
        default:
          throw new UnsafeTarError(
            `Entry ${label} is a ${header.type ?? 'entry of no type'}: only folders, files and symbolic links are taken`,
          );
      }
    }
  } finally {
    input.destroy();
    extract.destroy();
  }
  // Deepest first, so a read-only folder does not stop its own subfolders from being set.
  for (const { target, mode } of folderModes.reverse()) await fs.chmod(target, mode);
  return { entries, bytes };
}
