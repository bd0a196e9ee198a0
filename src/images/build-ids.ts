/**
 * Host id ranges for the work Ferry does over an image's tree (sandbox/identity.ts says why sandboxes never
 * run as host root): a build's steps (step-sandbox.ts) and every unpacking of layers (layer-sandbox.ts).
 *
 * As root, each holder gets 65,536 host ids of its own: 256 slots after the volumes' gids
 * (volumes/images.ts), host `first + n` being uid/gid `n` inside its user namespace, which Ferry maps itself.
 * Without root there is one id, Ferry's own, which bwrap maps to uid 0 inside.
 */
import { randomInt } from 'node:crypto';
import type { SandboxCapabilities } from '../sandbox/launch.js';
import type { IdRange } from './step-sandbox.js';

export interface HeldIds {
  ids: IdRange;
  /** Whether Ferry writes the range's maps itself (it is root); else bwrap maps uid 0 to Ferry's uid. */
  mapRange: boolean;
  /** The slot to give back (release), null without root. */
  slot: number | null;
}

const BUILD_IDS_FIRST = 1_895_890_944;
const BUILD_ID_SLOTS = 256;
const slotsInUse = new Set<number>();

/** A free range (as root), or Ferry's own id. Throws when every slot is held. */
export function acquireIds(caps: SandboxCapabilities): HeldIds {
  if (caps.identity && process.getuid?.() === 0) {
    if (slotsInUse.size >= BUILD_ID_SLOTS) throw new Error('too many image builds and unpackings at once');
    for (;;) {
      const slot = randomInt(BUILD_ID_SLOTS);
      if (slotsInUse.has(slot)) continue;
      slotsInUse.add(slot);
      return { ids: { first: BUILD_IDS_FIRST + slot * 65_536, count: 65_536 }, mapRange: true, slot };
    }
  }
  const uid = process.getuid?.() ?? 0;
  return { ids: { first: uid, count: 1 }, mapRange: false, slot: null };
}

export function releaseIds(slot: number | null): void {
  if (slot !== null) slotsInUse.delete(slot);
}
