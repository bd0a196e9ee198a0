/**
 * Hand-made ZIP bytes for tests. yazl refuses to write hostile archives (absolute or `..` names, symlinks,
 * devices, encrypted flags, lying sizes), so this writer lays out local headers, the central directory and
 * the end record itself, writing whatever it is told.
 */
import { crc32, deflateRawSync } from 'node:zlib';

export interface RawZipEntry {
  /** Written byte for byte (UTF-8, flagged as such): backslashes, `..` and leading slashes are kept. */
  name: string;
  data?: Buffer | string;
  /** A Unix mode (type and permission bits); makes the entry "made by" Unix with the mode in the high 16 bits. */
  mode?: number;
  method?: 'store' | 'deflate';
  /** The uncompressed size written in both headers; defaults to the real size. */
  declaredSize?: number;
  /** The CRC-32 written in both headers; defaults to the real one. */
  crc?: number;
  /** Extra general purpose bits (1 = encrypted, 0x40 = strong encryption); 0x800 (UTF-8 names) is always set. */
  flags?: number;
}

const UNIX_HOST = 3;
const VERSION = 20;
// 1 January 2024, 12:00:00 in MS-DOS date and time fields.
const DOS_TIME = (12 << 11) | (0 << 5) | 0;
const DOS_DATE = ((2024 - 1980) << 9) | (1 << 5) | 1;

export function makeZip(entries: RawZipEntry[]): Buffer {
  const locals: Buffer[] = [];
  const centrals: Buffer[] = [];
  let offset = 0;

  for (const e of entries) {
    const name = Buffer.from(e.name, 'utf8');
    const raw = e.data === undefined ? Buffer.alloc(0) : Buffer.from(e.data);
    const method = e.method === 'deflate' ? 8 : 0;
    const body = method === 8 ? deflateRawSync(raw) : raw;
    const crc = (e.crc ?? crc32(raw)) >>> 0;
    const size = e.declaredSize ?? raw.length;
    const flags = (e.flags ?? 0) | 0x800;
    const madeBy = e.mode === undefined ? VERSION : (UNIX_HOST << 8) | VERSION;
    const external = e.mode === undefined ? (e.name.endsWith('/') ? 0x10 : 0) : (e.mode << 16) >>> 0;

    const local = Buffer.alloc(30);
    local.writeUInt32LE(0x04034b50, 0);
    local.writeUInt16LE(VERSION, 4);
    local.writeUInt16LE(flags, 6);
    local.writeUInt16LE(method, 8);
    local.writeUInt16LE(DOS_TIME, 10);
    local.writeUInt16LE(DOS_DATE, 12);
    local.writeUInt32LE(crc, 14);
    local.writeUInt32LE(body.length, 18);
    local.writeUInt32LE(size, 22);
    local.writeUInt16LE(name.length, 26);
    local.writeUInt16LE(0, 28);
    locals.push(local, name, body);

    const central = Buffer.alloc(46);
    central.writeUInt32LE(0x02014b50, 0);
    central.writeUInt16LE(madeBy, 4);
    central.writeUInt16LE(VERSION, 6);
    central.writeUInt16LE(flags, 8);
    central.writeUInt16LE(method, 10);
    central.writeUInt16LE(DOS_TIME, 12);
    central.writeUInt16LE(DOS_DATE, 14);
    central.writeUInt32LE(crc, 16);
    central.writeUInt32LE(body.length, 20);
    central.writeUInt32LE(size, 24);
    central.writeUInt16LE(name.length, 28);
    // extra field length, comment length, disk number, internal attributes: all 0
    central.writeUInt32LE(external, 38);
    central.writeUInt32LE(offset, 42);
    centrals.push(central, name);

    offset += local.length + name.length + body.length;
  }

  const directory = Buffer.concat(centrals);
  const end = Buffer.alloc(22);
  end.writeUInt32LE(0x06054b50, 0);
  end.writeUInt16LE(entries.length, 8);
  end.writeUInt16LE(entries.length, 10);
  end.writeUInt32LE(directory.length, 12);
  end.writeUInt32LE(offset, 16);
  return Buffer.concat([...locals, directory, end]);
}
