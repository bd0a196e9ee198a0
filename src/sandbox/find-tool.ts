/**
 * Finds the host tools a sandbox network needs (`ip`, `nft`, `nsenter`, `unshare`, `slirp4netns`) in the
 * system's folders only, never on the server's own PATH, and says which Debian package has a missing one.
 */
import fsSync from 'node:fs';
import path from 'node:path';

const TOOL_DIRS = ['/usr/local/sbin', '/usr/local/bin', '/usr/sbin', '/usr/bin', '/sbin', '/bin'];

/** The tool's path, or '' after adding `<name> not found (apt-get install <pkg>)` to `reasons`. */
export function findTool(name: string, pkg: string, reasons: string[]): string {
  const found = TOOL_DIRS.map((dir) => path.join(dir, name)).find((file) => {
    try {
      fsSync.accessSync(file, fsSync.constants.X_OK);
      return true;
    } catch {
      return false;
    }
  });
  if (!found) reasons.push(`${name} not found (apt-get install ${pkg})`);
  return found ?? '';
}
