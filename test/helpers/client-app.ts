/** The app the client tests call (test/client-python, test/client-typescript): a function, one that throws, a generator, a slow one. */
export const CLIENT_TEST_APP = (name: string): Record<string, string> => ({
  'ferry.toml': `[app]\nname = "${name}"\n`,
  'main.ts': `
export function run({ name = 'world' }: { name?: string }) {
  console.log('greeting ' + name);
  return { message: 'Hello, ' + name + '!' };
}
export function fail() {
  throw new TypeError('broke on purpose');
}
export async function* count({ n = 5 }: { n?: number }) {
  for (let i = 0; i < n; i++) {
    yield { i };
    await new Promise((r) => setTimeout(r, 100));
  }
}
export async function slow() {
  await new Promise((r) => setTimeout(r, 60_000));
  return 'late';
}
`,
});
