/**
 * Calls in flight on a worker, per app and per calling gateway. A worker announces it with its load
 * (cluster/workers.ts) so a gateway can tell its own calls from the others' in an announcement that is up
 * to a second old: the others' part is as announced, its own part is what it has in flight now. Without
 * this split a gateway counted its own calls twice over a busy second and moved calls off a worker that
 * had room (bench:cluster, issue 13).
 */
export interface CallerTally {
  /** A call of `appKey` from `node` starts; the returned function ends it (idempotent). */
  enter(appKey: string, node: string): () => void;
  /** Calls in flight of `appKey`, per calling node; undefined when none. */
  of(appKey: string): Record<string, number> | undefined;
}

export function createCallerTally(): CallerTally {
  const apps = new Map<string, Map<string, number>>();
  return {
    enter(appKey, node) {
      let nodes = apps.get(appKey);
      if (!nodes) {
        nodes = new Map();
        apps.set(appKey, nodes);
      }
      nodes.set(node, (nodes.get(node) ?? 0) + 1);
      let ended = false;
      return () => {
        if (ended) return;
        ended = true;
        const current = apps.get(appKey);
        if (!current) return;
        const n = (current.get(node) ?? 1) - 1;
        if (n > 0) current.set(node, n);
        else current.delete(node);
        if (current.size === 0) apps.delete(appKey);
      };
    },
    of(appKey) {
      const nodes = apps.get(appKey);
      return nodes ? Object.fromEntries(nodes) : undefined;
    },
  };
}
