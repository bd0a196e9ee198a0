/**
 * A canary tree for the attack tests: a few files and folders outside whatever an attacker may write,
 * and a one-string summary of everything about them (content, mode, owner, times, the names present),
 * so that a test asserts "nothing here changed" with one comparison.
 */
import fs from 'node:fs/promises';
import path from 'node:path';

/** Makes `dir` with `f` (0640), `d/` (0750) and `d/g` (0600); returns `dir`. */
export async function makeCanary(dir: string): Promise<string> {
  await fs.mkdir(path.join(dir, 'd'), { recursive: true });
  await fs.writeFile(path.join(dir, 'f'), 'canary file');
  await fs.writeFile(path.join(dir, 'd', 'g'), 'canary file in a folder');
  await fs.chmod(path.join(dir, 'f'), 0o640);
  await fs.chmod(path.join(dir, 'd', 'g'), 0o600);
  await fs.chmod(path.join(dir, 'd'), 0o750);
  await fs.chmod(dir, 0o755);
  // Times in the past, so that a change made in the same instant as the tree still shows.
  const past = new Date(Date.now() - 3_600_000);
  for (const p of [path.join(dir, 'd', 'g'), path.join(dir, 'f'), path.join(dir, 'd'), dir])
    await fs.utimes(p, past, past);
  return dir;
}

/** Everything about the tree at `dir`, never following a link, as one string. */
export async function canaryState(dir: string): Promise<string> {
  const lines: string[] = [];
  const walk = async (at: string, rel: string): Promise<void> => {
    const st = await fs.lstat(at);
    const kind = st.isDirectory() ? 'dir' : st.isSymbolicLink() ? 'link' : st.isFile() ? 'file' : 'other';
    const body = st.isFile() ? await fs.readFile(at, 'utf8') : st.isSymbolicLink() ? await fs.readlink(at) : '';
    lines.push(
      `${rel || '.'} ${kind} ${(st.mode & 0o7777).toString(8)} ${st.uid}:${st.gid} m${st.mtimeMs} c${st.ctimeMs} ${JSON.stringify(body)}`,
    );
    if (st.isDirectory())
      for (const name of (await fs.readdir(at)).sort()) await walk(path.join(at, name), path.join(rel, name));
  };
  await walk(dir, '');
  return lines.join('\n');
}
