/** Where a build's files live on this node: `<buildsDir>/<build_id>/{source,out}`. */
import path from 'node:path';

export function buildFolder(buildsDir: string, buildId: string): { root: string; source: string; out: string } {
  const root = path.join(buildsDir, buildId);
  return { root, source: path.join(root, 'source'), out: path.join(root, 'out') };
}
