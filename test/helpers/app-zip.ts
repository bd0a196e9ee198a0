/** Builds app archives for tests with yazl, the way `ferry deploy` packs them. */
import yazl from 'yazl';

/** `executable`: names of files packed with mode 0755 (scripts an app's tools run). */
export function zipFiles(files: Record<string, string | Buffer>, executable: string[] = []): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const zip = new yazl.ZipFile();
    for (const [name, data] of Object.entries(files)) {
      zip.addBuffer(Buffer.isBuffer(data) ? data : Buffer.from(data), name, {
        mtime: new Date('2026-01-01T00:00:00Z'),
        ...(executable.includes(name) ? { mode: 0o100755 } : {}),
      });
    }
    zip.end();
    const chunks: Buffer[] = [];
    zip.outputStream.on('data', (c: Buffer) => chunks.push(c));
    zip.outputStream.on('end', () => resolve(Buffer.concat(chunks)));
    zip.outputStream.on('error', reject);
  });
}

export function helloApp(
  name = 'hello',
  body = "export function run({ name = 'world' }) { return { message: 'Hello, ' + name + '!' }; }\n",
) {
  return zipFiles({ 'ferry.toml': `[app]\nname = "${name}"\n`, 'main.ts': body });
}
