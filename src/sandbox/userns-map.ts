/**
 * The id maps of a bwrap user namespace that Ferry (as root) writes itself: bwrap is started with
 * `--info-fd` and `--userns-block-fd` as an unprivileged host uid (setpriv), reports its child's pid, and
 * waits until the maps of a whole range of host ids are written (what newuidmap would do; util-linux
 * 2.38's `unshare --map-users` needs newuidmap, which Debian does not install with it). Used by image
 * build steps (images/step-sandbox.ts) and Ferry's own tools over an untrusted tree (tree-sandbox.ts).
 */
import fs from 'node:fs/promises';
import type { Readable } from 'node:stream';

const BWRAP_START_TIMEOUT_MS = 30_000;

/** Reads bwrap's child pid from its info fd and writes the namespace's uid and gid maps (`0 first count`). */
export async function mapWhenReady(info: Readable, ids: { first: number; count: number }): Promise<void> {
  info.setEncoding('utf8');
  const pid = await new Promise<number>((resolve, reject) => {
    let text = '';
    const timer = setTimeout(() => reject(new Error('bwrap did not report its pid')), BWRAP_START_TIMEOUT_MS);
    info.on('data', (chunk: string) => {
      text += chunk;
      const match = /"child-pid"\s*:\s*(\d+)/.exec(text);
      if (match) {
        clearTimeout(timer);
        resolve(Number(match[1]));
      }
    });
    info.on('end', () => {
      clearTimeout(timer);
      reject(new Error('bwrap ended before it reported its pid'));
    });
    info.on('error', () => {});
  });
  info.resume();
  const map = `0 ${ids.first} ${ids.count}\n`;
  await fs.writeFile(`/proc/${pid}/uid_map`, map);
  await fs.writeFile(`/proc/${pid}/gid_map`, map);
}
