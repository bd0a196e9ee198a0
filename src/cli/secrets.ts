/**
 * `ferry secrets set|list|delete`. `set` takes the value from stdin when it is `-` or omitted, so
 * `printf %s "$TOKEN" | ferry secrets set API_TOKEN` keeps the value out of shell history and `ps`.
 */
import { MAX_SECRET_VALUE_BYTES } from '../secrets/secrets.js';
import { type ApiClient, CliError, createClient, printJson, printTable } from './client.js';

interface Json {
  json?: boolean;
}

interface SecretMetadata {
  name: string;
  created_at: string;
  updated_at: string;
}

const REFRESH_HINT = 'New replicas get the change; running replicas keep their environment until a redeploy.';

/** All of stdin as UTF-8, exactly (a trailing newline is part of the value). */
async function readStdin(): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of process.stdin) {
    const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(String(chunk));
    size += buf.length;
    // Stop early rather than buffer an accidental multi-gigabyte pipe the server would refuse anyway.
    if (size > MAX_SECRET_VALUE_BYTES) {
      throw new CliError(`The value on stdin is larger than ${MAX_SECRET_VALUE_BYTES} bytes`, 2);
    }
    chunks.push(buf);
  }
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(Buffer.concat(chunks));
  } catch {
    throw new CliError('The value on stdin is not valid UTF-8', 2);
  }
}

async function resolveValue(value: string | undefined): Promise<string> {
  if (value !== undefined && value !== '-') return value;
  if (process.stdin.isTTY) {
    throw new CliError(
      'Give the value as an argument, or pipe it on stdin: printf %s "$VALUE" | ferry secrets set NAME',
      2,
    );
  }
  const text = await readStdin();
  // Empty stdin is nearly always a mistake (a script run with stdin closed); '' as an argument still works.
  if (text === '') throw new CliError('No value on stdin (it was empty); pass "" as the value to set an empty one', 2);
  return text;
}

function secretPath(client: ApiClient, name?: string): string {
  const base = `/v2/projects/${client.project}/secrets`;
  return name === undefined ? base : `${base}/${encodeURIComponent(name)}`;
}

export async function secretsSetCommand(name: string, value: string | undefined, options: Json = {}): Promise<void> {
  const client = createClient();
  const secret = await client.call<SecretMetadata>('PUT', secretPath(client, name), {
    body: { value: await resolveValue(value) },
  });
  if (options.json) return printJson(secret);
  process.stdout.write(`Set secret ${secret.name}. ${REFRESH_HINT}\n`);
}

export async function secretsListCommand(options: Json = {}): Promise<void> {
  const client = createClient();
  const { secrets } = await client.call<{ secrets: SecretMetadata[] }>('GET', secretPath(client));
  if (options.json) return printJson(secrets);
  printTable(
    secrets.map((s) => ({ ...s })),
    ['name', 'created_at', 'updated_at'],
  );
}

export async function secretsDeleteCommand(name: string, options: Json = {}): Promise<void> {
  const client = createClient();
  await client.call('DELETE', secretPath(client, name));
  if (options.json) return printJson({ name, deleted: true });
  process.stdout.write(`Deleted secret ${name}. ${REFRESH_HINT}\n`);
}
