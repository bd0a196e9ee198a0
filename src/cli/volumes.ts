/**
 * `ferry volumes create|list|ls|cp|rm|delete`: a project's volumes and their files.
 *
 * `cp` copies a file or a folder (recursively) either way, streamed (never held in memory), with a
 * progress bar on a terminal. It is restartable per file: an upload lands under a temporary name and is
 * renamed into place by the server, a download is written to `<file>.ferry-part` and renamed once whole,
 * so an interrupted copy leaves only complete files, and running it again copies what is missing
 * (`--skip-existing` skips files already there with the same size).
 *
 * `NAME:PATH` names a path in a volume; a local path holding ":" is written `./a:b`.
 */
import { createReadStream, createWriteStream } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import cliProgress from 'cli-progress';
import { request } from 'undici';
import { type ApiClient, CliError, createClient, printJson, printTable } from './client.js';
import { safeText } from './terminal.js';

interface Json {
  json?: boolean;
}

interface VolumeEntry {
  name: string;
  type: 'file' | 'folder' | 'link' | 'other';
  size: number;
  modified_at: string;
}

const VOLUME_REF = /^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?):(.*)$/s;

/** `NAME:PATH` (or `NAME`) as a volume and a path; undefined for a local path. */
export function parseVolumeRef(text: string, bareName = false): { volume: string; path: string } | undefined {
  const match = VOLUME_REF.exec(text);
  if (match) return { volume: match[1]!, path: match[3]! };
  if (bareName && /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(text)) return { volume: text, path: '' };
  return undefined;
}

/** `20GiB`, `512MiB`, `1TiB`, `100` (MiB) as MiB. */
export function parseSizeMiB(text: string): number {
  const match = /^\s*(\d+(?:\.\d+)?)\s*(MiB|M|GiB|G|TiB|T)?\s*$/i.exec(text);
  if (!match) throw new CliError(`--size ${text}: give a size such as 512MiB, 20GiB or 1TiB`, 2);
  const n = Number(match[1]);
  const unit = (match[2] ?? 'MiB').toUpperCase()[0];
  const mib = unit === 'T' ? n * 1024 * 1024 : unit === 'G' ? n * 1024 : n;
  if (!Number.isInteger(mib)) throw new CliError(`--size ${text}: must be a whole number of MiB`, 2);
  return mib;
}

function formatBytes(bytes: number): string {
  if (bytes < 1024) return `${bytes} B`;
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes / 1024;
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i++;
  }
  return `${value.toFixed(1)} ${units[i]}`;
}

function base(client: ApiClient, name?: string): string {
  const root = `/v2/projects/${client.project}/volumes`;
  return name === undefined ? root : `${root}/${encodeURIComponent(name)}`;
}

export async function volumesCreateCommand(name: string, options: Json & { size: string }): Promise<void> {
  const client = createClient();
  const volume = await client.call<{ name: string; size_mib: number }>('POST', base(client), {
    body: { name, size_mib: parseSizeMiB(options.size) },
  });
  if (options.json) return printJson(volume);
  process.stdout.write(`Created volume ${volume.name} (${formatBytes(volume.size_mib * 1024 * 1024)}).\n`);
  process.stdout.write(
    `Mount it in an app's ferry.toml:\n\n[[volumes]]\nname = "${volume.name}"\nmount = "/${volume.name}"\n`,
  );
}

export async function volumesListCommand(options: Json = {}): Promise<void> {
  const client = createClient();
  const { volumes } = await client.call<{ volumes: Array<{ name: string; size_mib: number; created_at: string }> }>(
    'GET',
    base(client),
  );
  const detailed = [];
  for (const v of volumes) {
    detailed.push(
      await client.call<{
        name: string;
        size_mib: number;
        used_bytes: number;
        mounted_by: string[];
        created_at: string;
      }>('GET', base(client, v.name)),
    );
  }
  if (options.json) return printJson(detailed);
  printTable(
    detailed.map((v) => ({
      name: v.name,
      size: formatBytes(v.size_mib * 1024 * 1024),
      used: formatBytes(v.used_bytes),
      mounted_by: v.mounted_by.join(',') || '-',
      created_at: v.created_at,
    })),
    ['name', 'size', 'used', 'mounted_by', 'created_at'],
  );
}

async function listing(client: ApiClient, volume: string, dir: string) {
  return client.call<{ path: string; entries: VolumeEntry[]; truncated: boolean }>(
    'GET',
    `${base(client, volume)}/files?path=${encodeURIComponent(dir)}`,
  );
}

export async function volumesLsCommand(ref: string, options: Json = {}): Promise<void> {
  const target = parseVolumeRef(ref, true);
  if (!target) throw new CliError(`${ref}: give NAME or NAME:PATH`, 2);
  const client = createClient();
  const result = await listing(client, target.volume, target.path);
  if (options.json) return printJson(result);
  printTable(
    result.entries.map((e) => ({
      name: e.type === 'folder' ? `${e.name}/` : e.name,
      type: e.type,
      size: e.type === 'file' ? formatBytes(e.size) : '-',
      modified_at: e.modified_at,
    })),
    ['name', 'type', 'size', 'modified_at'],
  );
  if (result.truncated) process.stdout.write('(more entries not shown)\n');
}

export async function volumesRmCommand(ref: string, options: Json & { recursive?: boolean } = {}): Promise<void> {
  const target = parseVolumeRef(ref);
  if (!target) throw new CliError(`${ref}: give NAME:PATH`, 2);
  const client = createClient();
  const query = `path=${encodeURIComponent(target.path)}${options.recursive ? '&recursive=true' : ''}`;
  await client.call('DELETE', `${base(client, target.volume)}/file?${query}`);
  if (options.json) return printJson({ volume: target.volume, path: target.path, deleted: true });
  process.stdout.write(`Removed ${target.volume}:${safeText(target.path)}\n`);
}

export async function volumesDeleteCommand(name: string, options: Json & { force?: boolean } = {}): Promise<void> {
  const client = createClient();
  await client.call('DELETE', `${base(client, name)}${options.force ? '?force=true' : ''}`);
  if (options.json) return printJson({ name, deleted: true });
  process.stdout.write(`Deleted volume ${name} and its files.\n`);
}

/** One file to copy: local path, volume path, size. */
interface CopyItem {
  local: string;
  remote: string;
  size: number;
}

function joinRemote(dir: string, name: string): string {
  return `${dir.replace(/\/+$/, '')}/${name}`;
}

async function localFiles(root: string): Promise<Array<{ rel: string; size: number }>> {
  const out: Array<{ rel: string; size: number }> = [];
  async function walk(dir: string, rel: string): Promise<void> {
    for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
      const full = path.join(dir, entry.name);
      const r = rel ? `${rel}/${entry.name}` : entry.name;
      if (entry.isDirectory()) await walk(full, r);
      else if (entry.isFile()) out.push({ rel: r, size: (await fs.stat(full)).size });
      // Links and special files are not copied (a link could lead anywhere on this machine).
    }
  }
  await walk(root, '');
  return out.sort((a, b) => (a.rel < b.rel ? -1 : 1));
}

async function remoteFiles(
  client: ApiClient,
  volume: string,
  dir: string,
): Promise<Array<{ rel: string; size: number }>> {
  const out: Array<{ rel: string; size: number }> = [];
  async function walk(remote: string, rel: string): Promise<void> {
    const { entries, truncated } = await listing(client, volume, remote);
    if (truncated)
      throw new CliError(`${volume}:${remote} has more than 10,000 entries: copy its subfolders one by one`);
    for (const e of entries) {
      const r = rel ? `${rel}/${e.name}` : e.name;
      if (e.type === 'folder') await walk(joinRemote(remote, e.name), r);
      else if (e.type === 'file') out.push({ rel: r, size: e.size });
    }
  }
  await walk(dir, '');
  return out;
}

/** Whether `dir` is a folder in the volume (false: a file, or nothing). */
async function remoteKind(client: ApiClient, volume: string, p: string): Promise<VolumeEntry | 'root' | undefined> {
  const parts = p.split('/').filter((x) => x !== '' && x !== '.');
  if (parts.length === 0) return 'root';
  const parent = `/${parts.slice(0, -1).join('/')}`;
  const found = await listing(client, volume, parent).catch(() => undefined);
  return found?.entries.find((e) => e.name === parts.at(-1));
}

export async function volumesCpCommand(
  from: string,
  to: string,
  options: Json & { skipExisting?: boolean } = {},
): Promise<void> {
  const source = parseVolumeRef(from);
  const dest = parseVolumeRef(to);
  if (source && dest) throw new CliError('Copy between two volumes is not supported: one side must be local', 2);
  if (!source && !dest) throw new CliError('One side must be a volume path, NAME:PATH', 2);
  const client = createClient();
  const items: CopyItem[] = [];
  let skipped = 0;
  if (dest) {
    const stat = await fs.stat(from).catch(() => null);
    if (!stat) throw new CliError(`${from}: no such file or folder`, 2);
    const kind = await remoteKind(client, dest.volume, dest.path);
    const intoFolder = kind === 'root' || (kind !== undefined && kind.type === 'folder') || dest.path.endsWith('/');
    if (stat.isDirectory()) {
      const top =
        intoFolder && kind !== undefined ? joinRemote(dest.path, path.basename(path.resolve(from))) : dest.path;
      for (const f of await localFiles(from)) {
        items.push({ local: path.join(from, f.rel), remote: joinRemote(top, f.rel), size: f.size });
      }
    } else {
      const remote = intoFolder ? joinRemote(dest.path, path.basename(from)) : dest.path;
      items.push({ local: from, remote, size: stat.size });
    }
    if (options.skipExisting) {
      const kept: CopyItem[] = [];
      for (const item of items) {
        const there = await remoteKind(client, dest.volume, item.remote);
        if (there !== undefined && there !== 'root' && there.type === 'file' && there.size === item.size) skipped++;
        else kept.push(item);
      }
      items.splice(0, items.length, ...kept);
    }
  } else if (source) {
    const kind = await remoteKind(client, source.volume, source.path);
    if (kind === undefined) throw new CliError(`${from}: no such file or folder in the volume`, 1);
    const localStat = await fs.stat(to).catch(() => null);
    if (kind === 'root' || kind.type === 'folder') {
      const top = localStat?.isDirectory() && kind !== 'root' ? path.join(to, kind.name) : to;
      for (const f of await remoteFiles(client, source.volume, source.path)) {
        items.push({
          local: path.join(top, ...f.rel.split('/')),
          remote: joinRemote(source.path, f.rel),
          size: f.size,
        });
      }
    } else if (kind.type === 'file') {
      const local = localStat?.isDirectory() ? path.join(to, kind.name) : to;
      items.push({ local, remote: source.path, size: kind.size });
    } else {
      throw new CliError(`${from} is a ${kind.type}: only files and folders are copied`, 1);
    }
    if (options.skipExisting) {
      const kept: CopyItem[] = [];
      for (const item of items) {
        if ((await fs.stat(item.local).catch(() => null))?.size === item.size) skipped++;
        else kept.push(item);
      }
      items.splice(0, items.length, ...kept);
    }
  }

  const total = items.reduce((n, i) => n + i.size, 0);
  const interactive = process.stderr.isTTY === true && !options.json;
  const bar = interactive
    ? new cliProgress.SingleBar(
        {
          format: '  {direction} [{bar}] {percentage}% {value_h}/{total_h}  {file}',
          hideCursor: true,
          stream: process.stderr,
        },
        cliProgress.Presets.shades_classic,
      )
    : undefined;
  const direction = dest ? 'uploading' : 'downloading';
  let done = 0;
  const update = (file: string) =>
    bar?.update(done, { direction, value_h: formatBytes(done), total_h: formatBytes(total), file: safeText(file) });
  bar?.start(total, 0, { direction, value_h: formatBytes(0), total_h: formatBytes(total), file: '' });
  const started = Date.now();
  try {
    for (const item of items) {
      const counter = new Transform({
        transform(chunk: Buffer, _enc, cb) {
          done += chunk.length;
          update(item.remote);
          cb(null, chunk);
        },
      });
      if (dest) await upload(client, dest.volume, item, counter);
      else if (source) await download(client, source.volume, item, counter);
    }
  } finally {
    bar?.stop();
  }
  const seconds = (Date.now() - started) / 1000;
  const volume = (dest ?? source)!.volume;
  if (options.json) {
    return printJson({
      volume,
      direction: dest ? 'upload' : 'download',
      files: items.map((i) => ({ local: i.local, path: i.remote, bytes: i.size })),
      bytes: total,
      skipped,
      seconds,
    });
  }
  process.stdout.write(
    `Copied ${items.length} file${items.length === 1 ? '' : 's'} (${formatBytes(total)}) ${dest ? 'to' : 'from'} volume ${volume} in ${seconds.toFixed(1)} s${skipped ? `; ${skipped} already there skipped` : ''}.\n`,
  );
}

async function upload(client: ApiClient, volume: string, item: CopyItem, counter: Transform): Promise<void> {
  const url = `${client.url}${base(client, volume)}/file?path=${encodeURIComponent(item.remote)}`;
  const res = await request(url, {
    method: 'PUT',
    headers: {
      authorization: `Bearer ${client.token}`,
      'content-type': 'application/octet-stream',
      'content-length': String(item.size),
    },
    body: createReadStream(item.local, { highWaterMark: 1024 * 1024 }).pipe(counter),
    bodyTimeout: 0,
    headersTimeout: 0,
  }).catch((err: Error) => {
    throw new CliError(`Upload of ${item.local} failed: ${err.message}`);
  });
  const text = await res.body.text();
  if (res.statusCode >= 400)
    throw new CliError(`Upload of ${item.local} to ${volume}:${item.remote}: ${errorText(res.statusCode, text)}`);
}

async function download(client: ApiClient, volume: string, item: CopyItem, counter: Transform): Promise<void> {
  const url = `${client.url}${base(client, volume)}/file?path=${encodeURIComponent(item.remote)}`;
  const res = await request(url, {
    headers: { authorization: `Bearer ${client.token}` },
    bodyTimeout: 0,
    headersTimeout: 0,
  }).catch((err: Error) => {
    throw new CliError(`Download of ${volume}:${item.remote} failed: ${err.message}`);
  });
  if (res.statusCode >= 400) {
    throw new CliError(`Download of ${volume}:${item.remote}: ${errorText(res.statusCode, await res.body.text())}`);
  }
  await fs.mkdir(path.dirname(item.local), { recursive: true });
  const part = `${item.local}.ferry-part`;
  try {
    await pipeline(res.body, counter, createWriteStream(part));
    await fs.rename(part, item.local);
  } catch (err) {
    await fs.rm(part, { force: true });
    throw err;
  }
}

function errorText(status: number, text: string): string {
  try {
    const parsed = JSON.parse(text) as { error?: { code?: string; message?: string } };
    if (parsed.error?.message) return `${parsed.error.message} (${parsed.error.code ?? status})`;
  } catch {
    // not JSON
  }
  return `the server answered ${status}`;
}
