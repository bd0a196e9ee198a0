/**
 * A Node app for volume tests whose functions write, read, fill, remove and list files under its mounts;
 * `tables` is the ferry.toml after `[app]` (its `[[volumes]]`, and `[scaling]` when wanted).
 * `fill` writes `mib` MiB and fsyncs (a quota is charged at writeback on some filesystems), answering
 * `{ ok: false, code }` with `ENOSPC`, or `EDQUOT` for a quota (errno 122), when the bound stops it.
 */
export function volumeApp(name: string, tables: string): Record<string, string> {
  return {
    'ferry.toml': `[app]\nname = "${name}"\n\n${tables}`,
    'main.mjs': `
import fs from 'node:fs';
import path from 'node:path';
export function write({ file, text }) { fs.mkdirSync(path.dirname(file), { recursive: true }); fs.writeFileSync(file, text); return { ok: true }; }
export function read({ file }) { return { text: fs.readFileSync(file, 'utf8') }; }
export function tryWrite({ file, text }) {
  try { fs.writeFileSync(file, text); return { ok: true }; } catch (err) { return { ok: false, code: err.code }; }
}
export function fill({ file, mib }) {
  const chunk = Buffer.alloc(1024 * 1024, 1);
  const fd = fs.openSync(file, 'w');
  let written = 0;
  try {
    for (let i = 0; i < mib; i++) { fs.writeSync(fd, chunk); written++; }
    fs.fsyncSync(fd);
    return { ok: true, written };
  } catch (err) { return { ok: false, code: err.errno === -122 ? 'EDQUOT' : err.code, written }; }
  finally { try { fs.closeSync(fd); } catch {} } // GlusterFS's write-behind reports EDQUOT at close too
}
export function remove({ file }) { fs.rmSync(file, { force: true }); return { ok: true }; }
export function ids() { return { uid: process.getuid(), groups: process.getgroups() }; }
`,
  };
}
