/**
 * `ferry registries login|list|logout`: the project's registry logins (docs/api.md, "Registry logins").
 * The password is read from stdin only (`--password-stdin`, as `docker login` takes it), never from an
 * argument, which shell history and the process list would keep; no command prints it back.
 */
import { MAX_REGISTRY_PASSWORD_CHARS } from '../images/registry-logins.js';
import { type ApiClient, CliError, createClient, printJson, printTable } from './client.js';

interface Json {
  json?: boolean;
}

interface RegistryLogin {
  registry: string;
  username: string;
  created_at: string;
  updated_at: string;
}

/** Bytes read from stdin at most: a password's characters can take 4 bytes each. */
const MAX_STDIN_BYTES = MAX_REGISTRY_PASSWORD_CHARS * 4;

/** The password on stdin, less one trailing line break (what `echo` and a here-string add), as docker reads it. */
async function readPassword(): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of process.stdin) {
    const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(String(chunk));
    size += buf.length;
    if (size > MAX_STDIN_BYTES) throw new CliError(`The password on stdin is longer than the server takes`, 2);
    chunks.push(buf);
  }
  let text: string;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(Buffer.concat(chunks));
  } catch {
    throw new CliError('The password on stdin is not valid UTF-8', 2);
  }
  text = text.replace(/\r?\n$/, '');
  if (text === '') throw new CliError('No password on stdin (it was empty)', 2);
  return text;
}

function registryPath(client: ApiClient, registry?: string): string {
  const base = `/v2/projects/${client.project}/registries`;
  return registry === undefined ? base : `${base}/${encodeURIComponent(registry)}`;
}

export async function registriesLoginCommand(
  registry: string,
  options: Json & { username?: string; passwordStdin?: boolean },
): Promise<void> {
  if (!options.username) throw new CliError('Give the account with --username', 2);
  if (!options.passwordStdin) {
    throw new CliError(
      'The password is read from stdin only: printf %s "$TOKEN" | ferry registries login REGISTRY --username U --password-stdin',
      2,
    );
  }
  if (process.stdin.isTTY) throw new CliError('--password-stdin: pipe the password in, stdin is a terminal', 2);
  const password = await readPassword();
  const client = createClient();
  const login = await client.call<RegistryLogin>('PUT', registryPath(client, registry), {
    body: { username: options.username, password },
  });
  if (options.json) return printJson(login);
  process.stdout.write(
    `Logged in to ${login.registry} as ${login.username}. Pulls of this project's builds from there send it; the registry checks it at the next pull.\n`,
  );
}

export async function registriesListCommand(options: Json = {}): Promise<void> {
  const client = createClient();
  const { registries } = await client.call<{ registries: RegistryLogin[] }>('GET', registryPath(client));
  if (options.json) return printJson(registries);
  printTable(
    registries.map((r) => ({ ...r })),
    ['registry', 'username', 'created_at', 'updated_at'],
  );
}

export async function registriesLogoutCommand(registry: string, options: Json = {}): Promise<void> {
  const client = createClient();
  await client.call('DELETE', registryPath(client, registry));
  if (options.json) return printJson({ registry, deleted: true });
  process.stdout.write(`Logged out of ${registry}.\n`);
}
