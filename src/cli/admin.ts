/**
 * `ferry admin bootstrap` and `ferry admin login-link`: work offline, straight on the data directory (even
 * while `ferry serve` runs on it).
 *
 * `bootstrap` creates the project when it does not exist and a new owner service account with both scopes,
 * and prints its token once. `login-link` prints a dashboard sign-in link for an existing project without
 * making another owner, nor any account: its token is a short-lived session (manage scope only) of the
 * project's active manage account (auth/sessions.ts), and nothing of it is stored.
 *
 * Both print the address of the server running on the data directory (from its `server.json`), so the
 * `export FERRY_URL=` line and the link work whatever port it listens on.
 */
import path from 'node:path';
import { bootstrapProject, listServiceAccounts } from '../auth/service-accounts.js';
import { createSignInSession } from '../auth/sessions.js';
import { resolveServerConfig, type ServerConfig } from '../config.js';
import { loadOrCreateKey, prepareDataDir, prepareKeysDir, readServerRecord } from '../data-dir.js';
import { openStore, type Store } from '../store/index.js';
import { CliError, printJson } from './client.js';

const PROJECT_NAME = /^[a-z0-9][a-z0-9-]{0,62}$/;

interface ServerAddressOptions {
  dataDir?: string;
  databaseUrl?: string;
  keysDir?: string;
  url?: string;
  host?: string;
  port?: string;
}

export interface BootstrapOptions extends ServerAddressOptions {
  projectName: string;
  expiresInDays?: string;
  json?: boolean;
}

export interface LoginLinkOptions extends ServerAddressOptions {
  projectName: string;
  expiresInMinutes?: string;
  json?: boolean;
}

function loadConfig(options: ServerAddressOptions): ServerConfig {
  try {
    return resolveServerConfig({
      dataDir: options.dataDir,
      databaseUrl: options.databaseUrl,
      keysDir: options.keysDir,
      host: options.host,
      port: options.port,
    });
  } catch (err) {
    throw new CliError((err as Error).message, 2);
  }
}

/** A listening address people can open: "all interfaces" is reached on loopback. */
function connectable(url: string): string {
  return url
    .replace(/^(https?:\/\/)0\.0\.0\.0(?=[:/]|$)/, '$1127.0.0.1')
    .replace(/^(https?:\/\/)\[::\](?=[:/]|$)/, '$1[::1]')
    .replace(/\/+$/, '');
}

/**
 * The server's address: `--url` when given; else the server listening on this data directory; else
 * `--host`/`--port` when given; else FERRY_URL; else FERRY_HOST/FERRY_PORT (default 127.0.0.1:8000).
 */
export function serverAddress(
  options: ServerAddressOptions,
  config: ServerConfig,
  env: NodeJS.ProcessEnv = process.env,
): { url: string; running: boolean } {
  if (options.url) return { url: options.url.replace(/\/+$/, ''), running: false };
  const record = readServerRecord(config.dataDir);
  if (record) return { url: connectable(record.url), running: true };
  const configured = () => {
    const host = config.host.includes(':') ? `[${config.host}]` : config.host;
    return connectable(`http://${host}:${config.port}`);
  };
  if (options.host === undefined && options.port === undefined && env.FERRY_URL) {
    return { url: env.FERRY_URL.replace(/\/+$/, ''), running: false };
  }
  return { url: configured(), running: false };
}

async function withStore<T>(config: ServerConfig, fn: (store: Store, key: Uint8Array, root: string) => Promise<T>) {
  const dataDir = prepareDataDir(config.dataDir);
  const store = await openStore({
    dataDir: dataDir.root,
    databaseUrl: config.databaseUrl,
    busyTimeoutMs: config.storeBusyTimeoutMs,
  });
  try {
    return await fn(store, loadOrCreateKey(path.join(prepareKeysDir(config.keysDir), 'jwt.key')), dataDir.root);
  } finally {
    await store.destroy();
  }
}

function checkProjectName(name: string): void {
  if (!PROJECT_NAME.test(name)) {
    throw new CliError('--project-name must use a-z, 0-9 and "-" (at most 63 characters)', 2);
  }
}

// The token rides in the URL fragment: browsers never send the fragment to the server (so it is in no
// request line or access log), and the dashboard moves it to session storage and drops it from the
// address bar at once.
const signInLink = (url: string, token: string) => `${url}/#token=${token}`;

function serverLine(address: { url: string; running: boolean }, root: string): string {
  return address.running
    ? `Ferry is running on this data directory at ${address.url}.`
    : `No ferry serve is running on ${root}; the address below is the configured one (start it with \`ferry serve --data-dir ${root}\`).`;
}

export async function bootstrapCommand(options: BootstrapOptions): Promise<void> {
  const config = loadConfig(options);
  const days = options.expiresInDays === undefined ? 365 : Number(options.expiresInDays);
  if (!Number.isInteger(days) || days < 1 || days > 3650)
    throw new CliError('--expires-in-days must be a whole number from 1 to 3650', 2);
  checkProjectName(options.projectName);
  await withStore(config, async (store, key, root) => {
    const { project, created, account, token } = await bootstrapProject(store, key, {
      projectName: options.projectName,
      expiresInDays: days,
    });
    if (options.json) {
      process.stdout.write(`${JSON.stringify({ project_id: project.id, token })}\n`);
      return;
    }
    const owners = (await listServiceAccounts(store, project.id)).filter(
      (a) => a.id !== account.id && a.name === account.name && !a.revoked_at && !a.expired,
    );
    const address = serverAddress(options, config);
    const lines = [
      `${created ? 'Created' : 'Found'} project ${project.name} (${project.id}) in ${root}`,
      `New service account ${account.name} (${account.id}), scopes manage and run, expires ${account.expires_at.slice(0, 10)}.`,
    ];
    if (owners.length > 0) {
      lines.push(
        `Note: the project already had ${owners.length} active ${account.name} account${owners.length === 1 ? '' : 's'} (see \`ferry tokens list\`; revoke the ones you do not use).`,
        'For a dashboard sign-in link without a new owner, run `ferry admin login-link`.',
      );
    }
    lines.push(
      serverLine(address, root),
      '',
      'Token (shown once, store it as a secret):',
      token,
      '',
      'Use it with:',
      `  export FERRY_URL=${address.url} FERRY_PROJECT=${project.id} FERRY_TOKEN=${token}`,
      '',
      'Sign in to the dashboard (this link holds the token; keep it private):',
      `  ${signInLink(address.url, token)}`,
      '',
    );
    process.stdout.write(lines.join('\n'));
  });
}

export async function loginLinkCommand(options: LoginLinkOptions): Promise<void> {
  const config = loadConfig(options);
  const minutes = options.expiresInMinutes === undefined ? 60 : Number(options.expiresInMinutes);
  if (!Number.isInteger(minutes) || minutes < 5 || minutes > 1440)
    throw new CliError('--expires-in-minutes must be a whole number from 5 to 1440', 2);
  checkProjectName(options.projectName);
  await withStore(config, async (store, key, root) => {
    const project = await store
      .selectFrom('projects')
      .selectAll()
      .where('name', '=', options.projectName)
      .executeTakeFirst();
    if (!project) {
      throw new CliError(
        `No project named ${options.projectName} in ${root}. Create it with \`ferry admin bootstrap --data-dir ${root}\`.`,
      );
    }
    const session = await createSignInSession(store, key, {
      projectId: project.id,
      until: new Date(Date.now() + minutes * 60_000),
    });
    if (!session) {
      throw new CliError(
        `Project ${project.name} has no active service account with the manage scope for a sign-in session to belong to. Make an owner with \`ferry admin bootstrap --data-dir ${root} --project-name ${project.name}\`.`,
      );
    }
    const { account, token, expiresAt } = session;
    const address = serverAddress(options, config);
    const link = signInLink(address.url, token);
    if (options.json) {
      printJson({
        project_id: project.id,
        service_account_id: account.id,
        url: address.url,
        link,
        expires_at: expiresAt,
      });
      return;
    }
    process.stdout.write(
      [
        serverLine(address, root),
        `Sign in to the dashboard of project ${project.name} (${project.id}) with this link; keep it private.`,
        `It holds a sign-in session (scope manage, no account of its own) of the service account "${account.name}" (${account.id}), valid until ${expiresAt}; revoking that account ends it sooner:`,
        `  ${link}`,
        '',
      ].join('\n'),
    );
  });
}
